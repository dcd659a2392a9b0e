"""Messages between kvd's actors (in-process only; the wire format is kvd_client.wire).

Commands are imperative, notices past tense. A message that expects an answer is a
`Call` and carries its own reply future. Region and peer views handed across actors are
frozen snapshots: the registrar owns the live state and publishes copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvd_client import wire

from kvd.actors.base import Call, Outside
from kvd.core.hybrid import Group
from kvd.core.limits import Reservation
from kvd.core.planner import Geometry
from kvd.core.timeline import ClockOffset

# ------------------------------------------------------------------ shared views


@dataclass(frozen=True)
class LocalRegion:
    """A region this daemon registered with NIXL, as other actors may see it."""

    region_id: int
    generation: int
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    layout: wire.RegionLayout
    compat: str
    session: str
    name: str
    mem_type: str = "DRAM"
    device: int = 0
    groups: tuple[Group, ...] = ()
    """KV cache groups of a hybrid region (`kvd.core.hybrid`); () for a plain one."""


@dataclass(frozen=True)
class RemoteRegion:
    region_id: int
    generation: int
    engine_id: str
    tp_rank: int
    tp_size: int
    geometry: Geometry
    compat: str
    mem_type: str = "DRAM"
    device: int = 0
    layout: wire.RegionLayout | None = None
    groups: tuple[Group, ...] = ()
    """KV cache groups of a hybrid region (`kvd.core.hybrid`); () for a plain one."""


@dataclass(frozen=True)
class PeerInfo:
    """What a handshake taught us about a peer daemon."""

    agent: str
    incarnation: int
    host: str
    port: int
    lease_duration: float
    regions: dict[tuple[str, int], RemoteRegion]
    canary_addr: int
    canary_bytes: int
    handshaked_at: float
    write_bound: float = 0.0
    """How long a WRITE of its may still land after its lease lapsed (0: not said)."""
    native_reads: bool = False
    """Our UCX READs from it natively (`kvd.core.readpath`): else a pull goes by P's WRITE
    (`transfer.pull_by = "auto"`)."""

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    def ranks(self, engine_id: str) -> list[RemoteRegion]:
        """The engine's regions ordered by rank (only complete sets are usable)."""
        regs = sorted(
            (r for (e, _), r in self.regions.items() if e == engine_id), key=lambda r: r.tp_rank
        )
        return regs


# ------------------------------------------------------------------ from the gateway


@dataclass
class ClientRequest(Outside, Call[wire.Record]):
    """A decoded, validated client request routed to the actor that owns it."""

    session: str
    msg: wire.Record


@dataclass
class PeerTierRequest(Outside, Call[wire.Record]):
    """Side channel -> tiers: a peer daemon's tier request (authenticated when a shared
    secret is set: `agent` is then the peer its session key belongs to)."""

    agent: str
    msg: wire.PeerTierLookup | wire.PeerTierPin | wire.PeerTierUnpin


@dataclass(frozen=True)
class TiersTouched:
    """Gateway -> tiers: a client's `TierTouch` (one-way, never answered: the blocks it
    loaded through the directory, for the tiers' recency and counters)."""

    session: str
    msg: wire.TierTouch


@dataclass(frozen=True)
class FinishNotTaken:
    """Gateway -> sender: a client's finish was refused before it reached the sender (its
    mailbox was full: the engine got BUSY, its client reports SendFailed). A notice,
    never refused, so that D's registration or pull for the request fails at once
    instead of waiting for a finish that will not come (`kvd.core.sender.FinishRefused`)."""

    request_id: str
    code: int
    error: str
    """Why it was refused (the error the engine got)."""


@dataclass(frozen=True)
class AbortNotTaken:
    """Gateway -> sender or receiver: a client's abort found the actor's mailbox full. A
    notice, never refused, carried out as the abort would have been: an abort sheds
    load, and one dropped would leave the request waiting on its own bounds (a push
    registration: `transfer.push_registration_timeout`) while the engine waits for its
    terminal event."""

    session: str
    request_id: str


@dataclass(frozen=True)
class LoadNotTaken:
    """Gateway -> receiver: a client's registration or pull was refused BUSY (the
    receiver's mailbox full; its client reports RecvFailed). A notice, never refused, so
    that a track of the request stops heartbeating P's lease
    (`Receiver._drop_refused_track`)."""

    session: str
    request_id: str


@dataclass(frozen=True)
class LayersAnnounced(Outside):
    """Gateway -> sender: a worker's one-way `LayersSaved` (never answered; refused and
    counted when the mailbox is full: the request's finish writes what it named)."""

    session: str
    msg: wire.LayersSaved


@dataclass
class SessionClosed(Call[None]):
    """A client said goodbye, stopped pinging or was replaced: end everything it announced.

    The owner resolves it only once nothing can still transfer from or into the blocks
    the session's requests named (the gateway declares the session closed after every
    owner answered; only then may its client reuse those blocks).

    `client_gone`: it ended without the client's goodbye (timed out, or replaced because
    its process is gone): the registrar may then remove the staging segments its regions
    left (`kvd.adapters.shm.reap_segments` decides; a live client's are kept)."""

    session: str
    client_gone: bool = False
    timed_out: bool = False
    """It stopped pinging: its process may still run (frozen, or starved) and touch what
    it was given (the tiers keep slots it may write into out of use: `kvd.actors.tiers`)."""
    pid: int = 0
    """The client's process (its Hello), 0 if unknown."""


@dataclass
class Snapshot(Call[dict[str, Any]]):
    section: str


@dataclass(frozen=True)
class EventOut:
    """An event for the client session that announced the request (and the engine's workers)."""

    session: str
    engine_id: str
    record: wire.Record


# ------------------------------------------------------------------ registrar


@dataclass
class EnsurePeer(Call[PeerInfo]):
    """Handshake with the daemon at host:port unless cached (refresh=True forces one)."""

    host: str
    port: int
    refresh: bool = False
    not_before: float | None = None
    """A refresh: a handshake already in flight that started after this daemon
    time answers it too (the caller found its view stale at that time: whatever made it
    stale happened before, so that handshake's answer shows it). None: only a handshake
    started for this call."""


@dataclass(frozen=True)
class ClockReading:
    """A peer's clock minus ours (`kvd.core.timeline`) and when ours (ns) read it."""

    offset: ClockOffset
    measured_ns: int


@dataclass
class PeerClock(Call[ClockReading]):
    """The peer agent's clock offset, measured within `max_age_s` (measured now if not:
    raises when it cannot be, or the agent is not a peer)."""

    agent: str
    max_age_s: float


@dataclass
class RegisterDaemonRegion(Call[LocalRegion]):
    """A region the daemon itself owns (the EC region), registered like a worker's."""

    request: wire.RegisterRegion


@dataclass
class AcceptHandshake(Outside, Call[wire.Record]):
    """A handshake request that arrived on the side channel."""

    request: wire.Handshake


@dataclass
class PeerRegionDropped(Outside, Call[None]):
    """A peer says one of its regions is going away (raises AuthError if it cannot prove it)."""

    notice: wire.RegionDropped


@dataclass(frozen=True)
class ProbeReceived(Outside):
    agent: str
    probe: wire.Probe


@dataclass
class PingPeerCmd(Call[dict[str, Any]]):
    host: str
    port: int
    timeout: float


@dataclass
class TraceCmd(Call[dict[str, Any]]):
    """`kvd trace`: our stage records of a request, and the peer's if `peer`."""

    request_id: str
    peer: bool
    timeout: float


@dataclass(frozen=True)
class PeerUpdated:
    """Registrar -> sender and receiver: a peer's view changed (None = forgotten)."""

    agent: str
    info: PeerInfo | None


@dataclass(frozen=True)
class LocalRegionsChanged:
    """Registrar -> sender, receiver and EC router: the current set of local regions."""

    regions: dict[tuple[str, int], LocalRegion]


# ------------------------------------------------------------------ sender and receiver


@dataclass(frozen=True)
class NotifReceived:
    """Notifier -> owner: one decoded notification from a peer agent (an answer to our own
    transfer, a registration, a cancel): never refused. A registration or pull for the
    sender carries the bytes the notifier reserved for it (`kvd.core.limits`): the sender
    hands it to its machine, or releases it if it drops the message. A notice for the
    receiver carries its `limits.notif_bytes` reservation, released once handled."""

    agent: str
    msg: wire.Record
    reservation: Reservation | None = None


@dataclass(frozen=True)
class HeartbeatReceived(Outside):
    """Notifier -> sender: a peer's heartbeat (refused when the mailbox is full: the next
    one comes), with the bytes the notifier reserved for it (`limits.notif_bytes`),
    released by the sender once it has handled it."""

    agent: str
    msg: wire.Heartbeat
    reservation: Reservation | None = None


@dataclass(frozen=True)
class PeerLost:
    """A peer agent is unreachable: fail what waits on it, forget its view."""

    agent: str
    reason: str
    since: float = float("inf")
    """`handshaked_at` of the peer view the failure was seen through: requests bound to a
    later handshake (a restarted peer of the same name) are not affected."""
    endpoint: bool = False
    """Only our NIXL endpoint to it failed (a transfer's PeerDisconnected), nothing says
    it is gone: a peer that dialed us is kept (the engine mends the endpoint)."""


@dataclass
class DrainRemoteRegion(Call[None]):
    """Before a peer frees a region, finish or fail every transfer that touches it."""

    agent: str
    region_id: int


@dataclass
class DrainLocalRegion(Call[None]):
    """Before we free a local region, finish or fail every transfer that touches it."""

    region_id: int


# ------------------------------------------------------------------ operations (drain, abort)


@dataclass
class StartDrain(Call[None]):
    """Daemon -> sender and receiver: the daemon goes out of service (the machines'
    `StartDrain`). Resolved once nothing of the actor's is in flight; a notice between
    actors, never refused."""


@dataclass
class AbortByOperator(Outside, Call[dict[str, Any]]):
    """`kvd abort`: end the request by hand on this actor's side. Resolved with the state
    it was in; fails NotFound when the actor holds no such request."""

    request_id: str
