"""KvdConnector on vLLM 0.33's real Scheduler: a P instance and a D instance, two real kvd
daemons, real NIXL, real shared-memory staging; every received byte is checked.

The test plays the model runner (vllm_harness.py) and the proxy: same request key on both legs,
P's leg with max_tokens=1 and do_remote_decode, P's kv_transfer_params forwarded to D (pull),
or both legs at once with P's coordinates known up front (push).
"""

from __future__ import annotations

import importlib.util
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
    from vllm_harness import BLOCK_SIZE, TOKEN, Instance, make_instance, write_model

StartDaemon = Callable[..., DaemonProc]
SHORT_LEASE = "[transfer]\nkv_lease_duration = 2.0\npeer_probe_interval = 0.2\n"
SHARED_CFG = "[transfer]\nkv_lease_duration = 3.0\npeer_probe_interval = 0.2\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """One P and one D daemon shared by the tests that leave them running (starting a
    daemon takes seconds); each test asserts it leaves both idle. Torn down like `daemons`."""
    workdir = Path(tempfile.mkdtemp(prefix="kvdv-", dir="/tmp"))  # ipc paths must stay short
    with ThreadPoolExecutor(2) as ex:
        pd, dd = ex.map(lambda name: start_daemon(workdir, name, SHARED_CFG), ["kvd-sp", "kvd-sd"])
    yield pd, dd
    problems = []
    for d in (dd, pd):
        rc = d.stop()
        if rc != 0:
            problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
        if os.path.exists(d.socket):
            problems.append(f"{d.name} left its socket {d.socket}")
    shutil.rmtree(workdir, ignore_errors=True)
    assert not problems, "\n".join(problems)


def start_pair(daemons: StartDaemon, extra: str = "") -> tuple[DaemonProc, DaemonProc]:
    """P's and D's daemons, started concurrently (each takes seconds to come up)."""
    with ThreadPoolExecutor(2) as ex:
        pd, dd = ex.map(lambda name: daemons(name, extra), ["kvd-vp", "kvd-vd"])
    return pd, dd


@pytest.fixture
def instances() -> Iterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in made:
        inst.close()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 120 + 1 for i in range(n)]


def ids(key: str) -> tuple[str, str]:
    """P's and D's internal ids for one proxied request (same X-Request-Id, per-engine suffix)."""
    return f"cmpl-{key}-0-{secrets.token_hex(4)}", f"cmpl-{key}-0-{secrets.token_hex(4)}"


def run_until(cond: Callable[[], bool], insts: list[Instance], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; state: {[describe(i) for i in insts]}")
        for inst in insts:
            if inst.busy():
                inst.step()
        time.sleep(0.001)


def describe(inst: Instance) -> dict[str, Any]:
    s = inst.scheduler
    return {
        "name": inst.name,
        "requests": {r: str(q.status) for r, q in s.requests.items()},
        "held_blocks": inst.held_blocks(),
        "errors": inst.errors,
    }


def daemon_state(d: DaemonProc) -> dict[str, Any]:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        leases = c.status("leases")
        transfers = c.status("transfers")
    return {
        "leases": leases["leases"],
        "tracked": leases["tracked"],
        "receiving": transfers["receiving"],
    }


def counters(d: DaemonProc) -> dict[str, int]:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        got: dict[str, int] = c.status()["counters"]
    return got


def assert_daemon_idle(d: DaemonProc) -> None:
    deadline = time.monotonic() + 5
    while (st := daemon_state(d)) != {"leases": [], "tracked": [], "receiving": []}:
        assert time.monotonic() < deadline, f"{d.name} kept state: {st}"
        time.sleep(0.05)


def p_params(p: Instance, d_mode: str) -> dict[str, Any]:
    """What a push-mode proxy sends D up front: P's coordinates, no block ids."""
    w = p.connector.scheduler_side
    return {
        "do_remote_prefill": True,
        "remote_engine_id": p.engine_id,
        "remote_host": w.side_host,
        "remote_port": w.side_port,
        "tp_size": 1,
        "remote_block_size": BLOCK_SIZE,
        "transfer_mode": d_mode,
    }


def proxy(
    p: Instance, d: Instance, key: str, tokens: list[int], mode: str, *, max_tokens: int = 3
) -> tuple[str, str]:
    """Send one request through P and D the way the proxy does; returns (P id, D id)."""
    p_id, d_id = ids(key)
    p.add(p_id, tokens, max_tokens=1, params={"do_remote_decode": True, "do_remote_prefill": False})
    if mode == "push":
        d.add(d_id, tokens, max_tokens=max_tokens, params=p_params(p, "push"))
        d.verify[d_id] = (p.salt, 0)
    return p_id, d_id


def forward_params(
    p: Instance,
    d: Instance,
    p_id: str,
    d_id: str,
    tokens: list[int],
    *,
    max_tokens: int = 3,
    first: int = 0,
) -> dict[str, Any]:
    """Pull: once P's leg finished, its response's kv_transfer_params go to D."""
    params = p.finished[p_id].kv_transfer_params
    assert params is not None and params["remote_request_id"] == p_id
    assert params["remote_engine_id"] == p.engine_id and params["tp_size"] == 1
    assert len(params["remote_block_ids"][0]) == -(-len(tokens) // BLOCK_SIZE)
    d.add(d_id, tokens, max_tokens=max_tokens, params=params)
    d.verify[d_id] = (p.salt, first)
    return params


# ---------------------------------------------------------------------- transfers


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_concurrent_requests_arrive_byte_exact(
    mode: str, pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    pd, dd = pair
    # different physical KV layouts on purpose: blocks travel in logical order
    p = make_instance("p", pd.socket, model, mode=mode, layout="LBNHC")
    d = make_instance("d", dd.socket, model, mode=mode, layout="BLHNC")
    instances += [p, d]
    lengths = [20, 33, 48, 70, 16, 5]
    reqs = [proxy(p, d, f"r{i}", prompt(i, n), mode) for i, n in enumerate(lengths)]
    if mode == "pull":
        run_until(lambda: all(pid in p.finished for pid, _ in reqs), [p, d])
        for i, ((pid, did), n) in enumerate(zip(reqs, lengths, strict=True)):
            forward_params(p, d, pid, did, prompt(i, n))
    run_until(lambda: all(did in d.finished for _, did in reqs) and not p.busy(), [p, d])
    for (pid, did), n in zip(reqs, lengths, strict=True):
        assert did in d.waited_remote, "D never waited in WAITING_FOR_REMOTE_KVS"
        assert did in d.received and did not in d.failed_recv
        out = d.outputs[did]
        assert [t for o in out for t in o.new_token_ids] == [TOKEN] * 3
        assert pid in p.sent
        assert p.finished[pid].kv_transfer_params["transfer_mode"] == mode
        assert len(d.received[did]) == -(-n // BLOCK_SIZE)
    assert not p.errors and not d.errors, p.errors + d.errors
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_block_aligned_local_hit_loads_only_the_rest(
    mode: str, pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    pd, dd = pair
    p = make_instance("p", pd.socket, model, mode=mode)
    d = make_instance("d", dd.socket, model, mode=mode)
    instances += [p, d]
    shared = prompt(9, 3 * BLOCK_SIZE + 5)
    # D computed a request with the same 3-block prefix itself (D's own KV, D's salt)
    d.add("cmpl-local-0-00000000", shared, max_tokens=1, params=None)
    run_until(lambda: "cmpl-local-0-00000000" in d.finished, [d])
    tokens = shared[: 3 * BLOCK_SIZE] + prompt(10, 2 * BLOCK_SIZE + 3)
    pid, did = proxy(p, d, "hit", tokens, mode)
    if mode == "pull":
        run_until(lambda: pid in p.finished, [p, d])
        forward_params(p, d, pid, did, tokens)
    d.verify[did] = (p.salt, 3 * BLOCK_SIZE)  # positions before the hit keep D's own bytes
    run_until(lambda: did in d.finished and not p.busy(), [p, d])
    assert did in d.waited_remote and did in d.received
    assert not d.errors, d.errors
    p.assert_idle()
    d.assert_idle()
    moved = []
    for daemon in (pd, dd):
        with KvdClient(daemon.socket, role="cli", keepalive_interval=0) as c:
            recent = c.status("transfers")["recent"]
        moved += [r["bytes"] for r in recent if r["request_id"] in (pid, did)]
    staging = d.worker.worker_side.staging
    assert staging is not None
    assert moved == [3 * staging.block_bytes], (
        moved
    )  # 3 of the 6 blocks: the local hit stayed local


def test_async_scheduler_pull(
    pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    pd, dd = pair
    p = make_instance("p", pd.socket, model, async_scheduling=True)
    d = make_instance("d", dd.socket, model, async_scheduling=True)
    instances += [p, d]
    lengths = [40, 17, 64]
    reqs = [proxy(p, d, f"a{i}", prompt(20 + i, n), "pull") for i, n in enumerate(lengths)]
    run_until(lambda: all(pid in p.finished for pid, _ in reqs), [p, d])
    for i, ((pid, did), n) in enumerate(zip(reqs, lengths, strict=True)):
        forward_params(p, d, pid, did, prompt(20 + i, n))
    run_until(
        lambda: all(did in d.finished for _, did in reqs) and not p.busy() and not d.busy(), [p, d]
    )
    for _, did in reqs:
        assert did in d.waited_remote and did in d.received
    p.assert_idle()
    d.assert_idle()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nothing_to_load_sends_an_empty_transfer_so_p_frees_now(
    mode: str, pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    """vLLM asks for no external tokens (here: a request that must not read any cache):
    update_state_after_alloc gets 0 and the connector still tells P to free at once."""
    pd, dd = pair
    p = make_instance("p", pd.socket, model, mode=mode)
    d = make_instance("d", dd.socket, model, mode=mode)
    instances += [p, d]
    tokens = prompt(12, 41)
    p_id, d_id = ids("noload")
    p.add(p_id, tokens, max_tokens=1, params={"do_remote_decode": True})
    run_until(lambda: p_id in p.finished, [p])
    params = p.finished[p_id].kv_transfer_params if mode == "pull" else p_params(p, mode)
    before = counters(pd)
    d.add(d_id, tokens, max_tokens=2, params=params, skip_prefix_cache=True)
    run_until(lambda: d_id in d.finished and not d.busy() and not p.busy(), [p, d], timeout=10)
    assert d_id not in d.waited_remote and d_id not in d.received and d_id not in d.failed_recv
    assert p_id in p.sent
    after = counters(pd)
    assert after.get("leases_expired", 0) == before.get("leases_expired", 0)  # freed by D's notice
    key = "pulls_acked" if mode == "pull" else "sends_ok"  # an empty READ / WRITE
    assert after.get(key, 0) == before.get(key, 0) + 1
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


# ---------------------------------------------------------------------- failures


def test_d_aborts_while_waiting_push(
    pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    pd, dd = pair
    p = make_instance("p", pd.socket, model, mode="push")
    d = make_instance("d", dd.socket, model, mode="push")
    instances += [p, d]
    tokens = prompt(3, 50)
    p_id, d_id = ids("abort")
    d.add(d_id, tokens, max_tokens=3, params=p_params(p, "push"))
    run_until(lambda: d_id in d.waited_remote, [d])  # registered; P has not prefilled
    time.sleep(0.2)
    assert d.scheduler.requests[d_id].status.name == "WAITING_FOR_REMOTE_KVS"
    d.abort(d_id)
    run_until(lambda: not d.busy(), [d])  # the cancel ends it: RecvFailed, reported, blocks freed
    assert d_id in d.failed_recv and d_id not in d.received
    d.assert_idle()
    # P's leg arrives after D gave up: D's cancel left a tombstone, so P's finish ends the
    # send at once (no lease held for nobody) and P frees the blocks
    before = counters(pd)
    p.add(p_id, tokens, max_tokens=1, params={"do_remote_decode": True})
    run_until(lambda: p_id in p.finished and not p.busy(), [p], timeout=10)
    assert p_id in p.sent
    after = counters(pd)
    assert after.get("leases_expired", 0) == before.get("leases_expired", 0)
    assert after.get("finishes_after_cancel", 0) == before.get("finishes_after_cancel", 0) + 1
    p.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_d_aborts_before_admission_pull_frees_p_now(
    pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    pd, dd = pair
    p = make_instance("p", pd.socket, model)
    d = make_instance("d", dd.socket, model)
    instances += [p, d]
    tokens = prompt(4, 40)
    p_id, d_id = proxy(p, d, "early", tokens, "pull")
    run_until(lambda: p_id in p.finished, [p])
    params = p.finished[p_id].kv_transfer_params
    d.add(d_id, tokens, max_tokens=3, params=params)  # tracked (heartbeats), never scheduled
    before = counters(pd)
    d.abort(d_id)  # request_finished while queued: an empty pull tells P to free
    run_until(lambda: not p.busy() and not d.busy(), [p, d], timeout=10)
    assert p_id in p.sent and d_id not in d.received and d_id not in d.failed_recv
    after = counters(pd)  # freed by D's notice, not by the lease running out
    assert after.get("pulls_acked", 0) == before.get("pulls_acked", 0) + 1
    assert after.get("leases_expired", 0) == before.get("leases_expired", 0)
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_layerwise_push_when_d_registered_before_p_prefills(
    pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    """Both legs at once, D registered first: P's workers announce each layer from
    save_kv_layer and P's daemon streams it; D's KV is byte-exact, and P's finish (a step
    later) only ends the send."""
    pd, dd = pair
    p = make_instance("p", pd.socket, model, mode="push", layout="LBNHC")
    d = make_instance("d", dd.socket, model, mode="push")
    instances += [p, d]
    before = counters(pd)
    lengths = [37, 16, 50]
    reqs = [proxy(p, d, f"lw{i}", prompt(20 + i, n), "push") for i, n in enumerate(lengths)]

    def registered() -> bool:
        with KvdClient(pd.socket, role="cli", keepalive_interval=0) as c:
            return bool(c.status()["sender"]["pending_registrations"] == len(reqs))

    run_until(registered, [d])  # D allocated and registered; P has not prefilled yet
    run_until(lambda: all(did in d.finished for _, did in reqs) and not p.busy(), [p, d])
    after = counters(pd)
    assert after.get("streams_started", 0) - before.get("streams_started", 0) == len(reqs)
    assert after.get("sends_layered", 0) - before.get("sends_layered", 0) == len(reqs)
    assert after.get("layer_notices", 0) > before.get("layer_notices", 0)
    for (pid, did), n in zip(reqs, lengths, strict=True):
        assert did in d.received and did not in d.failed_recv, did
        assert len(d.received[did]) == -(-n // BLOCK_SIZE)
        assert pid in p.sent
    assert not p.errors and not d.errors, p.errors + d.errors
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_p_aborts_push_d_fails_fast_and_recomputes(
    pair: tuple[DaemonProc, DaemonProc], model: str, instances: list[Instance]
) -> None:
    """Push runs both legs at once; P's leg is aborted before it prefills: D must not wait
    for push_registration_timeout (480 s by default)."""
    pd, dd = pair
    p = make_instance("p", pd.socket, model, mode="push")
    d = make_instance("d", dd.socket, model, mode="push", failure_policy="recompute")
    instances += [p, d]
    tokens = prompt(8, 37)
    p_id, d_id = proxy(p, d, "pabort", tokens, "push")
    run_until(lambda: d_id in d.waited_remote, [d])  # D registered and waits for P's WRITE
    p.abort(p_id)  # never prefilled: an empty finish makes D's registration fail now
    run_until(lambda: d_id in d.finished and not d.busy() and not p.busy(), [p, d], timeout=10)
    assert d_id in d.failed_recv and d_id not in d.received and p_id not in p.sent
    assert [t for o in d.outputs[d_id] for t in o.new_token_ids] == [TOKEN] * 3
    p.assert_idle()
    d.assert_idle()
    assert_daemon_idle(pd)
    assert_daemon_idle(dd)


def test_d_daemon_killed_p_frees_by_lease_expiry(
    daemons: StartDaemon, model: str, instances: list[Instance]
) -> None:
    pd, dd = start_pair(daemons, SHORT_LEASE)
    p = make_instance("p", pd.socket, model)
    d = make_instance("d", dd.socket, model, failure_policy="recompute")
    instances += [p, d]
    tokens = prompt(5, 45)
    p_id, d_id = proxy(p, d, "dkill", tokens, "pull")
    run_until(lambda: p_id in p.finished, [p])
    d.add(d_id, tokens, max_tokens=2, params=p.finished[p_id].kv_transfer_params)
    until = time.monotonic() + 3.0  # D's daemon heartbeats: the 2 s lease outlives its first term
    run_until(lambda: time.monotonic() > until, [p])
    assert p_id in p.scheduler.requests and p_id not in p.sent, "P freed while D still heartbeated"
    dd.kill()
    t0 = time.monotonic()
    run_until(lambda: not p.busy(), [p], timeout=10)  # SendExpired -> finished_sending
    assert 0.5 < time.monotonic() - t0 < 6
    assert p_id in p.sent
    p.assert_idle()
    # D's client notices its daemon died: the load fails and the request recomputes
    run_until(lambda: d_id in d.finished and not d.busy(), [d], timeout=10)
    assert d_id in d.failed_recv and d_id not in d.received
    assert [t for o in d.outputs[d_id] for t in o.new_token_ids] == [TOKEN] * 2
    d.assert_idle()


@pytest.mark.parametrize(
    ("mode", "policy"), [("push", "recompute"), ("pull", "recompute"), ("pull", "fail")]
)
def test_p_daemon_killed_d_fails_the_load(
    mode: str, policy: str, daemons: StartDaemon, model: str, instances: list[Instance]
) -> None:
    pd, dd = start_pair(daemons, SHORT_LEASE)
    p = make_instance("p", pd.socket, model, mode=mode)
    d = make_instance("d", dd.socket, model, mode=mode, failure_policy=policy)
    instances += [p, d]
    tokens = prompt(6, 52)
    p_id, d_id = proxy(p, d, "pkill", tokens, mode)
    if mode == "pull":
        run_until(lambda: p_id in p.finished, [p])
        params = p.finished[p_id].kv_transfer_params
        pd.kill()
        d.add(d_id, tokens, max_tokens=2, params=params)
    else:
        run_until(lambda: d_id in d.waited_remote, [d])  # D registered; P has not prefilled
        time.sleep(0.3)
        pd.kill()
    run_until(lambda: d_id in d.finished and not d.busy(), [d], timeout=15)
    assert d_id in d.waited_remote and d_id in d.failed_recv and d_id not in d.received
    tokens_out = [t for o in d.outputs[d_id] for t in o.new_token_ids]
    if policy == "recompute":
        assert tokens_out == [TOKEN] * (2 if mode == "pull" else 3)
        assert d.finished[d_id].finish_reason.name == "LENGTH"
    else:
        assert tokens_out == [] and d.finished[d_id].finish_reason.name == "ERROR"
    d.assert_idle()
    # P's side: its client notices the dead daemon and frees what it handed over
    run_until(lambda: not p.busy(), [p], timeout=10)
    p.assert_idle()
    assert_daemon_idle(dd)
