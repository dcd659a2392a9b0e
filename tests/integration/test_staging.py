"""D-side staging (`kvd.core.staging`) with real daemons, NIXL and shared memory: a
staging area too small for a request falls back to direct descriptors (bytes still
right), a staged pull whose READ fails leaves D's blocks untouched, fails the request and
frees its slot, and an abort during staged pulls ends each request once with no slot
left in use or quarantined.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kvd_client import wire

from kvd.demo import DaemonProc

from .conftest import Pair
from .kvref import Side, spec_of
from .test_topologies import HOST, engine, run_case, wait_terminal

H4 = spec_of(4)


def staging_of(d: DaemonProc) -> dict[str, Any]:
    from kvd_client.client import KvdClient

    c = KvdClient(d.socket, role="cli", timeout=5.0, keepalive_interval=0)
    c.connect()
    try:
        staging: dict[str, Any] = c.status()["receiver"]["staging"]
        counters: dict[str, int] = c.status()["counters"]
    finally:
        c.close()
    return staging | {"counters": counters}


def wait_until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("ps", "ds"),
    [(Side(2), Side(1)), (Side(1, 16, "NHD"), Side(2, 16, "HND"))],
    ids=["tp2to1", "nhd_to_hnd_tp1to2"],
)
def test_a_full_staging_area_falls_back_to_direct_descriptors(
    daemons: Callable[..., DaemonProc], ps: Side, ds: Side
) -> None:
    p = daemons("kvdt-stg-p")
    d = daemons("kvdt-stg-d", overrides={"transfer": {"staging_bytes": 4096}})
    pair = Pair(p, d)
    run_case(pair, H4, ps, ds, "pull", seed=3, staging=False)  # every byte checked
    st = staging_of(d)
    assert st["counters"].get("staging_exhausted", 0) == 3
    assert st["counters"].get("staged_reads", 0) == 0
    assert (st["used"], st["quarantined"], st["allocated"]) == (0, 0, 0)


@pytest.mark.parametrize(
    ("ps", "ds", "staged"),
    [(Side(2), Side(1), 3), (Side(1), Side(4), 3), (Side(2, 16, "HND"), Side(1, 16, "HND"), 0)],
    ids=["nhd_tp2to1", "nhd_tp1to4", "hnd_tp2to1_few_descriptors"],
)
def test_a_push_of_many_small_pieces_is_gathered_on_p(
    daemons: Callable[..., DaemonProc], ps: Side, ds: Side, staged: int
) -> None:
    """P-side staging (`kvd.core.gather`): a push whose direct plan has a run per token
    (NHD, heads sliced) is gathered in P's staging into D's layout and written as a run
    per D block (every byte checked at D by `run_case`, P's bytes untouched); one with
    few descriptors (HND: a head slice per chunk, 24 here) goes direct. Every slot is
    freed once its WRITE ended."""
    p, d = daemons("kvdt-gth-p"), daemons("kvdt-gth-d")
    run_case(Pair(p, d), H4, ps, ds, "push", seed=5)
    st = staging_of(p)
    assert st["counters"].get("staged_writes", 0) == staged, st["counters"]
    assert (st["used"], st["quarantined"]) == (0, 0)
    if staged:
        assert st["counters"]["staged_write_descriptors_saved"] > 0
        # gathered from the shape's template (made once), not by planning each request
        assert st["counters"].get("staged_writes_templated", 0) == staged, st["counters"]
        assert st["counters"].get("gather_templates_made", 0) == 1, st["counters"]


def test_a_large_gathered_push_is_written_in_parts_while_the_next_is_gathered(
    daemons: Callable[..., DaemonProc],
) -> None:
    """A gathered push of a few MiB (P TP 1 -> D TP 4, NHD: a run per token and head
    slice) is cut into parts of D blocks (`transfer.gather_part_bytes`, 1 MiB here): each
    part's WRITE runs while the next is gathered, and only the last carries the PushDone.
    Every byte is checked at D by `run_case` (D reports the request done only after the
    last part), P's bytes stay untouched, and the slot is freed once every part's WRITE
    ended."""
    p = daemons("kvdt-pip-p", overrides={"transfer": {"gather_part_bytes": 1 << 20}})
    d = daemons("kvdt-pip-d")
    spec = spec_of(8, head_size=128, layers=24)  # 96 KiB a token: requests of 3-4.5 MiB
    run_case(Pair(p, d), spec, Side(1, num_blocks=12), Side(4, num_blocks=12), "push", seed=7)
    st = staging_of(p)
    assert st["counters"].get("staged_writes", 0) == 3, st["counters"]
    assert st["counters"].get("staged_writes_pipelined", 0) == 3, st["counters"]
    assert (st["used"], st["quarantined"]) == (0, 0)


def test_a_failed_staged_read_fails_the_request_and_leaves_d_untouched(
    daemons: Callable[..., DaemonProc],
) -> None:
    # D learns that P is gone only from the READ (no probe, no heartbeat meanwhile)
    slow = {"transfer": {"peer_probe_interval": 600.0, "kv_lease_duration": 600.0}}
    p = daemons("kvdt-stgf-p", overrides=slow)
    d = daemons("kvdt-stgf-d", overrides=slow)
    pair = Pair(p, d)
    rng = np.random.default_rng(5)
    ps, ds = Side(2), Side(1)
    pe = engine(p.socket, "pf", ps, H4, rng)
    de = engine(d.socket, "df", ds, H4, rng)
    try:
        # a first pull: D's daemon handshakes with P's and keeps its view
        run_case(pair, H4, ps, ds, "pull", seed=4)
        blocks = [1, 2, 3]
        assert pe.client.finished("p-x", blocks)
        before = de.buf(0).copy()
        allocated = staging_of(d)["allocated"]
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(10)
        # no track first: its heartbeat, sent at once, could find P gone and make D forget
        # P's view before the pull (then no READ at all); the pull's own first heartbeat
        # goes out only after its staged READ was set up, in the same turn
        de.client.pull(
            "d-x",
            blocks,
            HOST,
            p.side_port,
            remote_engine_id="pf",
            remote_request_id="p-x",
            remote_block_ids=blocks,
        )
        ev = wait_terminal(de.client, "d-x")
        assert isinstance(ev, wire.RecvFailed), ev
        assert tuple(ev.block_ids) == tuple(blocks)
        assert np.array_equal(de.buf(0), before)  # nothing of D's engine was written
        st = staging_of(d)
        assert st["allocated"] > allocated, st  # the READ was staged...
        assert (st["used"], st["quarantined"]) == (0, 0)  # ...and its slot freed
    finally:
        pe.close()
        de.close()


def test_aborted_staged_pulls_end_once_and_free_their_slots(
    daemons: Callable[..., DaemonProc],
) -> None:
    p = daemons("kvdt-stga-p")
    d = daemons("kvdt-stga-d")
    rng = np.random.default_rng(6)
    # head-sliced layout conversions of 4 MiB (32 blocks of 128 KiB, TP 1 -> 2): an abort
    # sent right after the pull lands before, during or after the staged READ and scatter
    spec = spec_of(4, head_size=128, layers=8)
    ps, ds = Side(1, 16, "NHD", num_blocks=192), Side(2, 16, "HND", num_blocks=192)
    pe = engine(p.socket, "pa", ps, spec, rng)
    de = engine(d.socket, "da", ds, spec, rng)
    try:
        outcomes: list[str] = []
        for i in range(6):
            blocks = list(range(i * 32, (i + 1) * 32))
            assert pe.client.finished(f"p-a{i}", blocks)
            de.client.track(
                f"d-a{i}", HOST, p.side_port, remote_engine_id="pa", remote_request_id=f"p-a{i}"
            )
            de.client.pull(
                f"d-a{i}",
                blocks,
                HOST,
                p.side_port,
                remote_engine_id="pa",
                remote_request_id=f"p-a{i}",
                remote_block_ids=blocks,
            )
            if i % 2 == 0:
                de.client.abort(f"d-a{i}", side="recv")
            ev = wait_terminal(de.client, f"d-a{i}")
            assert isinstance(ev, (wire.RecvFinished, wire.RecvFailed)), ev
            outcomes.append(type(ev).__name__)
            if i % 2:
                assert isinstance(ev, wire.RecvFinished)
            # no second terminal event for the request
            late = [e for e in de.client.wait_events(0.1) if e.request_id == f"d-a{i}"]
            assert late == [], late
        wait_until(
            "a slot still in use",
            lambda: (staging_of(d)["used"], staging_of(d)["quarantined"]) == (0, 0),
        )
        st = staging_of(d)
        assert st["counters"].get("staged_reads", 0) >= 3  # the pulls not aborted at least
        print("outcomes", outcomes, "staged", st["counters"].get("staged_reads"))
    finally:
        pe.close()
        de.close()
