"""Multi-turn (`bidirectional_kv_xfer`) with KvdConnector on vLLM 0.33's real Scheduler: turn
1 goes P -> D as usual; D stages its decode KV, keeps the finished request's blocks and
returns kv_transfer_params naming them; turn 2's P pulls the kept prefix from D's daemon
instead of recomputing it. Real daemons, real NIXL, real shared-memory staging; the bytes P
loads are checked against D's KV tensors.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvd.demo import DaemonProc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("KVD_REQUIRE_VLLM"):
    raise RuntimeError(
        "KVD_REQUIRE_VLLM is set but vLLM is not installed (run scripts/install-vllm.sh)"
    )

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not HAVE_VLLM, reason="vLLM 0.33 is not installed (scripts/install-vllm.sh installs it)"
    ),
]

if HAVE_VLLM:
    from test_kvd_connector import (
        assert_daemon_idle,
        counters,
        forward_params,
        prompt,
        proxy,
        run_until,
    )
    from vllm_harness import BLOCK_SIZE, TOKEN, Instance, make_instance, write_model

StartDaemon = Callable[..., DaemonProc]
CFG = "[transfer]\nkv_lease_duration = 3.0\npeer_probe_interval = 0.2\n"
OUT = 40
"""Tokens D decodes in turn 1 (its KV spans whole blocks past the prompt's)."""
BIDIR = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": BLOCK_SIZE}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in made:
        inst.close()


def turn1(p: Instance, d: Instance, tokens: list[int], out: int) -> tuple[str, dict[str, Any]]:
    """P -> D (pull) and D decodes `out` tokens: D's id and the params D returned."""
    p_id, d_id = proxy(p, d, "t1", tokens, "pull")
    run_until(lambda: p_id in p.finished, [p, d])
    forward_params(p, d, p_id, d_id, tokens, max_tokens=out)
    run_until(lambda: d_id in d.finished and p_id in p.sent, [p, d])
    assert [t for o in d.outputs[d_id] for t in o.new_token_ids] == [TOKEN] * out
    kept = d.finished[d_id].kv_transfer_params
    assert kept is not None, "D kept nothing"
    return d_id, kept


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_next_turn_p_loads_the_blocks_d_kept(
    daemons: StartDaemon, model: str, instances: list[Instance], async_scheduling: bool
) -> None:
    pd, dd = daemons("kvd-bp", CFG), daemons("kvd-bd", CFG)
    a = async_scheduling
    p = make_instance("p", pd.socket, model, extra=BIDIR, async_scheduling=a)
    d = make_instance("d", dd.socket, model, extra=BIDIR, async_scheduling=a)
    instances += [p, d]
    tokens = prompt(3, 2 * BLOCK_SIZE + 8)  # 40 tokens
    d_id, kept = turn1(p, d, tokens, out=OUT)
    # D kept what it had staged: the prompt and its decode KV, whole blocks named
    n = kept["remote_num_tokens"]
    assert len(tokens) + OUT - 2 <= n <= len(tokens) + OUT - 1, n
    (blocks,) = kept["remote_block_ids"]
    assert len(blocks) == -(-n // BLOCK_SIZE)
    assert kept["remote_request_id"] == d_id and kept["remote_engine_id"] == d.engine_id
    assert kept["remote_blocks_expiry_time"] > time.time() + 470
    assert d_id not in d.sent  # held (delay_free) until P's pull or the expiry
    held = {b: [t[b].clone() for t in d.kv.values()] for b in blocks}
    # turn 2: the conversation so far plus the user's next message, at P
    tokens2 = tokens + [TOKEN] * OUT + prompt(4, 20)
    p2 = "cmpl-t2-0-aaaaaaaa"
    params = dict(kept, do_remote_decode=True)
    # P still caches turn 1's 2 whole prompt blocks: it loads D's blocks after them
    p.add(p2, tokens2, max_tokens=1, params=params)
    run_until(lambda: p2 in p.finished, [p, d])
    run_until(lambda: p2 in p.finished and d_id in d.sent, [p, d])
    assert p2 in p.waited_remote and p2 in p.received and p2 not in p.failed_recv
    loaded = n // BLOCK_SIZE  # whole blocks only
    assert loaded >= 4
    for i, b in enumerate(p.received[p2][:loaded]):
        for layer, t in enumerate(p.kv.values()):
            got, want = t[b], held[blocks[i]][layer]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (i, layer)
    # P computed only the rest: the KV of the kept blocks' positions is D's, not P's own
    assert counters(dd)["kept_pulled"] == 1
    assert counters(pd)["transfers_ok"] >= 1 and counters(pd)["descriptors"] >= 1
    # turn 2 goes on to a D as usual (its KV mixes both instances: bytes not re-checked
    # here), and D keeps it in turn for turn 3
    p2_params = p.finished[p2].kv_transfer_params
    assert p2_params is not None and p2_params["remote_num_tokens"] == len(tokens2)
    d2 = "cmpl-t2-0-bbbbbbbb"
    d.add(d2, tokens2, max_tokens=2, params=p2_params)
    run_until(lambda: d2 in d.finished and p2 in p.sent, [p, d])
    kept2 = d.finished[d2].kv_transfer_params
    assert kept2 is not None and kept2["remote_request_id"] == d2
    # turn 3: P's own cache covers every whole block D kept, so it loads nothing and D's
    # blocks are freed at once (an empty pull) rather than at the expiry
    tokens3 = tokens2 + [TOKEN] * 2 + prompt(5, 9)
    p3 = "cmpl-t3-0-cccccccc"
    p.add(p3, tokens3, max_tokens=1, params=dict(kept2, do_remote_decode=True))
    run_until(lambda: p3 in p.finished and d2 in d.sent, [p, d])
    assert p3 not in p.waited_remote
    assert counters(dd)["kept_pulled"] == 2 and counters(dd).get("kept_expired", 0) == 0
    # no D takes turn 3 here: P's lease on it runs out (kv_lease_duration 3 s)
    run_until(lambda: p3 in p.sent and not p.busy() and not d.busy(), [p, d], timeout=10)
    assert not p.errors and not d.errors, p.errors + d.errors
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_kept_blocks_too_close_to_expiry_are_recomputed_and_freed(
    daemons: StartDaemon, model: str, instances: list[Instance]
) -> None:
    """D's TTL is short: by turn 2 less than 5 s remain, so P computes everything itself and
    never asks D; D's blocks go back to its engine at the expiry (finished_sending once)."""
    pd, dd = daemons("kvd-bp", CFG), daemons("kvd-bd", CFG)
    p = make_instance("p", pd.socket, model, extra=BIDIR)
    d = make_instance("d", dd.socket, model, extra={**BIDIR, "decoder_kv_blocks_ttl": 6.0})
    instances += [p, d]
    tokens = prompt(5, 2 * BLOCK_SIZE + 8)
    d_id, kept = turn1(p, d, tokens, out=4)
    assert kept["remote_blocks_expiry_time"] <= time.time() + 6.0
    time.sleep(1.5)
    tokens2 = tokens + [TOKEN] * 4 + prompt(6, 10)
    p2 = "cmpl-t2-0-cccccccc"
    p.add(p2, tokens2, max_tokens=1, params=dict(kept, do_remote_decode=True))
    run_until(lambda: p2 in p.finished, [p, d])
    assert p2 not in p.waited_remote and p2 not in p.received
    run_until(lambda: d_id in d.sent, [p, d], timeout=10)
    assert counters(dd)["kept_expired"] == 1 and counters(dd).get("kept_pulled", 0) == 0
    # P's own turn-2 lease is not wanted by any D here: wait for it to end
    run_until(
        lambda: not p.connector.scheduler_side._sending and not p.busy() and not d.busy(),
        [p, d],
        timeout=10,
    )
    assert not p.errors and not d.errors, p.errors + d.errors
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(dd)
