"""KvdTier's logic on vLLM 0.33's real tier classes, with an in-process fake of the daemon's
tier API (the transport port only; tests/vllm/test_kvd_tier.py runs the real daemon).

Checked here: the async lookup's semantics (tri-state, one batch per step whatever the
number of requests, results applied before the next step's lookups, cleanup, a failed or
timed-out batch is all misses, the retry interval, a clean shutdown), the transfers
(bytes moved without an intermediate buffer, each job reported once, a partly failed load
reported with its successful keys and its failed keys turned into misses, drain), the
namespace, the config and the import hygiene.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from kvd_client import wire
from kvd_client.errors import DaemonUnavailable, Timeout
from kvd_client.vllm.tiers import (
    RunnerJob,
    TierConfig,
    TransferRunner,
    TransportSlot,
    compat_namespace,
    lookup_batch,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("KVD_REQUIRE_VLLM"):
    raise RuntimeError("KVD_REQUIRE_VLLM is set but vLLM is not installed")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM 0.33 is not installed")
CLIENT_ROOT = Path(wire.__file__).resolve().parents[1]
BB = 256  # bytes per chunk in these tests


class FakeDaemon:
    """The daemon's tier store, in process: namespace -> key -> bytes."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, bytes], bytes] = {}
        self.batches: list[list[bytes]] = []
        self.dead = False
        self.slow = False  # raise Timeout as a client that timed out would
        self.gate = threading.Event()
        self.gate.set()
        self.xfer_gate = threading.Event()
        self.xfer_gate.set()
        self.entered = threading.Event()
        self.fail_load: set[bytes] = set()
        self.opened = 0
        self.closed = 0
        self.threads: set[str] = set()


class FakeTransport:
    def __init__(self, d: FakeDaemon, ns: bytes, block_bytes: int, timeout: float) -> None:
        if d.dead:
            raise DaemonUnavailable("no daemon")
        self.d, self.ns, self.bb = d, ns, block_bytes
        d.opened += 1

    def _check(self) -> None:
        self.d.threads.add(threading.current_thread().name)
        if self.d.dead:
            raise DaemonUnavailable("daemon gone")
        if self.d.slow:
            raise Timeout("no answer in time")

    def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        assert self.d.gate.wait(10)
        self._check()
        self.d.batches.append(list(keys))
        return [(self.ns, k) in self.d.blocks for k in keys]

    def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        self.d.entered.set()
        assert self.d.xfer_gate.wait(10)
        self._check()
        for k, b in zip(keys, blocks, strict=True):
            assert len(b) == self.bb
            self.d.blocks[(self.ns, k)] = bytes(b)
        return [True] * len(keys)

    def load(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        self._check()
        out = []
        for k, dst in zip(keys, dests, strict=True):
            data = self.d.blocks.get((self.ns, k))
            if data is None or k in self.d.fail_load:
                out.append(False)
                continue
            dst[:] = data
            out.append(True)
        return out

    def stats(self) -> dict[str, Any]:
        return {"blocks": len(self.d.blocks)}

    def close(self) -> None:
        self.d.closed += 1


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def settle(tier: Any, key: bytes, c: Any) -> Any:
    """End steps until the lookup of `key` is answered (as the scheduler would)."""
    from vllm.v1.kv_offload.base import LookupResult

    deadline = time.monotonic() + 5
    while (r := tier.lookup(key, c)) is LookupResult.RETRY:
        assert time.monotonic() < deadline, "lookup never answered"
        end_step(tier)
        time.sleep(0.002)
    return r


def answered(tier: Any) -> None:
    """Wait until the lookup thread has queued its answer (not yet applied)."""
    wait_for(lambda: not tier._lookups._pending_results.empty())


def tier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("kvd_tier", "vllm_off"))]


# ------------------------------------------------------------------------- vLLM-free parts


def test_namespace_separates_models_and_is_stable() -> None:
    base = {"model": "m", "dtype": "bfloat16", "tokens_per_hash": 16, "layout": "LBNHC"}
    ns = compat_namespace(base)
    assert len(ns) == 16 and ns == compat_namespace(dict(reversed(list(base.items()))))
    for change in (
        {"model": "m2"},
        {"dtype": "float16"},
        {"tokens_per_hash": 32},
        {"layout": "LBHNC"},
    ):
        assert compat_namespace({**base, **change}) != ns, change


def test_config_validates_and_names_the_key() -> None:
    c = TierConfig.from_kwargs({"kvd_socket": "/tmp/x.sock", "lookup_timeout": 0.5})
    assert c.socket == "/tmp/x.sock" and c.lookup_timeout == 0.5
    for bad in ({"lookup_timeout": 0}, {"transfer_timeout": "1"}, {"retry_interval": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TierConfig.from_kwargs(bad)
    with pytest.raises(ValueError, match="kvd_socket"):
        TierConfig.from_kwargs({"kvd_socket": 3})


def test_slot_backs_off_after_a_failure_and_reconnects() -> None:
    d = FakeDaemon()
    slot = TransportSlot(lambda: FakeTransport(d, b"n", BB, 1.0), 5.0, "lookup")
    d.dead = True
    assert slot.get(100.0) is None and slot.failures == 1
    d.dead = False
    assert slot.get(104.9) is None  # still inside the retry interval: not asked
    assert d.opened == 0
    assert slot.get(105.0) is not None and d.opened == 1
    d.slow = True
    assert lookup_batch(slot, [b"a", b"b"], now=lambda: 200.0) == [False, False]
    assert slot.failures == 2 and d.closed == 1  # a timed-out transport is dropped
    d.slow = False
    assert lookup_batch(slot, [b"a"], now=lambda: 201.0) == [False]
    assert d.batches == []  # inside the interval: a miss without asking
    d.blocks[(b"n", b"a")] = b"x"
    assert lookup_batch(slot, [b"a", b"b"], now=lambda: 205.0) == [True, False]


def test_runner_moves_bytes_reports_each_job_once_and_drains() -> None:
    d = FakeDaemon()
    arr = np.arange(8 * BB, dtype=np.uint8).reshape(8, BB) % 251
    flat = memoryview(arr).cast("B")
    r = TransferRunner(flat, BB, TransportSlot(lambda: FakeTransport(d, b"n", BB, 1.0), 5.0, "t"))
    try:
        r.submit(RunnerJob(1, False, (b"k3", b"k5"), (3 * BB, 5 * BB)))
        assert r.drain(5)
        [o] = r.take_finished()
        assert (o.job_id, o.is_load, o.done, o.nbytes) == (1, False, (True, True), 2 * BB)
        assert d.blocks[(b"n", b"k3")] == arr[3].tobytes()
        assert d.blocks[(b"n", b"k5")] == arr[5].tobytes()
        assert r.take_finished() == []  # once
        arr[0] = 0
        d.fail_load.add(b"k5")
        r.submit(RunnerJob(2, True, (b"k3", b"k5", b"nope"), (0, BB, 2 * BB)))
        assert r.drain(5)
        [o] = r.take_finished()
        assert o.done == (True, False, False) and not o.success
        assert arr[0].tobytes() == d.blocks[(b"n", b"k3")]
        d.xfer_gate.clear()  # a job still in flight cannot be submitted again
        r.submit(RunnerJob(9, False, (b"k0",), (0,)))
        with pytest.raises(ValueError, match="twice"):
            r.submit(RunnerJob(9, False, (b"k0",), (0,)))
        assert not r.drain(0.05) and r.pending() == 1
        r.submit(RunnerJob(10, False, (b"k1",), (BB,)))
        r.submit(RunnerJob(11, True, (b"k3",), (2 * BB,)))  # queued after 10, runs before
        d.xfer_gate.set()
        assert r.drain(5) and [o.job_id for o in r.take_finished()] == [9, 11, 10]
        with pytest.raises(ValueError, match="outside"):
            r.submit(RunnerJob(3, True, (b"k3",), (8 * BB,)))
        d.dead = True
        r.submit(RunnerJob(4, False, (b"k1",), (BB,)))
        assert r.drain(5)
        [o] = r.take_finished()
        assert o.done == (False,)
        assert r.stats()["store_failures"] == 1 and r.stats()["jobs_pending"] == 0
    finally:
        r.shutdown()
    assert not tier_threads()


def test_runner_shutdown_finishes_the_running_job_and_fails_the_queued() -> None:
    d = FakeDaemon()
    arr = np.full((4, BB), 9, dtype=np.uint8)
    slot = TransportSlot(lambda: FakeTransport(d, b"n", BB, 1.0), 5.0, "t")
    r = TransferRunner(memoryview(arr).cast("B"), BB, slot)
    d.xfer_gate.clear()
    r.submit(RunnerJob(1, False, (b"a",), (0,)))
    wait_for(d.entered.is_set)  # job 1 is mid-call
    r.submit(RunnerJob(2, False, (b"b",), (BB,)))
    stopper = threading.Thread(target=r.shutdown)
    stopper.start()
    wait_for(lambda: r._stopping)
    d.xfer_gate.set()
    stopper.join(5)
    assert not stopper.is_alive()
    assert {o.job_id: o.done for o in r.take_finished()} == {1: (True,), 2: (False,)}
    assert d.blocks == {(b"n", b"a"): arr[0].tobytes()} and d.closed == 1
    assert not tier_threads()


def test_import_hygiene() -> None:
    probe = (
        "import json, sys\n"
        "import kvd_client.vllm.tiers as t\n"
        "mods = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'kvd'})\n"
        "print(json.dumps(mods))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(CLIENT_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []


# ------------------------------------------------------------------------- on vLLM's classes


def fake_spec(model: str = "m", dtype: str = "bfloat16", layout: str = "LBNHC") -> Any:
    cfg = SimpleNamespace(
        model=SimpleNamespace(name=model, dtype=dtype),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        groups=(SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1")),),
        worker_kv_bytes_per_block=BB,
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1),
        kv_cache_layout=layout,
        canonical_layout=False,
        replicated_layout=False,
    )
    return SimpleNamespace(config=cfg)


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def tier(daemon: FakeDaemon) -> Iterator[Any]:
    from kvd_client.vllm.tiers import KvdTier

    primary = np.zeros((8, BB), dtype=np.int8)
    t = KvdTier(
        fake_spec(),
        memoryview(primary),
        "KvdTier",
        transport_factory=lambda s, ns, bb, to: FakeTransport(daemon, ns, bb, to),
        kvd_socket="/nonexistent/kvd.sock",
        retry_interval=0.05,
    )
    t.primary = primary
    yield t
    t.shutdown()
    assert not tier_threads(), tier_threads()


def ctx(rid: str) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id=rid)


def end_step(t: Any) -> None:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    t.on_schedule_end(ScheduleEndContext((), ()))


@needs_vllm
def test_factory_loads_the_tier_by_module_path() -> None:
    from kvd_client.vllm.tiers import KvdTier
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cls = SecondaryTierFactory.get_tier_class(
        {"type": "KvdTier", "module_path": "kvd_client.vllm.tiers"}
    )
    assert cls is KvdTier and issubclass(cls, SecondaryTierManager)


@needs_vllm
def test_lookup_is_tristate_batched_per_step_and_drained_before_the_next(
    tier: Any, daemon: FakeDaemon
) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    ns = tier.namespace
    daemon.blocks[(ns, b"a")] = b"x" * BB
    daemon.gate.clear()  # the daemon answers only when the test lets it
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.RETRY
    assert tier.lookup(b"b", ctx("r1")) is LookupResult.RETRY
    assert tier.lookup(b"a", ctx("r2")) is LookupResult.RETRY  # shared key, queued once
    assert tier.lookup(b"c", ctx("r2")) is LookupResult.RETRY
    assert daemon.batches == []  # nothing is sent before the step ends
    end_step(tier)
    # in flight: still not yet, and no second batch for the same keys
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.RETRY
    daemon.gate.set()
    answered(tier)
    end_step(tier)  # (the flush also drains what arrived)
    assert daemon.batches == [[b"a", b"b", b"c"]]  # one batch for two requests
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.HIT
    assert tier.lookup(b"b", ctx("r1")) is LookupResult.MISS
    assert tier.lookup(b"c", ctx("r2")) is LookupResult.MISS
    # answers are kept: no new batch for known keys
    end_step(tier)
    time.sleep(0.05)
    assert len(daemon.batches) == 1
    # cleanup drops only what no other request needs
    tier.on_request_finished(ctx("r1"))
    state = tier._lookups._lookup_state
    assert b"a" in state and b"b" not in state and b"c" in state
    tier.on_request_finished(ctx("r2"))
    assert not state and not tier._lookups._req_keys
    # a fresh lookup of a dropped key asks again
    assert tier.lookup(b"b", ctx("r3")) is LookupResult.RETRY
    end_step(tier)
    wait_for(lambda: len(daemon.batches) == 2)
    assert daemon.batches[1] == [b"b"]


@needs_vllm
def test_results_are_applied_before_the_next_steps_lookups(tier: Any, daemon: FakeDaemon) -> None:
    """The first lookup after a flush drains every answer that arrived, so within a step
    a key's verdict never changes between two lookups."""
    from vllm.v1.kv_offload.base import LookupResult

    daemon.blocks[(tier.namespace, b"a")] = b"x" * BB
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.RETRY
    end_step(tier)
    answered(tier)  # the answer is queued; applied at the next step's first lookup
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.HIT
    assert tier.lookup(b"z", ctx("r1")) is LookupResult.RETRY
    tier.on_request_finished(ctx("r1"))


@needs_vllm
def test_failed_and_timed_out_lookups_are_misses(tier: Any, daemon: FakeDaemon) -> None:
    from vllm.v1.kv_offload.base import LookupResult

    daemon.blocks[(tier.namespace, b"a")] = b"x" * BB
    daemon.slow = True
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.RETRY
    end_step(tier)
    answered(tier)
    assert tier._lookups._slot.failures == 1
    assert tier.lookup(b"a", ctx("r1")) is LookupResult.MISS  # present, but unanswered
    tier.on_request_finished(ctx("r1"))
    daemon.slow = False
    daemon.dead = True
    assert tier.lookup(b"a", ctx("r2")) is LookupResult.RETRY
    assert settle(tier, b"a", ctx("r2")) is LookupResult.MISS
    tier.on_request_finished(ctx("r2"))
    daemon.dead = False
    time.sleep(0.06)  # past retry_interval: asked again, and found
    assert tier.lookup(b"a", ctx("r3")) is LookupResult.RETRY
    assert settle(tier, b"a", ctx("r3")) is LookupResult.HIT
    tier.on_request_finished(ctx("r3"))


@needs_vllm
def test_store_and_load_through_the_primary_view(tier: Any, daemon: FakeDaemon) -> None:
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.tiering.base import TransferJob as VJob

    primary = tier.primary
    rng = np.random.default_rng(7)
    primary[:] = rng.integers(-128, 127, size=primary.shape, dtype=np.int8)
    want = {b"k2": primary[2].tobytes(), b"k6": primary[6].tobytes()}
    tier.submit_store(VJob(1, [b"k2", b"k6"], np.array([2, 6]), False, ctx("r1")))
    assert tier.has_pending_work()
    tier.drain_jobs()
    [res] = list(tier.get_finished_jobs())
    assert (res.job_id, res.success, res.transfer_bytes) == (1, True, 2 * BB)
    assert list(tier.get_finished_jobs()) == []  # each job once
    assert not tier.has_pending_work()
    assert {k: daemon.blocks[(tier.namespace, k)] for k in want} == want
    # a promotion into other slots
    primary[:] = 0
    for k in (b"k2", b"k6", b"gone"):
        assert tier.lookup(k, ctx("r2")) is LookupResult.RETRY
    end_step(tier)
    answered(tier)
    assert tier.lookup(b"k2", ctx("r2")) is LookupResult.HIT
    assert tier.lookup(b"k6", ctx("r2")) is LookupResult.HIT
    del daemon.blocks[(tier.namespace, b"k6")]  # evicted between lookup and load
    tier.submit_load(VJob(2, [b"k2", b"k6"], np.array([0, 4]), True, ctx("r2")))
    tier.drain_jobs()
    [res] = list(tier.get_finished_jobs())
    assert res.job_id == 2 and not res.success and res.successful_keys == (b"k2",)
    assert primary[0].tobytes() == want[b"k2"]
    assert not primary[4].any()
    # the failed key is a miss from now on (vLLM would otherwise promote it forever)
    assert tier.lookup(b"k6", ctx("r2")) is LookupResult.MISS
    assert tier.lookup(b"k2", ctx("r2")) is LookupResult.HIT
    tier.on_request_finished(ctx("r2"))
    # the data never went through a thread other than the two the tier owns
    assert daemon.threads <= {"kvd_tier_transfers_KvdTier", "vllm_offloading_lookup_KvdTier"}


@needs_vllm
def test_a_dead_daemon_fails_jobs_and_shutdown_is_clean(tier: Any, daemon: FakeDaemon) -> None:
    from vllm.v1.kv_offload.tiering.base import TransferJob as VJob

    daemon.dead = True
    tier.submit_load(VJob(5, [b"x"], np.array([1]), True, ctx("r1")))
    tier.submit_store(VJob(6, [b"y"], np.array([2]), False, ctx("r1")))
    tier.drain_jobs()
    res = {r.job_id: r for r in tier.get_finished_jobs()}
    assert set(res) == {5, 6} and not res[5].success and not res[6].success
    assert res[5].successful_keys is None
    t0 = time.monotonic()
    tier.shutdown()
    assert time.monotonic() - t0 < 1.0
    assert not tier_threads()
    tier.shutdown()  # twice is harmless
