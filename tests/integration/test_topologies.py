"""Any P onto any D: heterogeneous TP (both ways), block sizes (both ways, partial last
blocks), token layouts (NHD/HND), block- and layer-major regions, MLA and replicated KV
heads, in push and pull. Real daemons, real NIXL, real shared memory, one worker client
per simulated rank; every byte of every D rank is compared with a numpy reference built
from the request's KV tensor (`kvref`), not from the planner.

One P daemon and one D daemon serve every case of the module (each case registers its
own engines and closes them): a case never sees another's regions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import ErrorCode, InvalidRequest
from kvd_client.layout import KvSpec
from kvd_client.shm import SharedRegion, staging_name

from .conftest import Pair, daemon_pair
from .kvref import Side, compat, expected, fill, heads_of, rank_layout, request_kv, spec_of

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    yield from daemon_pair("topo")


@pytest.fixture(scope="module")
def pair_by_write() -> Iterator[Pair]:
    """D's daemon pulls by P's WRITE (`transfer.pull_by = "write"`, what `auto` does where
    UCX would emulate a READ: between hosts without RDMA)."""
    yield from daemon_pair("topow", d_transfer={"pull_by": "write"})


MODES = ["push", "pull", "pull-by-write"]


def pair_for(request: pytest.FixtureRequest, mode: str) -> Pair:
    fixture = "pair_by_write" if mode == "pull-by-write" else "pair"
    got: Pair = request.getfixturevalue(fixture)
    return got


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
    pair: Pair,
    spec: KvSpec,
    ps: Side,
    ds: Side,
    mode: str,
    seed: int,
    *,
    hits: int = 0,
    layerwise: bool = False,
    staging: bool = True,
) -> None:
    """One request per (tokens, D prefix hit) scenario, P -> D in `mode`, bytes checked.
    `layerwise` (push): D registers first and P's workers announce each layer before P
    finishes, so the request streams by layer (or goes whole where it cannot be cut).
    `staging`: whether D's daemon has staging room for a request (else it goes direct)."""
    rng = np.random.default_rng(seed)
    pair.n += 1
    tag = f"{pair.n}{mode}"
    p = engine(pair.p.socket, f"p{tag}", ps, spec, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, spec, rng)
    permuted = d.client.status()["counters"].get("receive_permutes", 0)
    staged_before = d.client.status()["counters"].get("staged_reads", 0)
    by_write_before = d.client.status()["counters"].get("pulls_by_write", 0)
    p_before = p.client.status()["counters"]
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
                if layerwise:
                    deadline = time.monotonic() + 10
                    while p.client.status()["sender"]["pending_registrations"] == 0:
                        assert time.monotonic() < deadline, "D's registration never reached P"
                        time.sleep(0.01)
                    layers = p.layouts[0].num_layers
                    for n in range(1, layers + 1):
                        for w in p.workers:
                            assert w.layers_saved(n, [(f"p-{rid}", pb)])
                    # the notices travel on the workers' sockets, the finish on the
                    # scheduler's: as in an engine, P finishes after its workers saved
                    want = p_before.get("streams_started", 0) + i + 1
                    while p.client.status()["counters"].get("streams_started", 0) < want:
                        assert time.monotonic() < deadline, "the stream never started"
                        time.sleep(0.01)
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
        # only the token layout differs: whole chunks moved, then permuted at D (3 requests)
        conversion = (ps.tp, ps.tokens) == (ds.tp, ds.tokens) and ps.kv_layout != ds.kv_layout
        done = d.client.status()["counters"].get("receive_permutes", 0) - permuted
        assert done == (3 * ds.tp if conversion else 0)
        # a pull that slices heads, at equal block sizes, READs P's blocks whole into D's
        # staging and scatters them (kvd.core.staging): 3 requests; one that only converts
        # the token layout READs whole chunks into D's blocks and permutes them (cheaper)
        sliced = len(heads_of(spec, ps.tp, 0)) != len(heads_of(spec, ds.tp, 0))
        stages = mode == "pull" and ps.tokens == ds.tokens and sliced and staging
        staged = d.client.status()["counters"].get("staged_reads", 0) - staged_before
        assert staged == (3 if stages else 0)
        # one machine: a pull READs (`auto`); D set to `write`: P WRITEs every pull
        by_write = d.client.status()["counters"].get("pulls_by_write", 0) - by_write_before
        assert by_write == (3 if mode == "pull-by-write" else 0)
        if layerwise:
            pc = p.client.status()["counters"]
            grew = {
                k: pc.get(k, 0) - p_before.get(k, 0)
                for k in ("streams_started", "sends_layered", "streams_whole")
            }
            # a D that permutes on receive cannot take a request by layer: it goes whole
            assert grew == (
                {"streams_started": 3, "sends_layered": 0, "streams_whole": 3}
                if conversion
                else {"streams_started": 3, "sends_layered": 3, "streams_whole": 0}
            ), grew
    finally:
        p.close()
        d.close()


H4 = spec_of(4)
TPS = [(a, b) for a in (1, 2, 4) for b in (1, 2, 4)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("p_tp", "d_tp"), TPS, ids=[f"tp{a}to{b}" for a, b in TPS])
def test_heterogeneous_tp(request: pytest.FixtureRequest, mode: str, p_tp: int, d_tp: int) -> None:
    run_case(pair_for(request, mode), H4, Side(p_tp), Side(d_tp), mode, seed=p_tp * 10 + d_tp)


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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("ps", "ds"), SHAPES, ids=[f"{a.label()}_to_{b.label()}" for a, b in SHAPES]
)
def test_block_sizes_and_layouts(
    request: pytest.FixtureRequest, mode: str, ps: Side, ds: Side
) -> None:
    pair = pair_for(request, mode)
    run_case(pair, H4, ps, ds, mode, seed=ps.tp + 7 * ds.tp + ps.tokens, hits=1)


SPECIAL = [
    ("mla", spec_of(1, mla=True, head_size=32), Side(2), Side(4, 32)),
    ("mla", spec_of(1, mla=True, head_size=32), Side(4, 32), Side(1, 16, "HND")),
    ("replicated", spec_of(2), Side(4), Side(1)),
    ("replicated", spec_of(2), Side(1, 16, "HND"), Side(4, 32)),
    ("replicated", spec_of(2), Side(4, 32), Side(2, 16, "HND")),
    ("replicated", spec_of(1), Side(2), Side(4)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("kind", "spec", "ps", "ds"),
    SPECIAL,
    ids=[f"{k}-{a.label()}_to_{b.label()}" for k, _, a, b in SPECIAL],
)
def test_mla_and_replicated_heads(
    request: pytest.FixtureRequest, mode: str, kind: str, spec: KvSpec, ps: Side, ds: Side
) -> None:
    run_case(pair_for(request, mode), spec, ps, ds, mode, seed=len(kind) + ps.tp + ds.tp)


# ------------------------------------------------------------------ refusals

REFUSED = [
    (
        "model-and-head-size",
        spec_of(4),
        KvSpec("org/other-model", "bfloat16", 4, 16, 2),
        Side(2),
        Side(1),
        ["model P='org/sim-model' D='org/other-model'", "head_size P=8 D=16"],
    ),
    (
        "dtype-and-heads",
        spec_of(4),
        KvSpec("org/sim-model", "float16", 2, 8, 2),
        Side(1),
        Side(2),
        ["dtype P='bfloat16' D='float16'", "num_kv_heads P=4 D=2"],
    ),
    (
        "mla-vs-kv",
        spec_of(1, mla=True, head_size=32),
        spec_of(1, head_size=32),
        Side(1),
        Side(1),
        ["mla P=True D=False"],
    ),
    (
        "block-sizes-do-not-divide",
        spec_of(4),
        spec_of(4),
        Side(1, 16),
        Side(1, 24),
        ["block sizes differ by a non-integer factor: P 16, D 24 tokens"],
    ),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("case", "p_spec", "d_spec", "ps", "ds", "says"), REFUSED, ids=[r[0] for r in REFUSED]
)
def test_incompatible_pairs_fail_naming_both_sides(
    pair: Pair,
    mode: str,
    case: str,
    p_spec: KvSpec,
    d_spec: KvSpec,
    ps: Side,
    ds: Side,
    says: list[str],
) -> None:
    """Both ends of the request end (failed, nothing hangs), D's reason names both
    sides' values, and not one byte of D changes."""
    rng = np.random.default_rng(5)
    pair.n += 1
    tag = f"{pair.n}{mode}"
    p = engine(pair.p.socket, f"p{tag}", ps, p_spec, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, d_spec, rng)
    try:
        before = [d.buf(r).copy() for r in range(ds.tp)]
        pb, db = [3, 1, 7], [5, 2]
        rid = f"{tag}-x"
        kw = {"remote_engine_id": p.name, "remote_request_id": f"p-{rid}"}
        d.client.track(f"d-{rid}", HOST, pair.p.side_port, **kw)
        assert p.client.finished(f"p-{rid}", pb)
        if mode == "push":
            d.client.register_push(f"d-{rid}", db, HOST, pair.p.side_port, **kw)
        else:
            d.client.pull(f"d-{rid}", db, HOST, pair.p.side_port, remote_block_ids=pb, **kw)
        dev = wait_terminal(d.client, f"d-{rid}")
        pev = wait_terminal(p.client, f"p-{rid}")
        assert isinstance(dev, wire.RecvFailed), dev
        assert dev.code == ErrorCode.INCOMPATIBLE, dev
        for text in says:
            assert text in dev.reason, dev.reason
        assert isinstance(pev, wire.SendFailed), pev
        for r in range(ds.tp):
            assert np.array_equal(d.buf(r), before[r])
        deadline = time.monotonic() + 5
        while p.client.status("leases")["leases"] or d.client.status("leases")["tracked"]:
            assert time.monotonic() < deadline, "a lease or a tracked request stayed behind"
            time.sleep(0.02)
    finally:
        p.close()
        d.close()


def test_one_side_opaque_the_other_a_spec_is_refused(pair: Pair) -> None:
    rng = np.random.default_rng(6)
    pair.n += 1
    p = engine(pair.p.socket, f"p{pair.n}op", Side(1), spec_of(4), rng)
    name = f"d{pair.n}op"
    d = Eng(name, Side(1), spec_of(4), KvdClient(pair.d.socket, role="scheduler", engine_id=name))
    d.client.connect()
    try:
        lay = rank_layout(spec_of(4), Side(1), 0)
        region = SharedRegion(staging_name(f"topo-{d.name}"), kvlayout.region_bytes(lay))
        d.regions.append(region)
        d.client.register_region(region, layout=lay, compat="opaque-hash-of-some-model")
        rid = f"{pair.n}op"
        d.client.track(f"d-{rid}", HOST, pair.p.side_port, remote_engine_id=p.name)
        assert p.client.finished(f"p-{rid}", [1])
        d.client.pull(
            f"d-{rid}",
            [1],
            HOST,
            pair.p.side_port,
            remote_engine_id=p.name,
            remote_request_id=f"p-{rid}",
            remote_block_ids=[1],
        )
        dev = wait_terminal(d.client, f"d-{rid}")
        assert isinstance(dev, wire.RecvFailed) and dev.code == ErrorCode.INCOMPATIBLE, dev
        assert "opaque compat hash" in dev.reason and compat(spec_of(4)) in dev.reason
        assert isinstance(wait_terminal(p.client, f"p-{rid}"), wire.SendFailed)
    finally:
        p.close()
        d.close()


BAD_REGIONS = [
    # (case, side, layout built for this spec, then changed, what the refusal says)
    ("chunk", Side(1), spec_of(4), {"chunk_bytes": 1000}, "chunk_bytes=1000, but 16 tokens x 4"),
    ("parts", Side(1), spec_of(4), {"kv_parts": 1}, "kv_parts=1, but a K/V spec needs 2"),
    ("layers", Side(1), spec_of(4, layers=3), {}, "layout has 3 layers but the KV spec says 2"),
    ("layout", Side(1), spec_of(4), {"kv_layout": "HDN"}, "kv_layout 'HDN' must be one of"),
    ("split", Side(3), spec_of(3), {}, "4 KV heads do not split over TP 3"),
]


@pytest.mark.parametrize(
    ("case", "side", "built", "change", "says"), BAD_REGIONS, ids=[b[0] for b in BAD_REGIONS]
)
def test_a_region_that_contradicts_its_spec_is_refused(
    pair: Pair, case: str, side: Side, built: KvSpec, change: dict[str, object], says: str
) -> None:
    lay = dataclasses.replace(rank_layout(built, side, 0), **change)
    with (
        SharedRegion(staging_name("topo-bad"), 1 << 20) as region,
        KvdClient(pair.d.socket, role="worker", engine_id=f"bad-{case}", tp_rank=0) as c,
    ):
        with pytest.raises(InvalidRequest) as err:
            c.register_region(region, layout=lay, tp_size=side.tp, compat=compat(spec_of(4)))
        assert says in err.value.message, err.value.message


LAYERWISE = [
    (Side(2), Side(4)),
    (Side(4), Side(1)),
    (Side(1, 16, "NHD", "layer"), Side(2, 32, "NHD")),
    (Side(2, 16, "HND"), Side(2, 16, "NHD")),  # D permutes: goes whole
]


@pytest.mark.parametrize(
    ("ps", "ds"), LAYERWISE, ids=[f"{a.label()}_to_{b.label()}" for a, b in LAYERWISE]
)
def test_layerwise_push_any_p_onto_any_d(pair: Pair, ps: Side, ds: Side) -> None:
    """Layer-wise push across TP sizes, block sizes and region layouts, every byte checked
    against the reference; a pair that needs a permute on receive goes whole."""
    run_case(pair, H4, ps, ds, "push", seed=ps.tp * 3 + ds.tp + 100, layerwise=True)
