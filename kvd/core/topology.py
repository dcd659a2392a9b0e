"""Which P rank feeds which D rank, which heads, and whether the two sides can map at all.

A region whose compat is a structured KV spec (`kvd_client.layout.kv_spec`) says what it
holds: the model's KV heads, head size, dtype, layers, MLA, and (in its layout) tokens per
physical block and the token layout inside a chunk (NHD: [token][head][elem], HND:
[head][token][elem]). From that and the TP sizes, `map_ranks` pairs the ranks once per
request, sans IO:

* P TP > D TP: a D rank holds the heads of several P ranks: one pair per such P rank,
  each moving its slice of heads into D's chunk.
* P TP < D TP: a D rank needs a slice of one P rank's heads: one pair moving only that
  slice (the planner reads/writes only those heads' bytes).
* Replicated KV heads (fewer KV heads than ranks) and MLA (one latent replicated on every
  rank): a D rank takes each head it needs from one P replica only, spread over the
  replicas by D rank (never N copies of the same bytes).

A region with an opaque compat (`compat_hash`) maps only onto an equal one at equal TP,
rank i to rank i, whole chunks (as before KV specs).

`check_region` validates a spec against the region's layout at registration, so a wrong
chunk size is refused there, naming the numbers; `map_ranks` refuses (Incompatible) a
pair whose model, dtype, KV heads, head size, layers or MLA differ, naming both sides'
values. Nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest
from kvd_client.layout import KvSpec, parse_kv_spec

LAYOUTS = ("NHD", "HND")


class RankRegion(Protocol):
    """What the mapping needs of one rank's region (LocalRegion and RemoteRegion have it)."""

    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def compat(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RankKv:
    """One rank's KV as the planner needs it below the chunk level."""

    spec: KvSpec
    tokens_per_block: int
    """Tokens per physical block."""
    kv_layout: str
    head0: int
    """First global head this rank holds."""
    heads: int
    """Heads this rank holds (consecutive global heads from `head0`)."""

    @property
    def head_bytes(self) -> int:
        return self.spec.head_bytes

    @property
    def token_step(self) -> int:
        """Bytes between consecutive tokens of one head inside a chunk."""
        return self.heads * self.head_bytes if self.kv_layout == "NHD" else self.head_bytes

    @property
    def head_step(self) -> int:
        """Bytes between consecutive heads of one token inside a chunk."""
        return (
            self.head_bytes if self.kv_layout == "NHD" else self.tokens_per_block * self.head_bytes
        )


@lru_cache(maxsize=256)
def _spec(compat: str) -> KvSpec | None:
    try:
        return parse_kv_spec(compat)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def check_region(
    compat: str, layout: wire.RegionLayout, tp_size: int, tp_rank: int
) -> RankKv | None:
    """The rank's KV if its compat is a KV spec (None for an opaque compat), validated
    against its layout; raises InvalidRequest naming what disagrees."""
    spec = _spec(compat)
    if spec is None:
        return None
    if layout.dtype != spec.dtype:
        raise InvalidRequest(f"layout dtype {layout.dtype!r} but the KV spec says {spec.dtype!r}")
    if layout.num_layers != spec.num_layers:
        raise InvalidRequest(
            f"layout has {layout.num_layers} layers but the KV spec says {spec.num_layers}"
        )
    if layout.kv_layout not in LAYOUTS:
        raise InvalidRequest(f"kv_layout {layout.kv_layout!r} must be one of {LAYOUTS}")
    parts = 1 if spec.mla else 2
    if layout.kv_parts != parts:
        raise InvalidRequest(
            f"kv_parts={layout.kv_parts}, but a {'MLA' if spec.mla else 'K/V'} spec needs "
            f"{parts} (K and V as separate chunks; MLA one latent chunk)"
        )
    try:
        head0, heads = spec.heads_on(tp_size, tp_rank)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    want = layout.tokens_per_block * heads * spec.head_bytes
    if layout.chunk_bytes != want:
        raise InvalidRequest(
            f"chunk_bytes={layout.chunk_bytes}, but {layout.tokens_per_block} tokens x "
            f"{heads} heads x {spec.head_bytes} bytes per head = {want} (KV spec, TP {tp_size})"
        )
    return RankKv(spec, layout.tokens_per_block, layout.kv_layout, head0, heads)


@dataclass(frozen=True, slots=True)
class Pair:
    """One transfer of a request: P rank `p` to D rank `d`, `heads` heads starting at P's
    local head `p_head` and D's local head `d_head`. `whole`: the heads are all of both
    ranks' heads (then whole chunks may move when tokens and layouts agree too)."""

    p: int
    d: int
    p_head: int
    d_head: int
    heads: int
    whole: bool


_SPEC_FIELDS = ("model", "dtype", "num_kv_heads", "head_size", "num_layers", "mla")


def _side_spec(side: str, regions: Sequence[RankRegion]) -> KvSpec | None:
    """The one spec every rank of a side states (None when all are opaque)."""
    specs = {_spec(r.compat) for r in regions}
    if len(specs) != 1:
        raise Incompatible(f"{side}'s ranks state different KV formats: {sorted(map(str, specs))}")
    return specs.pop()


def map_ranks(p: Sequence[RankRegion], d: Sequence[RankRegion]) -> tuple[Pair, ...]:
    """The transfers of a request from P's ranks (in rank order) to D's; raises
    Incompatible, naming both sides' values, unless the two can map."""
    if not p or not d:
        raise Incompatible(f"P has {len(p)} ranks, D has {len(d)}")
    ps, ds = _side_spec("P", p), _side_spec("D", d)
    if ps is None or ds is None:
        if ps is not None or ds is not None:
            raise Incompatible(
                f"KV compatibility differs: P states {p[0].compat!r}, D {d[0].compat!r} "
                "(one side uses an opaque compat hash, the other a KV spec)"
            )
        return _opaque(p, d)
    diffs = [
        f"{name} P={getattr(ps, name)!r} D={getattr(ds, name)!r}"
        for name in _SPEC_FIELDS
        if getattr(ps, name) != getattr(ds, name)
    ]
    if diffs:
        raise Incompatible("KV formats differ: " + ", ".join(diffs))
    return _pairs(ps, len(p), len(d))


def _opaque(p: Sequence[RankRegion], d: Sequence[RankRegion]) -> tuple[Pair, ...]:
    if len(p) != len(d):
        raise Incompatible(
            f"TP mismatch: P has {len(p)} ranks, D has {len(d)} (opaque compat hashes map "
            "only at equal TP; declare a KV spec, kvd_client.layout.kv_spec, to map others)"
        )
    for pr, dr in zip(p, d, strict=True):
        if not pr.compat or pr.compat != dr.compat:
            raise Incompatible(
                f"KV compatibility differs: P rank {pr.tp_rank} {pr.compat!r} "
                f"vs D rank {dr.tp_rank} {dr.compat!r}"
            )
    return tuple(Pair(i, i, 0, 0, 0, True) for i in range(len(p)))


@lru_cache(maxsize=1024)
def _pairs(spec: KvSpec, p_tp: int, d_tp: int) -> tuple[Pair, ...]:
    try:
        p_held = [spec.heads_on(p_tp, r) for r in range(p_tp)]
        d_held = [spec.heads_on(d_tp, r) for r in range(d_tp)]
    except ValueError as exc:
        raise Incompatible(f"KV heads cannot map: {exc} (P TP {p_tp}, D TP {d_tp})") from None
    out: list[Pair] = []
    for d, (g0, count) in enumerate(d_held):
        run: list[int] | None = None  # [p rank, p local head, d local head, heads]
        for g in range(g0, g0 + count):
            holders = [r for r, (h0, n) in enumerate(p_held) if h0 <= g < h0 + n]
            src = holders[d % len(holders)]
            p_local = g - p_held[src][0]
            if run is not None and run[0] == src and run[1] + run[3] == p_local:
                run[3] += 1
                continue
            if run is not None:
                out.append(_pair(run, d, p_held, d_held))
            run = [src, p_local, g - g0, 1]
        assert run is not None
        out.append(_pair(run, d, p_held, d_held))
    return tuple(out)


def _pair(
    run: list[int], d: int, p_held: list[tuple[int, int]], d_held: list[tuple[int, int]]
) -> Pair:
    src, p_head, d_head, heads = run
    whole = heads == p_held[src][1] == d_held[d][1]
    return Pair(src, d, p_head, d_head, heads, whole)
