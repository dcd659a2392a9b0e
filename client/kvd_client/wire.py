"""kvd's wire protocol: every message, local (client <-> daemon) and peer (daemon <-> daemon).

Rules:
- Every message is a frozen, typed record registered here with a stable numeric type id.
- Encoding is msgpack, never pickle: ``[PROTOCOL_VERSION, type_id, corr, field...]``.
  ``corr`` correlates a request with its reply (0 for events and notifications). Nested
  records are encoded as the list of their fields. Block-id lists travel as packed
  little-endian int32 bytes (``BlockIds``), so a million ids cost one memcpy.
- Decoding is total: any byte string either yields a record or raises exactly
  ``RemoteProtocolError`` (``VersionMismatch`` for a foreign version). Sizes are bounded
  before anything is allocated (msgpack limits) and every field is type-checked.
- Pure functions only: no sockets, no clocks. The daemon and the thin client both import
  this module; it depends on msgpack alone.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from array import array
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Final, TypeVar, Union, get_args, get_origin

import msgpack

from kvd_client.errors import ErrorCode, RemoteProtocolError, VersionMismatch

PROTOCOL_VERSION: Final = 13
"""4: the handshake says how long its WRITEs may still land (`Handshake.write_bound`).
8: an encoder-cache request names its consumer's incarnation (`ECXferReq.incarnation`).
10: a pull may be served by P's WRITE (`PushRegistration.p_block_ids`); the handshake says
where its daemon runs and how its UCX may READ (`Handshake.machine`, `Handshake.rdma`,
`Handshake.cma`), and a tier load from a peer may ask for the blocks inline
(`PeerTierPin.inline`)."""
DEFAULT_MAX_FRAME: Final = 16 * 1024 * 1024
MAX_ID_LEN: Final = 512
MAX_STR_LEN: Final = 4096
MAX_LIST_LEN: Final = 1 << 18
MAX_BLOCK_IDS: Final = 1 << 21
"""2 Mi ids (8 MiB packed): a maximal id list always fits in a default frame."""
MAX_CONTAINERS: Final = 1 << 18
"""Lists and maps one frame may create: caps the memory a hostile frame of empty
containers could cost (about 64 bytes of Python object per byte of msgpack)."""


@dataclasses.dataclass(frozen=True)
class Len:
    """Bounds on the length of a str, bytes or list field (inclusive)."""

    min: int = 0
    max: int = MAX_STR_LEN


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds on an int or float field (inclusive)."""

    min: float
    max: float


class _Packed:
    """Marker: a tuple of int32 ids sent as packed little-endian bytes."""


PACKED: Final = _Packed()

Id = Annotated[str, Len(1, MAX_ID_LEN)]
"""A request or engine id: 1..512 characters."""
OptId = Annotated[str, Len(0, MAX_ID_LEN)]
"""An id that may be empty ("" = not given)."""
Text = Annotated[str, Len(0, MAX_STR_LEN)]
U16 = Annotated[int, Range(0, 0xFFFF)]
U32 = Annotated[int, Range(0, 0xFFFFFFFF)]
U64 = Annotated[int, Range(0, 0xFFFFFFFFFFFFFFFF)]
I64 = Annotated[int, Range(-(1 << 63), (1 << 63) - 1)]
Count = Annotated[int, Range(0, 1 << 40)]
NonNegFloat = Annotated[float, Range(0.0, 1e12)]
BlockIds = Annotated[tuple[int, ...], PACKED, Len(0, MAX_BLOCK_IDS)]
"""Block ids, each a signed int32 on the wire (range checks against regions come later)."""
Blob = Annotated[bytes, Len(0, 8 * 1024 * 1024)]
Info = Annotated[dict[str, Any], Len(0, 1 << 16)]
"""A free-form map (status reports), only from the daemon to its CLI."""

T = TypeVar("T", bound="Record")


class Record:
    """Base of every wire record. Subclasses are frozen dataclasses with a TYPE id."""

    TYPE: ClassVar[int] = 0
    __dataclass_fields__: ClassVar[dict[str, Any]]


_REGISTRY: dict[int, type[Record]] = {}
_Codec = tuple[Callable[[Any], Any], Callable[[Any, str], Any]]
_CODECS: dict[type[Record], list[tuple[str, _Codec]]] = {}


def message(type_id: int) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a top-level wire message with a stable id."""

    def wrap(cls: type[T]) -> type[T]:
        if type_id in _REGISTRY:
            raise RuntimeError(f"duplicate wire type id {type_id}")
        cls.TYPE = type_id
        _REGISTRY[type_id] = cls
        return cls

    return wrap


def _fail(where: str, what: str) -> typing.NoReturn:
    raise RemoteProtocolError(f"{where}: {what}")


def _codec_for(tp: Any) -> _Codec:
    """Build (encode, decode) functions for one annotated field type."""
    meta: tuple[Any, ...] = ()
    if get_origin(tp) is Annotated:
        tp, *rest = get_args(tp)
        meta = tuple(rest)
    length = next((m for m in meta if isinstance(m, Len)), None)
    rng = next((m for m in meta if isinstance(m, Range)), None)
    packed = any(isinstance(m, _Packed) for m in meta)
    origin = get_origin(tp)

    if packed:
        max_n = length.max if length else MAX_BLOCK_IDS

        def enc_packed(v: Any) -> Any:
            a = array("i", v)
            if sys.byteorder != "little":
                a.byteswap()
            return a.tobytes()

        def dec_packed(v: Any, where: str) -> Any:
            if not isinstance(v, bytes) or len(v) % 4:
                _fail(where, "expected packed int32 bytes")
            if len(v) // 4 > max_n:
                _fail(where, f"too many ids ({len(v) // 4} > {max_n})")
            a = array("i")
            a.frombytes(v)
            if sys.byteorder != "little":
                a.byteswap()
            return tuple(a)

        return enc_packed, dec_packed

    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp}")
        inner_enc, inner_dec = _codec_for(args[0])

        def dec_opt(v: Any, where: str) -> Any:
            return None if v is None else inner_dec(v, where)

        return (lambda v: None if v is None else inner_enc(v)), dec_opt

    if tp is bool:

        def dec_bool(v: Any, where: str) -> Any:
            if not isinstance(v, bool):
                _fail(where, f"expected bool, got {type(v).__name__}")
            return v

        return (lambda v: v), dec_bool

    if tp is int:
        lo, hi = (rng.min, rng.max) if rng else (-(1 << 63), (1 << 64) - 1)

        def dec_int(v: Any, where: str) -> Any:
            if not isinstance(v, int) or isinstance(v, bool):
                _fail(where, f"expected int, got {type(v).__name__}")
            if not lo <= v <= hi:
                _fail(where, f"{v} out of range [{lo}, {hi}]")
            return v

        return (lambda v: v), dec_int

    if tp is float:
        flo, fhi = (rng.min, rng.max) if rng else (float("-inf"), float("inf"))

        def dec_float(v: Any, where: str) -> Any:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _fail(where, f"expected float, got {type(v).__name__}")
            f = float(v)
            if f != f or not flo <= f <= fhi:
                _fail(where, f"{v} out of range [{flo}, {fhi}]")
            return f

        return (lambda v: v), dec_float

    if tp in (str, bytes):
        lmin, lmax = (length.min, length.max) if length else (0, MAX_STR_LEN)

        def dec_sb(v: Any, where: str) -> Any:
            if not isinstance(v, tp):
                _fail(where, f"expected {tp.__name__}, got {type(v).__name__}")
            if not lmin <= len(v) <= lmax:
                _fail(where, f"length {len(v)} outside [{lmin}, {lmax}]")
            return v

        return (lambda v: v), dec_sb

    if origin in (list, tuple):
        seq_args = get_args(tp)
        item = seq_args[0]
        if origin is tuple and (len(seq_args) != 2 or seq_args[1] is not Ellipsis):
            raise TypeError(f"only tuple[T, ...] is supported, not {tp}")
        item_enc, item_dec = _codec_for(item)
        lmax = length.max if length else MAX_LIST_LEN
        lmin = length.min if length else 0

        def dec_seq(v: Any, where: str) -> Any:
            if not isinstance(v, list):
                _fail(where, f"expected list, got {type(v).__name__}")
            if not lmin <= len(v) <= lmax:
                _fail(where, f"length {len(v)} outside [{lmin}, {lmax}]")
            return tuple(item_dec(x, f"{where}[{i}]") for i, x in enumerate(v))

        return (lambda v: [item_enc(x) for x in v]), dec_seq

    if origin is dict:
        lmax = length.max if length else MAX_LIST_LEN

        def dec_map(v: Any, where: str) -> Any:
            if not isinstance(v, dict):
                _fail(where, f"expected map, got {type(v).__name__}")
            if len(v) > lmax or not all(isinstance(k, str) for k in v):
                _fail(where, "bad map")
            return v

        return plain, dec_map

    if isinstance(tp, type) and issubclass(tp, Record):
        sub = tp

        def dec_rec(v: Any, where: str) -> Any:
            return _decode_fields(sub, v, where)

        return (lambda v: _encode_fields(v)), dec_rec

    raise TypeError(f"unsupported wire field type {tp!r}")


def plain(value: Any) -> Any:
    """A free-form value as msgpack-safe plain data: map keys become str, tuples lists."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    return str(value)


def _codecs(cls: type[Record]) -> list[tuple[str, _Codec]]:
    got = _CODECS.get(cls)
    if got is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        got = [(f.name, _codec_for(hints[f.name])) for f in dataclasses.fields(cls)]  # type: ignore[arg-type,unused-ignore]
        _CODECS[cls] = got
    return got


def _encode_fields(rec: Record) -> list[Any]:
    return [enc(getattr(rec, name)) for name, (enc, _) in _codecs(type(rec))]


def _decode_fields(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, list):
        _fail(where, f"expected a {cls.__name__} record (list)")
    codecs = _codecs(cls)
    if len(raw) != len(codecs):
        _fail(where, f"{cls.__name__} has {len(codecs)} fields, got {len(raw)}")
    values = {
        name: dec(v, f"{cls.__name__}.{name}")
        for (name, (_, dec)), v in zip(codecs, raw, strict=True)
    }
    return cls(**values)


def encode(msg: Record, corr: int = 0) -> bytes:
    """Encode a registered message. Raises TypeError for unregistered records (our bug)."""
    cls = type(msg)
    if _REGISTRY.get(cls.TYPE) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered wire message")
    out = msgpack.packb([PROTOCOL_VERSION, cls.TYPE, corr, *_encode_fields(msg)], use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode(data: bytes, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[int, Record]:
    """Decode one frame into (corr, message). Raises RemoteProtocolError, nothing else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RemoteProtocolError("frame is not bytes")
    if len(data) > max_frame:
        raise RemoteProtocolError(f"frame of {len(data)} bytes exceeds the {max_frame}-byte limit")
    budget = [MAX_CONTAINERS]

    def count(obj: Any) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError("too many containers")
        return obj

    try:
        raw = msgpack.unpackb(
            data,
            list_hook=count,
            object_hook=count,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_frame,
            max_bin_len=max_frame,
            max_array_len=MAX_LIST_LEN,
            max_map_len=1 << 16,
            max_ext_len=0,
        )
    except RemoteProtocolError:
        raise
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise RemoteProtocolError(f"malformed msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, list) or len(raw) < 3:
        raise RemoteProtocolError("frame is not a [version, type, corr, ...] array")
    version, type_id, corr = raw[0], raw[1], raw[2]
    if not isinstance(version, int) or isinstance(version, bool):
        raise RemoteProtocolError("protocol version is not an int")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version} is not {PROTOCOL_VERSION}")
    if not isinstance(type_id, int) or isinstance(type_id, bool) or type_id not in _REGISTRY:
        raise RemoteProtocolError(f"unknown message type {type_id!r}")
    if not isinstance(corr, int) or isinstance(corr, bool) or not 0 <= corr < (1 << 64):
        raise RemoteProtocolError("bad correlation id")
    cls = _REGISTRY[type_id]
    try:
        return corr, _decode_fields(cls, raw[3:], cls.__name__)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # a validator bug must still surface as one error type
        raise RemoteProtocolError(f"invalid {cls.__name__}: {exc}") from None


def registry() -> Mapping[int, type[Record]]:
    """Every registered message type, by id (for tests and docs)."""
    return dict(_REGISTRY)


# --------------------------------------------------------------------------------------
# Shared nested records
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RegionLayout(Record):
    """How a KV region is laid out. Address of (block b, layer l, part k) =
    base + b*block_stride + l*layer_stride + k*kv_stride; each chunk is chunk_bytes."""

    num_blocks: Annotated[int, Range(1, 1 << 31)]
    num_layers: Annotated[int, Range(1, 1 << 16)]
    kv_parts: Annotated[int, Range(1, 2)]
    chunk_bytes: Annotated[int, Range(1, 1 << 40)]
    block_stride: Annotated[int, Range(0, 1 << 48)]
    layer_stride: Annotated[int, Range(0, 1 << 48)]
    kv_stride: Annotated[int, Range(0, 1 << 48)]
    tokens_per_block: Annotated[int, Range(1, 1 << 20)]
    physical_per_logical: Annotated[int, Range(1, 1 << 10)]
    kv_layout: Annotated[str, Len(1, 16)]
    """Token layout inside a chunk: "NHD" or "HND" (part of compatibility)."""
    dtype: Annotated[str, Len(1, 32)]


@dataclasses.dataclass(frozen=True)
class StateShard(Record):
    """One TP-sharded piece of a state part: `units` units of the model's whole state (heads,
    groups, channels), each `unit_bytes` bytes in a rank's chunk. Split over the ranks
    evenly (units >= TP: rank r holds units [r*units/TP, (r+1)*units/TP)) or replicated
    (units < TP: rank r holds unit r // (TP/units)), as vLLM shards heads and groups."""

    units: Annotated[int, Range(1, 1 << 24)]
    unit_bytes: Annotated[int, Range(1, 1 << 32)]


@dataclasses.dataclass(frozen=True)
class StatePart(Record):
    """How TP cuts one part of a state group's chunk (a conv state, an SSM state): its
    `shards` one after another, repeated `rows` times (a conv state stored as
    [kernel - 1][channels] has rows = kernel - 1; stored [channels][kernel - 1], rows = 1
    and the history inside `unit_bytes`)."""

    rows: Annotated[int, Range(1, 1 << 16)]
    shards: Annotated[tuple[StateShard, ...], Len(1, 16)]


@dataclasses.dataclass(frozen=True)
class KvGroup(Record):
    """One KV cache group of a hybrid region (a model with several groups: full attention,
    sliding window, Mamba/DeltaNet-style state). The group's chunks lie at `offset` bytes
    from the region's base, laid out by `layout` (its own blocks, layers, chunk size, block
    size and token layout). Its logical block ids follow the previous groups' in the
    region's id space (group g's ids start at the sum of the earlier groups' block counts).

    kind "full": every block of a request moves. "window": only the blocks inside the
    last `window_tokens` tokens move (`kvd_client.layout.window_blocks`). "state": one
    chunk per layer per state slot (not paged by tokens); a request's slots move whole."""

    kind: Annotated[str, Len(1, 16)]
    window_tokens: U32
    """Sliding window in tokens (kind "window"; 0 otherwise)."""
    offset: Annotated[int, Range(0, 1 << 48)]
    layout: RegionLayout
    compat: Annotated[str, Len(1, 128)]
    """The group's format: a KV spec (`kvd_client.layout.kv_spec`) for attention groups,
    a state spec (`kvd_client.layout.state_spec`) for state groups."""
    parts: Annotated[tuple[StatePart, ...], Len(0, 8)] = ()
    """(State groups) how TP cuts a chunk: these parts one after another (every chunk of
    the group alike; e.g. a conv state, then an SSM state). With it, a state group maps
    across TP (`kvd.core.hybrid`); without, only rank i to rank i at equal TP."""


@dataclasses.dataclass(frozen=True)
class RegionInfo(Record):
    """A region as a peer sees it after a handshake."""

    region_id: U32
    generation: U32
    engine_id: Id
    tp_rank: U16
    tp_size: U16
    base_addr: U64
    nbytes: U64
    mem_type: Annotated[str, Len(1, 8)]
    """NIXL memory type: "DRAM" (host staging) or "VRAM" (GPU memory)."""
    device: Annotated[int, Range(0, 1 << 10)]
    layout: RegionLayout
    compat: Annotated[str, Len(0, 128)]
    nixl_md: Blob
    """Partial NIXL metadata for this region (loaded incrementally by the peer)."""
    groups: Annotated[tuple[KvGroup, ...], Len(0, 64)] = ()
    """KV cache groups of a hybrid region (empty: one group, the region itself)."""


# --------------------------------------------------------------------------------------
# Client <-> daemon (local control plane, ZMQ ipc://)
# --------------------------------------------------------------------------------------


@message(1)
@dataclasses.dataclass(frozen=True)
class Hello(Record):
    """First message of a session. `role`: scheduler, worker or cli."""

    session: Id
    role: Annotated[str, Len(1, 16)]
    engine_id: OptId
    tp_rank: Annotated[int, Range(-1, 0xFFFF)]
    pid: U32
    client_version: Annotated[str, Len(0, 64)]


@message(2)
@dataclasses.dataclass(frozen=True)
class Welcome(Record):
    daemon_version: Annotated[str, Len(0, 64)]
    agent_name: Id
    side_host: Text
    side_port: U16
    kv_lease_duration: NonNegFloat
    ec_host: Text
    ec_port: U16
    incarnation: U64
    """Random per daemon start (as in the peer handshake): a P engine puts it in
    kv_transfer_params, so that D fails at once a request whose P daemon restarted."""
    client_timeout: NonNegFloat
    push_registration_timeout: NonNegFloat
    decoder_kv_blocks_ttl: NonNegFloat = 0.0
    """Seconds D keeps a finished request's blocks for the next turn (`Finish.keep_for`
    when the client names none); 0 = a daemon that does not keep them."""


@message(3)
@dataclasses.dataclass(frozen=True)
class KeepAlive(Record):
    """Sent by the client's keep-alive thread; no reply."""

    session: Id


@message(4)
@dataclasses.dataclass(frozen=True)
class Goodbye(Record):
    """A clean close: the daemon releases the session's regions and requests."""

    session: Id


@message(5)
@dataclasses.dataclass(frozen=True)
class Ok(Record):
    """Generic success reply."""


@message(6)
@dataclasses.dataclass(frozen=True)
class ErrorReply(Record):
    code: U16
    message: Text

    @classmethod
    def of(cls, code: ErrorCode, message: str) -> ErrorReply:
        return cls(int(code), message[:MAX_STR_LEN])


@message(10)
@dataclasses.dataclass(frozen=True)
class RegisterRegion(Record):
    """Register a worker's KV region. kind "shm": `name` is a POSIX shm name
    (mapped read-write by the daemon). kind "cuda-ipc": `ipc_handle` is a CUDA IPC handle.
    `compat` (layout.compat_hash) must not be empty: the daemon refuses that."""

    kind: Annotated[str, Len(1, 16)]
    name: Annotated[str, Len(0, 255)]
    nbytes: Annotated[int, Range(1, 1 << 44)]
    engine_id: Id
    tp_rank: U16
    tp_size: Annotated[int, Range(1, 0xFFFF)]
    layout: RegionLayout
    compat: Annotated[str, Len(0, 128)]
    ipc_handle: Annotated[bytes, Len(0, 4096)]
    device: Annotated[int, Range(-1, 1 << 10)]
    groups: Annotated[tuple[KvGroup, ...], Len(0, 64)] = ()
    """KV cache groups of a hybrid region (`KvGroup`); then `layout` must be
    `kvd_client.layout.hybrid_layout(groups)` (the region's block id space)."""


@message(11)
@dataclasses.dataclass(frozen=True)
class RegionRegistered(Record):
    region_id: U32
    generation: U32


@message(12)
@dataclasses.dataclass(frozen=True)
class DeregisterRegion(Record):
    region_id: U32


@message(20)
@dataclasses.dataclass(frozen=True)
class Track(Record):
    """D: a request that will load remote KV arrived; heartbeat P from now on."""

    request_id: Id
    engine_id: Id
    peer_host: Text
    peer_port: U16
    remote_engine_id: OptId
    remote_request_id: OptId
    remote_incarnation: U64 = 0
    """P daemon's incarnation from kv_transfer_params; 0 = not known (no check)."""


@message(21)
@dataclasses.dataclass(frozen=True)
class RegisterPush(Record):
    """D (push mode): these preallocated logical blocks await P's WRITE."""

    request_id: Id
    engine_id: Id
    block_ids: BlockIds
    peer_host: Text
    peer_port: U16
    remote_engine_id: OptId
    remote_request_id: OptId
    remote_incarnation: U64 = 0
    """P daemon's incarnation from kv_transfer_params; 0 = not known (no check)."""
    remote_session: OptId = ""
    """P client session that finished the request (kv_transfer_params); "" = not known. P's
    daemon fails the request at once if that session has ended."""
    num_tokens: U64 = 0
    """The request's tokens the blocks hold (what P computed; 0 = not said). Needed only
    by a sliding-window group whose block sizes differ between P and D (it places the
    window's blocks, `kvd.core.hybrid`)."""


@message(22)
@dataclasses.dataclass(frozen=True)
class Pull(Record):
    """D (pull mode): READ P's logical `remote_block_ids` into local `block_ids`.
    Empty lists mean a full local hit: only tell P to free."""

    request_id: Id
    engine_id: Id
    block_ids: BlockIds
    peer_host: Text
    peer_port: U16
    remote_engine_id: OptId
    remote_request_id: Id
    remote_block_ids: BlockIds
    remote_incarnation: U64 = 0
    """P daemon's incarnation from kv_transfer_params; 0 = not known (no check)."""
    remote_session: OptId = ""
    """P client session that finished the request (kv_transfer_params); "" = not known. P's
    daemon fails the request at once if that session has ended."""
    num_tokens: U64 = 0
    """The request's tokens the blocks hold (what P computed; 0 = not said). Needed only
    by a sliding-window group whose block sizes differ between P and D (it places the
    window's blocks, `kvd.core.hybrid`)."""


@message(23)
@dataclasses.dataclass(frozen=True)
class Finish(Record):
    """P: prefill finished; hold these logical blocks under a lease until sent.

    With `keep_for` > 0 (bidirectional KV), D: decode finished; keep these blocks for the
    next conversational turn, whose P pulls them, under a fixed lease of `keep_for`
    seconds that heartbeats do not extend. Ends like a P's lease: SendFinished (pulled),
    SendExpired or SendFailed."""

    request_id: Id
    engine_id: Id
    block_ids: BlockIds
    keep_for: Annotated[float, Range(0.0, 86400.0)] = 0.0
    num_tokens: U64 = 0
    """The request's tokens the blocks hold (what P computed; 0 = not said). Needed only
    by a sliding-window group whose block sizes differ between P and D (it places the
    window's blocks, `kvd.core.hybrid`)."""


@message(24)
@dataclasses.dataclass(frozen=True)
class Abort(Record):
    """Give up on a request: `side` "send" (P's engine) or "recv" (D's)."""

    request_id: Id
    engine_id: Id
    side: Annotated[str, Len(4, 4)]


@dataclasses.dataclass(frozen=True)
class SavedRequest(Record):
    """One request in a `LayersSaved`: P's id and its logical blocks, as the worker copied them."""

    request_id: Id
    block_ids: BlockIds


@message(29)
@dataclasses.dataclass(frozen=True)
class LayersSaved(Record):
    """P's worker (one way, corr 0, never answered): rank `tp_rank` of `engine_id` has the
    first `layers` layers of these requests' blocks in host memory. Cumulative, so any one
    message says everything so far; a lost or refused one only delays the WRITE to P's
    `finished` (which writes whatever was not announced)."""

    engine_id: Id
    tp_rank: U16
    layers: Annotated[int, Range(1, 1 << 16)]
    requests: Annotated[tuple[SavedRequest, ...], Len(1, 1 << 14)]


@message(30)
@dataclasses.dataclass(frozen=True)
class GetStatus(Record):
    """section: status, peers, leases, transfers, ec, or trace (the daemon's stage-trace
    records, which leave its ring; trace_on and trace_off switch recording)."""

    section: Annotated[str, Len(1, 32)]


@message(31)
@dataclasses.dataclass(frozen=True)
class StatusReply(Record):
    data: Info


@message(32)
@dataclasses.dataclass(frozen=True)
class PingPeer(Record):
    host: Text
    port: U16
    timeout: Annotated[float, Range(0.001, 3600.0)]


@message(36)
@dataclasses.dataclass(frozen=True)
class GetTrace(Record):
    """`kvd trace`: the daemon's stage records of one request (StatusReply), and with
    `peer` also those of the peer daemon it was transferred with, asked over the side
    channel within `timeout` seconds."""

    request_id: Id
    peer: bool
    timeout: Annotated[float, Range(0.001, 3600.0)]


@message(34)
@dataclasses.dataclass(frozen=True)
class Drain(Record):
    """Operator (role cli): take the daemon out of service. No new lease or transfer is
    accepted (each refused at once, on both sides, so D recomputes); what is leased or
    in flight runs to its end. `timeout` (0 = none) bounds the wait; `exit` ends the
    daemon once drained (or at the timeout). Answered at once (StatusReply, the drain
    state); `GetStatus("drain")` follows it."""

    timeout: Annotated[float, Range(0.0, 86400.0)]
    exit: bool


@message(35)
@dataclasses.dataclass(frozen=True)
class AbortRequest(Record):
    """Operator (role cli): end a stuck request by hand, on whichever side (P sending, D
    receiving) this daemon holds it; its engine gets the failure event. Answered with a
    StatusReply naming what was ended on each side."""

    request_id: Id


# Events: daemon -> client, corr = 0. Past tense.


@message(40)
@dataclasses.dataclass(frozen=True)
class SendFinished(Record):
    """P: the request's blocks were delivered (or needed no transfer); free them."""

    request_id: Id


@message(41)
@dataclasses.dataclass(frozen=True)
class RecvFinished(Record):
    """D: every byte of the request's blocks arrived."""

    request_id: Id


@message(42)
@dataclasses.dataclass(frozen=True)
class RecvFailed(Record):
    """D: the transfer failed; `block_ids` (logical) must be recomputed."""

    request_id: Id
    code: U16
    reason: Text
    block_ids: BlockIds


@message(43)
@dataclasses.dataclass(frozen=True)
class SendFailed(Record):
    """P: the request ended without a completed transfer (aborted, peer died); free."""

    request_id: Id
    code: U16
    reason: Text


@message(44)
@dataclasses.dataclass(frozen=True)
class SendExpired(Record):
    """P: the request's lease expired without a transfer; its blocks may be freed."""

    request_id: Id


# --------------------------------------------------------------------------------------
# Daemon <-> daemon: side channel (ZMQ tcp) and NIXL notifications
# --------------------------------------------------------------------------------------


@message(60)
@dataclasses.dataclass(frozen=True)
class Handshake(Record):
    """Side channel request and reply: who I am and what I expose."""

    agent_name: Id
    incarnation: U64
    """Random per daemon start: a restarted peer with the same name is a new peer."""
    nixl_md: Blob
    side_host: Text
    side_port: U16
    kv_lease_duration: NonNegFloat
    write_bound: NonNegFloat
    """Seconds after the last heartbeat it got for a push that a WRITE of this daemon may
    still land (its lease, post fence, transfer and settle bounds): how long a D that gave
    up on a push it registered here holds the blocks without its word. 0: not said."""
    regions: Annotated[tuple[RegionInfo, ...], Len(0, 4096)]
    canary_addr: U64
    canary_bytes: U32
    nonce: Annotated[bytes, Len(16, 64)]
    timestamp: NonNegFloat
    mac: Annotated[bytes, Len(0, 64)]
    machine: U64 = 0
    """UCX's id of the machine the daemon runs on (0: not known): peers on one machine
    READ each other natively (cma); `kvd.core.readpath`."""
    rdma: bool = False
    """The daemon's UCX may reach other hosts over an RDMA transport (a device is there
    and `UCX_TLS` allows one): between two such daemons a READ is native, elsewhere UCX
    emulates it over TCP and kvd pulls by P's WRITE instead."""
    cma: bool = False
    """The daemon's `UCX_TLS` allows `cma`: two daemons on one machine READ natively only
    if both do."""
    doorbell: bool = False
    """The daemon wakes its NIXL thread on a UDP datagram to side_host:side_port: ring it
    after each notification to it (`kvd.adapters.doorbell`)."""
    """HMAC-SHA256 over the fields above when a shared secret is configured."""


@message(61)
@dataclasses.dataclass(frozen=True)
class PushRegistration(Record):
    """PUSH_REG (notification D -> P): D's blocks for one request."""

    request_id: Id
    remote_request_id: OptId
    engine_id: Id
    remote_engine_id: OptId
    tp_size: Annotated[int, Range(1, 0xFFFF)]
    block_ids: BlockIds
    side_host: Text
    side_port: U16
    """D's side channel, where P re-handshakes if its view of D's regions is stale."""
    incarnation: U64
    """D's daemon incarnation."""
    generations: Annotated[tuple[U32, ...], Len(1, 4096)]
    """Generation of D's region of each rank, in rank order: P WRITEs only if its view of
    D has exactly these (else it handshakes with D again, then fails closed)."""
    p_session: OptId
    """P's client session that finished the request ("" = not known): if it has ended, the
    request will never be finished, and P fails the registration at once."""
    num_tokens: U64 = 0
    """D's `RegisterPush.num_tokens` (0 = not said)."""
    p_incarnation: U64 = 0
    """The incarnation of P's daemon that D's engine was told leased the request
    (kv_transfer_params' `remote_incarnation`; 0 = not known): a P daemon of another
    incarnation (it restarted since: the lease and the KV are gone) fails the
    registration at once, whatever view of P D held when it sent it."""
    p_block_ids: BlockIds = ()
    """A pull served by P's WRITE (`kvd.core.readpath`): the P blocks D's engine pulls
    (each one P leased for the request), in the order of `block_ids`. Empty: a push, P
    WRITEs every block it finished (their tail into D's)."""


@message(62)
@dataclasses.dataclass(frozen=True)
class Heartbeat(Record):
    """HB (notification D -> P): extend the leases of these requests."""

    request_ids: Annotated[tuple[Id, ...], Len(0, 1 << 16)]


@message(63)
@dataclasses.dataclass(frozen=True)
class PushDone(Record):
    """P -> D: WRITE number `tp_rank` of the request into D's blocks finished (ok) or
    failed. A request's WRITEs are one per pair of memory types (usually one for all TP
    ranks, `kvd.actors.transfers.transfer_groups`); D counts them; a failure may name 0."""

    request_id: Id
    tp_rank: U16
    ok: bool
    code: U16
    reason: Text


@message(64)
@dataclasses.dataclass(frozen=True)
class PullDone(Record):
    """D -> P: D finished READing P's blocks of `request_id` (P's id)."""

    request_id: Id
    d_request_id: Id
    generations: Annotated[tuple[U32, ...], Len(0, 4096)]
    """Generation of P's region of each rank that D READ from (empty: D read nothing). P
    acknowledges only if they are its regions' current generations: a READ through a
    stale view of P is never reported done."""
    p_session: OptId
    """P's client session that finished the request ("" = not known): if it has ended and
    no lease is held, P refuses at once instead of waiting for a finish."""
    p_incarnation: U64 = 0
    """As `PushRegistration.p_incarnation`: a P daemon of another incarnation refuses at
    once instead of waiting for a finish that went to the daemon before it."""


@message(65)
@dataclasses.dataclass(frozen=True)
class PullAck(Record):
    """P -> D: were the blocks still leased when D's READ finished (fail closed)?"""

    d_request_id: Id
    ok: bool
    code: U16
    reason: Text


@message(66)
@dataclasses.dataclass(frozen=True)
class CancelRegistration(Record):
    """D -> P: D aborted the request; drop its registration."""

    request_id: Id


@message(67)
@dataclasses.dataclass(frozen=True)
class RegionDropped(Record):
    """Side-channel notice: a region is going away; never address this generation again."""

    agent_name: Id
    region_id: U32
    generation: U32
    timestamp: NonNegFloat
    mac: Annotated[bytes, Len(0, 64)]
    """HMAC-SHA256 over the fields above when a shared secret is configured."""


@message(68)
@dataclasses.dataclass(frozen=True)
class Probe(Record):
    """Notification round trip (liveness, `kvd ping`). reply=False asks for an echo.

    A request with `canary_bytes` asks the peer to WRITE that much of its canary (at most
    `CANARY_BYTES`) to `canary_addr` in the asker's registered scratch, the echo riding
    the WRITE's notification: `kvd ping`'s byte check where the asker's READ would be
    UCX's emulation (TCP, `kvd.core.readpath`). An echo says in `canary_bytes` how much
    it wrote."""

    nonce: U64
    reply: bool
    canary_addr: U64 = 0
    canary_bytes: Annotated[int, Range(0, 1 << 20)] = 0


@message(69)
@dataclasses.dataclass(frozen=True)
class Resync(Record):
    """P -> D after P's daemon stalled: answer with ResyncAck once everything you sent me
    before this arrived (notifications between two agents arrive in order)."""

    nonce: U64


@message(70)
@dataclasses.dataclass(frozen=True)
class ResyncAck(Record):
    """D -> P: every cancel D decided before the Resync is now ahead of this ack."""

    nonce: U64


@message(71)
@dataclasses.dataclass(frozen=True)
class Sealed(Record):
    """An authenticated peer message (with a shared secret): `body` is the encoding of any
    other peer message (a notification of any kind, a region drop), sent under the session
    key `key_id` that a handshake derived, as number `counter` (1, 2, ...) of its direction.
    `mac` is HMAC-SHA256 over key_id, counter (8 bytes, big-endian) and body with that
    direction's key (`kvd.core.peersession`)."""

    key_id: Annotated[bytes, Len(16, 16)]
    counter: Annotated[int, Range(1, (1 << 64) - 1)]
    body: Blob
    mac: Annotated[bytes, Len(32, 32)]


@dataclasses.dataclass(frozen=True)
class TraceStage(Record):
    """One stage record of a request in a daemon's stage trace (`TraceAnswer`)."""

    t_ns: U64
    """The answering daemon's CLOCK_MONOTONIC, in ns."""
    request_id: Id
    stage: Annotated[str, Len(1, 128)]


@message(75)
@dataclasses.dataclass(frozen=True)
class TraceQuery(Record):
    """Side channel request (`kvd trace --peer`): your stage records of these requests
    (none: only the clock exchange), and your clock. NTP-style: `t0` is our
    CLOCK_MONOTONIC when it was sent."""

    agent_name: Id
    request_ids: Annotated[tuple[Id, ...], Len(0, 8)]
    t0: U64
    nonce: Annotated[bytes, Len(16, 64)]
    timestamp: NonNegFloat
    mac: Annotated[bytes, Len(0, 64)]
    """HMAC-SHA256 over the fields above when a shared secret is configured."""


@message(76)
@dataclasses.dataclass(frozen=True)
class TraceAnswer(Record):
    """Side channel reply to TraceQuery: the records the answering daemon keeps under the
    asked ids and the ids they are linked to, and its clock when the query arrived (`t1`)
    and when this answer left (`t2`)."""

    agent_name: Id
    t0: U64
    t1: U64
    t2: U64
    ids: Annotated[tuple[Id, ...], Len(0, 16)]
    stages: Annotated[tuple[TraceStage, ...], Len(0, 2048)]
    dropped: U32
    mac: Annotated[bytes, Len(0, 64)]
    """HMAC-SHA256 over the fields above, bound to the query's nonce, when a shared
    secret is configured."""


@dataclasses.dataclass(frozen=True)
class LayerRange(Record):
    """Layers [first, end) of one request (D's id) in a `LayersPushed`."""

    request_id: Id
    first: Annotated[int, Range(0, 1 << 16)]
    end: Annotated[int, Range(1, 1 << 16)]


@message(74)
@dataclasses.dataclass(frozen=True)
class LayersPushed(Record):
    """P -> D, carried by the layer-wise WRITE it describes (so it arrives after the bytes):
    rank `tp_rank` of each request received these layers. D reports a request done once
    every layer of every rank arrived (a failure still comes as a PushDone(ok=False))."""

    tp_rank: U16
    ranges: Annotated[tuple[LayerRange, ...], Len(1, 1 << 14)]


# --------------------------------------------------------------------------------------
# Encoder cache: client <-> daemon, and consumer daemon <-> producer daemon (ZMQ tcp)
# --------------------------------------------------------------------------------------

Shape = Annotated[tuple[Annotated[int, Range(0, 1 << 40)], ...], Len(0, 8)]


@message(80)
@dataclasses.dataclass(frozen=True)
class ECAllocate(Record):
    """Producer: blocks in the daemon's EC region for one encoder output (pinned until commit)."""

    mm_hash: Id
    nbytes: Annotated[int, Range(1, 1 << 40)]


@message(81)
@dataclasses.dataclass(frozen=True)
class ECBlocks(Record):
    """Where to copy an encoder output: block ids in the EC region named `region`."""

    mm_hash: Id
    block_ids: BlockIds
    block_bytes: U64
    region: Annotated[str, Len(0, 255)]


@message(82)
@dataclasses.dataclass(frozen=True)
class ECCommit(Record):
    """Producer: the bytes are in place; serve them to consumers asking under `compat`
    (not empty: the daemon refuses that)."""

    mm_hash: Id
    nbytes: Annotated[int, Range(1, 1 << 40)]
    shape: Shape
    dtype: Annotated[str, Len(1, 32)]
    modality: Annotated[str, Len(0, 32)]
    compat: Annotated[str, Len(0, 128)]


@message(83)
@dataclasses.dataclass(frozen=True)
class ECParams(Record):
    """The `ec_transfer_params` entry a producer publishes for one mm_hash."""

    mm_hash: Id
    peer_host: Text
    peer_port: U16
    nbytes: Annotated[int, Range(1, 1 << 40)]
    shape: Shape
    dtype: Annotated[str, Len(1, 32)]
    modality: Annotated[str, Len(0, 32)]
    compat: Annotated[str, Len(0, 128)]


@message(84)
@dataclasses.dataclass(frozen=True)
class ECEnsure(Record):
    """Consumer: make this encoder output available locally (answered later by an event).
    `compat` must equal the producer's committed one (not empty: the daemon refuses that)."""

    mm_hash: Id
    peer_host: Text
    peer_port: U16
    nbytes: Annotated[int, Range(1, 1 << 40)]
    compat: Annotated[str, Len(0, 128)]


@message(85)
@dataclasses.dataclass(frozen=True)
class ECRelease(Record):
    """Consumer: the step that loaded this output is done with it (drops one pin)."""

    mm_hash: Id


@message(93)
@dataclasses.dataclass(frozen=True)
class ECHits(Record):
    """Consumer: warm hits this client served itself from the daemon's EC index (counted as
    hits, and each output made most recently used). Sent without waiting, in batches."""

    mm_hashes: Annotated[tuple[Id, ...], Len(1, 1024)]


@message(86)
@dataclasses.dataclass(frozen=True)
class ECReady(Record):
    """Event: the output is in the local EC region at these blocks, pinned for the caller."""

    mm_hash: Id
    block_ids: BlockIds
    nbytes: U64
    local_hit: bool


@message(87)
@dataclasses.dataclass(frozen=True)
class ECUnavailable(Record):
    """Event: the output could not be had (unknown, timed out, refused); encode locally or fail."""

    mm_hash: Id
    code: U16
    reason: Text


@message(88)
@dataclasses.dataclass(frozen=True)
class ECXferReq(Record):
    """Consumer daemon -> producer daemon: WRITE mm_hash into my EC region's blocks.

    The producer WRITEs only if `agent_name`, `dst_region` and `dst_generation` are what
    its handshake with the daemon at `side_host:side_port` says: that agent, its EC region,
    that region's current generation. With a shared secret the request also proves the
    secret and is served at most once (`kvd.core.peerauth`)."""

    mm_hash: Id
    compat: Annotated[str, Len(0, 128)]
    agent_name: Id
    side_host: Text
    side_port: U16
    dst_region: U32
    dst_generation: U32
    dst_block_ids: BlockIds
    timestamp: NonNegFloat = 0.0
    """The consumer's wall clock (Unix seconds) when it made the request: with a shared
    secret, one too far from the producer's clock is refused (AUTH)."""
    nonce: Annotated[bytes, Len(0, 64)] = b""
    """Random and new for each request (16 bytes): with a shared secret, a nonce the
    producer has already served is refused (AUTH), so a captured request cannot be replayed."""
    mac: Annotated[bytes, Len(0, 64)] = b""
    """HMAC-SHA256 over b"ecxfer" and the request with an empty mac, when a shared secret
    is configured (`kvd.core.peerauth.message_mac`)."""
    serve_by_ns: U64 = 0
    """The consumer's monotonic clock (ns, the clock its side channel stamps in the clock
    exchange) after which the producer must not start the WRITE: its send time plus its
    `ec.xfer_timeout` (it quarantines the blocks for the rest of the life of a WRITE
    started before, no longer). The producer judges it through the clock offset it
    measured with the consumer, and refuses (TIMEOUT) a request it cannot prove to be in
    time (0 here, or no offset)."""
    incarnation: U64 = 0
    """The consumer daemon's incarnation (as its handshake announces it). The producer
    serves the request through its view of the consumer only if that view is of this
    incarnation; a consumer restarted under the same name and address (its EC region
    numbered as before) is handshaken with afresh, never written through the addresses of
    the process that died. 0: not said (the producer asks its registrar each time)."""


@message(89)
@dataclasses.dataclass(frozen=True)
class ECXferAck(Record):
    """Producer daemon -> consumer daemon: the answer to one `ECXferReq` (after its WRITE
    ended, or at once when refused), or to an `ECXferCancel` of a request that is not being
    served (refused TIMEOUT: nothing of that request can be written any more)."""

    mm_hash: Id
    ok: bool
    code: U16
    reason: Text
    nbytes: U64
    nonce: Annotated[bytes, Len(0, 64)] = b""
    """The nonce of the request answered: a consumer takes an ack only for the request it
    has in flight (or quarantined) under that nonce, never an older one's for a newer."""
    mac: Annotated[bytes, Len(0, 64)] = b""
    """With a shared secret: HMAC-SHA256 over b"ecack", the request's nonce and the ack with
    an empty mac, so an ack answers exactly one request and only the producer can say ok."""


@message(90)
@dataclasses.dataclass(frozen=True)
class ECXferCancel(Record):
    """Consumer daemon -> producer daemon: I gave up on the request with this nonce (its
    `serve_by_ns` has passed on my clock) and keep its blocks quarantined until you say
    nothing of it will be written. A producer serving it says nothing now (its ack comes
    when its WRITE ended); one that is not answers with a TIMEOUT `ECXferAck` naming the
    nonce: it will never serve it (its deadline has passed: `ECXferReq.serve_by_ns`).
    Sent again every second while the blocks stay quarantined (a restarted producer
    answers the first one that reaches it)."""

    mm_hash: Id
    nonce: Annotated[bytes, Len(0, 64)]
    mac: Annotated[bytes, Len(0, 64)] = b""
    """HMAC-SHA256 over b"eccancel" and the cancel with an empty mac, when a shared secret
    is configured."""


# --------------------------------------------------------------------------------------
# KV tiers: client <-> daemon (`kvd_client.tiers`, `kvd.actors.tiers`)
# --------------------------------------------------------------------------------------

Namespace = Annotated[bytes, Len(1, 128)]
"""The model's compatibility hash: blocks are kept and found only under it."""
MAX_TIER_KEYS: Final = 1 << 16
"""Most keys in one tier message."""
TierKeys = Annotated[bytes, Len(0, 8 * 1024 * 1024)]
"""A batch of keys of `key_bytes` each, concatenated (one bin: a 1,000-key batch decodes
as one memcpy, not 1,000 items)."""
KeyBytes = Annotated[int, Range(1, 256)]
Flags = Annotated[bytes, Len(0, MAX_TIER_KEYS)]
Gens = Annotated[bytes, Len(0, 8 * MAX_TIER_KEYS)]
"""Slot generations: one little-endian uint64 per slot (`TierSlots.gens`)."""
"""One byte per key of the batch it answers."""


@message(100)
@dataclasses.dataclass(frozen=True)
class TierOpen(Record):
    """Use the daemon's tiers for blocks of `block_bytes` under `namespace`. `prev`: the
    session this client had before this one (it reopened): it is done with every slot
    that session was given, so slots the daemon kept out of use for it (its session
    ended while it might still write into them) are free again."""

    namespace: Namespace
    block_bytes: Annotated[int, Range(1, 1 << 34)]
    prev: OptId = ""


@message(101)
@dataclasses.dataclass(frozen=True)
class TierOpened(Record):
    """Where the host tier's pool lives: the client maps the shared-memory segment `pool`
    read-write and copies blocks into or out of the slots the daemon names (slot i at
    offset i * slot_bytes)."""

    pool: Annotated[str, Len(1, 255)]
    pool_bytes: U64
    slot_bytes: U64
    num_slots: U32
    pin_timeout: NonNegFloat
    """Seconds a reservation or a pin is held for the client before the daemon drops it."""
    lookup_timeout: NonNegFloat
    """Seconds the daemon suggests a client waits for a lookup (`tiers.lookup_timeout`)."""
    disk: bool
    """Whether the daemon has a disk tier."""
    disk_files: Annotated[str, Len(0, 4096)]
    """The disk tier's directory, where the client may read block files itself
    (`TierPin.files`); "" = it may not (no disk tier, or `tiers.disk_client_reads` off)."""
    disk_verify: bool
    """Whether loads check a block file's checksum (`tiers.disk_checksum` is not "none")."""
    gens: Annotated[str, Len(0, 255)] = ""
    """The shared-memory segment of the slots' generations (one uint64 per slot, mapped
    read-only): a load checks, after copying a slot out, that its generation is still
    the one `TierSlots.gens` named (the slot was not reused meanwhile)."""
    directory: Annotated[str, Len(0, 255)] = ""
    """The shared-memory segment of the host tier's directory (`kvd_client.tierdir`,
    mapped read-only): a client loads a block it finds there without a round trip and
    names it afterwards in a `TierTouch`; "" = none (every load is pinned)."""


@message(102)
@dataclasses.dataclass(frozen=True)
class TierLookup(Record):
    """Which of these keys do the tiers hold (answered by `TierFound`, one batch)."""

    namespace: Namespace
    key_bytes: KeyBytes
    keys: TierKeys


TIER_MISS: Final = 0
TIER_HOST: Final = 1
TIER_DISK: Final = 2
TIER_PEER: Final = 3
"""Held by a peer daemon's tiers (only in answers to a client: a peer never forwards)."""


@message(103)
@dataclasses.dataclass(frozen=True)
class TierFound(Record):
    """Per key of the lookup: TIER_MISS, TIER_HOST, TIER_DISK or (to a client) TIER_PEER.
    Also the answer to a peer's `PeerTierLookup` (never TIER_PEER there)."""

    found: Flags


@message(104)
@dataclasses.dataclass(frozen=True)
class TierReserve(Record):
    """Store, step 1: reserve (and pin) host slots for the keys not held yet."""

    namespace: Namespace
    key_bytes: KeyBytes
    keys: TierKeys


SLOT_HELD: Final = -1
"""In `TierSlots` of a store: the key is already held (nothing to copy). Of a load: a miss."""
SLOT_REFUSED: Final = -2
"""In `TierSlots` of a store: no room (every slot pinned) or no room on the key's tier."""
SLOT_FILE: Final = -3
"""In `TierSlots` of a load with `files`: a disk-tier hit the client reads from its file
(pinned until `TierUnpin`)."""


@message(105)
@dataclasses.dataclass(frozen=True)
class TierSlots(Record):
    """Per key: the pool slot to copy into (store) or out of (load), or SLOT_HELD /
    SLOT_REFUSED. The slots stay pinned for operation `op` until `TierCommit` (store),
    `TierUnpin` (load), the pin timeout or the end of the session."""

    op: U64
    slots: BlockIds
    gens: Gens = b""
    """(Loads) per key, the generation of its slot when pinned (0 where no slot)."""


@message(106)
@dataclasses.dataclass(frozen=True)
class TierCommit(Record):
    """Store, step 2: the bytes of the reserved slots whose flag is 1 are in place; make
    them visible (flag 0: drop the reservation). Answered by `TierFlags`."""

    op: U64
    ok: Flags


@message(107)
@dataclasses.dataclass(frozen=True)
class TierFlags(Record):
    """Per key of the operation: 1 stored (or already held), 0 not."""

    flags: Flags


@message(108)
@dataclasses.dataclass(frozen=True)
class TierPin(Record):
    """Load, step 1: pin the keys' blocks in host slots (a disk hit is read into one
    first). Answered by `TierSlots` (SLOT_HELD = a miss). `files`: the client reads disk
    hits from their files itself (`TierOpened.disk_files`): such a key is answered
    SLOT_FILE, its file pinned until `TierUnpin`."""

    namespace: Namespace
    key_bytes: KeyBytes
    keys: TierKeys
    files: bool = False


@message(109)
@dataclasses.dataclass(frozen=True)
class TierUnpin(Record):
    """Load, step 2: the client copied the blocks out; drop the operation's pins."""

    op: U64


@message(110)
@dataclasses.dataclass(frozen=True)
class TierGrant(Record):
    """Store ahead: lend this session up to `n` free host slots (answered by
    `TierGranted`, possibly fewer, never by evicting a block the disk tier lacks, never
    waiting). The client copies blocks into them and names them in `TierPut`: a store
    without a round trip. Lent slots stay the session's until put, or its end."""

    n: Annotated[int, Range(1, MAX_TIER_KEYS)]


@message(111)
@dataclasses.dataclass(frozen=True)
class TierGranted(Record):
    """The slots lent to the session by a `TierGrant` (maybe none)."""

    slots: BlockIds


@message(112)
@dataclasses.dataclass(frozen=True)
class TierPut(Record):
    """Store into lent slots: key i's bytes are in place in `slots[i]`, a slot lent to
    this session; make them visible (answered by `TierFlags`: 1 stored or already held,
    0 refused). Every slot named here goes back to the daemon (used, or freed where its
    key was held already)."""

    namespace: Namespace
    key_bytes: KeyBytes
    keys: TierKeys
    slots: BlockIds


@message(113)
@dataclasses.dataclass(frozen=True)
class TierTouch(Record):
    """One-way, never answered: the client loaded these keys' blocks without a pin,
    through the directory (`TierOpened.directory`) or, `disk`, straight from the disk
    tier's files (`TierOpened.disk_files`). The daemon counts them and makes each the
    most recently used, as a pinned load would have (and promotes disk blocks read so,
    with `tiers.promote_on_hit`)."""

    namespace: Namespace
    key_bytes: KeyBytes
    keys: TierKeys
    disk: bool = False


# ------------------------------------------------------------------ tiers across nodes
# A daemon asks its peers' tiers on their side channel (sealed under the session key
# when a shared secret is set) and READs the hits out of their host pools over NIXL.


@message(120)
@dataclasses.dataclass(frozen=True)
class PeerTierLookup(Record):
    """Which of these keys does your own tier hold (host or disk)? Answered by
    `TierFound` (TIER_MISS, TIER_HOST or TIER_DISK per key). `block_bytes`: the
    asker's block size (a tier holding another size answers all misses)."""

    agent_name: Id
    namespace: Namespace
    block_bytes: Annotated[int, Range(1, 1 << 34)]
    key_bytes: KeyBytes
    keys: TierKeys


@message(121)
@dataclasses.dataclass(frozen=True)
class PeerTierPin(Record):
    """Pin these keys' blocks in your host pool for `agent_name` to READ (a disk hit is
    read into a slot first). Answered by `PeerTierPinned`; the pins are held until
    `PeerTierUnpin`, the peer's `tiers.peer_pin_timeout`, or until the peer learns that
    the asker (this incarnation of it) is gone."""

    agent_name: Id
    incarnation: U64
    namespace: Namespace
    block_bytes: Annotated[int, Range(1, 1 << 34)]
    key_bytes: KeyBytes
    keys: TierKeys
    inline: bool = False
    """Send the blocks' bytes in the answer (`PeerTierPinned.data`) and hold nothing: where
    the asker's UCX would emulate a READ (TCP, `kvd.core.readpath`)."""


@message(122)
@dataclasses.dataclass(frozen=True)
class PeerTierPinned(Record):
    """Per key: its slot in the pool at `pool_addr` (`pool_bytes` long, slots of
    `slot_bytes`), or SLOT_HELD (a miss); and 8 bytes per key (little-endian) of its
    block's checksum of kind `checksum_kind` (`kvd.actors.tiers.CHECKSUMS`), which the
    reader checks after its READ."""

    op: U64
    pool_addr: U64
    pool_bytes: U64
    slot_bytes: U64
    slots: BlockIds
    checksum_kind: U16
    checksums: Annotated[bytes, Len(0, 8 * MAX_TIER_KEYS)]
    data: Blob = b""
    """An inline pin (`PeerTierPin.inline`): each hit's block, in key order (`op` 0:
    nothing is held)."""


@message(123)
@dataclasses.dataclass(frozen=True)
class PeerTierUnpin(Record):
    """The reader is done with operation `op` (its READ ended, or it gave up)."""

    agent_name: Id
    op: U64
