"""KvdConnector with a hybrid model on vLLM 0.33's real Scheduler: a KVCacheConfig of
three groups (full attention, sliding window, Mamba-style state) from vLLM's own planner,
a P and a D instance, two real kvd daemons, real NIXL and shared-memory staging; every
byte D's groups need is checked (vllm_hybrid_harness.py), in pull and push."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kvd_client.client import KvdClient

from kvd.demo import DaemonProc, start_daemon

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
        ids,
        p_params,
        prompt,
        run_until,
    )
    from vllm_harness import TOKEN, write_model
    from vllm_hybrid_harness import WINDOW, HybridInstance, make_hybrid_instance

SHARED_CFG = "[transfer]\nkv_lease_duration = 3.0\npeer_probe_interval = 0.2\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-hybrid"))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvdh-", dir="/tmp"))
    with ThreadPoolExecutor(2) as ex:
        pd, dd = ex.map(lambda name: start_daemon(workdir, name, SHARED_CFG), ["kvd-hp", "kvd-hd"])
    yield pd, dd
    problems = []
    for d in (dd, pd):
        rc = d.stop()
        if rc != 0:
            problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
    shutil.rmtree(workdir, ignore_errors=True)
    assert not problems, "\n".join(problems)


@pytest.fixture
def instances() -> Iterator[list[HybridInstance]]:
    made: list[HybridInstance] = []
    yield made
    for inst in made:
        inst.close()


def recent_bytes(d: DaemonProc, rids: set[str]) -> int:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        recent = c.status("transfers")["recent"]
    return sum(int(r["bytes"]) for r in recent if r["request_id"] in rids)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_hybrid_requests_arrive_byte_exact(
    mode: str, pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[HybridInstance]
) -> None:
    pd, dd = pair
    p = make_hybrid_instance("p", pd.socket, model, mode=mode)
    d = make_hybrid_instance("d", dd.socket, model, mode=mode)
    instances += [p, d]
    # shorter than the window, about one window, several windows long
    lengths = [20, 41, 70, 130]
    reqs = []
    for i, n in enumerate(lengths):
        pid, did = ids(f"h{i}")
        p.add(pid, prompt(i, n), max_tokens=1, params={"do_remote_decode": True})
        if mode == "push":
            d.add(did, prompt(i, n), max_tokens=3, params=p_params(p, "push"))
            d.verify[did] = (p.salt, 0)
        reqs.append((pid, did))
    if mode == "pull":
        run_until(lambda: all(pid in p.finished for pid, _ in reqs), [p, d])
        for i, ((pid, did), n) in enumerate(zip(reqs, lengths, strict=True)):
            params = p.finished[pid].kv_transfer_params
            assert len(params["remote_block_ids"]) == 3  # one list per KV cache group
            full, window, state = params["remote_block_ids"]
            assert len(full) == -(-(n - 1) // 16)  # P computed all but the last token
            t = n - 1  # the window's blocks: those holding the last WINDOW - 1 of P's tokens
            assert len(window) == -(-t // 16) - max(0, t - (WINDOW - 1)) // 16
            assert len(state) == 1
            d.add(did, prompt(i, n), max_tokens=3, params=params)
            d.verify[did] = (p.salt, 0)
    run_until(lambda: all(did in d.finished for _, did in reqs) and not p.busy(), [p, d])
    for pid, did in reqs:
        assert did in d.waited_remote, "D never waited in WAITING_FOR_REMOTE_KVS"
        assert did in d.received and did not in d.failed_recv
        assert [t for o in d.outputs[did] for t in o.new_token_ids] == [TOKEN] * 3
        assert pid in p.sent
    assert not p.errors and not d.errors, p.errors + d.errors
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)
    # what moved: full blocks, the window's blocks only, one state slot per request
    staging = d.worker.worker_side.hybrid
    assert staging is not None
    sizes = [
        g.layout.num_layers * g.layout.kv_parts * g.layout.chunk_bytes for g in staging.kv_groups
    ]

    def window(t: int) -> int:  # blocks holding the last WINDOW - 1 of t tokens
        return -(-t // 16) - max(0, t - (WINDOW - 1)) // 16

    want = sum(-(-(n - 1) // 16) * sizes[0] + window(n - 1) * sizes[1] + sizes[2] for n in lengths)
    moved = recent_bytes(dd, {did for _, did in reqs}) + recent_bytes(pd, {pid for pid, _ in reqs})
    assert moved == want, (moved, want)


def test_a_group_kvd_cannot_move_is_refused_naming_it(model: str) -> None:
    import torch
    from kvd_client.vllm.groups import KvGroups
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    local = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16, attention_chunk_size=64
    )
    cfg: Any = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], local)],
    )
    with pytest.raises(ValueError, match=r"group 1 \(ChunkedLocalAttentionSpec\)"):
        KvGroups.from_config(cfg)
    one: Any = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["a"], full)]
    )
    assert KvGroups.from_config(one) is None  # one full group: the plain region, as before


def test_groups_pick_what_moves_and_both_sides_agree() -> None:
    from kvd_client.vllm.groups import GroupInfo, KvGroups

    g = KvGroups(
        [
            GroupInfo("full", 0, 16, 0, ("a",)),
            GroupInfo("window", 40, 16, 0, ("b",)),
            GroupInfo("state", 0, 16, 2, ("c",)),
        ],
        num_blocks=100,
    )
    null = 0
    # P computed 69 tokens: 5 blocks; vLLM freed the window group's first (null)
    p = g.finished([[1, 2, 3, 4, 5], [0, 6, 7, 8, 9], [0, 11, 12, 13]], 69, null)
    # full: all 5; window: tokens 30..68 (the last 39) are in blocks 1..4
    assert p == ([1, 2, 3, 4, 5], [106, 107, 108, 109], [211])
    # D loads the same 69 tokens after a 32-token local hit: full blocks 2..4, the same
    # window blocks from its hit on (the daemon pairs the tails: P's last 3), the running
    # slot (scratch slots dropped)
    d = g.loading([[21, 22, 23, 24, 25], [31, 32, 33, 34, 35], [41, 42, 43]], 32, 69, null)
    assert d == ([23, 24, 25], [133, 134, 135], [241])
    assert g.remote_for(p, 32, 69, 16) == [3, 4, 5, 106, 107, 108, 109, 211]
    assert g.remote_for(p, 32, 69, 0) == g.remote_for(p, 32, 69, 16)  # (P's = D's size)
    # P's blocks of 32 tokens (its own lists): tokens 32..68 are in its blocks 1 and 2
    assert g.remote_for([[1, 2, 3], [6, 7], [11]], 32, 69, 32) == [2, 3, 6, 7, 11]
    # a hit inside P's first block cannot pair
    assert g.remote_for([[1, 2, 3], [6, 7], [11]], 16, 69, 32) is None
    assert g.backoff == 1
