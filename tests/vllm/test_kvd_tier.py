"""KvdTier on vLLM 0.33's real Scheduler, OffloadingConnector and TieringOffloadingSpec,
with real kvd daemons keeping the tier (real IPC, real shared memory); every loaded byte
is checked against the KV of the instance that computed it.

The test plays the model runner and the GPU<->CPU copies (vllm_tier_harness.py); two
engine instances in this process are two engines on one node: separate vLLM schedulers,
separate primary tiers (shared-memory regions), separate daemon sessions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd.demo import DaemonProc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("KVD_REQUIRE_VLLM"):
    raise RuntimeError("KVD_REQUIRE_VLLM is set but vLLM is not installed")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM 0.33 is not installed"),
]

if HAVE_VLLM:
    from vllm_harness import BLOCK_SIZE, write_model
    from vllm_tier_harness import (
        Engine,
        make_engine,
        multi_extra,
        offload_extra,
        offload_segments,
        offloading,
    )

StartDaemon = Callable[..., DaemonProc]
TIERS = "[tiers]\nenabled = true\nhost_bytes = 4194304\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    ids = [e.vllm_config.kv_transfer_config.engine_id for e in made]
    for e in made:
        e.close()
    # this test's engines' segments only (other test files may run engines meanwhile)
    left = {n for n in offload_segments() if any(i in n for i in ids)}
    assert not left, "a primary tier's shared memory was left behind"
    left = [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("kvd_tier", "kvd-tiers", "vllm_off"))
    ]
    assert not left, f"threads left: {left}"


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 120 + 1 for i in range(n)]


def tier_of(e: Engine) -> Any:
    [tier] = offloading(e).connector_scheduler.manager.secondary_tiers
    return tier


def tier_stats(e: Engine) -> dict[str, Any]:
    s: dict[str, Any] = tier_of(e).stats()
    return s


def matched(e: Engine, rid: str) -> list[int | None]:
    return [n for r, n, _ in e.matched if r == rid]


def store_prompt(e: Engine, rid: str, tokens: list[int]) -> None:
    """Run a request to the end on `e`, until its full blocks are in the daemon's tier."""
    e.add(rid, tokens)
    e.run()
    assert rid in e.finished
    full = len(tokens) // BLOCK_SIZE
    assert tier_stats(e)["stored_blocks"] >= full, tier_stats(e)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_second_instance_is_served_from_the_daemon_tier(
    daemons: StartDaemon, model: str, engines: list[Engine], async_scheduling: bool
) -> None:
    d = daemons("kvd-tv", TIERS)
    extra = offload_extra(d.socket)
    a = make_engine("a", model, extra, async_scheduling=async_scheduling)
    engines.append(a)
    tokens = prompt(1, 4 * BLOCK_SIZE + 6)
    store_prompt(a, "r1", tokens)
    assert a.computed["r1"] >= set(range(len(tokens)))  # A computed it all
    # A second engine on the node: its own scheduler, primary tier and daemon session.
    b = make_engine("b", model, extra, async_scheduling=async_scheduling)
    engines.append(b)
    b.verify["r1"] = a.salt
    b.add("r1", tokens)
    b.run()
    seen = matched(b, "r1")
    # None while the lookup is in flight (and while the chunks are promoted), then the hit
    assert seen[0] is None and seen[-1] == 4 * BLOCK_SIZE, seen
    assert all(n is None for n in seen[:-1]), seen
    assert b.loaded["r1"] == 4 * BLOCK_SIZE and not b.errors, (b.loaded, b.errors)
    # B computed only what was not loaded: the tail of the prompt and the output
    assert min(b.computed["r1"]) == 4 * BLOCK_SIZE
    st = tier_stats(b)
    assert st["loaded_blocks"] == 4 and st["load_failures"] == 0
    assert st["lookup_batches"] == 1  # all the request's keys in one round trip
    a.assert_idle()
    b.assert_idle()


CHILD = """
import json, sys
sys.path.insert(0, {here!r})
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
init_none_hash(sha256)
from vllm_tier_harness import make_engine, offload_extra
e = make_engine("first", {model!r}, offload_extra({socket!r}), salt="salt-first")
e.add("r1", {tokens!r})
e.run()
[tier] = e.connector.connector_scheduler.manager.secondary_tiers
stats = tier.stats()
e.close()
print(json.dumps(stats))
"""


def test_an_engine_process_that_exited_serves_the_next_one(
    daemons: StartDaemon, model: str, engines: list[Engine]
) -> None:
    """The first engine runs in its own process and exits; the daemon keeps its blocks and
    an engine started afterwards (this process) loads them."""
    d = daemons("kvd-tp", TIERS)
    tokens = prompt(7, 3 * BLOCK_SIZE + 9)
    code = CHILD.format(
        here=str(Path(__file__).parent), model=model, socket=d.socket, tokens=tokens
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["stored_blocks"] == 3
    b = make_engine("b", model, offload_extra(d.socket))
    engines.append(b)
    b.verify["r1"] = "salt-first"
    b.add("r1", tokens)
    b.run()
    assert matched(b, "r1")[-1] == 3 * BLOCK_SIZE
    assert b.loaded["r1"] == 3 * BLOCK_SIZE and not b.errors, b.errors
    b.assert_idle()


def test_another_model_never_shares_blocks(
    daemons: StartDaemon, model: str, engines: list[Engine], tmp_path: Path
) -> None:
    d = daemons("kvd-tm", TIERS)
    a = make_engine("a", model, offload_extra(d.socket))
    engines.append(a)
    tokens = prompt(2, 3 * BLOCK_SIZE + 1)
    store_prompt(a, "r1", tokens)
    other = write_model(tmp_path / "other-model")  # the same shapes, another model name
    c = make_engine("c", other, offload_extra(d.socket))
    engines.append(c)
    assert tier_of(c).namespace != tier_of(a).namespace
    c.add("r1", tokens)
    c.run()
    assert matched(c, "r1")[-1] == 0 and c.computed["r1"] >= set(range(len(tokens)))
    # the same model with another salt is another namespace too
    s = make_engine("s", model, offload_extra(d.socket, namespace_salt="tenant-2"))
    engines.append(s)
    s.add("r1", tokens)
    s.run()
    assert matched(s, "r1")[-1] == 0
    # and the first model still finds its own
    b = make_engine("b", model, offload_extra(d.socket))
    engines.append(b)
    b.verify["r1"] = a.salt
    b.add("r1", tokens)
    b.run()
    assert matched(b, "r1")[-1] == 3 * BLOCK_SIZE and b.loaded["r1"] == 3 * BLOCK_SIZE
    assert not b.errors


def test_a_dead_daemon_is_misses_no_error_no_hang(
    daemons: StartDaemon, model: str, engines: list[Engine]
) -> None:
    d = daemons("kvd-td", TIERS)
    d.proc.kill()
    d.proc.wait()
    extra = offload_extra(d.socket, lookup_timeout=0.3, transfer_timeout=0.3)
    e = make_engine("e", model, extra)
    engines.append(e)
    tokens = prompt(3, 4 * BLOCK_SIZE + 2)
    t0 = time.monotonic()
    e.add("r1", tokens)
    e.run()
    e.add("r2", prompt(4, 2 * BLOCK_SIZE + 3))
    e.run()
    assert time.monotonic() - t0 < 10
    assert set(e.finished) == {"r1", "r2"}
    assert matched(e, "r1")[-1] == 0 and e.computed["r1"] >= set(range(len(tokens)))
    st = tier_stats(e)
    assert st["stored_blocks"] == 0 and st["jobs_pending"] == 0
    t0 = time.monotonic()
    e.close()
    engines.remove(e)
    assert time.monotonic() - t0 < 2.0  # shutdown waits at most one call's timeout


def test_beside_kvd_connector_in_multiconnector(
    daemons: StartDaemon, model: str, engines: list[Engine]
) -> None:
    """P/D plus offloading: P and D each run vLLM's MultiConnector with KvdConnector and
    the OffloadingConnector (KvdTier), both on their node's one daemon. P's prefill goes to
    D over kvd (D checks every byte; D's tier lookup answers a miss meanwhile) and into
    P's daemon tier; a second P engine on P's node then serves the prompt from the tier
    (every loaded byte checked)."""
    pd = daemons("kvd-mp", TIERS)
    dd = daemons("kvd-md", TIERS)
    p = make_engine("p", model, multi_extra(pd.socket), connector="MultiConnector")
    d = make_engine("d", model, multi_extra(dd.socket), connector="MultiConnector")
    engines += [p, d]
    tokens = prompt(5, 4 * BLOCK_SIZE + 7)
    key = secrets.token_hex(4)
    pid, did = f"cmpl-{key}-0-{secrets.token_hex(4)}", f"cmpl-{key}-0-{secrets.token_hex(4)}"
    p.add(pid, tokens, max_tokens=1, params={"do_remote_decode": True})
    p.run(until=lambda: pid in p.finished)
    params = p.finished[pid].kv_transfer_params
    assert params is not None and params["remote_request_id"] == pid
    d.add(did, tokens, max_tokens=3, params=params)
    d.verify[did] = p.salt
    deadline = time.monotonic() + 30
    while did not in d.finished or p.busy() or d.busy():
        assert time.monotonic() < deadline, "P/D did not finish"
        for e in (p, d):
            if e.busy():
                e.step()
        time.sleep(0.002)
    # D: None while its tier lookup was out, then KvdConnector's claim of the prompt
    seen_d = matched(d, did)
    assert seen_d[0] is None and seen_d[-1] == len(tokens), seen_d
    assert d.loaded[did] == len(tokens) and not d.errors, d.errors
    assert matched(p, pid)[-1] == 0  # nothing in the tier yet: P computed it
    assert tier_stats(p)["stored_blocks"] == 4
    p2 = make_engine("p2", model, multi_extra(pd.socket), connector="MultiConnector")
    engines.append(p2)
    p2.verify["again"] = p.salt
    p2.add("again", tokens, max_tokens=1)
    p2.run()
    seen = matched(p2, "again")
    assert seen[0] is None and seen[-1] == 4 * BLOCK_SIZE, seen
    assert p2.loaded["again"] == 4 * BLOCK_SIZE and not p2.errors, p2.errors
    for e in (p, d, p2):
        e.assert_idle()


def test_blocks_evicted_after_the_lookup_fail_the_load_and_are_recomputed(
    daemons: StartDaemon, model: str, engines: list[Engine]
) -> None:
    """The daemon answered "held" but evicted the blocks before the load: the load fails,
    KvdTier reports it failed and turns those keys into misses, vLLM recomputes them."""
    d = daemons("kvd-te", "[tiers]\nenabled = true\nhost_bytes = 65536\n")  # 16 blocks
    a = make_engine("a", model, offload_extra(d.socket))
    b = make_engine("b", model, offload_extra(d.socket))
    engines += [a, b]
    tokens = prompt(6, 4 * BLOCK_SIZE + 3)
    store_prompt(a, "r1", tokens)
    b.verify["r1"] = a.salt
    b.add("r1", tokens)
    b.step()  # the lookup goes out at the end of this step
    lookups = tier_of(b)._lookups
    deadline = time.monotonic() + 10
    while lookups._pending_results.empty():  # answered "held", not yet applied
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for i in range(5):  # 20 newer blocks push r1's 4 out of the 16-block host tier
        store_prompt(a, f"x{i}", prompt(100 + i, 4 * BLOCK_SIZE))
    b.run()
    assert "r1" in b.finished and not b.errors
    st = tier_stats(b)
    assert st["load_failures"] == 4 and st["loaded_blocks"] == 0, st
    assert "r1" not in b.loaded or b.loaded["r1"] == 0
    assert b.computed["r1"] >= set(range(len(tokens)))  # recomputed, all of it
    seen = matched(b, "r1")
    assert seen[-1] == 0 and None in seen, seen
    a.assert_idle()
    b.assert_idle()


def test_blocks_demoted_to_the_disk_tier_are_served_after_a_daemon_restart(
    daemons: StartDaemon, model: str, engines: list[Engine], workdir: Path
) -> None:
    """A small host tier demotes the oldest blocks to the daemon's disk tier; the daemon
    restarts (its disk index is rebuilt); a new engine still loads them, byte-exact."""
    disk = workdir / "disk"
    cfg = f'[tiers]\nenabled = true\nhost_bytes = 65536\ndisk_path = "{disk}"\n'
    d = daemons("kvd-tk", cfg)
    a = make_engine("a", model, offload_extra(d.socket))
    engines.append(a)
    tokens = prompt(8, 4 * BLOCK_SIZE + 1)
    store_prompt(a, "r1", tokens)
    for i in range(5):  # 20 newer blocks: r1's 4 leave the 16-block host tier for disk
        store_prompt(a, f"x{i}", prompt(200 + i, 4 * BLOCK_SIZE))
    a.close()
    engines.remove(a)
    assert d.stop() == 0
    d2 = daemons("kvd-tk", cfg)  # same socket, same disk
    b = make_engine("b", model, offload_extra(d2.socket))
    engines.append(b)
    b.verify["r1"] = a.salt
    b.add("r1", tokens)
    b.run()
    assert matched(b, "r1")[-1] == 4 * BLOCK_SIZE, matched(b, "r1")
    assert b.loaded["r1"] == 4 * BLOCK_SIZE and not b.errors, b.errors
    # the engine read r1's blocks from the daemon's files itself (one pass into vLLM's
    # primary tier), then the daemon promoted them into its host tier
    out = subprocess.run(
        [sys.executable, "-m", "kvd", "tiers", "--socket", d2.socket, "--json"],
        capture_output=True,
        check=True,
    )
    counters = json.loads(out.stdout)["counters"]
    assert counters.get("disk_client_reads", 0) >= 4, counters
    b.assert_idle()
