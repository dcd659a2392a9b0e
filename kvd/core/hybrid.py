"""KV cache groups of hybrid models: what each group moves, and the plan of a request.

A hybrid model (full attention + sliding window + Mamba/DeltaNet-style state) has several
KV cache groups. A rank registers them as one region (one NIXL registration, one
generation, one lease, one heartbeat stream per node pair per request, as any region):
`wire.RegisterRegion.groups` lists the groups, each with its own layout at its own offset
in the region, and the region's block id space is the groups' ids one after the other
(group g's logical ids start at the sum of the earlier groups' block counts; the region's
own `layout` is `kvd_client.layout.hybrid_layout(groups)`). A request names its blocks
of every group in that one id space, so nothing else of the protocol changes.

What each kind moves (`plan_groups`):

* full: every block, mapped like a plain region (`kvd.core.planner.plan_request`: with
  a KV spec any TP, block sizes, NHD/HND, MLA, replicated heads; with an opaque compat
  hash equal TP and formats only).
* window: only the blocks inside the window: of the tail blocks each side names, the
  last ``min(D's, P's, window_blocks(window, block size))`` (P holds every block the
  window touches, so a D block P does not hold is outside it). TP and token layouts map
  as for full groups. Where the block sizes differ, a tail alone does not say where its
  blocks lie, so the request's token count places them (`num_tokens`: each side's list
  ends with the block holding the last token): the tokens both hold, from the window's
  first block on, move in units of the smaller block (`_window_plan`); without a token
  count such a pair is refused.
* state: per layer, one slot per state id (not paged by tokens): the request's slots
  move whole, P's i-th slot into D's i-th; only at equal TP, rank i to rank i (the
  state's inner shape is the model's), with equal slot sizes (`StateSpec`).

Group structures must agree (kinds, windows, order) and each group's format must agree
(its KV spec or state spec); anything else is refused (Incompatible) naming both sides'
values. Sans IO: plain functions of region views and block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Final, Protocol

import numpy as np
from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest
from kvd_client.layout import (
    GROUP_KINDS,
    StateSpec,
    hybrid_layout,
    parse_state_spec,
    region_bytes,
    shard_units,
    state_part_bytes,
    window_blocks,
)

from kvd.core.planner import (
    Geometry,
    Int64Array,
    Permute,
    Plan,
    RankView,
    RequestPlan,
    check_blocks,
    check_logical,
    plan_heads,
    plan_pieces,
    plan_request,
    plan_transfer,
    rank_kv,
    receive_permutes,
)
from kvd.core.topology import Pair, check_region, map_ranks

MAX_GROUPS: Final = 64


@dataclass(frozen=True, slots=True)
class Group:
    """One KV cache group of one rank's region, validated, at its absolute address."""

    kind: str
    window_tokens: int
    offset: int
    first_id: int
    """First logical id of the group in the region's id space."""
    geometry: Geometry
    layout: wire.RegionLayout
    compat: str
    parts: tuple[wire.StatePart, ...] = ()
    """(State groups) how each part of a chunk is cut by TP (`wire.KvGroup.parts`)."""

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def to_wire(self) -> wire.KvGroup:
        return wire.KvGroup(
            self.kind, self.window_tokens, self.offset, self.layout, self.compat, self.parts
        )

    def describe(self) -> str:
        return f"window({self.window_tokens} tokens)" if self.kind == "window" else self.kind


class HybridView(RankView, Protocol):
    """A rank's region as the hybrid planning needs it (LocalRegion, RemoteRegion)."""

    @property
    def groups(self) -> tuple[Group, ...]: ...


def region_groups(
    base_addr: int,
    nbytes: int,
    layout: wire.RegionLayout,
    groups: Sequence[wire.KvGroup],
    tp_size: int,
    tp_rank: int,
) -> tuple[Group, ...]:
    """The validated groups of a region registered (or announced by a peer) with `groups`;
    () for a plain region. Raises InvalidRequest naming what is wrong: an unknown kind, a
    window without tokens, a group outside the region or overlapping another, a layout
    that is not `hybrid_layout(groups)`, a KV spec that does not fit the group's layout
    (`check_region`), a state spec that does not."""
    if not groups:
        return ()
    if len(groups) > MAX_GROUPS:
        raise InvalidRequest(f"{len(groups)} KV cache groups, at most {MAX_GROUPS}")
    envelope = hybrid_layout(tuple(groups))
    if layout != envelope:
        raise InvalidRequest(
            "a hybrid region's layout must be kvd_client.layout.hybrid_layout(groups) "
            f"({envelope.num_blocks} block ids), got {layout}"
        )
    out: list[Group] = []
    first = 0
    spans: list[tuple[int, int, int]] = []
    for i, g in enumerate(groups):
        where = f"KV cache group {i} ({g.kind})"
        if g.kind not in GROUP_KINDS:
            raise InvalidRequest(f"{where}: kind must be one of {GROUP_KINDS}")
        if (g.kind == "window") != (g.window_tokens > 0):
            raise InvalidRequest(
                f"{where}: window_tokens={g.window_tokens} (a window group needs > 0, "
                "other kinds 0)"
            )
        if g.layout.physical_per_logical != 1:
            raise InvalidRequest(
                f"{where}: physical_per_logical={g.layout.physical_per_logical}, a group "
                "states its own block size instead (1)"
            )
        size = region_bytes(g.layout)
        if g.offset + size > nbytes:
            raise InvalidRequest(
                f"{where}: ends at byte {g.offset + size}, the region has {nbytes}"
            )
        try:
            geo = Geometry.from_layout(base_addr + g.offset, size, g.layout)
            if g.kind == "state":
                _check_state(g.compat, g.layout)
                _check_parts(g.parts, g.layout, tp_size)
            else:  # a KV spec must fit; an opaque compat maps only onto an equal one
                if g.parts:
                    raise InvalidRequest("parts describe a state group's chunks only")
                check_region(g.compat, g.layout, tp_size, tp_rank)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{where}: {exc.message}") from None
        spans.append((g.offset, g.offset + size, i))
        out.append(
            Group(g.kind, g.window_tokens, g.offset, first, geo, g.layout, g.compat, g.parts)
        )
        first += g.layout.num_blocks
    spans.sort()
    for (_, end, a), (start, _, b) in pairwise(spans):
        if start < end:
            raise InvalidRequest(f"KV cache groups {a} and {b} overlap in the region")
    return tuple(out)


def _check_state(compat: str, layout: wire.RegionLayout) -> StateSpec:
    try:
        spec = parse_state_spec(compat)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if layout.dtype != spec.dtype or layout.num_layers != spec.num_layers:
        raise InvalidRequest(
            f"layout has {layout.num_layers} layers of {layout.dtype!r}, the state spec "
            f"says {spec.num_layers} of {spec.dtype!r}"
        )
    if layout.kv_parts * layout.chunk_bytes != spec.slot_bytes:
        raise InvalidRequest(
            f"a slot is {layout.kv_parts} x {layout.chunk_bytes} bytes per layer, the state "
            f"spec says {spec.slot_bytes}"
        )
    return spec


def _check_parts(parts: Sequence[wire.StatePart], layout: wire.RegionLayout, tp_size: int) -> None:
    """A state group's parts (if given) must cut exactly its chunks at this TP."""
    if not parts:
        return
    try:
        got = sum(state_part_bytes(part, tp_size) for part in parts)
    except ValueError as exc:
        raise InvalidRequest(f"its parts: {exc}") from None
    if got != layout.chunk_bytes:
        raise InvalidRequest(
            f"its parts cut {got} bytes per rank at TP {tp_size}, a chunk has {layout.chunk_bytes}"
        )


# ------------------------------------------------------------------ structure


def is_hybrid(p: Sequence[HybridView], d: Sequence[HybridView]) -> bool:
    """Whether the pair is hybrid; Incompatible, naming both, if only one side is."""
    ph = bool(p) and bool(p[0].groups)
    dh = bool(d) and bool(d[0].groups)
    if ph != dh:
        raise Incompatible(f"KV cache groups differ: P has {_describe(p)}, D has {_describe(d)}")
    return ph


def _describe(side: Sequence[HybridView]) -> str:
    if not side or not side[0].groups:
        return "one group (a plain region)"
    return f"{len(side[0].groups)} groups (" + ", ".join(g.describe() for g in side[0].groups) + ")"


def check_structure(p: Sequence[HybridView], d: Sequence[HybridView]) -> None:
    """Refuse (Incompatible, naming both sides' values) unless every rank of each side has
    the same groups and P's and D's agree in order, kinds, windows and model."""
    for side, regions in (("P", p), ("D", d)):
        first = [(g.kind, g.window_tokens, g.compat) for g in regions[0].groups]
        for r in regions[1:]:
            if [(g.kind, g.window_tokens, g.compat) for g in r.groups] != first:
                raise Incompatible(f"{side}'s ranks state different KV cache groups")
    pk = [(g.kind, g.window_tokens) for g in p[0].groups]
    dk = [(g.kind, g.window_tokens) for g in d[0].groups]
    if pk != dk:
        raise Incompatible(f"KV cache groups differ: P has {_describe(p)}, D has {_describe(d)}")
    if p[0].compat != d[0].compat:
        raise Incompatible(f"hybrid regions differ: P states {p[0].compat!r}, D {d[0].compat!r}")


# ------------------------------------------------------------------ planning


@dataclass(frozen=True, slots=True)
class _GroupRank:
    """One group of one rank's region as `plan_request` sees a plain region."""

    tp_rank: int
    tp_size: int
    compat: str
    geometry: Geometry
    layout: wire.RegionLayout | None
    mem_type: str


def _views(side: Sequence[HybridView], g: int) -> list[_GroupRank]:
    return [
        _GroupRank(
            r.tp_rank,
            r.tp_size,
            r.groups[g].compat,
            r.groups[g].geometry,
            r.groups[g].layout,
            r.mem_type,
        )
        for r in side
    ]


def split_ids(groups: Sequence[Group], ids: Sequence[int]) -> list[Int64Array]:
    """A request's logical ids (the region's id space) per group, as each group's own ids,
    in the order named. Raises InvalidRequest for an id outside every group."""
    arr = np.asarray(ids, dtype=np.int64) if len(ids) else np.empty(0, dtype=np.int64)
    total = groups[-1].first_id + groups[-1].num_blocks
    bad = (arr < 0) | (arr >= total)
    if bad.any():
        first = int(np.argmax(bad))
        raise InvalidRequest(
            f"block id {int(arr[first])} (position {first}) is outside the region's "
            f"{total} ids (its KV cache groups')"
        )
    firsts = np.array([g.first_id for g in groups], dtype=np.int64)
    which = np.searchsorted(firsts, arr, side="right") - 1
    return [arr[which == i] - groups[i].first_id for i in range(len(groups))]


def _logical_tokens(side: Sequence[HybridView], g: int) -> int:
    lay = side[0].groups[g].layout
    return lay.tokens_per_block * lay.physical_per_logical


def _window_size(g: int, p: Sequence[HybridView], d: Sequence[HybridView], num_tokens: int) -> int:
    """The block size of window group g where it is the same on both sides, else 0 (then
    the request's token count places the tails: Incompatible without it)."""
    pt, dt = _logical_tokens(p, g), _logical_tokens(d, g)
    if pt == dt:
        return pt
    if num_tokens <= 0:
        raise Incompatible(
            f"sliding-window group {g}: block sizes differ, P {pt} tokens, D {dt}: the "
            "request's token count is needed to align the window (its client sent none)"
        )
    return 0


def _window_plan(
    g: int,
    p: Sequence[HybridView],
    pb: Int64Array,
    d: Sequence[HybridView],
    db: Int64Array,
    num_tokens: int,
    local_is_p: bool,
) -> RequestPlan:
    """A window group whose block sizes differ. Each side's (logical) list is a tail
    ending with the block that holds token `num_tokens - 1`; the tokens both hold, from
    the first block the window reaches (its last window - 1 tokens) on, move in units of
    the smaller block size, each side in its own layout and block size."""
    n = num_tokens
    pl, dl = _logical_tokens(p, g), _logical_tokens(d, g)
    starts = []
    for side, blocks, size in (("P", pb, pl), ("D", db, dl)):
        start = (-(-n // size) - len(blocks)) * size
        if start < 0:
            raise InvalidRequest(
                f"sliding-window group {g}: {side} names {len(blocks)} blocks of {size} "
                f"tokens for a request of {n} tokens"
            )
        starts.append(start)
    pv, dv = _views(p, g), _views(d, g)
    pairs = map_ranks(pv, dv)
    if not pairs or pairs[0].heads == 0:
        raise Incompatible(
            f"sliding-window group {g}: block sizes differ (P {pl}, D {dl} tokens) and the "
            "group states no KV format to map them by"
        )
    pk, dk = [rank_kv(r) for r in pv], [rank_kv(r) for r in dv]
    small = min(pk[0].tokens_per_block, dk[0].tokens_per_block)
    large = max(pk[0].tokens_per_block, dk[0].tokens_per_block)
    if large % small:
        raise Incompatible(
            f"sliding-window group {g}: block sizes differ by a non-integer factor: "
            f"P {pk[0].tokens_per_block}, D {dk[0].tokens_per_block} tokens"
        )
    window = p[0].groups[g].window_tokens
    first = max(*starts, max(0, n - (window - 1)) // small * small)
    units = max(0, -(-(n - first) // small))
    plans: list[Plan] = []
    for pair in pairs:
        a, b = pk[pair.p], dk[pair.d]
        p_phys = check_logical(pv[pair.p].geometry, pb.tolist())
        d_phys = check_logical(dv[pair.d].geometry, db.tolist())
        p_off, d_off = first - starts[0], first - starts[1]
        p_blocks = p_phys[p_off // a.tokens_per_block :]
        d_blocks = d_phys[d_off // b.tokens_per_block :]
        p_first, d_first = p_off % a.tokens_per_block, d_off % b.tokens_per_block
        pg, dg = pv[pair.p].geometry, dv[pair.d].geometry
        if local_is_p:
            plan = plan_heads(
                pg, a, p_blocks, dg, b, d_blocks, unit=small, units=units,
                local_head=pair.p_head, remote_head=pair.d_head, heads=pair.heads,
                local_first=p_first, remote_first=d_first,
            )  # fmt: skip
        else:
            plan = plan_heads(
                dg, b, d_blocks, pg, a, p_blocks, unit=small, units=units,
                local_head=pair.d_head, remote_head=pair.p_head, heads=pair.heads,
                local_first=d_first, remote_first=p_first,
            )  # fmt: skip
        plans.append(plan)
    return RequestPlan(pairs, tuple(plans))


def _window_tail(
    g: int, p: Sequence[HybridView], pb: Int64Array, d: Sequence[HybridView], db: Int64Array
) -> tuple[Int64Array, Int64Array]:
    """The blocks of a window group (equal block sizes) that move: the last of both tails,
    within the window."""
    size = _logical_tokens(p, g)
    k = min(len(pb), len(db), window_blocks(p[0].groups[g].window_tokens, size))
    return pb[len(pb) - k :], db[len(db) - k :]


def _d_window(g: int, d: Sequence[HybridView], db: Int64Array) -> Int64Array:
    grp = d[0].groups[g]
    k = min(len(db), window_blocks(grp.window_tokens, _logical_tokens(d, g)))
    return db[len(db) - k :]


def _state_pairs(g: int, p: Sequence[HybridView], d: Sequence[HybridView]) -> tuple[Pair, ...]:
    """Rank i to rank i, when the two sides' state groups can map (at different TP: the
    pairs `_state_pieces` finds)."""
    if len(p) != len(d):
        return tuple(_state_pieces(g, p, d))
    for pr, dr in zip(p, d, strict=True):
        ps, ds = parse_state_spec(pr.groups[g].compat), parse_state_spec(dr.groups[g].compat)
        diffs = [
            f"{name} P={getattr(ps, name)!r} D={getattr(ds, name)!r}"
            for name in ("model", "dtype", "slot_bytes", "num_layers")
            if getattr(ps, name) != getattr(ds, name)
        ]
        if diffs:
            raise Incompatible(f"state group {g} (rank {pr.tp_rank}) differs: " + ", ".join(diffs))
        pg, dg = pr.groups[g].geometry, dr.groups[g].geometry
        if (pg.kv_parts, pg.chunk_bytes) != (dg.kv_parts, dg.chunk_bytes):
            raise Incompatible(
                f"state group {g} (rank {pr.tp_rank}): slots are {pg.kv_parts} x "
                f"{pg.chunk_bytes} bytes on P, {dg.kv_parts} x {dg.chunk_bytes} on D"
            )
    return tuple(Pair(i, i, 0, 0, 0, True) for i in range(len(p)))


def _state_pieces(
    g: int, p: Sequence[HybridView], d: Sequence[HybridView]
) -> dict[Pair, list[tuple[int, int, int, int]]]:
    """A state group at different TP: per rank pair, the pieces of a chunk (part, P
    offset, D offset, length) that D's rank takes from P's. Each unit a D rank holds comes
    from one P rank (the first that holds it: a replicated unit moves once); the pairs
    are in D rank order, then P's. Incompatible unless both sides describe their chunks'
    cut (`wire.KvGroup.parts`) alike and the model, dtype and layers agree."""
    ps, ds = p[0].groups[g], d[0].groups[g]
    pspec, dspec = parse_state_spec(ps.compat), parse_state_spec(ds.compat)
    diffs = [
        f"{name} P={getattr(pspec, name)!r} D={getattr(dspec, name)!r}"
        for name in ("model", "dtype", "num_layers")
        if getattr(pspec, name) != getattr(dspec, name)
    ]
    if diffs:
        raise Incompatible(f"state group {g} differs: " + ", ".join(diffs))
    if not ps.parts or not ds.parts:
        raise Incompatible(
            f"state group {g}: TP differs, P {len(p)} ranks, D {len(d)}, and "
            f"{'P' if not ps.parts else 'D'} does not describe how TP cuts its state "
            "(KvGroup.parts): it maps only rank i to rank i at equal TP"
        )
    if ps.parts != ds.parts or any(r.groups[g].parts != ps.parts for r in (*p, *d)):
        raise Incompatible(
            f"state group {g}: its state is cut differently, P {ps.parts}, D {ds.parts}"
        )
    tp_p, tp_d = len(p), len(d)
    # one chunk's pieces per pair, then the same for each of a slot's chunks (K/V parts)
    cut: dict[Pair, list[tuple[int, int, int]]] = {}
    for j in range(tp_d):
        base_p = base_d = 0
        for part in ps.parts:
            row_p = state_part_bytes(part, tp_p) // part.rows
            row_d = state_part_bytes(part, tp_d) // part.rows
            for row in range(part.rows):
                off_p, off_d = base_p + row * row_p, base_d + row * row_d
                for shard in part.shards:
                    mine = shard_units(shard.units, tp_d, j)
                    for u in mine:
                        i = next(r for r in range(tp_p) if u in shard_units(shard.units, tp_p, r))
                        have = shard_units(shard.units, tp_p, i)
                        piece = (
                            off_p + (u - have.start) * shard.unit_bytes,
                            off_d + (u - mine.start) * shard.unit_bytes,
                            shard.unit_bytes,
                        )
                        pieces = cut.setdefault(Pair(i, j, 0, 0, 0, False), [])
                        last = pieces[-1] if pieces else None
                        if last and last[0] + last[2] == piece[0] and last[1] + last[2] == piece[1]:
                            pieces[-1] = (last[0], last[1], last[2] + piece[2])
                        else:
                            pieces.append(piece)
                    off_p += len(shard_units(shard.units, tp_p, 0)) * shard.unit_bytes
                    off_d += len(mine) * shard.unit_bytes
            base_p += state_part_bytes(part, tp_p)
            base_d += state_part_bytes(part, tp_d)
    chunks = ps.layout.kv_parts
    out = {
        pair: [(c, po, do, n) for c in range(chunks) for po, do, n in pieces]
        for pair, pieces in cut.items()
    }
    return dict(sorted(out.items(), key=lambda kv: (kv[0].d, kv[0].p)))


def _state_plans(
    g: int,
    p: Sequence[HybridView],
    pb: Int64Array,
    d: Sequence[HybridView],
    db: Int64Array,
    local_is_p: bool,
) -> RequestPlan:
    if len(pb) != len(db):
        raise InvalidRequest(
            f"state group {g}: P names {len(pb)} state slots, D {len(db)} (they move slot for slot)"
        )
    if len(p) != len(d):
        plans: list[Plan] = []
        cut = _state_pieces(g, p, d)
        for pair, pieces in cut.items():
            pg, dg = p[pair.p].groups[g].geometry, d[pair.d].groups[g].geometry
            pbx, dbx = check_blocks(pg, pb), check_blocks(dg, db)
            if local_is_p:
                plans.append(plan_pieces(pg, pbx, dg, dbx, pieces))
            else:
                flipped = [(k, do, po, n) for k, po, do, n in pieces]
                plans.append(plan_pieces(dg, dbx, pg, pbx, flipped))
        return RequestPlan(tuple(cut), tuple(plans))
    pairs = _state_pairs(g, p, d)
    plans = []
    for pair in pairs:
        pg, dg = p[pair.p].groups[g].geometry, d[pair.d].groups[g].geometry
        check_blocks(pg, pb)
        check_blocks(dg, db)
        plans.append(plan_transfer(pg, pb, dg, db) if local_is_p else plan_transfer(dg, db, pg, pb))
    return RequestPlan(pairs, tuple(plans))


def plan_groups(
    p: Sequence[HybridView],
    p_logical: Sequence[int],
    d: Sequence[HybridView],
    d_logical: Sequence[int],
    *,
    local_is_p: bool,
    num_tokens: int = 0,
) -> RequestPlan:
    """`plan_request` of a hybrid pair: every group's transfers (module docstring), one
    after the other. `num_tokens`: the request's token count (0: not known), needed by a
    window group whose block sizes differ. A rank pair appears once per group; its
    descriptors go in the same NIXL transfer as the others of its memory types
    (`transfer_groups`), so D still counts one completion per transfer. Permutes name
    their group's geometry."""
    check_structure(p, d)
    p_ids = split_ids(p[0].groups, p_logical)
    d_ids = split_ids(d[0].groups, d_logical)
    pairs: list[Pair] = []
    plans: list[Plan] = []
    permutes: list[Permute] = []
    for g, grp in enumerate(p[0].groups):
        pb, db = p_ids[g], d_ids[g]
        if grp.kind == "state":
            rp = _state_plans(g, p, pb, d, db, local_is_p)
        elif grp.kind == "window" and not _window_size(g, p, d, num_tokens):
            rp = _window_plan(g, p, pb, d, db, num_tokens, local_is_p)
        else:
            if grp.kind == "window":
                pb, db = _window_tail(g, p, pb, d, db)
            rp = plan_request(
                _views(p, g), pb.tolist(), _views(d, g), db.tolist(), local_is_p=local_is_p
            )
        permutes += _rebased(rp.permutes, rp.pairs, len(pairs), d, g)
        pairs += rp.pairs
        plans += rp.plans
    return RequestPlan(tuple(pairs), tuple(plans), tuple(permutes))


def group_permutes(
    p: Sequence[HybridView],
    d: Sequence[HybridView],
    d_logical: Sequence[int],
    num_tokens: int = 0,
) -> tuple[tuple[Pair, ...], tuple[Permute, ...]]:
    """`receive_permutes` of a hybrid pair (D's side of push: P's blocks unknown): the
    pairs in `plan_groups`' order, and the permutes of D's attention groups (a window
    group's: the last `window_blocks` D names. Should P hold fewer, P writes only the last
    of them and D's earlier ones lie outside the window (P holds every block the window
    touches): they are permuted, unwritten, and never read)."""
    check_structure(p, d)
    d_ids = split_ids(d[0].groups, d_logical)
    pairs: list[Pair] = []
    permutes: list[Permute] = []
    for g, grp in enumerate(p[0].groups):
        if grp.kind == "state":
            got: tuple[Pair, ...] = _state_pairs(g, p, d)
            jobs: tuple[Permute, ...] = ()
        elif grp.kind == "window" and not _window_size(g, p, d, num_tokens):
            got, jobs = map_ranks(_views(p, g), _views(d, g)), ()  # (no permute: sizes differ)
        else:
            db = d_ids[g]
            if grp.kind == "window":
                db = _d_window(g, d, db)
            got, jobs = receive_permutes(_views(p, g), _views(d, g), db.tolist())
        permutes += _rebased(jobs, got, len(pairs), d, g)
        pairs += got
    return tuple(pairs), tuple(permutes)


def _rebased(
    jobs: Sequence[Permute], pairs: Sequence[Pair], first: int, d: Sequence[HybridView], g: int
) -> list[Permute]:
    """Permutes of group g as the whole request's: pair indices after the earlier groups'
    (`first`), each with its group's geometry on D's rank."""
    return [
        replace(j, pair=first + j.pair, geometry=d[pairs[j.pair].d].groups[g].geometry)
        for j in jobs
    ]


def plan_any(
    p: Sequence[HybridView],
    p_logical: Sequence[int],
    d: Sequence[HybridView],
    d_logical: Sequence[int],
    *,
    local_is_p: bool,
    num_tokens: int = 0,
) -> RequestPlan:
    """The plan of a request between any two regions: `plan_groups` for hybrid ones,
    `plan_request` otherwise (a hybrid side facing a plain one is refused)."""
    if is_hybrid(p, d):
        return plan_groups(p, p_logical, d, d_logical, local_is_p=local_is_p, num_tokens=num_tokens)
    return plan_request(p, p_logical, d, d_logical, local_is_p=local_is_p)


def permutes_any(
    p: Sequence[HybridView],
    d: Sequence[HybridView],
    d_logical: Sequence[int],
    num_tokens: int = 0,
) -> tuple[tuple[Pair, ...], tuple[Permute, ...]]:
    """`group_permutes` for hybrid regions, `receive_permutes` otherwise."""
    if is_hybrid(p, d):
        return group_permutes(p, d, d_logical, num_tokens)
    return receive_permutes(p, d, d_logical)
