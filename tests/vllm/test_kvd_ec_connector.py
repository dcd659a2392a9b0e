"""KvdECConnector on vLLM 0.33's real Scheduler: an E (encode-only, `ec_producer`) instance
and a PD (`ec_consumer`) instance, each over its own real kvd daemon (`[ec] role` producer
and consumer), real NIXL between the daemons, real multimodal requests from vLLM's
InputProcessor (vllm_ec_harness.py). Every encoder output a consumer's forward uses is
checked byte for byte against the producer's.

The test plays the proxy: the image goes to E with max_tokens=1, E's response
`ec_transfer_params` go into the PD request's `extra_args["ec_transfer_params"]`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
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
    from kvd_client.vllm.ec import params_to_dict
    from vllm.v1.request import RequestStatus
    from vllm_ec_harness import HIDDEN, QUERY_TOKENS, ECInstance, image, make_ec_instance
    from vllm_ec_harness import write_mm_model as _write_mm_model

KiB = 1 << 10
OUTPUT_BYTES = 32 * 64 * 2  # QUERY_TOKENS x HIDDEN bfloat16


def ec_cfg(role: str, region: int) -> str:
    return (
        f'[ec]\nrole = "{role}"\nregion_bytes = {region}\nblock_bytes = {KiB}\nxfer_timeout = 5.0\n'
    )


# E's region holds 4 outputs (FIFO eviction under pressure); vLLM's own encoder cache holds 8
E_CFG = ec_cfg("producer", 4 * OUTPUT_BYTES)
PD_CFG = ec_cfg("consumer", 64 * KiB)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write_mm_model(tmp_path_factory.mktemp("tiny-blip2"))


@pytest.fixture(scope="module")
def ec_pair() -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """The E node's and the PD node's daemons, shared by the tests (each leaves them idle)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvde-", dir="/tmp"))  # ipc paths must stay short
    with ThreadPoolExecutor(2) as ex:
        e, c = ex.map(
            lambda a: start_daemon(workdir, a[0], a[1]), [("kvd-ee", E_CFG), ("kvd-ec", PD_CFG)]
        )
    yield e, c
    problems = []
    for d in (c, e):
        rc = d.stop()
        if rc != 0:
            problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
        if os.path.exists(d.socket):
            problems.append(f"{d.name} left its socket {d.socket}")
    shutil.rmtree(workdir, ignore_errors=True)
    assert not problems, "\n".join(problems)


@pytest.fixture
def insts() -> Iterator[list[ECInstance]]:
    made: list[ECInstance] = []
    yield made
    for inst in made:
        inst.close()


def run_until(cond: Callable[[], bool], insts: list[ECInstance], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            state = [
                (i.name, {r: str(q.status) for r, q in i.scheduler.requests.items()}, i.errors)
                for i in insts
            ]
            raise AssertionError(f"timed out; {state}")
        for inst in insts:
            if inst.busy():
                inst.step()
        time.sleep(0.001)


def ec_status(d: DaemonProc) -> dict[str, Any]:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        return c.status("ec")


def counter(d: DaemonProc, key: str) -> int:
    with KvdClient(d.socket, role="cli", keepalive_interval=0) as c:
        return int(c.status()["counters"].get(key, 0))


def encode(
    e: ECInstance, rid: str, seed: int, *, committed_with_response: bool = True
) -> dict[str, Any]:
    """The proxy's first leg: the image to E with max_tokens=1; E's ec_transfer_params.

    By the time the response leaves the engine step, what it announces is committed in E's
    daemon, unless E reused vLLM's cached copy of an output its daemon had evicted (then
    it is saved again in the next step)."""
    e.add(rid, image(seed), max_tokens=1)
    run_until(lambda: rid in e.finished, [e])
    out = e.finished[rid]
    assert str(out.finish_reason) == "stop" and not e.errors, (out, e.errors)
    params: dict[str, Any] = out.ec_transfer_params
    assert params is not None and len(params) == 1
    produced = ec_status(e.daemon)["produced"]
    assert all(h in produced for h in params) == committed_with_response, (params, produced)
    run_until(lambda: not e.busy(), [e])
    assert all(h in ec_status(e.daemon)["produced"] for h in params)
    return params


def consume(pd: ECInstance, rid: str, seed: int, params: dict[str, Any], salt: str) -> Any:
    """The proxy's second leg: the same request to PD with E's params in extra_args."""
    for h in params:
        pd.remote_salt[h] = salt
    pd.add(rid, image(seed), max_tokens=2, ec_params=params)
    run_until(lambda: rid in pd.finished, [pd])
    return pd.finished[rid]


def assert_consumer_idle(pd: ECInstance, d: DaemonProc) -> None:
    side = pd.connector.scheduler_side
    run_until(lambda: not pd.busy(), [pd])
    assert not side._cons and not side._reqs and not side._load_acks, (side._cons, side._reqs)
    st = ec_status(d)
    assert st["consumer"]["pinned"] == 0 and st["fetching"] == [], st
    assert not pd.errors, pd.errors


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("async_sched", [False, True], ids=["sync", "async-scheduler"])
def test_consumer_waits_for_the_producers_output_then_has_its_bytes(
    model: str, ec_pair: tuple[DaemonProc, DaemonProc], insts: list[ECInstance], async_sched: bool
) -> None:
    e_d, pd_d = ec_pair
    e = make_ec_instance("E", e_d.socket, model, "ec_producer", async_scheduling=async_sched)
    e.daemon = e_d
    pd = make_ec_instance(
        "PD",
        pd_d.socket,
        model,
        "ec_consumer",
        with_kv_connector=True,
        async_scheduling=async_sched,
    )
    insts += [e, pd]
    assert e.encoder_only  # an ec_producer instance runs the encoder only
    # one daemon session per process and engine: the EC connector uses KvdConnector's
    assert pd.scheduler.connector is not None
    assert pd.connector.scheduler_side.shared is pd.scheduler.connector.scheduler_side.shared

    # E commits an output only after its worker copied it (never in the step that
    # allocates it); PD holds its pin on an output until its worker copied it out
    committed_early: list[bool] = []
    pinned_at_load: list[int] = []
    e.before_worker = lambda so: committed_early.extend(
        h in ec_status(e_d)["produced"] for h in so.ec_connector_metadata.saves
    )
    pd.before_worker = lambda so: pinned_at_load.extend(
        ec_status(pd_d)["consumer"]["pinned"] for _ in so.ec_connector_metadata.loads
    )

    seed = 111 if async_sched else 101
    params = encode(e, "e-1", seed)
    ((h, entry),) = params.items()
    assert committed_early == [False]
    with KvdClient(e_d.socket, role="cli", keepalive_interval=0) as c:
        welcome = c.welcome
    assert welcome is not None
    assert entry == {
        "peer_host": welcome.ec_host,
        "peer_port": welcome.ec_port,
        "nbytes": QUERY_TOKENS * HIDDEN * 2,
        "shape": [QUERY_TOKENS, HIDDEN],
        "dtype": "bfloat16",
        "modality": "image",
        "compat": pd.connector.scheduler_side.compat,
    }
    assert e.encoded == [h]
    assert h in ec_status(e_d)["produced"]  # committed: the worker's copy was reported
    # what the response announced is what the daemon's commit returned
    assert params_to_dict(e.connector.scheduler_side._prod[h].params) == entry
    assert ec_status(e_d)["producer"]["pinned"] == 0

    served = counter(e_d, "ec_served")
    pd.remote_salt[h] = e.salt
    os.kill(e_d.proc.pid, signal.SIGSTOP)  # the producer's answer cannot arrive for now
    try:
        pd.add("pd-1", image(seed), max_tokens=2, ec_params=params)
        steps, until = 0, time.monotonic() + 0.5
        while time.monotonic() < until:
            pd.step()
            steps += 1
            time.sleep(0.005)
        assert steps > 10
        assert pd.status("pd-1") == RequestStatus.WAITING and "pd-1" not in pd.scheduled
        assert not pd.connector.has_cache_item(h)
    finally:
        os.kill(e_d.proc.pid, signal.SIGCONT)
    run_until(lambda: "pd-1" in pd.finished, [pd])
    assert str(pd.finished["pd-1"].finish_reason) == "length"
    # the forward used exactly E's bytes, loaded by start_load_caches; PD encoded nothing
    assert pd.verified == {"pd-1": [h]} and pd.encoded == [] and not pd.errors
    assert pinned_at_load == [OUTPUT_BYTES // KiB]  # its blocks; released after the copy
    assert counter(e_d, "ec_served") == served + 1
    assert_consumer_idle(pd, pd_d)


def test_the_same_hash_again_is_a_local_hit(
    model: str, ec_pair: tuple[DaemonProc, DaemonProc], insts: list[ECInstance]
) -> None:
    e_d, pd_d = ec_pair
    e = make_ec_instance("E", e_d.socket, model, "ec_producer")
    e.daemon = e_d
    pd = make_ec_instance("PD", pd_d.socket, model, "ec_consumer")
    insts += [e, pd]
    params = encode(e, "e-1", 102)
    (h,) = params
    hits, misses, served = (
        counter(pd_d, "ec_hits"),
        counter(pd_d, "ec_misses"),
        counter(e_d, "ec_served"),
    )
    consume(pd, "pd-1", 102, params, e.salt)
    # vLLM's own encoder cache forgets it (a model runner clears its copy too): the second
    # request must load it again, and PD's daemon serves it from its cache
    pd.scheduler.reset_encoder_cache()
    pd.encoder_cache.clear()
    # PD's daemon's EC index says it holds the output: the request waits for the local
    # hit's answer in the step that schedules it, instead of being deferred to the next
    pd.add("pd-2", image(102), max_tokens=2, ec_params=params)
    pd.step()
    assert "pd-2" in pd.scheduled, pd.status("pd-2")
    run_until(lambda: "pd-2" in pd.finished, [pd])
    assert pd.verified == {"pd-1": [h], "pd-2": [h]} and pd.encoded == []
    assert counter(pd_d, "ec_hits") == hits + 1 and counter(pd_d, "ec_misses") == misses + 1
    assert counter(e_d, "ec_served") == served + 1

    # two requests for a new output at once: one fetch, both get the producer's bytes
    params = encode(e, "e-2", 103)
    (h2,) = params
    pd.remote_salt[h2] = e.salt
    misses = counter(pd_d, "ec_misses")
    pd.add("pd-3", image(103), max_tokens=2, ec_params=params)
    pd.add("pd-4", image(103), max_tokens=2, ec_params=params)
    run_until(lambda: {"pd-3", "pd-4"} <= set(pd.finished), [pd])
    assert pd.verified["pd-3"] == [h2] and pd.verified["pd-4"] == [h2] and pd.encoded == []
    assert counter(pd_d, "ec_misses") == misses + 1

    # aborted while it waits: the fetch still ends, and its pin is dropped
    params = encode(e, "e-3", 104)
    pd.add("pd-5", image(104), max_tokens=2, ec_params=params)
    pd.step()
    assert pd.status("pd-5") == RequestStatus.WAITING
    pd.scheduler.finish_requests("pd-5", RequestStatus.FINISHED_ABORTED)
    assert "pd-5" not in pd.scheduled
    assert_consumer_idle(pd, pd_d)


def test_a_failed_save_is_never_served_and_holds_no_blocks(
    model: str, ec_pair: tuple[DaemonProc, DaemonProc], insts: list[ECInstance]
) -> None:
    """E sized the output wrong (its worker's tensor does not match): the worker does not
    copy it, the scheduler commits the blocks under a hash no consumer has, so nothing is
    left pinned and no consumer ever gets those bytes."""
    e_d, pd_d = ec_pair
    e = make_ec_instance("E", e_d.socket, model, "ec_producer", output_width=HIDDEN // 2)
    e.daemon = e_d
    pd = make_ec_instance("PD", pd_d.socket, model, "ec_consumer")
    insts += [e, pd]
    params = encode(e, "e-1", 301)  # announced in the step that (failed to) save it
    ((h, entry),) = params.items()
    assert entry["shape"] == [QUERY_TOKENS, HIDDEN // 2]
    assert e.connector.scheduler_side._prod[h].state == "void"
    assert ec_status(e_d)["producer"]["pinned"] == 0
    out = consume(pd, "pd-1", 301, params, e.salt)
    assert str(out.finish_reason) == "error" and "pd-1" not in pd.scheduled
    assert pd.encoded == [] and pd.verified == {}
    # asked again, E does not announce it any more
    e.add("e-2", image(301), max_tokens=1)
    run_until(lambda: "e-2" in e.finished, [e])
    assert e.finished["e-2"].ec_transfer_params is None
    run_until(lambda: not e.busy(), [e])
    assert ec_status(e_d)["producer"]["pinned"] == 0
    assert_consumer_idle(pd, pd_d)


def test_ec_region_copies_scattered_blocks(tmp_path: Path) -> None:
    """The worker's copies in and out of the EC region: any block order, a partial last
    block, a device->host->device round trip of every byte; bad block ids refused."""
    import torch
    from kvd_client.shm import SharedRegion, unique_name
    from kvd_client.vllm.ec import ECRegionView, bytes_to_tensor, tensor_bytes

    region = SharedRegion(unique_name("kvd-ectest"), 16 * KiB)
    view = ECRegionView(region.name, region.nbytes, KiB)
    try:
        t = torch.randn(7, 200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        data = tensor_bytes(t)  # 2800 bytes: 3 blocks, the last one partial
        blocks = [9, 2, 3]
        view.write(blocks, data)
        raw = data.numpy().tobytes()

        def at(lo: int, n: int) -> bytes:  # no view of the region outlives the call
            return bytes(region.buf[lo : lo + n])

        assert at(9 * KiB, KiB) == raw[:KiB]
        assert at(2 * KiB, len(raw) - KiB) == raw[KiB:]
        back = bytes_to_tensor(
            view.read(blocks, data.numel()), (7, 200), torch.bfloat16, torch.device("cpu")
        )
        assert torch.equal(back.view(torch.int16), t.view(torch.int16))
        with pytest.raises(ValueError):
            view.write([15, 16, 17], data)  # beyond the region
        with pytest.raises(ValueError):
            view.read([1, 2], data.numel())  # too few blocks
    finally:
        view.close()
        region.close()


def test_unknown_or_evicted_output_fails_the_request_until_encoded_again(
    model: str, ec_pair: tuple[DaemonProc, DaemonProc], insts: list[ECInstance]
) -> None:
    e_d, pd_d = ec_pair
    e = make_ec_instance("E", e_d.socket, model, "ec_producer")
    e.daemon = e_d
    pd = make_ec_instance("PD", pd_d.socket, model, "ec_consumer")
    insts += [e, pd]
    params_a = encode(e, "e-a", 201)
    (h_a, entry) = next(iter(params_a.items()))

    # unknown: an image E never encoded, announced with otherwise valid coordinates
    h_x = pd.mm_hash(image(202))
    out = consume(pd, "pd-x", 202, {h_x: entry}, e.salt)
    assert str(out.finish_reason) == "error"
    assert "pd-x" not in pd.scheduled and pd.encoded == []

    # evicted: four more outputs fill E's region, the oldest (A) goes (FIFO)
    for i in range(4):
        encode(e, f"e-f{i}", 210 + i)
    assert h_a not in ec_status(e_d)["produced"]
    out = consume(pd, "pd-a", 201, params_a, e.salt)
    assert str(out.finish_reason) == "error" and "pd-a" not in pd.scheduled

    # re-issued to E: vLLM's encoder cache on E still holds A (it is not encoded again);
    # the connector finds it evicted from the daemon and saves it again from there
    assert encode(e, "e-a2", 201, committed_with_response=False) == params_a
    assert e.encoded.count(h_a) == 1
    assert h_a in ec_status(e_d)["produced"]
    consume(pd, "pd-a2", 201, params_a, e.salt)
    assert pd.verified == {"pd-a2": [h_a]}

    # once vLLM's encoder cache on E has dropped it too, E encodes it again and the
    # allocation for it finds it evicted
    for i in range(8):
        encode(e, f"e-g{i}", 220 + i)
    assert h_a not in ec_status(e_d)["produced"]
    assert encode(e, "e-a3", 201) == params_a
    assert e.encoded.count(h_a) == 2
    pd.scheduler.reset_encoder_cache()
    pd.encoder_cache.clear()
    consume(pd, "pd-a3", 201, params_a, e.salt)
    assert pd.verified == {"pd-a2": [h_a], "pd-a3": [h_a]} and pd.encoded == []
    assert ec_status(e_d)["producer"]["pinned"] == 0  # every allocation was committed
    assert_consumer_idle(pd, pd_d)
