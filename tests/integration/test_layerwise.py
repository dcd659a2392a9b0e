"""Layer-wise push end to end: real daemons, real NIXL, real shared memory.

P's workers announce each layer once it is in host memory (`KvdClient.layers_saved`, one
way); P's daemon WRITEs it at once into the D that registered, and D reports the request
done once every layer of every rank arrived, before P's engine even finished it. Each
layer's bytes are put in P's blocks only just before that layer is announced, so a layer
written early would arrive as zeros and fail the byte check.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from kvd_client import wire
from kvd_client.client import Event

from kvd.demo import Engine, make_engine

from .conftest import StartDaemon

HOST = "127.0.0.1"
LAYERS = 6
TP = 2


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def value(i: int, rank: int, block_pos: int, layer: int, part: int) -> int:
    return (i * 37 + rank * 11 + block_pos * 5 + layer * 3 + part) % 251 + 1


def fill_layer(p: Engine, i: int, blocks: list[int], layer: int) -> None:
    for rank in range(TP):
        for pos, b in enumerate(blocks):
            for part in range(2):
                p.chunk(rank, b, layer, part)[:] = value(i, rank, pos, layer, part)


def arrived(d: Engine, i: int, blocks: list[int], skip: int = 0) -> bool:
    """D's `blocks` hold P's blocks from position `skip` on (D needs only the tail)."""
    return all(
        (d.chunk(rank, b, layer, part) == value(i, rank, skip + pos, layer, part)).all()
        for rank in range(TP)
        for pos, b in enumerate(blocks)
        for layer in range(LAYERS)
        for part in range(2)
    )


def events(client: Any, want: int, timeout: float = 10.0) -> list[Event]:
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += client.wait_events(0.2)
    return got


def engines(daemons: StartDaemon, *, p_layer_major: bool, d_layer_major: bool) -> tuple[Any, ...]:
    pd, dd = daemons("kvd-p"), daemons("kvd-d")
    kw: dict[str, Any] = {"num_blocks": 64, "num_layers": LAYERS, "chunk_bytes": 4096, "tp": TP}
    p = make_engine(pd.socket, "prefill", workers=True, layer_major=p_layer_major, **kw)
    d = make_engine(dd.socket, "decode", workers=True, layer_major=d_layer_major, **kw)
    return pd, dd, p, d


def register_all(d: Engine, p: Engine, port: int, reqs: list[tuple[str, str, list[int]]]) -> None:
    for p_id, d_id, d_blocks in reqs:
        d.client.register_push(d_id, d_blocks, HOST, port, remote_request_id=p_id)
    wait_until(
        lambda: p.client.status()["sender"]["pending_registrations"] == len(reqs),
        10,
        "registrations at P",
    )


def layer_writes(p: Engine) -> int:
    return int(p.client.status()["counters"].get("layer_writes", 0))


def assert_clean(p: Engine, d: Engine) -> None:
    """Nothing left: no lease, registration, stream or transfer on either side."""

    def clean() -> bool:
        ps, ds = p.client.status(), d.client.status()
        sender = ps["sender"]
        return (
            sender["leases"] == 0
            and sender["pending_registrations"] == 0
            and sender["writing"] == 0
            and sender["streaming"] == 0
            and sender["sending"] == 0
            and ds["receiver"]["receiving"] == 0
            and p.client.status("leases")["leases"] == []
            and d.client.status("leases")["tracked"] == []
            and d.client.status("transfers")["in_flight"] == []
        )

    wait_until(clean, 5, "both daemons clean")


@pytest.mark.parametrize(("p_layer_major", "d_layer_major"), [(False, False), (True, False)])
def test_layerwise_push_several_requests_every_byte(
    daemons: StartDaemon, p_layer_major: bool, d_layer_major: bool
) -> None:
    pd, _dd, p, d = engines(daemons, p_layer_major=p_layer_major, d_layer_major=d_layer_major)
    try:
        n = 6
        reqs = []
        for i in range(n):
            p_blocks = [1 + 3 * i, 2 + 3 * i, 30 + i]
            d_blocks = [40 + 4 * i, 38 + 4 * i, 39 + 4 * i][: 3 if i % 3 else 2]
            reqs.append((f"lw{i}-0-pppppppp", f"lw{i}-0-dddddddd", p_blocks, d_blocks))
        register_all(d, p, pd.side_port, [(pi, di, db) for pi, di, _, db in reqs])
        streamed = reqs[:-1]  # the last one: its workers announce only 2 layers
        for layer in range(LAYERS):
            for i, (_, _, p_blocks, _) in enumerate(reqs):
                fill_layer(p, i, p_blocks, layer)
            before = layer_writes(p)
            for w in p.workers:
                upto = layer + 1
                notice = [(pi, pb) for pi, _, pb, _ in streamed]
                if layer < 2:
                    notice.append((reqs[-1][0], reqs[-1][2]))
                assert w.layers_saved(upto, notice)
            if layer < LAYERS - 1:
                # each layer is written as soon as every rank announced it, one WRITE for
                # every request at once (the first may wait for D's view and a re-sync)
                wait_until(lambda b=before: layer_writes(p) > b, 10, f"layer {layer} written")
                assert d.client.drain_events() == []
        # D is done for every streamed request before P's engine finished any of them
        got = events(d.client, len(streamed))
        assert sorted(type(e).__name__ for e in got) == ["RecvFinished"] * len(streamed)
        assert {e.request_id for e in got} == {di for _, di, _, _ in streamed}
        for i, (_, _, p_blocks, d_blocks) in enumerate(streamed):
            skip = len(p_blocks) - len(d_blocks)
            assert arrived(d, i, d_blocks, skip), f"request {i}: bytes differ"
        # the last request gets its remaining layers at P's finish
        for p_id, _, p_blocks, _ in reqs:
            assert p.client.finished(p_id, p_blocks)
        last = events(d.client, 1)
        assert [type(e).__name__ for e in last] == ["RecvFinished"]
        assert arrived(d, n - 1, reqs[-1][3], len(reqs[-1][2]) - len(reqs[-1][3]))
        p_got = events(p.client, n)
        assert Counter(type(e).__name__ for e in p_got) == {"SendFinished": n}
        assert_clean(p, d)
        pc, dc = p.client.status()["counters"], d.client.status()["counters"]
        assert pc["streams_started"] == n and pc["sends_layered"] == n
        assert pc.get("layer_notices_rejected", 0) == 0
        assert pc.get("layer_writes_coalesced", 0) > 0  # requests ready together: one WRITE
        assert pc.get("leases_granted", 0) == 0  # streamed: claimed, never leased
        assert pc.get("layer_plans_moved", 0) > 0  # later layers: the first plan, moved
        assert dc["recv_ok"] == n and dc.get("recv_failed", 0) == 0
        assert dc.get("notifs_rejected", 0) == 0 and pc.get("notifs_rejected", 0) == 0
        # a whole-request push still works beside it (D registers after P finished)
        fill_layer(p, 99, [50], 0)
        p.client.finished("whole-0-pppppppp", [50])
        d.client.register_push(
            "whole-0-dddddddd", [63], HOST, pd.side_port, remote_request_id="whole-0-pppppppp"
        )
        assert [type(e).__name__ for e in events(d.client, 1)] == ["RecvFinished"]
        assert (d.chunk(0, 63, 0, 1) == value(99, 0, 0, 0, 1)).all()
        assert [type(e).__name__ for e in events(p.client, 1)] == ["SendFinished"]
    finally:
        p.close()
        d.close()


def test_p_killed_after_some_layers_fails_d_never_done(daemons: StartDaemon) -> None:
    pd, _dd, p, d = engines(daemons, p_layer_major=False, d_layer_major=False)
    try:
        reqs = [(f"k{i}-0-pppppppp", f"k{i}-0-dddddddd", [1 + i], [10 + i]) for i in range(3)]
        register_all(d, p, pd.side_port, [(pi, di, db) for pi, di, _, db in reqs])
        for layer in range(2):
            before = layer_writes(p)
            for i, (_, _, pb, _) in enumerate(reqs):
                fill_layer(p, i, pb, layer)
            for w in p.workers:
                w.layers_saved(layer + 1, [(pi, pb) for pi, _, pb, _ in reqs])
            wait_until(lambda b=before: layer_writes(p) > b, 10, f"layer {layer} written")
        wait_until(lambda: p.client.status()["sender"]["sending"] == 0, 5, "writes landed")
        assert d.client.drain_events() == []
        pd.kill()
        got = events(d.client, len(reqs), timeout=15)
        assert len(got) == len(reqs)
        for ev in got:
            assert isinstance(ev, wire.RecvFailed), ev
        assert {e.request_id: e.block_ids for e in got if isinstance(e, wire.RecvFailed)} == {
            di: tuple(db) for _, di, _, db in reqs
        }
        # never done afterwards either
        time.sleep(0.5)
        assert d.client.drain_events() == []
        ds = d.client.status()
        assert ds["counters"].get("recv_ok", 0) == 0 and ds["receiver"]["receiving"] == 0
        assert d.client.status("leases")["tracked"] == []
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("who", ["d", "p"])
def test_abort_mid_stream_frees_everything(daemons: StartDaemon, who: str) -> None:
    pd, _dd, p, d = engines(daemons, p_layer_major=False, d_layer_major=True)
    try:
        reqs = [
            (f"ab{i}-0-pppppppp", f"ab{i}-0-dddddddd", [1 + i, 20 + i], [30 + i]) for i in range(3)
        ]
        register_all(d, p, pd.side_port, [(pi, di, db) for pi, di, _, db in reqs])
        for layer in range(3):  # half of the layers
            before = layer_writes(p)
            for i, (_, _, pb, _) in enumerate(reqs):
                fill_layer(p, i, pb, layer)
            for w in p.workers:
                w.layers_saved(layer + 1, [(pi, pb) for pi, _, pb, _ in reqs])
            wait_until(lambda b=before: layer_writes(p) > b, 10, f"layer {layer} written")
        assert p.client.status()["sender"]["streaming"] == len(reqs)
        victim_p, victim_d, _, victim_db = reqs[0]
        if who == "d":
            d.client.abort(victim_d)
        else:
            p.client.abort(victim_p, side="send")
        (ev,) = events(d.client, 1)
        assert isinstance(ev, wire.RecvFailed) and ev.request_id == victim_d
        assert ev.block_ids == tuple(victim_db)
        wait_until(lambda: p.client.status()["sender"]["streaming"] == 2, 5, "P let go")
        # more layers for every request: the ended one is not written again
        for layer in range(3, LAYERS):
            for i, (_, _, pb, _) in enumerate(reqs):
                fill_layer(p, i, pb, layer)
            for w in p.workers:
                w.layers_saved(layer + 1, [(pi, pb) for pi, _, pb, _ in reqs])
        got = events(d.client, 2)
        assert sorted(e.request_id for e in got) == sorted(di for _, di, _, _ in reqs[1:])
        assert all(isinstance(e, wire.RecvFinished) for e in got)
        for i, (_, _, _, db) in enumerate(reqs[1:], start=1):
            assert arrived(d, i, db, 1)
        # P's engine finishes the others (and, if D gave up, the victim too: it ends failed
        # at once, nothing leased; an engine that aborted it never finishes it)
        finishing = reqs if who == "d" else reqs[1:]
        for p_id, _, pb, _ in finishing:
            p.client.finished(p_id, pb)
        p_got = {e.request_id: type(e).__name__ for e in events(p.client, len(finishing))}
        want = {reqs[1][0]: "SendFinished", reqs[2][0]: "SendFinished"}
        if who == "d":
            want[victim_p] = "SendFailed"
        assert p_got == want
        assert_clean(p, d)
        assert d.client.drain_events() == []
    finally:
        p.close()
        d.close()


def test_a_notice_from_a_session_that_is_not_the_rank_is_refused(daemons: StartDaemon) -> None:
    pd, _dd, p, d = engines(daemons, p_layer_major=False, d_layer_major=False)
    try:
        register_all(d, p, pd.side_port, [("x-0-pppppppp", "x-0-dddddddd", [5])])
        # the scheduler's session, and a worker naming another rank or a bad block
        assert p.client.layers_saved(LAYERS, [("x-0-pppppppp", [5])])
        p.workers[0]._sock.send(  # type: ignore[union-attr]
            wire.encode(
                wire.LayersSaved("prefill", 1, 1, (wire.SavedRequest("x-0-pppppppp", (5,)),))
            )
        )
        assert p.workers[1].layers_saved(1, [("x-0-pppppppp", [10_000])])
        wait_until(
            lambda: p.client.status()["counters"].get("layer_notices_rejected", 0) == 1,
            5,
            "the bad block refused",
        )
        pc = p.client.status()["counters"]
        assert pc["ipc_rejected"] >= 2 and pc.get("streams_started", 0) == 0
        assert d.client.drain_events() == []
    finally:
        p.close()
        d.close()
