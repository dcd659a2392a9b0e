"""kvd's configuration: one typed tree, loaded from TOML and validated once, at start.

Every setting is a field of a frozen dataclass (one per TOML table) with a default and a
doc string in its metadata, so `kvd serve` runs with no file at all. The reference table
in the README and `configs/kvd.example.toml` are rendered from these dataclasses
(`python -m kvd.config --reference` / `--example`), so code, docs and example cannot
drift. Values are checked when a section is built: a bad file fails at start, naming the
file and the dotted key, never later inside some actor. Nothing here does IO except
`load_config` (the file) and `AuthConfig.load_secret` (the secret).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import socket
import stat
import sys
import textwrap
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, NoReturn, get_type_hints

from kvd.core.addresses import host_problem, parse_peer_list

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB

DEFAULTS_SOURCE: Final = "<defaults>"
"""`ConfigError.source` when no file was read."""
CODE_SOURCE: Final = "<code>"
"""`ConfigError.source` for a section built directly in code with bad values."""

_SUN_PATH_MAX: Final = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
_NAME_RE: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "[::]", "*"})
_COMMENT_WIDTH: Final = 88

_Format = Literal["", "bytes", "mode"]
_Check = Callable[[Any], str | None]


class ConfigError(Exception):
    """A configuration that kvd refuses: a TOML syntax error, an unknown key, a bad value.

    `source` is the file (or `<defaults>` / `<code>`), `key` the dotted key at fault
    (empty when the fault is the file as a whole), `message` what is wrong with it.
    """

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source: Final = source
        self.key: Final = key
        self.message: Final = message
        super().__init__(f"{source}: {key}: {message}" if key else f"{source}: {message}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str]]:
        return (type(self), (self.source, self.key, self.message))

    def with_source(self, source: str) -> ConfigError:
        """The same error, blamed on `source`."""
        return ConfigError(source, self.key, self.message)

    def all(self) -> list[ConfigError]:
        """Every error found (one, unless this is a `ConfigErrors`)."""
        return [self]


class ConfigErrors(ConfigError):
    """Several errors in one file (`parse_config` reports all it finds, not only the
    first); `key` and `message` are the first's, `str()` lists them all, one per line."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        first = errors[0]
        super().__init__(first.source, first.key, first.message)
        self.errors: Final = tuple(errors)
        Exception.__init__(self, "\n".join(str(e) for e in errors))

    def __reduce__(self) -> Any:
        return (type(self), (self.errors,))

    def with_source(self, source: str) -> ConfigError:
        return ConfigErrors([e.with_source(source) for e in self.errors])

    def all(self) -> list[ConfigError]:
        return list(self.errors)


def _opt(
    default: Any,
    doc: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    choices: tuple[str, ...] = (),
    check: _Check | None = None,
    fmt: _Format = "",
) -> Any:
    """A config field: default, doc, and the declarative rules its value must meet.

    `check` is for rules that do not fit the others; it returns a message or None.
    `fmt` only changes how the default is rendered (`0o660`, `16 MiB`).
    """
    metadata = {
        "doc": doc,
        "gt": gt,
        "ge": ge,
        "le": le,
        "choices": choices,
        "check": check,
        "fmt": fmt,
    }
    return field(default=default, metadata=metadata)


def _check_name(value: str) -> str | None:
    if value and not _NAME_RE.fullmatch(value):
        return f"must be 1 to 64 of [A-Za-z0-9._-] (got {value!r})"
    return None


def _check_host(value: str) -> str | None:
    if not value or value != value.strip() or " " in value:
        return f"must be an address or host name without spaces (got {value!r})"
    return None


def _check_socket_path(value: str) -> str | None:
    if len(os.fsencode(value)) > _SUN_PATH_MAX:
        return f"must be at most {_SUN_PATH_MAX} bytes, the AF_UNIX limit (got {value!r})"
    if "\0" in value:
        return "must not contain NUL"
    return None


def _type_name(value: object) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table"}
    for typ, name in names.items():
        if type(value) is typ:
            return name
    if isinstance(value, Mapping):
        return "table"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


def _describe(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{_type_name(value)} {text}"


_FIELD_TYPES: dict[type, dict[str, type]] = {}


def _field_types(cls: type) -> dict[str, type]:
    """Field name -> type (str, int, float, bool) of a config dataclass, memoised."""
    types = _FIELD_TYPES.get(cls)
    if types is None:
        hints = get_type_hints(cls)
        types = _FIELD_TYPES[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return types


@dataclass(frozen=True)
class _Section:
    """Base of every section: checks each field against its type and rules on creation."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = self._checked(f, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        self._check_together()

    def _check_together(self) -> None:
        """Rules that involve more than one field of the section."""

    @classmethod
    def _fail(cls, name: str, message: str) -> NoReturn:
        raise ConfigError(CODE_SOURCE, f"{cls.SECTION}.{name}", message)

    @classmethod
    def field_errors(cls, table: Mapping[str, Any]) -> list[ConfigError]:
        """Every field of `table` (known keys only) that breaks its own rules."""
        errors = []
        for f in dataclasses.fields(cls):
            if f.name in table:
                try:
                    cls._checked(f, table[f.name])
                except ConfigError as exc:
                    errors.append(exc)
        return errors

    @classmethod
    def _checked(cls, f: dataclasses.Field[Any], value: Any) -> Any:
        shown = _render_value(f, value)  # as written, before an int becomes a float
        expected = _field_types(cls)[f.name]
        if expected is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                cls._fail(f.name, f"must be a number (got {_describe(value)})")
            value = float(value)
            if not math.isfinite(value):
                cls._fail(f.name, f"must be finite (got {value!r})")
        elif expected is int:
            if isinstance(value, bool) or not isinstance(value, int):
                cls._fail(f.name, f"must be an integer (got {_describe(value)})")
        elif expected is bool:
            if not isinstance(value, bool):
                cls._fail(f.name, f"must be true or false (got {_describe(value)})")
        elif expected is str:
            if not isinstance(value, str):
                cls._fail(f.name, f"must be a string (got {_describe(value)})")
        else:  # pragma: no cover - a field of a type this module does not handle
            raise TypeError(f"{cls.SECTION}.{f.name}: unsupported type {expected!r}")
        meta = f.metadata
        gt, ge, le = meta["gt"], meta["ge"], meta["le"]
        if (
            (gt is not None and not value > gt)
            or (ge is not None and value < ge)
            or (le is not None and value > le)
        ):
            cls._fail(f.name, f"must be {_range_text(f)} (got {shown})")
        choices: tuple[str, ...] = meta["choices"]
        if choices and value not in choices:
            hint = _did_you_mean(value, choices)
            cls._fail(f.name, f"must be one of {_choices_text(choices)} (got {shown}){hint}")
        check: _Check | None = meta["check"]
        if check is not None and (message := check(value)) is not None:
            cls._fail(f.name, message)
        return value


def _doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__ or "")


@dataclass(frozen=True)
class DaemonConfig(_Section):
    """The daemon process: its identity, the local IPC socket, actor mailboxes, shutdown."""

    SECTION: ClassVar[str] = "daemon"

    name: str = _opt(
        "",
        "NIXL agent name; must be unique among the daemons that talk to each other. "
        "Empty: `kvd-<hostname>-<side_channel.port>`, or `kvd-<hostname>-<pid>` when "
        "side_channel.port is 0. Letters, digits, `.`, `_` and `-`, at most 64 characters.",
        check=_check_name,
    )
    socket: str = _opt(
        "",
        "Path of the IPC socket that local clients connect to. Empty: "
        "`$XDG_RUNTIME_DIR/kvd/kvd.sock` when XDG_RUNTIME_DIR is set, else "
        "`/run/kvd/kvd.sock`. At most 107 bytes (the AF_UNIX limit).",
        check=_check_socket_path,
    )
    socket_mode: int = _opt(
        0o660,
        "File mode of the IPC socket; a client needs write permission on it to connect.",
        ge=0,
        le=0o777,
        fmt="mode",
    )
    client_timeout: float = _opt(
        10.0,
        "Seconds without any message from a client (idle clients ping) before its "
        "regions and requests are cleaned up (a frozen client; one whose connection is "
        "lost, e.g. killed, is cleaned up at once).",
        gt=0,
    )
    mailbox_size: int = _opt(
        1024,
        "Bound of the outside input (client requests, peers' heartbeats and probes) "
        "waiting in each actor's mailbox, and of the consumers' EC requests a producer "
        "serves at once: beyond it input is answered BUSY, never queued without bound. "
        "Notices between actors are never refused and do not count.",
        ge=1,
        le=1_000_000,
    )
    shutdown_timeout: float = _opt(
        5.0,
        "Seconds allowed for the shielded cleanup at shutdown (deregistering memory, "
        "releasing handles) before the daemon exits anyway.",
        gt=0,
    )
    max_frame_bytes: int = _opt(
        16 * MiB,
        "Largest message accepted on any socket, in bytes; a bigger one is rejected and "
        "counted. Above twice this, the transport drops the sender's connection before "
        "reading the message (counted as a lost connection).",
        ge=4096,
        le=GiB,
        fmt="bytes",
    )
    reap_leftover_segments: bool = _opt(
        True,
        "Remove host-staging segments that dead clients left in /dev/shm: at start, and "
        "when a client's session ends without its goodbye. Only a segment named by "
        "`kvd_client.shm.staging_name` in the daemon's pid namespace, owned by the "
        "daemon's user, whose creating process is gone and that no process maps or holds "
        "open. Off: such leftovers stay until removed by hand.",
    )
    trace_records: int = _opt(
        0,
        "Records kept by the stage trace (when each request passed each stage of the "
        "daemon, for `kvd bench`): a ring that drops the oldest first, read and cleared "
        "through the `trace` status section; the `trace_off` and `trace_on` sections "
        "switch it at run time. 0 = no ring.",
        ge=0,
        le=1_000_000,
    )
    trace_requests: int = _opt(
        4096,
        "Recent requests whose stages the daemon keeps for `kvd trace REQUEST_ID` (when "
        "the request passed each stage, at most 64 stages each, and the peer it was "
        "transferred with); the oldest request is forgotten first. Always on: a stage "
        "costs a few hundred ns, about 20 stages per request on each side. 0 = none "
        "(with trace_records 0, each traced place then costs one branch).",
        ge=0,
        le=1_000_000,
    )


@dataclass(frozen=True)
class SideChannelConfig(_Section):
    """The ZMQ TCP side channel to peer daemons: handshakes (agent metadata, region
    layout, compatibility hash)."""

    SECTION: ClassVar[str] = "side_channel"

    host: str = _opt("127.0.0.1", "Address the side channel binds to.", check=_check_host)
    port: int = _opt(
        5600, "TCP port of the side channel; 0 picks an ephemeral port.", ge=0, le=65535
    )
    advertise_host: str = _opt(
        "",
        "Address peers should use to reach this daemon: an IP address or an RFC 1123 "
        "host name (peers refuse to dial anything else). Empty: `host`. Required when "
        "`host` is a wildcard address (0.0.0.0, :: or *).",
    )
    handshake_timeout: float = _opt(
        5.0,
        "Seconds a handshake with a peer may take; then it fails, and so do the "
        "requests waiting on it.",
        gt=0,
    )
    forget_silent_peers: float = _opt(
        600.0,
        "Seconds a known peer may stay silent (its side channel unanswered, no "
        "notification from it) before the daemon forgets it: its NIXL entry, its view in "
        "every actor, the sockets to it; the next use handshakes afresh. Each peer's side "
        "channel is asked a small clock query every tenth of this (at most every 60 s); "
        "one that answers under another name is forgotten at once. A daemon gone for "
        "good is otherwise remembered, and redialed, forever. 0: never.",
        ge=0,
    )

    @property
    def advertised_host(self) -> str:
        """The address peers should connect to."""
        return self.advertise_host or self.host

    def _check_together(self) -> None:
        if self.advertise_host:
            if (message := _check_host(self.advertise_host)) is not None:
                self._fail("advertise_host", message)
            if self.advertise_host in _WILDCARD_HOSTS:
                self._fail(
                    "advertise_host",
                    f"must be an address peers can connect to (got {self.advertise_host!r})",
                )
        elif self.host in _WILDCARD_HOSTS:
            self._fail(
                "advertise_host",
                f"must be set when host is a wildcard address (host is {self.host!r})",
            )
        # Peers (and their clients' daemons) refuse to dial anything else, so a daemon
        # advertising it could never be reached: refuse it here, at start.
        if (why := host_problem(self.advertised_host)) is not None:
            key = "advertise_host" if self.advertise_host else "host"
            self._fail(key, f"must be an IP address or RFC 1123 host name peers can dial: {why}")


@dataclass(frozen=True)
class NixlConfig(_Section):
    """The NIXL agent this daemon owns."""

    SECTION: ClassVar[str] = "nixl"

    backend: str = _opt("UCX", "NIXL transfer backend. Only UCX is supported.", choices=("UCX",))
    ucx_error_handling_mode: str = _opt(
        "peer",
        "UCX error handling. `peer` detects a dead peer in about 10 ms and fails its "
        "transfers. `none` allows shared-memory active messages, but transfers to a dead "
        "peer (and shutdown) can then hang forever. Keep `peer`.",
        choices=("peer", "none"),
    )
    poll_max_idle_us: int = _opt(
        1000,
        "Longest pause, in microseconds, of the NIXL poll loop: it polls continuously "
        "while transfers are in flight and backs off up to this when idle, instead of "
        "spinning a core.",
        ge=10,
        le=100_000,
    )
    poll_deep_idle_us: int = _opt(
        100_000,
        "Longest pause, in microseconds, of the NIXL poll loop while the daemon has nothing "
        "going on at all (no request, encoder-cache fetch, tier operation or probe a "
        "notification or a peer's transfer could be for): an idle daemon then costs well "
        "under 1% of a core. Any input to the daemon (a client or peer message) ends the "
        "pause at once. Set it to `poll_max_idle_us` to never pause longer.",
        ge=10,
        le=1_000_000,
    )
    doorbell: bool = _opt(
        True,
        "Bind a UDP doorbell on the side channel's address and port (`side_channel.host`, "
        "`side_channel.port`; UDP, beside its TCP), said in the handshake: a peer rings it "
        "after each notification to this daemon, so an idle NIXL thread (backed off up to "
        "`poll_max_idle_us`) polls at once instead of at its next timed poll. Datagrams "
        "are empty and never read: one that is forged or lost costs one poll, or the "
        "timed wait. Where UDP between the daemons is filtered, nothing breaks.",
    )
    num_threads: int = _opt(
        0,
        "`num_threads` passed to the NIXL backend (UCX worker threads); 0 = the backend's default.",
        ge=0,
        le=1024,
    )
    ucx_tls: str = _opt(
        "",
        "If non-empty, the daemon sets UCX_TLS to this, e.g. `tcp` so that two network "
        "namespaces on one host behave as two hosts. Shared-memory-only values (`shm`, "
        "`posix,self`) fail at agent creation under `peer` error handling. Empty: "
        "UCX_TLS is left as the environment sets it.",
    )


@dataclass(frozen=True)
class TransferConfig(_Section):
    """KV transfers between prefill (P) and decode (D) daemons: leases, heartbeats,
    watchdogs."""

    SECTION: ClassVar[str] = "transfer"

    kv_lease_duration: float = _opt(
        30.0,
        "Seconds of the lease P grants on a request's blocks when its prefill finishes. D "
        "heartbeats every lease/6; each heartbeat extends the lease to max(current "
        "expiry, now + 2/3 x lease). When the lease expires P reclaims the blocks. Use "
        "the same value on P and D.",
        gt=0,
    )
    push_registration_timeout: float = _opt(
        480.0,
        "Seconds D keeps a push registration that never completes; then it withdraws it at "
        "P and fails the request once P confirms no WRITE into its blocks can still land "
        "(or P is gone, or P's settle bound passed: docs/late-writes.md).",
        gt=0,
    )
    decoder_kv_blocks_ttl: float = _opt(
        480.0,
        "Seconds D keeps a finished request's blocks for the next conversational turn "
        "(bidirectional KV: the engine's `keep`), so that the next turn's P pulls them "
        "instead of recomputing. A fixed lease: heartbeats do not extend it. When it "
        "expires the blocks go back to D's engine and a later pull fails (P recomputes). "
        "The default for a `keep` that names no TTL of its own.",
        gt=0,
        le=86400,
    )
    peer_probe_interval: float = _opt(
        1.0,
        "Seconds between D's checks that a P it waits on is alive; a dead P fails its "
        "requests within this plus NIXL's detection time.",
        gt=0,
    )
    transfer_timeout: float = _opt(
        30.0,
        "Seconds a posted transfer may stay in flight before kvd gives up on it. NIXL cannot "
        "cancel a posted transfer, so kvd reports it failed only once UCX has ended it: this "
        "is also UCX's bound on a silent peer (UCX_TCP_USER_TIMEOUT, with keepalive probes "
        "at half of it, unless set in the environment), so a transfer given up on ends "
        "within about twice this; one UCX still has not ended after 2 x this + 1 s is "
        "reported failed as unsettled and counted (its bytes may still land: docs/late-writes.md).",
        gt=0,
    )
    lease_wait_timeout: float = _opt(
        5.0,
        "Seconds P keeps D's pull completion that arrived before P's engine finished the "
        "request (D's READ overtook P's `finished` on its way to P's daemon), waiting for "
        "the lease; then the pull is refused and D fails the request.",
        gt=0,
    )
    expired_tombstones: int = _opt(
        65536,
        "How many expired request ids P remembers, so that a late registration or pull "
        "for one fails at once instead of waiting. 0 = remember none.",
        ge=0,
        le=100_000_000,
    )
    staging_bytes: int = _opt(
        256 << 20,
        "Bytes of staging (daemon-owned memory, registered with NIXL on first use). On D, a "
        "pull that slices heads (P TP != D TP) or converts the token layout (NHD/HND) READs "
        "whole chunks into a slot of it and scatters them into D's blocks; on P, a push "
        "whose direct plan has many small descriptors (head slices, token runs) is gathered "
        "into a slot in D's layout and WRITten as a few contiguous runs; each where that is "
        "cheaper than direct descriptors. A request that finds no slot free moves by direct "
        "descriptors instead. 0 = no staging.",
        ge=0,
        le=1 << 40,
        fmt="bytes",
    )
    pull_by: str = _opt(
        "auto",
        "How D's daemon moves a pull: `read` (NIXL READ of P's blocks), `write` (P's daemon "
        "WRITEs them into D's blocks when D asks, as for a push), or `auto`: read where UCX "
        "reads natively (both daemons on one machine with cma allowed, or both with an RDMA "
        "device and transport), write elsewhere. Over TCP UCX emulates a READ, and UCX 1.23 "
        "aborts the serving daemon when a reader dies with GET requests still queued at it "
        "(kvd.core.readpath).",
        choices=("auto", "read", "write"),
    )
    gather_part_bytes: int = _opt(
        8 << 20,
        "On P, a push gathered into staging (see staging_bytes) is WRITten in parts of about "
        "this many bytes (whole D blocks, at most 2 parts): a part's WRITE runs while the "
        "next part is gathered, and only the last one tells D the request is there. "
        "Measured on 2 cores, two parts of a 16 MiB push beat one, four and eight. "
        "0 = one WRITE after the whole gather.",
        ge=0,
        le=1 << 40,
        fmt="bytes",
    )


@dataclass(frozen=True)
class LimitsConfig(_Section):
    """Limits on what clients and peers may make the daemon hold. Beyond each, the input
    is refused with an error naming the limit (a client gets it as the reply or as its
    request's failed event; a peer's refused registration or pull is answered failed, so
    its D recomputes), counted, and shown with its current use in `kvd status`."""

    SECTION: ClassVar[str] = "limits"

    max_clients: int = _opt(
        1024,
        "Client sessions (engine schedulers and workers, `kvd` CLI calls) open at once; a "
        "Hello beyond it is refused (BUSY). CLI sessions may use 8 more, so the daemon can "
        "still be inspected at the limit.",
        ge=1,
        le=1_000_000,
    )
    pending_registrations_per_peer: int = _opt(
        16384,
        "Push registrations and pulls from one peer D that P keeps while P's engine has "
        "not finished the request; beyond it P answers the registration (or pull) failed "
        "at once, and D fails the request for its engine to recompute.",
        ge=1,
        le=100_000_000,
    )
    notifs_per_peer_per_s: float = _opt(
        100_000.0,
        "NIXL notifications accepted from one peer agent per second, with bursts of up "
        "to one second's worth; a peer's notifications beyond it are dropped and counted "
        "(set it well above the peer's real traffic: a dropped completion fails its "
        "request only when a watchdog fires).",
        ge=1,
        le=100_000_000,
    )
    pending_bytes: int = _opt(
        256 * MiB,
        "Estimated bytes of per-request state each transfer machine may hold (about 1 KiB "
        "plus 40 bytes per block id per request). P: leases, and registrations and pulls "
        "waiting for P's engine, charged as they are decoded (so also while they wait to "
        "be handled); D: requests tracked or receiving. Beyond it a new "
        "registration or pull is answered failed, and a client's finish, push "
        "registration or pull ends failed at once (its track is refused).",
        ge=64 * KiB,
        le=1024 * GiB,
        fmt="bytes",
    )
    notif_bytes: int = _opt(
        64 * MiB,
        "Estimated bytes of peers' decoded NIXL notifications waiting for the actor that "
        "handles them, bounded apart for heartbeats (P: each may name 65,536 requests) and "
        "for P's answers to D (push completions, layer notices, pull acks, re-sync "
        "requests), about 100 bytes per request id they name; one peer may hold at most "
        "half of each. Beyond it a notification is dropped and counted: a heartbeat's next "
        "one comes, and a D request whose answer was dropped ends failed at its watchdog "
        "(set it well above real traffic).",
        ge=64 * KiB,
        le=1024 * GiB,
        fmt="bytes",
    )
    handshake_bytes: int = _opt(
        64 * MiB,
        "Bytes of side-channel requests (peers' handshakes and region-drop notices) being "
        "served at once, each charged its frame's size twice (the frame and what it decodes "
        "to). Beyond it a request is answered BUSY at once and counted; one request is "
        "always admitted when none is in progress, so a handshake up to "
        "`daemon.max_frame_bytes` still passes.",
        ge=64 * KiB,
        le=1024 * GiB,
        fmt="bytes",
    )


@dataclass(frozen=True)
class AuthConfig(_Section):
    """Authentication of peer daemons."""

    SECTION: ClassVar[str] = "auth"

    secret_file: str = _opt(
        "",
        "Path of a shared secret (use an absolute path). When set, peers must prove they "
        "know it (HMAC-SHA256) or are refused: each handshake derives a session key for "
        "the two daemons, and every later peer message (NIXL notifications, region-drop "
        "notices) is sealed under it with a counter and admitted once; encoder-cache "
        "transfer requests are served once and their acks are MACed. The nodes' clocks "
        "must agree within 2 minutes. All daemons that exchange KV or encoder outputs "
        "need the same secret. The file must exist, be non-empty and have no group or "
        "other permissions (chmod 600); a trailing newline is ignored. Empty: peers are "
        "not authenticated (a warning at start, and `kvd status` says so).",
    )

    def load_secret(self) -> bytes | None:
        """The shared secret, or None when `secret_file` is empty.

        Raises ConfigError when the file is missing, unreadable, not a regular file,
        empty, or accessible by group or others.
        """
        if not self.secret_file:
            return None
        return _read_secret(self.secret_file)


def _read_secret(path: str) -> bytes:
    key = "auth.secret_file"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not hang us
    except FileNotFoundError:
        raise ConfigError(CODE_SOURCE, key, f"secret file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(
            CODE_SOURCE, key, f"cannot open secret file {path}: {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(CODE_SOURCE, key, f"secret file {path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ConfigError(
                CODE_SOURCE,
                key,
                f"secret file {path} is accessible by group or others (mode {mode:#o}); "
                f"run chmod 600 {path}",
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            secret = f.read().rstrip(b"\r\n")
    finally:
        os.close(fd)
    if not secret:
        raise ConfigError(CODE_SOURCE, key, f"secret file {path} is empty")
    return secret


@dataclass(frozen=True)
class LogConfig(_Section):
    """Logging."""

    SECTION: ClassVar[str] = "log"

    level: str = _opt("info", "Lowest level logged.", choices=("debug", "info", "warning", "error"))
    format: str = _opt(
        "auto",
        "Log format: `console`, `json`, or `auto` (console on a TTY, JSON otherwise).",
        choices=("auto", "json", "console"),
    )
    rejection_interval: float = _opt(
        10.0,
        "Seconds between log lines about the same kind of rejected input (malformed "
        "frames, refused requests and handshakes, lost connections) at the same place: "
        "the first is logged at once, then at most one summary line per interval with the "
        "number not logged. Every rejection is counted in `kvd status` either way.",
        gt=0,
        le=86_400,
    )


@dataclass(frozen=True)
class MetricsConfig(_Section):
    """The Prometheus metrics exporter."""

    SECTION: ClassVar[str] = "metrics"

    port: int = _opt(0, "Port of the Prometheus HTTP exporter; 0 = no exporter.", ge=0, le=65535)
    host: str = _opt("127.0.0.1", "Address the exporter binds to.", check=_check_host)


_EC_SERVES: Final = frozenset({"producer", "both"})


@dataclass(frozen=True)
class ECConfig(_Section):
    """Encoder-cache (EC) transfers: multimodal encoder outputs moved from encoder
    (producer) nodes to the nodes that consume them."""

    SECTION: ClassVar[str] = "ec"

    role: str = _opt(
        "none",
        "`none`: EC off. `producer`: serves encoder outputs (binds the EC router). "
        "`consumer`: fetches them from producers. `both`: both.",
        choices=("none", "producer", "consumer", "both"),
    )
    port: int = _opt(
        0,
        "TCP port of the EC router (ZMQ ROUTER) that producers bind on side_channel.host; "
        "0 picks an ephemeral port.",
        ge=0,
        le=65535,
    )
    region_bytes: int = _opt(
        256 * MiB,
        "Size in bytes of the EC shared region registered with NIXL when role is not "
        "`none`. A positive multiple of block_bytes.",
        gt=0,
        le=1024 * GiB,
        fmt="bytes",
    )
    block_bytes: int = _opt(
        MiB,
        "Size in bytes of one EC block, the unit of allocation and transfer.",
        gt=0,
        le=GiB,
        fmt="bytes",
    )
    xfer_timeout: float = _opt(
        10.0,
        "Seconds a consumer waits for a producer's transfer (XferAck) before failing it.",
        gt=0,
    )
    producer_socket_idle: float = _opt(
        300.0,
        "Seconds a consumer keeps its socket to a producer that no fetch needs and that "
        "it sent nothing on (then closed: a producer restarted at another address is "
        "not redialed for good; the next fetch from it opens another).",
        gt=0,
    )
    cache_blocks_reserve: int = _opt(
        0,
        "Blocks of the EC region that a consumer's cache of loaded encodings leaves free "
        "for incoming transfers; 0 = the cache may fill the region (its least recently "
        "used blocks are evicted under allocation pressure).",
        ge=0,
    )

    @property
    def num_blocks(self) -> int:
        """Blocks in the EC region."""
        return self.region_bytes // self.block_bytes

    def _check_together(self) -> None:
        if self.region_bytes % self.block_bytes:
            self._fail(
                "region_bytes",
                f"must be a multiple of ec.block_bytes ({self.block_bytes}) "
                f"(got {self.region_bytes})",
            )
        if self.cache_blocks_reserve > self.num_blocks:
            self._fail(
                "cache_blocks_reserve",
                f"must be at most the number of blocks in the region ({self.num_blocks}) "
                f"(got {self.cache_blocks_reserve})",
            )


@dataclass(frozen=True)
class TiersConfig(_Section):
    """KV tiers kept by the daemon for its engines (vLLM's secondary offloading tiers):
    a host-memory pool in shared memory and, optionally, a disk tier (`kvd tiers`)."""

    SECTION: ClassVar[str] = "tiers"

    enabled: bool = _opt(False, "Keep KV tiers (clients then may open them).")
    host_bytes: int = _opt(
        GiB,
        "Size in bytes of the host tier's shared-memory pool (registered with NIXL), cut "
        "into slots of the block size of the first client that opens it.",
        gt=0,
        le=4096 * GiB,
        fmt="bytes",
    )
    disk_path: str = _opt(
        "",
        "Directory of the disk tier's files (created if missing); empty = no disk tier. "
        "Its index is rebuilt from the files at start (a warm restart). One daemon per "
        "directory: a daemon holds its `.lock` while it runs, and another daemon given "
        "the same directory does not start (`tiers_disk_in_use`).",
    )
    disk_bytes: int = _opt(
        16 * GiB,
        "Most bytes the disk tier's files may take (least recently used files are "
        "deleted to make room).",
        ge=0,
        le=1 << 50,
        fmt="bytes",
    )
    disk_checksum: str = _opt(
        "sum64",
        "Checksum kept with each disk block and checked on every load (a mismatch is a "
        "miss, the file removed and counted): `sum64` (the 64-bit sum of the block's "
        "words, at about memory speed: catches flipped bits, zeroed or cut data), `crc32` "
        "(stronger, ~2 GB/s per core), or `none` (only the length is checked).",
        choices=("sum64", "crc32", "none"),
    )
    disk_client_reads: bool = _opt(
        True,
        "Engines on this node read disk-tier hits straight from the block files into "
        "their own memory and check them (one pass over the bytes, no round trip: a file "
        "is immutable once in place); they need read access to `disk_path`, else they "
        "load through the host pool as when this is off (read into a slot, checked, "
        "copied out).",
    )
    promote_on_hit: bool = _opt(
        True,
        "A disk-tier or peer-tier block that is loaded stays in the host tier afterwards "
        "(off: it is read into a slot for that load only).",
    )
    demote_on_evict: bool = _opt(
        True,
        "Host-tier blocks are written to the disk tier before they are evicted (ahead of "
        "need, once fewer than `low_water` slots are free); off: they are dropped.",
    )
    low_water: float = _opt(
        0.05,
        "Fraction of the host pool's slots kept free by demoting (or dropping) its least "
        "recently used blocks in the background.",
        ge=0,
        le=0.9,
    )
    pin_timeout: float = _opt(
        30.0,
        "Seconds a client's reservation (store) or pin (load) is held before the daemon "
        "drops it (it is dropped at once when the client's session ends).",
        gt=0,
    )
    lookup_timeout: float = _opt(
        2.0,
        "Seconds a client waits for a lookup batch's answer (told to clients; a late "
        "answer counts as all-miss).",
        gt=0,
    )
    peers: str = _opt(
        "",
        "Peer daemons whose tiers a local miss is looked up in: their side channels as "
        "`host:port`, separated by commas (handshaked at start and retried while they do "
        "not answer). Empty: none (see `ask_known_peers`).",
        check=lambda v: p if isinstance(p := parse_peer_list(v), str) else None,
    )
    ask_known_peers: bool = _opt(
        False,
        "Also look local misses up in the tiers of every peer daemon this one has "
        "handshaked with (P/D peers, EC peers), besides `peers`.",
    )
    peer_lookup_timeout: float = _opt(
        0.2,
        "Seconds a lookup waits for the peers' answers (only when some key missed "
        "locally); a peer that has not answered by then is a miss for that batch.",
        gt=0,
        le=60,
    )
    peer_read_timeout: float = _opt(
        2.0,
        "Seconds a load allows a peer to pin its hits, and then the NIXL READ of them; "
        "past either the keys are misses (the vLLM side recomputes them). Keep twice it "
        "below the clients' load timeout (`transfer_timeout` of the vLLM tier, 5 s).",
        gt=0,
    )
    peer_pin_timeout: float = _opt(
        10.0,
        "Seconds this daemon holds the pins a peer's load took on its blocks, unless the "
        "peer releases them first (or is known to be gone or restarted). Must exceed "
        "`peer_read_timeout`.",
        gt=0,
    )

    peer_pin_share: float = _opt(
        0.5,
        "The most of the host tier's blocks that one peer's loads may hold pinned here at "
        "once (a fraction); a peer's load beyond it finds misses (counted "
        "`tiers_peer_pins_refused`), so that a peer cannot pin the whole tier.",
        gt=0,
        le=1,
    )

    def _check_together(self) -> None:
        if self.peer_pin_timeout <= self.peer_read_timeout:
            self._fail(
                "peer_pin_timeout",
                f"must exceed tiers.peer_read_timeout ({self.peer_read_timeout}) "
                f"(got {self.peer_pin_timeout})",
            )

    @property
    def peer_addrs(self) -> list[tuple[str, int]]:
        got = parse_peer_list(self.peers)
        assert not isinstance(got, str)  # checked at creation
        return got


@dataclass(frozen=True)
class Config:
    """The whole configuration of one kvd daemon."""

    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    side_channel: SideChannelConfig = field(default_factory=SideChannelConfig)
    nixl: NixlConfig = field(default_factory=NixlConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    ec: ECConfig = field(default_factory=ECConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)

    def __post_init__(self) -> None:
        for name, cls in _section_types().items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(CODE_SOURCE, name, f"must be a {cls.__name__}")
        self._check_ports()

    def _check_ports(self) -> None:
        """No two listeners of this daemon may ask for the same fixed port."""
        listeners = [("side_channel.port", self.side_channel.host, self.side_channel.port)]
        if self.ec.role in _EC_SERVES:
            listeners.append(("ec.port", self.side_channel.host, self.ec.port))
        listeners.append(("metrics.port", self.metrics.host, self.metrics.port))
        for i, (key, host, port) in enumerate(listeners):
            for other_key, other_host, other_port in listeners[:i]:
                same_host = host == other_host or bool({host, other_host} & _WILDCARD_HOSTS)
                if port and port == other_port and same_host:
                    raise ConfigError(
                        CODE_SOURCE, key, f"port {port} is already taken by {other_key}"
                    )


def _section_types() -> dict[str, type[_Section]]:
    return _field_types(Config)


# --- loading -----------------------------------------------------------------------------


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read and validate the TOML file at `path`; None gives the defaults (no file read)."""
    if path is None:
        return parse_config({}, DEFAULTS_SOURCE)
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read config: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "", f"invalid TOML: not UTF-8 ({exc.reason})") from None
    return parse_config(data, source)


def parse_config(data: Mapping[str, Any], source: str) -> Config:
    """Build a validated `Config` from parsed TOML; errors are blamed on `source`.

    Every error is reported, not only the first (`ConfigErrors` when there are several):
    unknown sections and keys, and each value that breaks its rules. The rules that
    relate fields (within a section, then across sections, and the secret file) are
    checked once every value on its own is right."""
    sections = _section_types()
    built: dict[str, _Section] = {}
    errors: list[ConfigError] = []
    for raw_name, table in data.items():
        name = str(raw_name)
        cls = sections.get(name)
        if cls is None:
            errors.append(ConfigError(source, name, "unknown section" + _suggest_section(name)))
            continue
        if not isinstance(table, Mapping):
            errors.append(ConfigError(source, name, f"must be a table (got {_describe(table)})"))
            continue
        known = list(_field_types(cls))
        bad = [e.with_source(source) for e in cls.field_errors(table)]
        for raw_key in table:
            key = str(raw_key)
            if key not in known:
                hint = _did_you_mean(key, known)
                bad.append(ConfigError(source, f"{name}.{key}", "unknown key" + hint))
        if bad:
            errors += bad
            continue
        try:
            built[name] = cls(**table)
        except ConfigError as exc:
            errors.append(exc.with_source(source))
    if not errors:
        try:
            config = Config(**built)  # type: ignore[arg-type]
            config.auth.load_secret()  # validated at start, not at the first handshake
        except ConfigError as exc:
            errors.append(exc.with_source(source))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
    return config


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    same_but_case = [c for c in candidates if c.lower() == word.lower()]
    close = same_but_case or difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _suggest_section(name: str) -> str:
    owners = [s for s, cls in _section_types().items() if name in _field_types(cls)]
    if len(owners) == 1:
        return f" (did you mean {owners[0]}.{name}, under [{owners[0]}]?)"
    return _did_you_mean(name, list(_section_types()))


# --- derived values ----------------------------------------------------------------------


def resolve_socket_path(cfg: Config) -> Path:
    """The IPC socket path: daemon.socket, else under $XDG_RUNTIME_DIR, else /run/kvd."""
    if cfg.daemon.socket:
        return Path(cfg.daemon.socket)
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return Path(runtime_dir) / "kvd" / "kvd.sock"
    return Path("/run/kvd/kvd.sock")


def resolve_agent_name(cfg: Config, *, hostname: str | None = None, pid: int | None = None) -> str:
    """The NIXL agent name: daemon.name, else `kvd-<hostname>-<port or pid>`."""
    if cfg.daemon.name:
        return cfg.daemon.name
    suffix = str(cfg.side_channel.port or (pid if pid is not None else os.getpid()))
    host = re.sub(r"[^A-Za-z0-9._-]", "_", hostname or socket.gethostname()) or "localhost"
    host = host[: 64 - len("kvd--") - len(suffix)]
    return f"kvd-{host}-{suffix}"


# --- rendering: reference table and example file -----------------------------------------


def _render_value(f: dataclasses.Field[Any], value: Any) -> str:
    """`value` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int) and f.metadata.get("fmt") == "mode":
        return f"{value:#o}"
    if isinstance(value, int) and f.metadata.get("fmt") == "bytes":
        return f"{value:_}"
    return repr(value)


def _render_bound(f: dataclasses.Field[Any], bound: float) -> str:
    if f.metadata["fmt"] == "mode":
        return f"{int(bound):#o}" if bound else "0"
    if f.metadata["fmt"] == "bytes":
        return _human_bytes(int(bound))
    if isinstance(bound, int) and bound >= 100_000:
        return f"{bound:_}"
    return f"{bound:g}"


def _range_text(f: dataclasses.Field[Any]) -> str:
    """The field's bounds in words: `> 0`, `>= 0`, `between 1 and 1_000_000`."""
    gt, ge, le = f.metadata["gt"], f.metadata["ge"], f.metadata["le"]
    if ge is not None and le is not None:
        return f"between {_render_bound(f, ge)} and {_render_bound(f, le)}"
    parts = []
    if gt is not None:
        parts.append(f"> {_render_bound(f, gt)}")
    if ge is not None:
        parts.append(f">= {_render_bound(f, ge)}")
    if le is not None:
        parts.append(f"<= {_render_bound(f, le)}")
    return " and ".join(parts)


def _choices_text(choices: tuple[str, ...]) -> str:
    return ", ".join(json.dumps(c) for c in choices)


def _human_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _rules_text(f: dataclasses.Field[Any]) -> str:
    meta = f.metadata
    rules = []
    if meta["choices"]:
        rules.append(f"One of {_choices_text(meta['choices'])}.")
    if (bounds := _range_text(f)) != "":
        rules.append(f"Must be {bounds}.")
    return " ".join(rules)


def _full_doc(f: dataclasses.Field[Any]) -> str:
    doc: str = f.metadata["doc"]
    rules = _rules_text(f)
    return f"{doc} {rules}" if rules else doc


def _default(f: dataclasses.Field[Any]) -> Any:
    assert f.default is not dataclasses.MISSING, f"{f.name} has no default"
    return f.default


def _all_fields() -> list[tuple[str, type[_Section], dataclasses.Field[Any]]]:
    return [
        (section, cls, f)
        for section, cls in _section_types().items()
        for f in dataclasses.fields(cls)
    ]


def config_keys() -> list[str]:
    """Every dotted key kvd accepts, in file order."""
    return [f"{section}.{f.name}" for section, _, f in _all_fields()]


def config_reference_markdown() -> str:
    """A markdown table of every setting: key, type, default and doc."""
    lines = ["| Key | Type | Default | Description |", "|---|---|---|---|"]
    for section, cls, f in _all_fields():
        typ = _field_types(cls)[f.name].__name__
        default = f"`{_render_value(f, _default(f))}`"
        if f.metadata["fmt"] == "bytes":
            default += f" ({_human_bytes(_default(f))})"
        doc = _full_doc(f).replace("|", "\\|")
        lines.append(f"| `{section}.{f.name}` | {typ} | {default} | {doc} |")
    return "\n".join(lines) + "\n"


def _comment(text: str) -> list[str]:
    return ["# " + line for line in textwrap.wrap(text, width=_COMMENT_WIDTH - 2)]


def example_toml() -> str:
    """A commented example config with every key at its default."""
    lines = _comment(
        "kvd configuration. Generated from kvd/config.py by `python -m kvd.config "
        "--example`. Every key is optional; each is shown here with its default."
    )
    for section, cls in _section_types().items():
        lines += ["", *_comment(_doc(cls)), f"[{section}]"]
        for f in dataclasses.fields(cls):
            lines += ["", *_comment(_full_doc(f)), f"{f.name} = {_render_value(f, _default(f))}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvd.config`: print the reference or the example, or check a file."""
    parser = argparse.ArgumentParser(
        prog="python -m kvd.config", description="kvd configuration reference and checks"
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--reference", action="store_true", help="print the markdown table")
    action.add_argument("--example", action="store_true", help="print the example TOML")
    action.add_argument("--check", metavar="PATH", help="validate a config file")
    args = parser.parse_args(argv)
    if args.reference:
        sys.stdout.write(config_reference_markdown())
    elif args.example:
        sys.stdout.write(example_toml())
    else:
        try:
            load_config(args.check)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{args.check}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
