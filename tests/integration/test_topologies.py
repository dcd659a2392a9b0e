"""Any P onto any D: heterogeneous TP (both ways), block sizes (both ways, partial last
blocks), token layouts (NHD/HND), block- and layer-major regions, MLA and replicated KV
heads, in push and pull. Real daemons, real NIXL, real shared memory, one worker client
per simulated rank; every byte of every D rank is compared with a numpy reference built
from the request's KV tensor (`kvref`), not from the planner.

One P daemon and one D daemon serve every case of the module (each case registers its
own engines and closes them): a case never sees another's regions.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.layout import KvSpec
from kvd_client.shm import SharedRegion, staging_name

from kvd.demo import DaemonProc, start_daemon

from .kvref import Side, compat, expected, fill, heads_of, rank_layout, request_kv, spec_of

HOST = "127.0.0.1"


@dataclass
class Pair:
    p: DaemonProc
    d: DaemonProc
    n: int = 0


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    work = Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    started: list[DaemonProc] = []
    try:
        over = {"daemon": {"reap_leftover_segments": False}}
        started.append(start_daemon(work, "topo-p", overrides=over))
        started.append(start_daemon(work, "topo-d", overrides=over))
        yield Pair(started[0], started[1])
    finally:
        problems = []
        for d in reversed(started):
            rc = d.stop()
            if rc != 0:
                problems.append(f"{d.name} exited {rc}:\n{d.log.read_text()[-2000:]}")
        shutil.rmtree(work, ignore_errors=True)
        assert not problems, "\n".join(problems)


@dataclass
class Eng:
    """A simulated engine: a scheduler client and one worker client per rank."""

    name: str
    side: Side
    spec: KvSpec
    client: KvdClient
    regions: list[SharedRegion] = field(default_factory=list)
    layouts: list[wire.RegionLayout] = field(default_factory=list)
    workers: list[KvdClient] = field(default_factory=list)

    def buf(self, rank: int) -> np.ndarray:
        return np.frombuffer(self.regions[rank].buf, dtype=np.uint8)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.client.close()
        for r in self.regions:
            r.close()


def engine(sock: str, name: str, side: Side, spec: KvSpec, rng: np.random.Generator) -> Eng:
    client = KvdClient(sock, role="scheduler", engine_id=name)
    client.connect()
    eng = Eng(name, side, spec, client)
    try:
        for rank in range(side.tp):
            lay = rank_layout(spec, side, rank)
            region = SharedRegion(staging_name(f"topo-{name}-r{rank}"), kvlayout.region_bytes(lay))
            eng.regions.append(region)
            eng.layouts.append(lay)
            eng.buf(rank)[:] = rng.integers(0, 256, region.nbytes, dtype=np.uint8)
            w = KvdClient(sock, role="worker", engine_id=name, tp_rank=rank)
            w.connect()
            eng.workers.append(w)
            w.register_region(
                region, layout=lay, tp_rank=rank, tp_size=side.tp, compat=compat(spec)
            )
    except BaseException:
        eng.close()
        raise
    return eng


def wait_terminal(client: KvdClient, rid: str, timeout: float = 20.0) -> Event:
    deadline = time.monotonic() + timeout
    seen: list[Event] = []
    while time.monotonic() < deadline:
        seen.extend(client.wait_events(0.05))
        for ev in seen:
            if ev.request_id == rid and not isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
                return ev
    raise AssertionError(f"no terminal event for {rid} within {timeout}s (saw {seen!r})")


def timed(what: str, t0: float) -> float:
    t1 = time.perf_counter()
    print(f"{what}: {t1 - t0:.3f}s")
    return t1


def run_case(
    pair: Pair, spec: KvSpec, ps: Side, ds: Side, mode: str, seed: int, *, hits: int = 0
) -> None:
    """One request per (tokens, D prefix hit) scenario, P -> D in `mode`, bytes checked."""
    rng = np.random.default_rng(seed)
    pair.n += 1
    tag = f"{pair.n}{mode}"
    p = engine(pair.p.socket, f"p{tag}", ps, spec, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, spec, rng)
    try:
        free_p = list(rng.permutation(ps.num_blocks))
        free_d = list(rng.permutation(ds.num_blocks))
        big = max(ps.tokens, ds.tokens)
        # token counts: full blocks, a partial last block, one token into a block
        for i, ntok in enumerate((3 * big, 2 * big + 5, big + 1)):
            m = -(-ntok // ps.tokens)
            kv = request_kv(spec, m * ps.tokens, rng)  # P's blocks are full (tail = stale)
            # D may hold a prefix itself: in D blocks, on a boundary of the larger block
            hit = hits * (big // ds.tokens) if i == 0 else 0
            n_d = -(-ntok // ds.tokens) - hit
            pb = [int(free_p.pop()) for _ in range(m)]
            db = [int(free_d.pop()) for _ in range(n_d)]
            for rank in range(ps.tp):
                fill(p.buf(rank), p.layouts[rank], spec, ps.tp, rank, pb, kv)
            before = [d.buf(rank).copy() for rank in range(ds.tp)]
            p_snapshot = [p.buf(rank).copy() for rank in range(ps.tp)]
            rid = f"{tag}-{i}"
            if mode == "push":
                d.client.track(f"d-{rid}", HOST, pair.p.side_port, remote_engine_id=p.name)
                d.client.register_push(
                    f"d-{rid}",
                    db,
                    HOST,
                    pair.p.side_port,
                    remote_engine_id=p.name,
                    remote_request_id=f"p-{rid}",
                )
                assert p.client.finished(f"p-{rid}", pb)
            else:
                assert p.client.finished(f"p-{rid}", pb)
                d.client.track(
                    f"d-{rid}",
                    HOST,
                    pair.p.side_port,
                    remote_engine_id=p.name,
                    remote_request_id=f"p-{rid}",
                )
                d.client.pull(
                    f"d-{rid}",
                    db,
                    HOST,
                    pair.p.side_port,
                    remote_engine_id=p.name,
                    remote_request_id=f"p-{rid}",
                    remote_block_ids=pb,
                )
            dev = wait_terminal(d.client, f"d-{rid}")
            pev = wait_terminal(p.client, f"p-{rid}")
            assert isinstance(dev, wire.RecvFinished), dev
            assert isinstance(pev, wire.SendFinished), pev
            for rank in range(ds.tp):
                want = expected(
                    before[rank], d.layouts[rank], spec, ds.tp, rank, db, hit * ds.tokens, kv
                )
                if not np.array_equal(d.buf(rank), want):
                    bad = np.flatnonzero(d.buf(rank) != want)
                    pytest.fail(
                        f"{rid}: D rank {rank} (heads {heads_of(spec, ds.tp, rank)}) differs "
                        f"at {bad.size} bytes, first at offset {bad[0]}"
                    )
            for rank in range(ps.tp):  # P's bytes are read, never written
                assert np.array_equal(p.buf(rank), p_snapshot[rank])
    finally:
        p.close()
        d.close()


H4 = spec_of(4)
TPS = [(a, b) for a in (1, 2, 4) for b in (1, 2, 4)]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TPS, ids=[f"tp{a}to{b}" for a, b in TPS])
def test_heterogeneous_tp(pair: Pair, mode: str, p_tp: int, d_tp: int) -> None:
    run_case(pair, H4, Side(p_tp), Side(d_tp), mode, seed=p_tp * 10 + d_tp)


SHAPES = [
    # (P side, D side): block sizes both ways, token layouts, region layouts, and mixes
    (Side(1, 16), Side(1, 32)),
    (Side(1, 32), Side(1, 16)),
    (Side(2, 16, "HND"), Side(1, 32, "HND")),
    (Side(1, 32, "NHD"), Side(2, 16, "HND")),
    (Side(1, 16, "NHD"), Side(1, 16, "HND")),
    (Side(2, 16, "HND"), Side(2, 16, "NHD")),
    (Side(4, 16, "HND", "layer"), Side(2, 32, "NHD")),
    (Side(2, 32, "NHD", "layer"), Side(4, 16, "HND", "layer")),
    (Side(1, 16, "HND"), Side(4, 16, "HND")),
    (Side(4, 16, "NHD"), Side(1, 16, "NHD", "layer")),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("ps", "ds"), SHAPES, ids=[f"{a.label()}_to_{b.label()}" for a, b in SHAPES]
)
def test_block_sizes_and_layouts(pair: Pair, mode: str, ps: Side, ds: Side) -> None:
    run_case(pair, H4, ps, ds, mode, seed=ps.tp + 7 * ds.tp + ps.tokens, hits=1)


SPECIAL = [
    ("mla", spec_of(1, mla=True, head_size=32), Side(2), Side(4, 32)),
    ("mla", spec_of(1, mla=True, head_size=32), Side(4, 32), Side(1, 16, "HND")),
    ("replicated", spec_of(2), Side(4), Side(1)),
    ("replicated", spec_of(2), Side(1, 16, "HND"), Side(4, 32)),
    ("replicated", spec_of(2), Side(4, 32), Side(2, 16, "HND")),
    ("replicated", spec_of(1), Side(2), Side(4)),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("kind", "spec", "ps", "ds"),
    SPECIAL,
    ids=[f"{k}-{a.label()}_to_{b.label()}" for k, _, a, b in SPECIAL],
)
def test_mla_and_replicated_heads(
    pair: Pair, mode: str, kind: str, spec: KvSpec, ps: Side, ds: Side
) -> None:
    run_case(pair, spec, ps, ds, mode, seed=len(kind) + ps.tp + ds.tp)
