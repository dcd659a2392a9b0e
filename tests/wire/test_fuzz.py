"""The decoder is total: any bytes yield a record or raise exactly RemoteProtocolError.

Also: every valid record survives encode/decode, and the size limits hold at their edges.
Strategies for valid records are derived from the dataclass annotations (Len, Range,
PACKED), so a new message or field is fuzzed without touching this file; a field type
the builder does not know fails loudly.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Annotated, Any, get_args, get_origin

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_client import wire
from kvd_client.errors import RemoteProtocolError, VersionMismatch

from .make_golden import GOLDEN

REGISTRY = wire.registry()
TYPE_IDS = sorted(REGISTRY)
CLASSES = [REGISTRY[t] for t in TYPE_IDS]
GOLDEN_FRAMES = {name: wire.encode(msg, corr) for name, (corr, msg) in sorted(GOLDEN.items())}
U64_MAX = (1 << 64) - 1
I64_MIN = -(1 << 63)
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def check_total(
    data: Any, max_frame: int = wire.DEFAULT_MAX_FRAME
) -> tuple[int, wire.Record] | None:
    """Decode; None for RemoteProtocolError. Any other exception escapes and fails the test."""
    try:
        out = wire.decode(data, max_frame)
    except RemoteProtocolError:
        return None
    corr, rec = out
    assert isinstance(corr, int) and 0 <= corr <= U64_MAX
    assert REGISTRY[type(rec).TYPE] is type(rec)
    # What was accepted re-encodes to a frame that decodes to the same bytes again
    # (bytes, not ==, so a NaN inside a StatusReply map does not spoil the comparison).
    again = wire.encode(rec, corr)
    corr2, rec2 = wire.decode(again, max(max_frame, len(again)))
    assert corr2 == corr
    assert wire.encode(rec2, corr2) == again
    return out


# --------------------------------------------------------------------------------------
# Strategies for valid records, from the annotations
# --------------------------------------------------------------------------------------


def split_annotated(tp: Any) -> tuple[Any, wire.Len | None, wire.Range | None, bool]:
    meta: tuple[Any, ...] = ()
    if get_origin(tp) is Annotated:
        tp, *rest = get_args(tp)
        meta = tuple(rest)
    length = next((m for m in meta if isinstance(m, wire.Len)), None)
    rng = next((m for m in meta if isinstance(m, wire.Range)), None)
    packed = any(m is wire.PACKED for m in meta)
    return tp, length, rng, packed


def field_types(cls: type[wire.Record]) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


# Small caps keep examples fast; the exact Len/Range edges are in test_limits.
SMALL_STR, SMALL_BYTES, SMALL_LIST = 40, 64, 6

info_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(I64_MIN, U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid(tp: Any) -> st.SearchStrategy[Any]:
    base, length, rng, packed = split_annotated(tp)
    lo_len = length.min if length else 0
    hi_len = length.max if length else wire.MAX_STR_LEN
    if packed:
        ids = st.integers(I32_MIN, I32_MAX)
        return st.lists(ids, min_size=lo_len, max_size=min(hi_len, SMALL_LIST * 8)).map(tuple)
    if base is bool:
        return st.booleans()
    if base is int:
        lo, hi = (int(rng.min), int(rng.max)) if rng else (I64_MIN, U64_MAX)
        return st.integers(lo, hi)
    if base is float:
        flo, fhi = (rng.min, rng.max) if rng else (None, None)
        return st.floats(flo, fhi, allow_nan=False)
    if base is str:
        return st.text(min_size=lo_len, max_size=max(lo_len, min(hi_len, SMALL_STR)))
    if base is bytes:
        return st.binary(min_size=lo_len, max_size=max(lo_len, min(hi_len, SMALL_BYTES)))
    if get_origin(base) is tuple:
        (item, _) = get_args(base)
        hi_list = max(lo_len, min(length.max if length else wire.MAX_LIST_LEN, SMALL_LIST))
        return st.lists(valid(item), min_size=lo_len, max_size=hi_list).map(tuple)
    if get_origin(base) is dict:
        return st.dictionaries(st.text(max_size=12), info_values, max_size=6)
    if isinstance(base, type) and issubclass(base, wire.Record):
        return st.builds(base, **{name: valid(t) for name, t in field_types(base)})
    raise TypeError(f"no strategy for wire field type {tp!r}: teach tests/wire/test_fuzz.py")


CORR = st.integers(0, U64_MAX)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@fuzz(40)
@given(data=st.data(), corr=CORR)
def test_round_trip(cls: type[wire.Record], data: st.DataObject, corr: int) -> None:
    msg = data.draw(valid(cls))
    frame = wire.encode(msg, corr)
    assert wire.decode(frame) == (corr, msg)


# --------------------------------------------------------------------------------------
# (a) random bytes, (b) mutated golden frames
# --------------------------------------------------------------------------------------

# Random bytes rarely get past the header, so half the inputs start with a plausible one.
plausible_header = st.builds(
    lambda n, tid, corr: bytes([0x90 | n, 1, tid, corr]),
    st.integers(3, 15),
    st.sampled_from(TYPE_IDS),
    st.integers(0, 0x7F),
)


@fuzz(600)
@given(prefix=st.one_of(st.just(b""), plausible_header), body=st.binary(max_size=300))
def test_random_bytes(prefix: bytes, body: bytes) -> None:
    check_total(prefix + body)


@fuzz(200)
@given(data=st.binary(max_size=64), max_frame=st.integers(0, 80))
def test_random_bytes_small_max_frame(data: bytes, max_frame: int) -> None:
    if check_total(data, max_frame) is not None:
        assert len(data) <= max_frame


mutation = st.one_of(
    st.tuples(st.just("xor"), st.integers(0, 1 << 16), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 1 << 16), st.sampled_from(range(256))),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(0)),
)


def mutate(data: bytes, ops: list[tuple[str, int, Any]]) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in ops:
        i = pos % (len(buf) + 1)
        if op == "insert":
            buf[i:i] = arg
        elif not buf:
            continue
        elif op == "xor":
            buf[i % len(buf)] ^= arg
        elif op == "set":
            buf[i % len(buf)] = arg
        elif op == "delete":
            del buf[i : i + arg]
        else:
            del buf[i:]
    return bytes(buf)


@fuzz(1500)
@given(name=st.sampled_from(sorted(GOLDEN_FRAMES)), ops=st.lists(mutation, min_size=1, max_size=4))
def test_mutated_golden_frames(name: str, ops: list[tuple[str, int, Any]]) -> None:
    check_total(mutate(GOLDEN_FRAMES[name], ops))


@pytest.mark.parametrize("name", sorted(GOLDEN_FRAMES))
def test_every_prefix_and_single_byte_change(name: str) -> None:
    frame = GOLDEN_FRAMES[name]
    for k in range(len(frame)):
        assert check_total(frame[:k]) is None, f"a {k}-byte prefix decoded"
    assert check_total(frame + b"\xc0") is None, "trailing bytes accepted"
    for i in range(len(frame)):
        for x in (0x01, 0x10, 0x80, 0xFF):
            changed = bytearray(frame)
            changed[i] ^= x
            check_total(bytes(changed))


# --------------------------------------------------------------------------------------
# (c) structurally random msgpack under a valid header
# --------------------------------------------------------------------------------------

interesting_ints = st.sampled_from(
    [
        *(0, 1, -1, I32_MIN, I32_MIN - 1, I32_MAX, I32_MAX + 1, 0xFFFF, 0x10000, 0xFFFFFFFF),
        *(1 << 32, 1 << 40, 1 << 44, 1 << 48, I64_MIN, (1 << 63) - 1, 1 << 63, U64_MAX),
    ]
)
msgpack_leaves = st.one_of(
    st.none(),
    st.booleans(),
    interesting_ints,
    st.integers(I64_MIN, U64_MAX),
    st.floats(),  # nan and +-inf included
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e12, 1e300]),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
)
map_keys = st.one_of(st.text(max_size=8), st.binary(max_size=8), interesting_ints, st.none())
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(map_keys, inner, max_size=4),
    max_leaves=12,
)
any_corr = st.one_of(CORR, msgpack_values)


def pack(value: Any) -> bytes:
    out = msgpack.packb(value, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


@pytest.mark.parametrize("type_id", TYPE_IDS)
@fuzz(20)
@given(corr=any_corr, fields=st.lists(msgpack_values, max_size=14))
def test_random_fields(type_id: int, corr: Any, fields: list[Any]) -> None:
    check_total(pack([wire.PROTOCOL_VERSION, type_id, corr, *fields]))


@pytest.mark.parametrize("name", sorted(GOLDEN))
@fuzz(30)
@given(data=st.data())
def test_one_golden_field_replaced(name: str, data: st.DataObject) -> None:
    """Random values where the validators look: inside an otherwise valid record."""
    raw = msgpack.unpackb(GOLDEN_FRAMES[name], raw=False)
    target: list[Any] = raw
    start = 3
    # Now and then walk into a nested record or list (RegionInfo, RegionLayout, ids).
    while True:
        nested = [i for i in range(start, len(target)) if isinstance(target[i], list) and target[i]]
        if not nested or not data.draw(st.booleans(), label="descend"):
            break
        target = target[data.draw(st.sampled_from(nested), label="into")]
        start = 0
    if len(target) > start:
        i = data.draw(st.integers(start, len(target) - 1), label="field")
        target[i] = data.draw(msgpack_values, label="value")
    check_total(pack(raw))


def test_wrong_header_values() -> None:
    frame = GOLDEN_FRAMES["Probe"]
    raw = msgpack.unpackb(frame, raw=False)
    v = wire.PROTOCOL_VERSION
    for version in (0, v - 1, v + 1, 255, -1, U64_MAX):
        with pytest.raises(VersionMismatch):
            wire.decode(pack([version, *raw[1:]]))
    for version in (True, float(v), str(v), None, [v]):
        with pytest.raises(RemoteProtocolError) as info:
            wire.decode(pack([version, *raw[1:]]))
        assert type(info.value) is RemoteProtocolError
    for type_id in (0, 7, 71, 255, -1, U64_MAX, True, 68.0, "68", None):
        with pytest.raises(RemoteProtocolError):
            wire.decode(pack([wire.PROTOCOL_VERSION, type_id, *raw[2:]]))
    for corr in (-1, I64_MIN, True, 1.0, "1", None, b"\x00"):
        with pytest.raises(RemoteProtocolError):
            wire.decode(pack([wire.PROTOCOL_VERSION, 68, corr, *raw[3:]]))
    assert wire.decode(pack([wire.PROTOCOL_VERSION, 68, U64_MAX, *raw[3:]]))[0] == U64_MAX
    for not_a_frame in ([], [1], [1, 68], {"a": 1}, 1, "x", None):
        with pytest.raises(RemoteProtocolError):
            wire.decode(pack(not_a_frame))


def test_non_bytes_input() -> None:
    for bad in ("\x93\x01\x05\x00", None, 12, [1, 5, 0]):
        with pytest.raises(RemoteProtocolError):
            wire.decode(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# (e) size limits at their edges
# --------------------------------------------------------------------------------------


def test_oversized_frame_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        raise AssertionError("unpackb called on an oversized frame")

    frame = GOLDEN_FRAMES["Handshake"]
    monkeypatch.setattr(wire.msgpack, "unpackb", spy)
    for data in (frame, bytearray(frame), memoryview(frame)):
        with pytest.raises(RemoteProtocolError, match="exceeds"):
            wire.decode(data, max_frame=len(frame) - 1)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (wire.DEFAULT_MAX_FRAME + 1))
    assert calls == []


def test_frame_exactly_at_the_limit() -> None:
    # The largest legal id list, in a frame decoded with the limit set to its exact size.
    base = GOLDEN["RegisterPush"][1]
    assert isinstance(base, wire.RegisterPush)
    msg = dataclasses.replace(base, block_ids=(7,) * wire.MAX_BLOCK_IDS)
    frame = wire.encode(msg, 1)
    assert len(frame) <= wire.DEFAULT_MAX_FRAME
    assert wire.decode(frame, max_frame=len(frame)) == (1, msg)
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        wire.decode(frame, max_frame=len(frame) - 1)
    # The same holds for a custom limit.
    frame = GOLDEN_FRAMES["Handshake"]
    assert wire.decode(frame, max_frame=len(frame)) == GOLDEN["Handshake"]


def test_msgpack_container_limits() -> None:
    def status(data: Any) -> bytes:
        return pack([wire.PROTOCOL_VERSION, wire.StatusReply.TYPE, 0, data])

    at_limit = [0] * wire.MAX_LIST_LEN
    assert check_total(status({"k": at_limit})) is not None
    with pytest.raises(RemoteProtocolError):
        wire.decode(status({"k": [*at_limit, 0]}))
    # An array header that announces more than the limit, with no body behind it.
    with pytest.raises(RemoteProtocolError):
        wire.decode(b"\x94\x01\x1f\x00\xdd" + (wire.MAX_LIST_LEN + 1).to_bytes(4, "big"))
    big_map = {str(i): i for i in range(1 << 16)}
    assert check_total(status(big_map)) is not None
    with pytest.raises(RemoteProtocolError):
        wire.decode(status({**big_map, "x": 0}))
    with pytest.raises(RemoteProtocolError):
        wire.decode(status({"k": {**big_map, "x": 0}}))
    # Extension types (timestamps included) are never part of the protocol.
    with pytest.raises(RemoteProtocolError):
        wire.decode(status({"k": msgpack.ExtType(1, b"x")}))
    with pytest.raises(RemoteProtocolError):
        wire.decode(status({"k": msgpack.Timestamp(1, 0)}))
    # Nesting deeper than the unpacker's stack.
    deep = b"\x91" * 5000 + b"\xc0"
    with pytest.raises(RemoteProtocolError):
        wire.decode(b"\x94\x01\x1f\x00\x81\xa1k" + deep)


def boundary_cases(tp: Any, golden: Any) -> Iterator[tuple[str, Any, bool]]:
    """(label, raw wire value, accepted?) at and just past every bound of a field type."""
    base, length, rng, packed = split_annotated(tp)
    lo_len = length.min if length else 0
    if packed:
        hi = length.max if length else wire.MAX_BLOCK_IDS
        yield "max ids", b"\x00" * (4 * hi), True
        yield "max+1 ids", b"\x00" * (4 * (hi + 1)), False
        yield "ragged", b"\x00" * 6, False
        yield "as list", [1, 2], False
        if lo_len == 0:
            yield "no ids", b"", True
        return
    if base is bool:
        yield from (("true", True, True), ("false", False, True))
        yield from (("int 1", 1, False), ("int 0", 0, False), ("nil", None, False))
        return
    if base is int:
        lo, hi = (int(rng.min), int(rng.max)) if rng else (I64_MIN, U64_MAX)
        yield "min", lo, True
        yield "max", hi, True
        if lo - 1 >= I64_MIN:
            yield "min-1", lo - 1, False
        if hi + 1 <= U64_MAX:
            yield "max+1", hi + 1, False
        yield from (("bool", True, False), ("float", float(lo), False), ("str", "1", False))
        return
    if base is float:
        assert rng is not None
        yield "min", rng.min, True
        yield "max", rng.max, True
        if float(rng.max).is_integer():
            yield "int max", int(rng.max), True
        yield "below", math.nextafter(rng.min, -math.inf), False
        yield "above", math.nextafter(rng.max, math.inf), False
        yield from (("nan", math.nan, False), ("inf", math.inf, False), ("bool", True, False))
        yield "str", "1.0", False
        return
    if base in (str, bytes):
        hi = length.max if length else wire.MAX_STR_LEN
        unit: Any = "é" if base is str else b"\xff"  # str bounds count code points
        other: Any = b"x" if base is str else "x"
        yield "min len", unit * lo_len, True
        yield "max len", unit * hi, True
        yield "max+1 len", unit * (hi + 1), False
        if lo_len > 0:
            yield "min-1 len", unit * (lo_len - 1), False
        yield "wrong type", other * max(lo_len, 1), False
        yield "nil", None, False
        return
    if get_origin(base) is tuple:
        (item_tp, _) = get_args(base)
        hi = length.max if length else wire.MAX_LIST_LEN
        assert golden, "the golden instance needs a non-empty list here"
        item = golden[0]
        yield "min len", [item] * lo_len, True
        yield "max len", [item] * hi, True
        yield "max+1 len", [item] * (hi + 1), False
        if lo_len > 0:
            yield "min-1 len", [item] * (lo_len - 1), False
        yield "map", {"a": item}, False
        for label, value, ok in boundary_cases(item_tp, item):
            yield f"item {label}", [*golden, value], ok
        return
    if get_origin(base) is dict:
        hi = length.max if length else wire.MAX_LIST_LEN
        yield "empty", {}, True
        yield "max len", {str(i): None for i in range(hi)}, True
        yield "bytes key", {b"k": 1}, False
        yield "list", [], False
        return
    if isinstance(base, type) and issubclass(base, wire.Record):
        yield "fields missing", golden[:-1], False
        yield "extra field", [*golden, 0], False
        yield "map", {}, False
        for j, (name, sub_tp) in enumerate(field_types(base)):
            for label, value, ok in boundary_cases(sub_tp, golden[j]):
                yield f"{name} {label}", [*golden[:j], value, *golden[j + 1 :]], ok
        return
    raise TypeError(f"no boundary cases for wire field type {tp!r}: teach tests/wire/test_fuzz.py")


def limit_cases(name: str, j: int) -> Iterator[tuple[str, list[Any], bool]]:
    """(label, frame as a list, accepted?) for field j of the golden `name`."""
    raw = msgpack.unpackb(GOLDEN_FRAMES[name], raw=False)
    _, tp = field_types(type(GOLDEN[name][1]))[j]
    for label, value, ok in boundary_cases(tp, raw[3 + j]):
        yield label, [*raw[: 3 + j], value, *raw[3 + j + 1 :]], ok


def limit_params() -> Iterator[Any]:
    # Only labels at collection: some values are 16 MiB, built again inside the test.
    for name, (_, msg) in sorted(GOLDEN.items()):
        for j, (field, _) in enumerate(field_types(type(msg))):
            for label, _, ok in limit_cases(name, j):
                yield pytest.param(name, j, label, ok, id=f"{name}.{field} {label}")


@pytest.mark.parametrize(("name", "j", "label", "ok"), list(limit_params()))
def test_limits(name: str, j: int, label: str, ok: bool) -> None:
    fields = next(f for lbl, f, _ in limit_cases(name, j) if lbl == label)
    frame = pack(fields)
    max_frame = max(len(frame), wire.DEFAULT_MAX_FRAME)  # limits of fields, not of frames
    if ok:
        corr, rec = wire.decode(frame, max_frame)
        assert corr == fields[2]
        assert msgpack.unpackb(wire.encode(rec, corr), raw=False) == fields
    else:
        with pytest.raises(RemoteProtocolError):
            wire.decode(frame, max_frame)


# --------------------------------------------------------------------------------------
# Bounds that once failed (regressions)
# --------------------------------------------------------------------------------------


def test_max_block_ids_fit_in_a_default_frame() -> None:
    corr, base = GOLDEN["Finish"]
    assert isinstance(base, wire.Finish)
    msg = dataclasses.replace(base, block_ids=(0,) * wire.MAX_BLOCK_IDS)
    assert wire.decode(wire.encode(msg, corr)) == (corr, msg)


def test_status_reply_with_int_keyed_nested_map_round_trips() -> None:
    """Info maps travel with string keys (and tuples as lists): encode normalises them."""
    msg = wire.StatusReply(data={"regions": {3: {"blocks": 4096, "ids": (1, 2)}}})
    got = wire.decode(wire.encode(msg, 1))
    assert got == (1, wire.StatusReply(data={"regions": {"3": {"blocks": 4096, "ids": [1, 2]}}}))


def test_frame_of_empty_containers_is_refused_cheaply() -> None:
    """Nested empty lists cost ~64 bytes each in memory: the container budget stops them."""
    n = wire.MAX_CONTAINERS + 10
    frame = msgpack.packb([1, 5, 0, [[] for _ in range(n)]])
    with pytest.raises(RemoteProtocolError):
        wire.decode(frame)
