"""The stage trace of one request: where its time goes, from D's call to D's event.

The daemons record (monotonic ns, request id, stage) while their trace is on
(`kvd.core.trace`; the stage names are those the daemon records); the client records
its call, the call's return and the event (`Timed`). Everything runs on one host, so
all share CLOCK_MONOTONIC. A request's records are joined by its two ids (P's and D's:
a message between the daemons is recorded under its sender's id) and each stage's time
is taken from the client's call.

`PUSH` and `PULL` list the stages on the request's path in order: a stage's "took" is
the time since the stage before it on the path. Stages off the path (P's own event, D's
heartbeat to P) name the stage they are measured from. Medians over the traced
requests, in microseconds: medians do not add up exactly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvd.bench.common import Timed, median
from kvd.core.trace import StageTrace


@dataclass(frozen=True)
class Stage:
    side: str
    """"client", "D" (the receiving daemon) or "P" (the sending one)."""
    name: str
    """The stage as recorded: `<actor or thread>.<what happened>`."""
    label: str
    after: str = ""
    """Off the request's path: the key of the stage it is measured from."""

    @property
    def key(self) -> str:
        return f"{self.side} {self.name}"


_CALL: Final = Stage("client", "call", "D's client calls register_push / pull")
_SENT: Final = Stage("client", "sent", "client: request encoded and queued to ZMQ (IPC)")
_ARRIVAL: Final = (
    Stage("D", "gateway.request", "client -> D gateway (ZMQ IPC), frame decoded"),
    Stage("D", "receiver.dequeued", "D receiver: request taken from its mailbox"),
)
_ADMITTED: Final = Stage(
    "D", "receiver.admitted", "D receiver: the turn ends (bounds checked, Ok to the client)"
)
"""With P's view at hand the request is resolved in the turn that admits it (before Ok)."""
_EVENT: Final = (
    Stage("D", "notifier.routed", "D notifier: decoded, routed to the receiver (loop hop)"),
    Stage("D", "receiver.notif_fed", "D receiver: completion (machine: FINISHED, event out)"),
    Stage("D", "gateway.event", "D gateway: RecvFinished handed to ZMQ (events mailbox)"),
    Stage("client", "event", "D -> client (ZMQ IPC): RecvFinished in hand"),
)

_P_WRITE: Final = (
    Stage("P", "nixl.picked", "P NIXL thread: picks the WRITE up"),
    Stage("P", "nixl.posted", "P NIXL thread: descriptor lists, transfer posted"),
    Stage("P", "nixl.done", "P NIXL thread: sees the WRITE (cma) complete"),
)
_P_RETURNED: Final = Stage(
    "P", "transfer.returned", "  off the path: P's WRITE completion back on its loop", "P nixl.done"
)

PUSH: Final[tuple[Stage, ...]] = (
    _CALL,
    _SENT,
    *_ARRIVAL,
    Stage("D", "receiver.resolved", "D receiver: HANDSHAKING, P's regions, registration"),
    _ADMITTED,
    Stage("D", "receiver.notif_handed", "D receiver: machine (REGISTERING), registration to NIXL"),
    Stage("D", "nixl.notif_picked", "D NIXL thread: picks the registration up (after the beat)"),
    Stage("P", "nixl.notif_polled", "D -> P notification (UCX), P's NIXL thread polled it"),
    Stage("P", "notifier.routed", "P notifier: decoded, routed to the sender (loop hop)"),
    Stage("P", "sender.view_resolved", "P sender: match (MATCHED), D's regions (held view)"),
    Stage("P", "sender.claimed", "P sender: lease claimed (WRITING), WRITE planned next"),
    Stage("P", "transfer.handed", "P sender: plan, WRITE handed to the NIXL thread"),
    *_P_WRITE,
    Stage("D", "nixl.notif_polled", "P -> D PushDone (UCX, with the WRITE), D polled it"),
    *_EVENT,
    Stage(
        "D",
        "receiver.beat_handed",
        "  off the path: D's heartbeat to P handed to NIXL",
        after="D receiver.admitted",
    ),
    Stage(
        "P",
        "sender.notif_fed",
        "  off the path: the turn that fed D's registration ends",
        after="P sender.claimed",
    ),
    _P_RETURNED,
    Stage(
        "P",
        "gateway.event",
        "  off the path: P's SendFinished handed to ZMQ",
        after="P transfer.returned",
    ),
)

PULL: Final[tuple[Stage, ...]] = (
    _CALL,
    _SENT,
    *_ARRIVAL,
    Stage("D", "receiver.resolved", "D receiver: HANDSHAKING, P's regions, READ planned"),
    Stage("D", "transfer.handed", "D receiver: machine (READING), READ to the NIXL thread"),
    Stage("D", "nixl.picked", "D NIXL thread: picks the READ up"),
    Stage("D", "nixl.posted", "D NIXL thread: descriptor lists, transfer posted"),
    Stage("D", "nixl.done", "D NIXL thread: the READ (cma) complete"),
    Stage("D", "transfer.returned", "D receiver: READ completion back on its loop"),
    Stage("D", "receiver.notif_handed", "D receiver: machine ACKING, PullDone to NIXL"),
    Stage("D", "nixl.notif_picked", "D NIXL thread: picks the PullDone up"),
    Stage("P", "nixl.notif_polled", "D -> P notification (UCX), P's NIXL thread polled it"),
    Stage("P", "notifier.routed", "P notifier: decoded, routed to the sender (loop hop)"),
    Stage("P", "sender.notif_fed", "P sender: lease held? (DELIVERED), PullAck, event out"),
    Stage("P", "sender.notif_handed", "P sender: PullAck handed to the NIXL thread"),
    Stage("P", "nixl.notif_picked", "P NIXL thread: picks the PullAck up"),
    Stage("D", "nixl.notif_polled", "P -> D PullAck (UCX), D's NIXL thread polled it"),
    *_EVENT,
    Stage(
        "D",
        "receiver.beat_handed",
        "  off the path: D's heartbeat to P handed to NIXL",
        after="D receiver.admitted",
    ),
    Stage(
        "D",
        "receiver.admitted",
        "  off the path: the turn ends (bounds checked, Ok to the client)",
        after="D receiver.resolved",
    ),
    Stage(
        "P",
        "gateway.event",
        "  off the path: P's SendFinished handed to ZMQ",
        after="P sender.notif_fed",
    ),
)

LAYERWISE: Final[tuple[Stage, ...]] = (
    Stage("client", "call", "P's worker announces the last layer (layers_saved)"),
    Stage("client", "sent", "worker: LayersSaved encoded and queued to ZMQ (IPC, one way)"),
    Stage("P", "gateway.request", "worker -> P gateway (ZMQ IPC), frame decoded"),
    Stage("P", "sender.layers_fed", "P sender: the notice fed to the machine (STREAMING)"),
    Stage("P", "transfer.handed", "P sender: the turn ends, the layer's WRITE handed over"),
    *_P_WRITE,
    Stage("D", "nixl.notif_polled", "P -> D LayersPushed (UCX, with the WRITE), D polled it"),
    *_EVENT,
    _P_RETURNED,
)
"""The path of a layer-wise push after its last layer: timed from the worker's last
`layers_saved` call, with the records of the last layer's WRITE (`last_layer`)."""

STAGES: Final = {"push": PUSH, "pull": PULL}
"""The control scenario's tables (the layer-wise scenario traces `LAYERWISE`)."""

Records = Mapping[str, Sequence[Sequence[Any]]]
"""Side ("P", "D") -> its daemon's records, each [t_ns, request id, stage]."""


def last_layer(records: Records, num_layers: int) -> dict[str, list[list[Any]]]:
    """The records of a layer-wise push with its last layer's WRITE under the request's id:
    a layer WRITE is recorded as `<request>/l<first>-<end>`; the one that ends at
    `num_layers` is renamed to `<request>`, the others are dropped (the layers before
    were written before the last one was announced)."""
    out: dict[str, list[list[Any]]] = {}
    tail = f"-{num_layers}"
    for side, recs in records.items():
        kept = out[side] = []
        for t, rid, stage in recs:
            base, cut, rng = str(rid).rpartition("/l")
            if not cut:
                kept.append([t, rid, stage])
            elif rng.endswith(tail):
                kept.append([t, base, stage])
    return out


def join(reqs: Sequence[Timed], records: Records) -> list[dict[str, int]]:
    """Per request: stage key -> ns since the client's call (a stage recorded more than
    once counts from its first time at or after the call)."""
    index: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for side, recs in records.items():
        for t, rid, stage in recs:
            index.setdefault((side, str(rid)), []).append((int(t), str(stage)))
    out = []
    for r in reqs:
        times = {"client call": 0, "client sent": r.sent - r.call, "client event": r.event - r.call}
        for side in records:
            for rid in (r.p_id, r.d_id):
                for t, stage in index.get((side, rid), ()):
                    key = f"{side} {stage}"
                    dt = t - r.call
                    if dt >= 0 and (key not in times or dt < times[key]):
                        times[key] = dt
        out.append(times)
    return out


def summarize(stages: Sequence[Stage], joined: Sequence[Mapping[str, int]]) -> list[dict[str, Any]]:
    """One row per stage: median "at" (since the call) and "took" (since the stage before
    it), in microseconds, and on how many requests it was seen."""
    rows = []
    path: list[str] = []
    for st in stages:
        ats = [j[st.key] for j in joined if st.key in j]
        before = [st.after] if st.after else list(reversed(path))
        tooks = []
        for j in joined:
            if st.key not in j:
                continue
            prev = next((k for k in before if k in j), None)
            if prev is not None:
                tooks.append(j[st.key] - j[prev])
        rows.append(
            {
                "stage": st.key,
                "label": st.label,
                "n": len(ats),
                "at_us": round(median(ats) / 1e3, 1),
                "took_us": round(median(tooks) / 1e3, 1),
                "on_path": not st.after,
            }
        )
        if not st.after:
            path.append(st.key)
    return rows


def complete(stages: Sequence[Stage], joined: Sequence[Mapping[str, int]]) -> int:
    """How many requests have every stage on the path."""
    keys = [st.key for st in stages if not st.after]
    return sum(1 for j in joined if all(k in j for k in keys))


def mark_cost(n: int = 200_000) -> dict[str, float]:
    """What one traced place costs in this interpreter, in ns: recording (the test, the
    clock, the append) and, with the trace off, the test alone."""
    tr = StageTrace(1 << 16, time.monotonic_ns)
    rid, stage = "ctl-push-d-1-0123abcd", "receiver.admitted"
    out = {}
    for name, on in (("mark_ns", True), ("off_ns", False)):
        tr.switch(on)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            if tr.on:
                tr.mark(rid, stage)
        out[name] = round((time.perf_counter_ns() - t0) / n, 1)
    return out
