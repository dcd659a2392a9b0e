"""The KV tiers' indexes: which blocks the host pool and the disk tier hold (sans-IO).

Blocks are named by `TierKey` = (namespace, key): the namespace is the model's
compatibility hash, so two models never share a block; the key is vLLM's OffloadKey.

`HostIndex`: the daemon's shared-memory pool cut into `num_slots` slots. An entry is
RESERVED (a store's client is copying into it, or a disk read is filling it) or READY.
Entries in use are pinned (counted); a READY entry with no pins sits in a recency list
and is evicted, oldest first, when a reservation needs its slot. A pinned or RESERVED
entry is never evicted. A READY entry knows whether the disk tier holds a copy
(`on_disk`, "clean"): clean entries are evicted before dirty ones, since evicting a
dirty one loses the block unless it is demoted first, which the actor does ahead of
need (`victims`, then `evict` once the copy is on disk).

Slot generations (`gens`, one counter per slot, published by the daemon in shared
memory): a slot's counter is bumped whenever the slot is given to a new use (a new
entry, or lent out), before any new byte can be written into it. A load's answer names
each slot's generation; a client that copied a slot out checks the counter afterwards,
so a copy from a slot reused meanwhile (its pins dropped: a frozen or slow reader) is
seen and is a miss (the seqlock argument of `kvd_client.ecindex`). A `Directory` (the
daemon's shared-memory table, `kvd_client.tierdir`) is told of every READY entry that is
not transient, with its slot and generation, and of its leaving: clients load what it
names without a pin, checked by the same generations; `touch` then makes such entries
the most recently used.

Lent slots belong to no key: slots `lend` gives a client ahead of its stores (it copies
blocks in, then names their keys: `fill`), and a RESERVED entry whose writer may still
write into it after its operation was dropped (a frozen or slow client), `detach`ed: its
key is forgotten (a miss; the key may be stored again elsewhere) but the slot stays out
of use until the actor knows that writer is done (`give_back`).

`DiskIndex`: files bounded by `capacity` bytes. An entry is RESERVED (a temp file being written, not
yet renamed: never served) or READY; READY entries with no readers sit in an LRU list,
and making room for a new file evicts from its old end (the actor deletes those files).

`OpBook`: the operations that hold pins for a client session (a store's reservations,
a load's pins), each with a deadline: the actor drops an operation's pins when its
client ends it, when its session ends, or when it expires.

Across nodes (a daemon asking its peers' tiers): `found_problem` and `pinned_problem`
validate a peer's answers, `pick_peers` merges the answers of a lookup batch (the same
choice whatever order they came in), and `PeerHints` remembers, bounded, which peer a
lookup found each key on, for the load that follows.

Every operation is O(1) (dicts and OrderedDicts; no scan), so 100k blocks cost what 1k
do. Time is only ever a parameter.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from kvd_client import wire

from kvd.core.timers import TimerHeap

TierKey = tuple[bytes, bytes]
"""(namespace, key)."""


class SlotGens(Protocol):
    """One counter per slot (a list in tests; a uint64 view of shared memory in the daemon)."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> int: ...
    def __setitem__(self, i: int, v: int, /) -> None: ...


class Directory(Protocol):
    """Where READY host entries are published for clients' loads without a round trip
    (`kvd_client.tierdir`): told when an entry becomes visible and when it leaves."""

    def publish(self, key: TierKey, slot: int, gen: int) -> None: ...
    def retract(self, key: TierKey) -> None: ...


class State(enum.Enum):
    RESERVED = "reserved"
    READY = "ready"
    CONDEMNED = "condemned"
    """(disk) Found bad while it had readers: no longer served, forgotten by the last
    reader's unpin."""


class Reserve(enum.Enum):
    """Why a reservation got no slot."""

    HELD = "held"
    """The key is already held (ready, or being stored by another operation)."""
    FULL = "full"
    """Every slot is pinned or reserved: nothing can be evicted."""


@dataclass(slots=True)
class _HostEntry:
    slot: int
    state: State
    pins: int
    on_disk: bool = False
    transient: bool = False
    """Read from disk for one load without promotion: freed when its last pin goes."""


@dataclass(frozen=True, slots=True)
class Evicted:
    key: TierKey
    slot: int
    on_disk: bool
    """False: the block left the tiers (it was not on disk)."""


class HostIndex:
    """Slots of the host pool, by key, with pins and LRU eviction (module docstring).

    Unpinned READY entries are kept in two recency lists: clean (the disk tier holds a
    copy) and dirty (it does not). A slot is taken from the free list, else from the
    least recently used clean entry, and only then, if the caller allows it, from the
    least recently used dirty one (whose block then leaves the tiers): where a disk tier
    takes demoted blocks, the actor writes dirty entries out (`victims`) instead."""

    __slots__ = ("_clean", "_dir", "_dirty", "_entries", "_free", "_gens", "_lent", "num_slots")

    def __init__(
        self, num_slots: int, gens: SlotGens | None = None, directory: Directory | None = None
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if gens is not None and len(gens) < num_slots:
            raise ValueError(f"{len(gens)} generation counters for {num_slots} slots")
        self.num_slots: Final = num_slots
        self._gens: SlotGens = [0] * num_slots if gens is None else gens
        self._dir = directory
        """Told of every READY entry that is not transient, and of its leaving."""
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: 0 first
        self._lent: set[int] = set()
        self._entries: dict[TierKey, _HostEntry] = {}
        # READY and unpinned, oldest first
        self._clean: OrderedDict[TierKey, None] = OrderedDict()
        self._dirty: OrderedDict[TierKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def evictable(self) -> int:
        return len(self._clean) + len(self._dirty)

    @property
    def lent(self) -> int:
        """Slots out of use until their writer is known to be done (`detach`)."""
        return len(self._lent)

    def gen(self, slot: int) -> int:
        """The slot's generation (bumped each time it is given to a new use)."""
        return self._gens[slot]

    @property
    def clean(self) -> int:
        """Unpinned entries the disk tier also holds (evicted first, at no loss)."""
        return len(self._clean)

    def ready(self, key: TierKey) -> bool:
        e = self._entries.get(key)
        return e is not None and e.state is State.READY

    def ready_many(self, keys: Sequence[TierKey]) -> list[bool]:
        """`ready` of each key (a lookup batch's cost: one comprehension, no calls)."""
        get, ready = self._entries.get, State.READY
        return [(e := get(k)) is not None and e.state is ready for k in keys]

    def slot_of(self, key: TierKey) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.slot

    def pins(self, key: TierKey) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.pins

    def on_disk(self, key: TierKey) -> bool:
        e = self._entries.get(key)
        return e is not None and e.on_disk

    def reserve(
        self,
        key: TierKey,
        *,
        transient: bool = False,
        on_disk: bool = False,
        evict_dirty: bool = True,
    ) -> tuple[int, Evicted | None] | Reserve:
        """A RESERVED entry (pinned once) for `key` in a free slot, or in the slot of the
        least recently used unpinned clean entry, or (`evict_dirty`) dirty one: evicted,
        and returned."""
        if key in self._entries:
            return Reserve.HELD
        victim: Evicted | None = None
        if self._free:
            slot = self._free.pop()
        elif self._clean or (evict_dirty and self._dirty):
            lru = self._clean if self._clean else self._dirty
            old, _ = lru.popitem(last=False)
            e = self._entries.pop(old)
            self._retract(old)
            victim = Evicted(old, e.slot, e.on_disk)
            slot = e.slot
        else:
            return Reserve.FULL
        self._gens[slot] += 1  # before any byte of the new use is written
        self._entries[key] = _HostEntry(slot, State.RESERVED, 1, on_disk, transient)
        return slot, victim

    def commit(self, key: TierKey, *, keep_pin: bool = False) -> None:
        """RESERVED -> READY, dropping the reservation's pin (or keeping it for the
        operation that reserved it: a load that read the block from disk)."""
        e = self._entry(key)
        if e.state is not State.RESERVED:
            raise ValueError(f"{key!r} is not reserved")
        e.state = State.READY
        if self._dir is not None and not e.transient:
            self._dir.publish(key, e.slot, self._gens[e.slot])
        if not keep_pin:
            self._unpin(key, e)

    def abort(self, key: TierKey) -> int:
        """Drop a RESERVED entry (its bytes never became visible); returns its slot."""
        e = self._entry(key)
        if e.state is not State.RESERVED:
            raise ValueError(f"{key!r} is not reserved")
        del self._entries[key]
        self._free.append(e.slot)
        return e.slot

    def detach(self, key: TierKey) -> int:
        """Forget a RESERVED entry but keep its slot out of use (lent): its writer may
        still write into it. Returns the slot (for `give_back`)."""
        e = self._entry(key)
        if e.state is not State.RESERVED:
            raise ValueError(f"{key!r} is not reserved")
        del self._entries[key]
        self._lent.add(e.slot)
        return e.slot

    def lend(self, n: int) -> tuple[list[int], list[Evicted]]:
        """Up to `n` slots lent out (a store ahead of its keys: `fill`): free ones first,
        then those of the least recently used unpinned clean entries (evicted, returned),
        never a dirty one (its block would leave the tiers for a store not made yet)."""
        slots: list[int] = []
        evicted: list[Evicted] = []
        while len(slots) < n:
            if self._free:
                slot = self._free.pop()
            elif self._clean:
                old, _ = self._clean.popitem(last=False)
                e = self._entries.pop(old)
                self._retract(old)
                evicted.append(Evicted(old, e.slot, True))
                slot = e.slot
            else:
                break
            self._gens[slot] += 1  # before any byte of the new use is written
            self._lent.add(slot)
            slots.append(slot)
        return slots, evicted

    def fill(self, key: TierKey, slot: int) -> bool:
        """A lent slot holds `key`'s block now: a READY entry, unpinned, the most recently
        used dirty one. False (the slot stays lent) where the key is held already."""
        if slot not in self._lent:
            raise ValueError(f"slot {slot} is not lent")
        if key in self._entries:
            return False
        self._lent.discard(slot)
        self._entries[key] = _HostEntry(slot, State.READY, 0)
        self._dirty[key] = None
        if self._dir is not None:
            self._dir.publish(key, slot, self._gens[slot])
        return True

    def give_back(self, slot: int) -> None:
        """A lent slot is free again (its writer is known to be done)."""
        if slot not in self._lent:
            raise ValueError(f"slot {slot} is not lent")
        self._lent.discard(slot)
        self._free.append(slot)

    def pin(self, key: TierKey) -> int | None:
        """Pin a READY entry (a use: it becomes the most recently used); its slot."""
        e = self._entries.get(key)
        if e is None or e.state is not State.READY:
            return None
        if e.pins == 0:
            (self._clean if e.on_disk else self._dirty).pop(key, None)
        e.pins += 1
        return e.slot

    def unpin(self, key: TierKey) -> bool:
        """Drop one pin; True if a transient entry was freed by it."""
        return self._unpin(key, self._entry(key))

    def _unpin(self, key: TierKey, e: _HostEntry) -> bool:
        if e.pins <= 0:
            raise ValueError(f"{key!r} is not pinned")
        e.pins -= 1
        if e.pins == 0 and e.state is State.READY:
            if e.transient:
                del self._entries[key]
                self._free.append(e.slot)
                return True
            (self._clean if e.on_disk else self._dirty)[key] = None
        return False

    def mark_on_disk(self, key: TierKey) -> None:
        """The disk tier now holds a copy: an unpinned entry becomes the oldest clean one
        (it was among the oldest dirty ones: the demoter writes those)."""
        e = self._entries.get(key)
        if e is None or e.on_disk:
            return
        e.on_disk = True
        if key in self._dirty:
            del self._dirty[key]
            self._clean[key] = None
            self._clean.move_to_end(key, last=False)

    def victims(self, n: int) -> list[TierKey]:
        """Up to `n` least recently used unpinned dirty entries, oldest first (to write
        to disk before they are evicted)."""
        out: list[TierKey] = []
        for key in self._dirty:
            if len(out) >= n:
                break
            out.append(key)
        return out

    def evict_clean(self, n: int) -> list[Evicted]:
        """Evict up to `n` least recently used unpinned clean entries."""
        out: list[Evicted] = []
        while self._clean and len(out) < n:
            key, _ = self._clean.popitem(last=False)
            e = self._entries.pop(key)
            self._retract(key)
            self._free.append(e.slot)
            out.append(Evicted(key, e.slot, True))
        return out

    def evict(self, key: TierKey) -> Evicted | None:
        """Evict an unpinned READY entry now (None if it is pinned, reserved or gone)."""
        e = self._entries.get(key)
        if e is None or e.state is not State.READY or e.pins:
            return None
        del self._entries[key]
        self._retract(key)
        (self._clean if e.on_disk else self._dirty).pop(key, None)
        self._free.append(e.slot)
        return Evicted(key, e.slot, e.on_disk)

    def touch(self, keys: Sequence[TierKey]) -> int:
        """Loads made without a pin (through the directory): each unpinned READY entry
        among `keys` becomes the most recently used. Returns how many were held."""
        n = 0
        get, ready = self._entries.get, State.READY
        for key in keys:
            e = get(key)
            if e is None or e.state is not ready:
                continue
            n += 1
            if e.pins == 0:
                (self._clean if e.on_disk else self._dirty).move_to_end(key)
        return n

    def _retract(self, key: TierKey) -> None:
        if self._dir is not None:
            self._dir.retract(key)

    def _entry(self, key: TierKey) -> _HostEntry:
        e = self._entries.get(key)
        if e is None:
            raise KeyError(key)
        return e

    def keys(self) -> Iterator[TierKey]:
        return iter(self._entries)


@dataclass(slots=True)
class _DiskEntry:
    nbytes: int
    state: State
    readers: int = 0


class DiskIndex:
    """Files of the disk tier, bounded by `capacity` bytes (module docstring)."""

    __slots__ = ("_entries", "_lru", "capacity", "used")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity: Final = capacity
        self.used = 0
        self._entries: dict[TierKey, _DiskEntry] = {}
        self._lru: OrderedDict[TierKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def ready(self, key: TierKey) -> bool:
        e = self._entries.get(key)
        return e is not None and e.state is State.READY

    def ready_many(self, keys: Sequence[TierKey]) -> list[bool]:
        """`ready` of each key."""
        get, ready = self._entries.get, State.READY
        return [(e := get(k)) is not None and e.state is ready for k in keys]

    def nbytes(self, key: TierKey) -> int:
        e = self._entries.get(key)
        return 0 if e is None else e.nbytes

    def begin_write(self, key: TierKey, nbytes: int) -> list[TierKey] | Reserve:
        """A WRITING entry of `nbytes`; returns the READY entries evicted to make room
        (their files are to be deleted), or why not: HELD, or FULL (what is being read or
        written leaves no room; nothing was evicted)."""
        if key in self._entries:
            return Reserve.HELD
        if nbytes > self.capacity:
            return Reserve.FULL
        need = self.used + nbytes - self.capacity
        if need > 0:
            can = 0
            for old in self._lru:  # only as far as needed: amortized O(1) per eviction
                can += self._entries[old].nbytes
                if can >= need:
                    break
            if can < need:
                return Reserve.FULL
        evicted: list[TierKey] = []
        while self.used + nbytes > self.capacity:
            old, _ = self._lru.popitem(last=False)
            self.used -= self._entries.pop(old).nbytes
            evicted.append(old)
        self._entries[key] = _DiskEntry(nbytes, State.RESERVED)
        self.used += nbytes
        return evicted

    def finish_write(self, key: TierKey, ok: bool) -> None:
        """The file was renamed into place (ok) or removed (not ok)."""
        e = self._entries.get(key)
        if e is None or e.state is not State.RESERVED:
            raise ValueError(f"{key!r} is not being written")
        if ok:
            e.state = State.READY
            self._lru[key] = None
        else:
            del self._entries[key]
            self.used -= e.nbytes

    def add_existing(self, key: TierKey, nbytes: int) -> list[TierKey] | Reserve:
        """A file found at start (warm restart): READY at once, as the most recent."""
        got = self.begin_write(key, nbytes)
        if isinstance(got, list):
            self.finish_write(key, True)
        return got

    def pin(self, key: TierKey) -> bool:
        """A reader of a READY file (a use: it becomes the most recently used)."""
        e = self._entries.get(key)
        if e is None or e.state is not State.READY:
            return False
        if e.readers == 0:
            self._lru.pop(key, None)
        e.readers += 1
        return True

    def touch(self, keys: Sequence[TierKey]) -> int:
        """Files clients read without a pin (`kvd_client.tiers`' direct loads): each READY
        one with no reader becomes the most recently used. Returns how many are held."""
        n = 0
        get, ready = self._entries.get, State.READY
        for key in keys:
            e = get(key)
            if e is None or e.state is not ready:
                continue
            n += 1
            if e.readers == 0:
                self._lru.move_to_end(key)
        return n

    def unpin(self, key: TierKey) -> bool:
        """A reader is done. True: that was the last reader of a condemned file, which is
        forgotten now (delete it)."""
        e = self._entries.get(key)
        if e is None or e.readers <= 0:
            raise ValueError(f"{key!r} has no reader")
        e.readers -= 1
        if e.readers == 0 and e.state is State.READY:
            self._lru[key] = None
        elif e.readers == 0 and e.state is State.CONDEMNED:
            del self._entries[key]
            self.used -= e.nbytes
            return True
        return False

    def remove(self, key: TierKey) -> bool:
        """Forget a file that turned out bad. True: forgotten now (delete it). A file that
        still has readers is condemned instead (False): no longer ready (a miss, never
        pinned again), and forgotten by its last reader's `unpin`, which says so."""
        e = self._entries.get(key)
        if e is None or e.state is not State.READY:
            return False
        if e.readers:
            e.state = State.CONDEMNED
            return False
        del self._entries[key]
        self._lru.pop(key, None)
        self.used -= e.nbytes
        return True

    def keys(self) -> Iterator[TierKey]:
        return iter(self._entries)


class OpKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(slots=True)
class Op:
    """Pins held for a client: a store's reservations or a load's pins. `slots[i]` is
    key i's slot, or a negative wire code (held, refused, miss): nothing held for it."""

    op: int
    session: str
    kind: OpKind
    keys: list[TierKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    pending: set[tuple[TierKey, int]] = field(default_factory=set)
    """(key, slot) still being read from disk: released by the read's end, not here."""
    released: bool = False
    """Its pins were dropped (closed) while reads were pending."""
    waiting: list[int] = field(default_factory=list)
    """Indices of disk hits waiting for a free host slot to be read into."""
    answered: bool = False


class OpBook:
    """Operations by id and by session, each with a deadline (module docstring)."""

    __slots__ = ("_by_session", "_deadlines", "_next", "_ops")

    def __init__(self) -> None:
        self._ops: dict[int, Op] = {}
        self._by_session: dict[str, set[int]] = {}
        self._deadlines: TimerHeap[int] = TimerHeap()
        self._next = 0

    def __len__(self) -> int:
        return len(self._ops)

    def open(self, session: str, kind: OpKind, deadline: float) -> Op:
        self._next += 1
        op = Op(self._next, session, kind)
        self._ops[op.op] = op
        self._by_session.setdefault(session, set()).add(op.op)
        self._deadlines.set(op.op, deadline)
        return op

    def get(self, op: int) -> Op | None:
        return self._ops.get(op)

    def close(self, op: int) -> Op | None:
        """Remove and return the operation (None if unknown or already closed)."""
        got = self._ops.pop(op, None)
        if got is None:
            return None
        self._deadlines.discard(op)
        ids = self._by_session.get(got.session)
        if ids is not None:
            ids.discard(op)
            if not ids:
                del self._by_session[got.session]
        return got

    def of_session(self, session: str) -> list[int]:
        return sorted(self._by_session.get(session, ()))

    def next_deadline(self) -> float | None:
        return self._deadlines.next_time()

    def expired(self, now: float) -> list[int]:
        """Operations whose deadline passed (still open: the caller closes them)."""
        return [op for op, _ in self._deadlines.pop_due(now) if op in self._ops]


# ------------------------------------------------------------------ across nodes

_PEER_RANK: Final = {wire.TIER_HOST: 0, wire.TIER_DISK: 1}
"""A peer's host hit is preferred to another's disk hit (no disk read on its side)."""


def found_problem(found: bytes, n: int) -> str | None:
    """What is wrong with a peer's `TierFound` for a batch of `n` keys, or None."""
    if len(found) != n:
        return f"{len(found)} answers for {n} keys"
    if any(f not in (wire.TIER_MISS, wire.TIER_HOST, wire.TIER_DISK) for f in found):
        return "an answer that is not miss, host or disk"
    return None


def pick_peers(n: int, answers: dict[str, bytes]) -> list[str | None]:
    """Per key of a batch of `n`: the peer to load it from (None: no peer holds it).
    Among the peers that hold a key: a host hit before a disk hit, then the least agent
    name: deterministic, whatever order the (validated) answers arrived in."""
    out: list[str | None] = [None] * n
    best: list[tuple[int, str] | None] = [None] * n
    for agent, found in answers.items():
        for i, f in enumerate(found):
            if f == wire.TIER_MISS:
                continue
            cand = (_PEER_RANK[f], agent)
            b = best[i]
            if b is None or cand < b:
                best[i] = cand
                out[i] = agent
    return out


def pinned_problem(
    ans: wire.PeerTierPinned, n: int, slot_bytes: int, kinds: set[int]
) -> str | None:
    """What is wrong with a peer's `PeerTierPinned` for `n` keys of `slot_bytes` each (so
    that no descriptor is built from it), or None."""
    if len(ans.slots) != n:
        return f"{len(ans.slots)} slots for {n} keys"
    if len(ans.checksums) != 8 * n:
        return f"{len(ans.checksums)} checksum bytes for {n} keys"
    if ans.checksum_kind not in kinds:
        return f"unknown checksum kind {ans.checksum_kind}"
    if any(s != wire.SLOT_HELD for s in ans.slots) and ans.slot_bytes != slot_bytes:
        return f"slots of {ans.slot_bytes} bytes, not {slot_bytes}"
    if ans.pool_addr + ans.pool_bytes >= 1 << 63:
        return "a pool past the end of the address space"
    num_slots = ans.pool_bytes // slot_bytes
    for s in ans.slots:
        if s != wire.SLOT_HELD and not 0 <= s < num_slots:
            return f"slot {s} outside the pool's {num_slots} slots"
    return None


class PeerHints:
    """Which peer a lookup found each key on (the last `capacity` keys): the load that
    follows asks that peer. A stale hint costs a miss, never a wrong block."""

    __slots__ = ("_hints", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity: Final = capacity
        self._hints: OrderedDict[TierKey, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hints)

    def note(self, key: TierKey, agent: str) -> None:
        self._hints[key] = agent
        self._hints.move_to_end(key)
        while len(self._hints) > self.capacity:
            self._hints.popitem(last=False)

    def get(self, key: TierKey) -> str | None:
        return self._hints.get(key)

    def forget_peer(self, agent: str) -> int:
        """Drop every hint naming `agent` (it is gone); how many."""
        gone = [k for k, a in self._hints.items() if a == agent]
        for k in gone:
            del self._hints[k]
        return len(gone)
