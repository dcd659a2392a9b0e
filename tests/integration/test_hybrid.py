"""Hybrid models: a region of several KV cache groups (full attention, sliding window,
Mamba-style state) moved P -> D by real daemons over real NIXL and real shared memory, one
worker client per simulated rank, in push and pull, with TP, block-size and token-layout
variations where they apply. Every byte of every D rank is compared with a numpy
reference built from the request's tensors (`kvref` for attention groups, strided views
of the state slots), not from the planner: the window group's blocks outside the window
and every byte outside the request's blocks must keep their values.
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
from kvd_client.errors import ErrorCode
from kvd_client.layout import KvSpec
from kvd_client.shm import SharedRegion, staging_name

from .conftest import Pair, daemon_pair
from .kvref import Side, compat, expected, fill, rank_layout, request_kv

HOST = "127.0.0.1"
MODEL = "org/sim-hybrid"
FULL = KvSpec(MODEL, "bfloat16", 4, 8, 2)
WIN = KvSpec(MODEL, "bfloat16", 4, 8, 1)
WINDOW = 40
"""Sliding window in tokens: with 16-token blocks a request keeps at most 4 blocks."""
STATE_LAYERS = 2
STATE_SLOTS = 16


@dataclass(frozen=True)
class HSide:
    """One engine's hybrid format."""

    tp: int
    tokens: int = 16
    kv_layout: str = "NHD"
    major: str = "block"
    kinds: tuple[str, ...] = ("full", "window", "state")
    num_blocks: int = 40
    cut: bool = False
    """The state group describes how TP cuts it (`CUT`), so it maps across TP."""

    def side(self) -> Side:
        return Side(self.tp, self.tokens, self.kv_layout, self.major, self.num_blocks)

    def label(self) -> str:
        cut = "-cut" if self.cut else ""
        kinds = "+".join(self.kinds)
        return f"tp{self.tp}-b{self.tokens}-{self.kv_layout}-{self.major[0]}-{kinds}{cut}"


def state_layout(tp: int) -> wire.RegionLayout:
    """Per rank and layer, a slot of a conv part and an SSM part, split over TP."""
    return kvlayout.block_major(
        STATE_SLOTS, STATE_LAYERS, 512 // tp, kv_parts=2, tokens_per_block=1, dtype="float32"
    )


CUT = (
    # a conv state stored [kernel - 1][channels]: x by heads, B and C by groups (2 groups:
    # replicated at TP 4), then an SSM state by heads, as Mamba2 shards them
    wire.StatePart(3, (wire.StateShard(8, 4), wire.StateShard(2, 4), wire.StateShard(2, 4))),
    wire.StatePart(1, (wire.StateShard(8, 16),)),
)


def rank_units(units: int, tp: int, rank: int) -> list[int]:
    """The units a rank holds (written here, apart from the daemon's `shard_units`)."""
    if units >= tp:
        return list(range(rank * units // tp, (rank + 1) * units // tp))
    return [rank * units // tp]


def rank_chunk(whole: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """A rank's chunk of `CUT` from the whole model's chunk (`whole`: every part's rows of
    every shard's units, in order)."""
    out: list[np.ndarray] = []
    at = 0
    for part in CUT:
        for _ in range(part.rows):
            for sh in part.shards:
                units = whole[at : at + sh.units * sh.unit_bytes].reshape(sh.units, sh.unit_bytes)
                out.append(units[rank_units(sh.units, tp, rank)].ravel())
                at += sh.units * sh.unit_bytes
    return np.concatenate(out)


def cut_layout(tp: int) -> wire.RegionLayout:
    chunk = int(rank_chunk(np.zeros(cut_whole_bytes(), np.uint8), tp, 0).size)
    return kvlayout.block_major(
        STATE_SLOTS, STATE_LAYERS, chunk, kv_parts=2, tokens_per_block=1, dtype="float32"
    )


def cut_whole_bytes() -> int:
    return sum(p.rows * sum(s.units * s.unit_bytes for s in p.shards) for p in CUT)


def cut_compat(tp: int) -> str:
    lay = cut_layout(tp)
    return kvlayout.state_spec(
        model=MODEL, dtype="float32", slot_bytes=2 * lay.chunk_bytes, num_layers=STATE_LAYERS
    )


def state_compat(tp: int) -> str:
    return kvlayout.state_spec(
        model=MODEL, dtype="float32", slot_bytes=2 * (512 // tp), num_layers=STATE_LAYERS
    )


def state_view(buf: np.ndarray, lay: wire.RegionLayout) -> np.ndarray:
    """A writable ``[slot, layer, part, byte]`` view of a state group's bytes."""
    shape = (lay.num_blocks, lay.num_layers, lay.kv_parts, lay.chunk_bytes)
    strides = (lay.block_stride, lay.layer_stride, lay.kv_stride, 1)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    yield from daemon_pair("hyb")


@dataclass
class Eng:
    """A simulated hybrid engine: a scheduler client and one worker client per rank."""

    name: str
    hs: HSide
    client: KvdClient
    regions: list[SharedRegion] = field(default_factory=list)
    groups: list[tuple[wire.KvGroup, ...]] = field(default_factory=list)
    workers: list[KvdClient] = field(default_factory=list)

    def buf(self, rank: int) -> np.ndarray:
        return np.frombuffer(self.regions[rank].buf, dtype=np.uint8)

    def group(self, kind: str) -> int:
        return self.hs.kinds.index(kind)

    def gbuf(self, rank: int, kind: str, buf: np.ndarray | None = None) -> np.ndarray:
        g = self.groups[rank][self.group(kind)]
        whole = self.buf(rank) if buf is None else buf
        return whole[g.offset : g.offset + kvlayout.region_bytes(g.layout)]

    def glayout(self, rank: int, kind: str) -> wire.RegionLayout:
        return self.groups[rank][self.group(kind)].layout

    def base(self, kind: str) -> int:
        return kvlayout.group_bases(self.groups[0])[self.group(kind)]

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.client.close()
        for r in self.regions:
            r.close()


def hybrid_parts(hs: HSide, rank: int) -> list[tuple[str, wire.RegionLayout, str, int]]:
    parts: list[tuple[str, wire.RegionLayout, str, int]] = []
    for kind in hs.kinds:
        if kind == "full":
            parts.append(("full", rank_layout(FULL, hs.side(), rank), compat(FULL), 0))
        elif kind == "window":
            parts.append(("window", rank_layout(WIN, hs.side(), rank), compat(WIN), WINDOW))
        elif hs.cut:
            parts.append(("state", cut_layout(hs.tp), cut_compat(hs.tp), 0))
        else:
            parts.append(("state", state_layout(hs.tp), state_compat(hs.tp), 0))
    return parts


def engine(sock: str, name: str, hs: HSide, rng: np.random.Generator) -> Eng:
    client = KvdClient(sock, role="scheduler", engine_id=name)
    client.connect()
    eng = Eng(name, hs, client)
    try:
        for rank in range(hs.tp):
            lay, groups, nbytes = kvlayout.hybrid_region(hybrid_parts(hs, rank))
            if hs.cut:
                groups = tuple(
                    dataclasses.replace(g, parts=CUT) if g.kind == "state" else g for g in groups
                )
            region = SharedRegion(staging_name(f"hyb-{name}-r{rank}"), nbytes)
            eng.regions.append(region)
            eng.groups.append(groups)
            eng.buf(rank)[:] = rng.integers(0, 256, region.nbytes, dtype=np.uint8)
            w = KvdClient(sock, role="worker", engine_id=name, tp_rank=rank)
            w.connect()
            eng.workers.append(w)
            w.register_region(
                region,
                layout=lay,
                tp_rank=rank,
                tp_size=hs.tp,
                compat=kvlayout.hybrid_compat(MODEL),
                groups=groups,
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


def fill_state(
    p: Eng, d: Eng, want: list[np.ndarray], p_slot: int, d_slot: int, rng: np.random.Generator
) -> None:
    """Random state in P's slot of every rank; D rank r's slot is to hold P rank r's (equal
    TP), or with `CUT` its share of the whole state P's ranks hold between them. (A
    function, so that no view of the shared memory outlives it.)"""
    if p.hs.cut:
        for layer in range(STATE_LAYERS):
            for part in range(2):
                whole = rng.integers(0, 256, cut_whole_bytes(), np.uint8)
                for r in range(p.hs.tp):
                    pv = state_view(p.gbuf(r, "state"), p.glayout(r, "state"))
                    pv[p_slot, layer, part] = rank_chunk(whole, p.hs.tp, r)
                for r in range(d.hs.tp):
                    dv = state_view(d.gbuf(r, "state", want[r]), d.glayout(r, "state"))
                    dv[d_slot, layer, part] = rank_chunk(whole, d.hs.tp, r)
        return
    for r in range(p.hs.tp):
        pv = state_view(p.gbuf(r, "state"), p.glayout(r, "state"))
        pv[p_slot] = rng.integers(0, 256, pv[p_slot].shape, np.uint8)
        dv = state_view(d.gbuf(r, "state", want[r]), d.glayout(r, "state"))
        dv[d_slot] = pv[p_slot]


def announce(pair: Pair, p: Eng, rid: str, pb: list[int], done: int) -> None:
    """P's workers say every layer of the request is staged, once D's registration is
    there (the region's only 'layer' is its id space); wait until the stream started."""
    before = p.client.status()["counters"].get("streams_started", 0)
    deadline = time.monotonic() + 10
    while p.client.status()["sender"]["pending_registrations"] == 0:
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.01)
    for w in p.workers:
        assert w.layers_saved(1, [(rid, pb)])
    while p.client.status()["counters"].get("streams_started", 0) <= before:
        assert time.monotonic() < deadline, "the stream never started"
        time.sleep(0.01)


@dataclass
class Scenario:
    """One request: its tokens, how many window blocks P holds and D names (tails)."""

    tokens: int
    p_window: int
    d_window: int


SCENARIOS = (
    Scenario(7 * 16 + 5, 5, 6),  # P has not freed one block yet, D names more: 4 move
    Scenario(6 * 16, 3, 3),  # both hold fewer than the window's cover: 3 move
    Scenario(16 + 1, 2, 2),  # a short request: the window covers all of it
)


def run_case(
    pair: Pair, ps: HSide, ds: HSide, mode: str, seed: int, *, layerwise: bool = False
) -> None:
    """Every scenario P -> D in `mode`, bytes checked. `layerwise` (push): P's workers
    announce saved layers after D registered; a hybrid request is never cut by layer, so
    each goes whole at P's finish."""
    rng = np.random.default_rng(seed)
    pair.n += 1
    tag = f"{pair.n}{mode}"
    p = engine(pair.p.socket, f"p{tag}", ps, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, rng)
    try:
        free = {
            (side, kind): list(
                rng.permutation(eng.hs.num_blocks if kind != "state" else STATE_SLOTS)
            )
            for side, eng in (("p", p), ("d", d))
            for kind in eng.hs.kinds
        }
        for i, sc in enumerate(SCENARIOS):
            rid = f"{tag}-{i}"
            m = -(-sc.tokens // ps.tokens)  # P's block positions
            n = -(-sc.tokens // ds.tokens)  # D's
            pb: list[int] = []
            db: list[int] = []
            before = [d.buf(r).copy() for r in range(ds.tp)]
            want = [b.copy() for b in before]
            for kind in ps.kinds:
                pfree, dfree = free[("p", kind)], free[("d", kind)]
                if kind == "state":
                    p_ids = [int(pfree.pop())]
                    d_ids = [int(dfree.pop())]
                    fill_state(p, d, want, p_ids[0], d_ids[0], rng)
                else:
                    spec = FULL if kind == "full" else WIN
                    held = m if kind == "full" else min(sc.p_window, m)
                    named = n if kind == "full" else min(sc.d_window, n)
                    kv = request_kv(spec, m * ps.tokens, rng)
                    p_ids = [int(pfree.pop()) for _ in range(held)]
                    d_ids = [int(dfree.pop()) for _ in range(named)]
                    first = (m - held) * ps.tokens  # P's first held token
                    for r in range(ps.tp):
                        lay = p.glayout(r, kind)
                        fill(p.gbuf(r, kind), lay, spec, ps.tp, r, p_ids, kv[first:])
                    moved = d_ids
                    if kind == "window":  # the last blocks both hold, within the window
                        k = min(held, named, kvlayout.window_blocks(WINDOW, ds.tokens))
                        moved = d_ids[named - k :]
                    start = (n - len(moved)) * ds.tokens
                    for r in range(ds.tp):
                        lay = d.glayout(r, kind)
                        gb = d.gbuf(r, kind, want[r])
                        gb[:] = expected(gb, lay, spec, ds.tp, r, moved, start, kv)
                pb += [p.base(kind) + b for b in p_ids]
                db += [d.base(kind) + b for b in d_ids]
            p_snapshot = [p.buf(r).copy() for r in range(ps.tp)]
            kw = {"remote_engine_id": p.name, "remote_request_id": f"p-{rid}"}
            d.client.track(f"d-{rid}", HOST, pair.p.side_port, **kw)
            if mode == "push":
                d.client.register_push(f"d-{rid}", db, HOST, pair.p.side_port, **kw)
                if layerwise:
                    announce(pair, p, f"p-{rid}", pb, i)
                assert p.client.finished(f"p-{rid}", pb)
            else:
                assert p.client.finished(f"p-{rid}", pb)
                d.client.pull(f"d-{rid}", db, HOST, pair.p.side_port, remote_block_ids=pb, **kw)
            dev = wait_terminal(d.client, f"d-{rid}")
            pev = wait_terminal(p.client, f"p-{rid}")
            assert isinstance(dev, wire.RecvFinished), dev
            assert isinstance(pev, wire.SendFinished), pev
            for r in range(ds.tp):
                if not np.array_equal(d.buf(r), want[r]):
                    bad = np.flatnonzero(d.buf(r) != want[r])
                    where = [f"{g.kind}@{g.offset}" for g in d.groups[r] if g.offset <= bad[0]][-1]
                    pytest.fail(
                        f"{rid}: D rank {r} differs at {bad.size} bytes, first at offset "
                        f"{bad[0]} (group {where})"
                    )
            for r in range(ps.tp):  # P's bytes are read, never written
                assert np.array_equal(p.buf(r), p_snapshot[r])
    finally:
        p.close()
        d.close()


STATE_TP = [
    # a state group that describes how TP cuts it (Mamba2-like: x by heads, B/C by groups,
    # replicated at TP 4; the SSM state by heads) maps across TP like attention does
    (HSide(2, cut=True), HSide(1, cut=True)),
    (HSide(1, cut=True), HSide(2, cut=True)),
    (HSide(4, kinds=("full", "state"), cut=True), HSide(2, kinds=("full", "state"), cut=True)),
    (HSide(1, kinds=("full", "state"), cut=True), HSide(4, kinds=("full", "state"), cut=True)),
    (HSide(2, cut=True), HSide(2, cut=True)),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("ps", "ds"), STATE_TP, ids=[f"{a.label()}_{b.label()}" for a, b in STATE_TP]
)
def test_state_groups_across_tp(pair: Pair, mode: str, ps: HSide, ds: HSide) -> None:
    run_case(pair, ps, ds, mode, seed=ps.tp * 13 + ds.tp)


CASES = [
    # (P, D): every group at equal TP; TP both ways and layouts for attention-only hybrids;
    # block sizes both ways with state (a state group is not paged by tokens)
    (HSide(1), HSide(1)),
    (HSide(2), HSide(2, kv_layout="HND")),
    (HSide(2, major="layer"), HSide(2)),
    (HSide(2, kinds=("full", "window")), HSide(1, kinds=("full", "window"), major="layer")),
    (HSide(1, kinds=("full", "window")), HSide(2, kinds=("full", "window"), kv_layout="HND")),
    (HSide(4), HSide(4, major="layer")),
    (HSide(4, kinds=("full", "window")), HSide(2, kinds=("full", "window"), kv_layout="HND")),
    (HSide(1, 16, kinds=("full", "state")), HSide(1, 32, kinds=("full", "state"))),
    (HSide(2, 32, kinds=("full", "state")), HSide(2, 16, "HND", kinds=("full", "state"))),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("ps", "ds"), CASES, ids=[f"{a.label()}_{b.label()}" for a, b in CASES])
def test_hybrid_every_byte(pair: Pair, mode: str, ps: HSide, ds: HSide) -> None:
    run_case(pair, ps, ds, mode, seed=len(pair.p.name) + ps.tp * 7 + ds.tokens)


def test_hybrid_layerwise_push_goes_whole(pair: Pair) -> None:
    """Workers announcing layers of a hybrid request: it streams, cannot be cut by layer
    (its groups' layers are not the region's), and goes whole at P's finish, every byte
    right."""
    with KvdClient(pair.p.socket, role="cli", keepalive_interval=0) as c:
        before = c.status()["counters"]
    run_case(pair, HSide(2), HSide(2, kv_layout="HND"), "push", seed=21, layerwise=True)
    with KvdClient(pair.p.socket, role="cli", keepalive_interval=0) as c:
        after = c.status()["counters"]
    grew = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in ("streams_started", "sends_layered", "streams_whole")
    }
    assert grew == {"streams_started": 3, "sends_layered": 0, "streams_whole": 3}, grew


WINDOW_SIZES = [
    # a sliding-window group whose block sizes differ, placed by the request's token count
    (HSide(1, 16, kinds=("full", "window")), HSide(1, 32, kinds=("full", "window"))),
    (HSide(2, 32, kinds=("full", "window")), HSide(1, 16, "HND", kinds=("full", "window"))),
    (HSide(1, 16, "HND", kinds=("full", "window")), HSide(2, 32, kinds=("full", "window"))),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("ps", "ds"), WINDOW_SIZES, ids=[f"{a.label()}_{b.label()}" for a, b in WINDOW_SIZES]
)
def test_window_groups_at_other_block_sizes(pair: Pair, mode: str, ps: HSide, ds: HSide) -> None:
    """Each side names its window group's blocks holding the window's tokens (its last
    window - 1 before the end, as the vLLM connector does; P sometimes one block more, not
    freed yet) in its own block size. With the request's token count, D's blocks get
    every token of the window from P, each in D's layout: exactly the tokens from the
    first block both hold (within the window) to the end of the request's last unit of
    the smaller block size; every other byte of D keeps its value."""
    rng = np.random.default_rng(31 + ps.tokens + ds.tp)
    pair.n += 1
    tag = f"{pair.n}{mode}w"
    p = engine(pair.p.socket, f"p{tag}", ps, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, rng)
    small = min(ps.tokens, ds.tokens)
    try:
        free = {
            (side, kind): list(rng.permutation(eng.hs.num_blocks))
            for side, eng in (("p", p), ("d", d))
            for kind in eng.hs.kinds
        }
        for i, (n_tok, extra) in enumerate(((7 * 16 + 5, 1), (6 * 16, 0), (17, 0), (100, 1))):
            rid = f"{tag}-{i}"
            m, n = -(-n_tok // ps.tokens), -(-n_tok // ds.tokens)
            win_lo = max(0, n_tok - (WINDOW - 1))  # the window's tokens: [win_lo, n_tok)
            before = [d.buf(r).copy() for r in range(ds.tp)]
            want = [b.copy() for b in before]
            pb: list[int] = []
            db: list[int] = []
            for kind in ps.kinds:
                spec = FULL if kind == "full" else WIN
                kv = request_kv(spec, m * ps.tokens, rng)
                p_first = 0 if kind == "full" else max(0, win_lo // ps.tokens - extra)
                d_first = 0 if kind == "full" else win_lo // ds.tokens
                p_ids = [int(free[("p", kind)].pop()) for _ in range(m - p_first)]
                d_ids = [int(free[("d", kind)].pop()) for _ in range(n - d_first)]
                for r in range(ps.tp):
                    lay = p.glayout(r, kind)
                    fill(p.gbuf(r, kind), lay, spec, ps.tp, r, p_ids, kv[p_first * ps.tokens :])
                only = None
                if kind == "window":
                    lo = max(p_first * ps.tokens, d_first * ds.tokens, win_lo // small * small)
                    hi = -(-n_tok // small) * small
                    assert lo <= win_lo  # (the window's every token is among them)
                    only = (lo, hi)
                for r in range(ds.tp):
                    lay = d.glayout(r, kind)
                    gb = d.gbuf(r, kind, want[r])
                    gb[:] = expected(
                        gb, lay, spec, ds.tp, r, d_ids, d_first * ds.tokens, kv, only=only
                    )
                pb += [p.base(kind) + b for b in p_ids]
                db += [d.base(kind) + b for b in d_ids]
            kw = {"remote_engine_id": p.name, "remote_request_id": f"p-{rid}"}
            d.client.track(f"d-{rid}", HOST, pair.p.side_port, **kw)
            if mode == "push":
                d.client.register_push(
                    f"d-{rid}", db, HOST, pair.p.side_port, num_tokens=n_tok, **kw
                )
                assert p.client.finished(f"p-{rid}", pb, n_tok)
            else:
                assert p.client.finished(f"p-{rid}", pb, n_tok)
                d.client.pull(
                    f"d-{rid}",
                    db,
                    HOST,
                    pair.p.side_port,
                    remote_block_ids=pb,
                    num_tokens=n_tok,
                    **kw,
                )
            dev = wait_terminal(d.client, f"d-{rid}")
            assert isinstance(dev, wire.RecvFinished), dev
            assert isinstance(wait_terminal(p.client, f"p-{rid}"), wire.SendFinished)
            for r in range(ds.tp):
                if not np.array_equal(d.buf(r), want[r]):
                    bad = np.flatnonzero(d.buf(r) != want[r])
                    pytest.fail(f"{rid}: D rank {r} differs at {bad.size} bytes, first {bad[0]}")
    finally:
        p.close()
        d.close()


def test_a_token_count_p_and_d_disagree_on_fails_the_request(pair: Pair) -> None:
    """P's finish and D's registration naming different token counts: the request fails
    on both sides (nothing is guessed), D's bytes untouched."""
    ps = HSide(1, 16, kinds=("full", "window"))
    ds = HSide(1, 32, kinds=("full", "window"))
    rng = np.random.default_rng(5)
    pair.n += 1
    tag = f"{pair.n}tok"
    p = engine(pair.p.socket, f"p{tag}", ps, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, rng)
    try:
        before = [d.buf(r).copy() for r in range(ds.tp)]
        pb = [p.base("full") + b for b in range(4)] + [p.base("window") + b for b in (5, 6, 7)]
        db = [d.base("full") + b for b in range(2)] + [d.base("window") + b for b in (1, 2)]
        rid = f"{tag}-x"
        kw = {"remote_engine_id": p.name, "remote_request_id": f"p-{rid}"}
        d.client.track(f"d-{rid}", HOST, pair.p.side_port, **kw)
        d.client.register_push(f"d-{rid}", db, HOST, pair.p.side_port, num_tokens=60, **kw)
        assert p.client.finished(f"p-{rid}", pb, 64)
        dev = wait_terminal(d.client, f"d-{rid}")
        assert isinstance(dev, wire.RecvFailed), dev
        assert isinstance(wait_terminal(p.client, f"p-{rid}"), wire.SendFailed)
        assert "64 tokens" in dev.reason and "60" in dev.reason, dev.reason
        for r in range(ds.tp):
            assert np.array_equal(d.buf(r), before[r])
    finally:
        p.close()
        d.close()


REFUSED = [
    (
        "window-block-sizes",
        HSide(1, 16, kinds=("full", "window")),
        HSide(1, 32, kinds=("full", "window")),
        ["sliding-window group 1", "P 16 tokens, D 32", "token count is needed"],
    ),
    ("state-tp", HSide(2), HSide(1), ["state group 2", "P 2 ranks, D 1"]),
    (
        "kinds",
        HSide(1, kinds=("full", "window")),
        HSide(1, kinds=("full", "state")),
        ["P has 2 groups (full, window(40 tokens))", "D has 2 groups (full, state)"],
    ),
]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("case", "ps", "ds", "says"), REFUSED, ids=[r[0] for r in REFUSED])
def test_incompatible_groups_fail_naming_both_sides(
    pair: Pair, mode: str, case: str, ps: HSide, ds: HSide, says: list[str]
) -> None:
    """Both ends of the request end (failed, nothing hangs), D's reason names both sides'
    values, and not one byte of D changes."""
    rng = np.random.default_rng(9)
    pair.n += 1
    tag = f"{pair.n}{mode}"
    p = engine(pair.p.socket, f"p{tag}", ps, rng)
    d = engine(pair.d.socket, f"d{tag}", ds, rng)
    try:
        before = [d.buf(r).copy() for r in range(ds.tp)]
        pb = [p.base("full") + b for b in (3, 1, 7)]
        db = [d.base("full") + b for b in (5, 2)]
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


def test_hybrid_facing_a_plain_region_is_refused(pair: Pair) -> None:
    """A hybrid P and a plain D (one group) fail the request, naming both structures."""
    rng = np.random.default_rng(11)
    pair.n += 1
    p = engine(pair.p.socket, f"p{pair.n}hp", HSide(1), rng)
    name = f"d{pair.n}hp"
    d = KvdClient(pair.d.socket, role="scheduler", engine_id=name)
    d.connect()
    lay = rank_layout(FULL, Side(1), 0)
    region = SharedRegion(staging_name(f"hyb-{name}"), kvlayout.region_bytes(lay))
    try:
        d.register_region(region, layout=lay, compat=compat(FULL))
        rid = f"{pair.n}hp"
        kw = {"remote_engine_id": p.name, "remote_request_id": f"p-{rid}"}
        d.track(f"d-{rid}", HOST, pair.p.side_port, **kw)
        assert p.client.finished(f"p-{rid}", [1])
        d.pull(f"d-{rid}", [1], HOST, pair.p.side_port, remote_block_ids=[1], **kw)
        dev = wait_terminal(d, f"d-{rid}")
        assert isinstance(dev, wire.RecvFailed) and dev.code == ErrorCode.INCOMPATIBLE, dev
        assert "P has 3 groups" in dev.reason and "D has one group" in dev.reason, dev.reason
        assert isinstance(wait_terminal(p.client, f"p-{rid}"), wire.SendFailed)
    finally:
        p.close()
        d.close()
        region.close()


BAD = [
    ("kind", {"kind": "sparse"}, "kind must be one of"),
    ("window", {"window_tokens": 0, "kind": "window"}, "a window group needs > 0"),
    ("offset", {"offset": 1 << 30}, "ends at byte"),
    ("state-spec", {"compat": compat(FULL), "kind": "state"}, "is not a state spec"),
    ("parts-on-full", {"parts": CUT}, "parts describe a state group's chunks only"),
    ("state-parts-size", {"parts": CUT}, "its parts cut 272 bytes per rank at TP 1"),
    (
        "state-parts-split",
        {"parts": (wire.StatePart(1, (wire.StateShard(3, 4),)),)},
        "3 units do not split over 2 ranks",
    ),
]


@pytest.mark.parametrize(("case", "change", "says"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_group_is_refused_at_registration(
    pair: Pair, case: str, change: dict[str, object], says: str
) -> None:
    name = f"bad{pair.n}{case}"
    pair.n += 1
    tp = 2 if case == "state-parts-split" else 1
    c = KvdClient(pair.d.socket, role="worker", engine_id=name, tp_rank=0)
    c.connect()
    lay, groups, nbytes = kvlayout.hybrid_region(hybrid_parts(HSide(tp), 0))
    region = SharedRegion(staging_name(f"hyb-{name}"), nbytes)
    try:
        g = groups[2] if case.startswith("state") else groups[0]
        fields = {**g.__dict__, **change}
        bad = wire.KvGroup(**fields)
        at = groups.index(g)
        groups = (*groups[:at], bad, *groups[at + 1 :])
        with pytest.raises(Exception, match=says):
            c.register_region(
                region,
                layout=lay,
                compat=kvlayout.hybrid_compat(MODEL),
                groups=groups,
                tp_size=tp,
            )
    finally:
        c.close()
        region.close()


def test_status_names_each_regions_groups(pair: Pair) -> None:
    rng = np.random.default_rng(12)
    pair.n += 1
    eng = engine(pair.d.socket, f"st{pair.n}", HSide(2), rng)
    try:
        mine = [r for r in eng.client.status()["regions"] if r["engine_id"] == eng.name]
        assert [r["groups"] for r in mine] == [["full", "window(40 tokens)", "state"]] * 2
        assert [r["blocks"] for r in mine] == [2 * 40 + STATE_SLOTS] * 2  # the id space
    finally:
        eng.close()
