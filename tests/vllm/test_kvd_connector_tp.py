"""KvdConnector at TP > 1 on vLLM 0.33's real Scheduler: one scheduler-side connector and
one worker-side connector per rank (each with its own KV tensors and daemon session, all
in this process: vllm_tp_harness.py), two real kvd daemons, real NIXL and shared-memory
staging. P and D may differ in TP, block size and KV layout (the connector declares a KV
spec, the daemon maps); every byte of every head at every D rank is compared with P's
bytes read back from P's ranks. A P/D pair whose KV dtype differs is refused at handshake
with both values named, and vLLM's load-failure policy applies."""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
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
    from vllm_tp_harness import (
        KV_HEADS,
        TOKEN,
        WINDOW,
        TPInstance,
        make_tp_instance,
        write_model,
    )

SHARED_CFG = "[transfer]\nkv_lease_duration = 3.0\npeer_probe_interval = 0.2\n"
LENGTHS = [20, 45, 70]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-tp"))


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    with ThreadPoolExecutor(2) as ex:
        pd, dd = ex.map(lambda name: start_daemon(workdir, name, SHARED_CFG), ["kvd-tp", "kvd-td"])
    yield pd, dd
    problems = []
    for d in (dd, pd):
        rc = d.stop()
        if rc != 0:
            problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
    shutil.rmtree(workdir, ignore_errors=True)
    assert not problems, "\n".join(problems)


@pytest.fixture
def instances() -> Iterator[list[TPInstance]]:
    made: list[TPInstance] = []
    yield made
    for inst in made:
        inst.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 120 + 1 for i in range(n)]


def ids(key: str) -> tuple[str, str]:
    tag = secrets.token_hex(3)
    return f"cmpl-{key}{tag}-0-{secrets.token_hex(4)}", f"cmpl-{key}{tag}-0-{secrets.token_hex(4)}"


def run_until(cond: Callable[[], bool], insts: list[TPInstance], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(
                "timed out; "
                + str(
                    [
                        (i.name, {r: str(q.status) for r, q in i.scheduler.requests.items()})
                        for i in insts
                    ]
                )
            )
        for inst in insts:
            if inst.busy():
                inst.step()
        time.sleep(0.001)


def push_params(p: TPInstance) -> dict[str, Any]:
    """What a push-mode proxy sends D up front (both legs at once)."""
    side = p.connector.scheduler_side
    return {
        "do_remote_prefill": True,
        "remote_engine_id": p.engine_id,
        "remote_host": side.side_host,
        "remote_port": side.side_port,
        "tp_size": p.tp,
        "remote_block_size": p.block_size,
        "transfer_mode": "push",
    }


def expired(d: DaemonProc) -> int:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        return int(c.status()["counters"].get("leases_expired", 0))


def assert_daemon_idle(d: DaemonProc) -> None:
    deadline = time.monotonic() + 5
    while True:
        with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
            leases = c.status("leases")
            transfers = c.status("transfers")
        st = (leases["leases"], leases["tracked"], transfers["receiving"])
        if st == ([], [], []):
            return
        assert time.monotonic() < deadline, f"{d.name} kept state: {st}"
        time.sleep(0.05)


def transfer(
    p: TPInstance, d: TPInstance, mode: str, lengths: list[int], key: str
) -> list[tuple[str, str, int]]:
    """Proxy `lengths` requests P -> D, run both engines until D decoded them all."""
    reqs = []
    for i, n in enumerate(lengths):
        pid, did = ids(f"{key}{i}")
        p.add(pid, prompt(i, n), max_tokens=1, params={"do_remote_decode": True})
        if mode == "push":
            d.add(did, prompt(i, n), max_tokens=3, params=push_params(p))
            d.verify[did] = (p, pid)
        reqs.append((pid, did, n))
    if mode == "pull":
        run_until(lambda: all(pid in p.finished for pid, _, _ in reqs), [p, d])
        for i, (pid, did, n) in enumerate(reqs):
            params = p.finished[pid].kv_transfer_params
            assert params["tp_size"] == p.tp and params["remote_block_size"] == p.block_size
            d.add(did, prompt(i, n), max_tokens=3, params=params)
            d.verify[did] = (p, pid)
    run_until(lambda: all(did in d.finished for _, did, _ in reqs) and not p.busy(), [p, d])
    return reqs


def wait_logged(d: TPInstance, caplog: pytest.LogCaptureFixture, *needles: str) -> None:
    """Until D's scheduler side has logged every needle: it logs a failed load's reason when
    it takes the request's event from its own session, which may come after the workers'
    sessions reported the failure and vLLM finished the request (its next step, in vLLM)."""
    side = d.connector.scheduler_side
    deadline = time.monotonic() + 10
    while not all(n in caplog.text for n in needles):
        assert time.monotonic() < deadline, caplog.text
        side.has_pending_push_work()  # drains the session's events, as each step does
        time.sleep(0.01)


def check_arrived(p: TPInstance, d: TPInstance, reqs: list[tuple[str, str, int]]) -> None:
    assert not p.errors and not d.errors, p.errors + d.errors
    for pid, did, n in reqs:
        assert did in d.waited_remote, "D never waited in WAITING_FOR_REMOTE_KVS"
        assert did in d.received and did not in d.failed_recv, did
        assert [t for o in d.outputs[did] for t in o.new_token_ids] == [TOKEN] * 3
        assert pid in p.sent
        # every D rank compared every head it holds at every position P computed
        assert d.checked[did] == 2 * n * KV_HEADS, (d.checked[did], n)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_tp_ranks_arrive_byte_exact(
    p_tp: int,
    d_tp: int,
    mode: str,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
) -> None:
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=p_tp, mode=mode)
    d = make_tp_instance("d", dd.socket, model, tp=d_tp, mode=mode)
    instances += [p, d]
    reqs = transfer(p, d, mode, LENGTHS, f"t{p_tp}{d_tp}")
    check_arrived(p, d, reqs)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize(
    ("p_tp", "p_bs", "p_layout", "d_tp", "d_bs", "d_layout", "mode"),
    [
        (2, 16, "LBNHC", 1, 32, "LBNHC", "pull"),  # D blocks 2x P's, heads gathered
        (1, 32, "LBNHC", 2, 16, "LBNHC", "push"),  # P blocks 2x D's, heads sliced
        (1, 16, "LBNHC", 2, 16, "LBHNC", "pull"),  # NHD -> HND, heads sliced
        (2, 16, "LBHNC", 2, 16, "LBNHC", "push"),  # HND -> NHD at equal TP
    ],
)
def test_block_sizes_and_layouts_differ(
    p_tp: int,
    p_bs: int,
    p_layout: str,
    d_tp: int,
    d_bs: int,
    d_layout: str,
    mode: str,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
) -> None:
    pd, dd = pair
    p = make_tp_instance(
        "p", pd.socket, model, tp=p_tp, mode=mode, block_size=p_bs, layout=p_layout
    )
    d = make_tp_instance(
        "d", dd.socket, model, tp=d_tp, mode=mode, block_size=d_bs, layout=d_layout
    )
    instances += [p, d]
    want = {"LBNHC": "NHD", "LBHNC": "HND"}
    for inst, lay in ((p, p_layout), (d, d_layout)):
        staging = inst.ranks[0].connector.worker_side.staging
        assert staging is not None and staging.kv_layout == want[lay]
    reqs = transfer(p, d, mode, [20, 45, 70, 32], "b")
    check_arrived(p, d, reqs)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_hybrid_at_tp2_arrives_byte_exact(
    mode: str, pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[TPInstance]
) -> None:
    """Full attention + sliding window + Mamba-style state, TP 2 on both sides: every rank's
    full blocks, window blocks inside the window and state slot equal P's same rank's."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=2, mode=mode, hybrid=True)
    d = make_tp_instance("d", dd.socket, model, tp=2, mode=mode, hybrid=True)
    instances += [p, d]
    lengths = [20, 41, 70, 130]
    reqs = transfer(p, d, mode, lengths, "h")
    assert not p.errors and not d.errors, p.errors + d.errors
    for pid, did, n in reqs:
        assert did in d.received and did not in d.failed_recv, did
        assert pid in p.sent
        t = n - 1  # P computed all but the last prompt token (D computes it: state)
        window = min(t, WINDOW - 1)
        # per layer pair: full every token, window its tokens, both heads of both ranks;
        # plus one state slot per Mamba layer per rank
        assert d.checked[did] == 2 * (t + window) * KV_HEADS + 2 * 2, (d.checked[did], n)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize("state", [True, False], ids=["with_state", "attention_only"])
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "mode"), [(2, 1, "pull"), (2, 1, "push"), (1, 2, "pull"), (1, 2, "push")]
)
def test_hybrid_groups_map_across_tp(
    p_tp: int,
    d_tp: int,
    mode: str,
    state: bool,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
) -> None:
    """Full attention + sliding window (+ Mamba2 state) with P and D at different TP: each
    attention group maps its heads across the ranks like a plain region, the window moving
    only its blocks. The connector describes how TP cuts the state (`state_parts`: x by
    heads, B and C by groups, one group replicated at TP 2, SSM by heads), so each D rank
    receives its share of P's whole state, from the P ranks that hold it: every byte of
    every D rank's state slot equals its share of the state P's ranks held (reassembled
    and re-cut by the harness, independently of kvd), as well as every attention byte."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=p_tp, mode=mode, hybrid=True, state=state)
    d = make_tp_instance("d", dd.socket, model, tp=d_tp, mode=mode, hybrid=True, state=state)
    instances += [p, d]
    lengths = [20, 70]
    reqs = transfer(p, d, mode, lengths, "m")
    assert not p.errors and not d.errors, p.errors + d.errors
    for pid, did, n in reqs:
        assert did in d.received and did not in d.failed_recv, did
        assert pid in p.sent
        t = n - 1 if state else n  # with state, D computes the prompt's last token itself
        window = min(t, WINDOW - 1)
        # attention cells of every head, plus one state slot per Mamba layer per D rank
        slots = 2 * d_tp if state else 0
        assert d.checked[did] == 2 * (t + window) * KV_HEADS + slots, (d.checked[did], n)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_an_undescribed_state_at_another_tp_is_refused_naming_both_sides(
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kept refusal (README): a state group at another TP whose cut the connector cannot
    tell (here the HF config does not name Mamba2's groups, which TP 2 replicates). D's
    load fails (vLLM's policy applies) and P frees at once."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=2, hybrid=True, describe_state=False)
    d = make_tp_instance("d", dd.socket, model, tp=1, hybrid=True, describe_state=False)
    instances += [p, d]
    before = expired(pd)
    with caplog.at_level(logging.WARNING, logger="kvd_client.vllm"):
        reqs = transfer(p, d, "pull", [45], "s")
        ((pid, did, _),) = reqs
        assert did in d.failed_recv and did not in d.received
        assert d.finished[did].finish_reason.name == "ERROR"  # kv_load_failure_policy "fail"
        assert pid in p.sent and expired(pd) == before  # cancelled by D: freed, no expiry
        p.assert_idle()
        d.assert_idle()
        wait_logged(d, caplog, "INCOMPATIBLE", "state group 2: TP differs, P 2 ranks, D 1")
    assert "does not describe how TP cuts its state" in caplog.text, caplog.text
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_a_different_kv_dtype_is_refused_naming_both(
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TP may differ (2 -> 1 is accepted above); the KV dtype may not: D's daemon refuses at
    handshake naming both values, no byte is written, P frees at once, and vLLM's
    kv_load_failure_policy ("fail" here) ends D's request with an error."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=2)
    d = make_tp_instance("d", dd.socket, model, tp=1, dtype="float16")
    instances += [p, d]
    before = expired(pd)
    # D's scheduler side takes its session's events only once vLLM finished the request on
    # the workers' report (the order a busy engine can see): the reason is logged even so.
    side = d.connector.scheduler_side
    take = side.sub.take
    side.sub.take = lambda: take() if d.finished else []  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="kvd_client.vllm"):
        reqs = transfer(p, d, "pull", [45], "x")
        ((pid, did, _),) = reqs
        assert did in d.failed_recv and did not in d.received
        assert d.finished[did].finish_reason.name == "ERROR"
        assert pid in p.sent and expired(pd) == before  # cancelled by D: freed, no expiry
        p.assert_idle()
        d.assert_idle()
        wait_logged(d, caplog, "INCOMPATIBLE", "dtype P='bfloat16' D='float16'")
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16)])
def test_hybrid_window_group_at_another_block_size(
    p_bs: int,
    d_bs: int,
    mode: str,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
) -> None:
    """Full attention + sliding window with different block sizes on P and D: the
    connectors send the request's token count, which places each side's window blocks;
    every token of the window (and of the full group) arrives, byte for byte."""
    pd, dd = pair
    p = make_tp_instance(
        "p", pd.socket, model, tp=2, mode=mode, hybrid=True, state=False, block_size=p_bs
    )
    d = make_tp_instance(
        "d", dd.socket, model, tp=2, mode=mode, hybrid=True, state=False, block_size=d_bs
    )
    instances += [p, d]
    lengths = [20, 45, 70, 130]
    reqs = transfer(p, d, mode, lengths, "b")
    assert not p.errors and not d.errors, p.errors + d.errors
    for pid, did, n in reqs:
        assert did in d.received and did not in d.failed_recv, did
        assert pid in p.sent
        window = min(n, WINDOW - 1)
        assert d.checked[did] == 2 * (n + window) * KV_HEADS, (d.checked[did], n)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize(("shared", "loads"), [(32, True), (16, False)])
def test_local_hit_with_larger_p_blocks_loads_only_from_a_p_block_boundary(
    shared: int,
    loads: bool,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P's blocks hold 32 tokens, D's 16. D's blocks take the tail of P's from a boundary of
    the larger block: a local hit of 32 tokens loads the rest; one of 16 cannot pair (P's
    block 0 holds tokens D has and tokens it needs), so D computes the request itself."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=2, block_size=32)
    d = make_tp_instance("d", dd.socket, model, tp=1, block_size=16)
    instances += [p, d]
    tokens = prompt(50, shared) + prompt(51, 50)
    d.add("cmpl-local-0-00000000", tokens[: shared + 1], max_tokens=1, params=None)
    run_until(lambda: "cmpl-local-0-00000000" in d.finished, [d])
    pid, did = ids("hit")
    p.add(pid, tokens, max_tokens=1, params={"do_remote_decode": True})
    run_until(lambda: pid in p.finished, [p, d])
    params = p.finished[pid].kv_transfer_params
    with caplog.at_level(logging.WARNING, logger="kvd_client.vllm"):
        d.add(did, tokens, max_tokens=3, params=params)
        d.verify[did] = (p, pid)
        d.local_hit[did] = shared
        run_until(lambda: did in d.finished and not p.busy() and not d.busy(), [p, d])
    assert not p.errors and not d.errors, p.errors + d.errors
    assert [t for o in d.outputs[did] for t in o.new_token_ids] == [TOKEN] * 3
    assert pid in p.sent
    if loads:
        assert did in d.received and d.checked[did] == 2 * len(tokens) * KV_HEADS
    else:
        assert did not in d.waited_remote and did not in d.received
        assert "does not end on a boundary of P's blocks (32 tokens, D's 16)" in caplog.text
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.fixture(scope="module")
def model2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-tp2"), kv_heads=2)


@pytest.mark.parametrize(("p_tp", "d_tp", "mode"), [(4, 1, "pull"), (1, 4, "push"), (4, 2, "pull")])
def test_replicated_kv_heads(
    p_tp: int,
    d_tp: int,
    mode: str,
    pair: tuple[DaemonProc, DaemonProc],
    model2: str,
    instances: list[TPInstance],
) -> None:
    """2 KV heads at TP 4: each head is on two ranks; D takes every head from one replica."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model2, tp=p_tp, mode=mode)
    d = make_tp_instance("d", dd.socket, model2, tp=d_tp, mode=mode)
    instances += [p, d]
    reqs = transfer(p, d, mode, [20, 45], "rep")
    assert not p.errors and not d.errors, p.errors + d.errors
    for pid, did, n in reqs:
        assert did in d.received and did not in d.failed_recv, did
        assert pid in p.sent
        # every D rank checked its heads (replicas included) at every position
        assert d.checked[did] == 2 * n * sum(r.heads for r in d.ranks), d.checked[did]
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def counters(d: DaemonProc) -> dict[str, int]:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        got: dict[str, int] = c.status()["counters"]
    return got


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_layerwise_push_across_tp(
    p_tp: int,
    d_tp: int,
    pair: tuple[DaemonProc, DaemonProc],
    model: str,
    instances: list[TPInstance],
) -> None:
    """D registered before P prefills: every P rank announces its layers from
    save_kv_layer and P's daemon streams them into D's ranks of another TP."""
    pd, dd = pair
    p = make_tp_instance("p", pd.socket, model, tp=p_tp, mode="push")
    d = make_tp_instance("d", dd.socket, model, tp=d_tp, mode="push")
    instances += [p, d]
    before = counters(pd)
    lengths = [37, 50]
    reqs = []
    for i, n in enumerate(lengths):
        pid, did = ids(f"lw{i}")
        d.add(did, prompt(i, n), max_tokens=3, params=push_params(p))
        d.verify[did] = (p, pid)
        reqs.append((pid, did, n))

    def registered() -> bool:
        with KvdClient(pd.socket, role="cli", keepalive_interval=0) as c:
            return bool(c.status()["sender"]["pending_registrations"] == len(reqs))

    run_until(registered, [d])  # D allocated and registered; P has not prefilled yet
    for i, (pid, _, n) in enumerate(reqs):
        p.add(pid, prompt(i, n), max_tokens=1, params={"do_remote_decode": True})
    run_until(lambda: all(did in d.finished for _, did, _ in reqs) and not p.busy(), [p, d])
    after = counters(pd)
    assert after.get("sends_layered", 0) - before.get("sends_layered", 0) == len(reqs)
    assert after.get("layer_notices", 0) > before.get("layer_notices", 0)
    check_arrived(p, d, reqs)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)
