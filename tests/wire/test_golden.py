"""Golden fixtures pin the wire bytes of every message (STYLE.md point 6).

A failure here means the wire format changed. If that was intended, bump
PROTOCOL_VERSION where old peers must be refused, run `python tests/wire/make_golden.py`
and review the fixture diff; never edit a fixture or a pinned number to make this pass.
"""

from __future__ import annotations

import pytest
from kvd_client import wire
from kvd_client.errors import ErrorCode

from .make_golden import FIXTURE_DIR, GOLDEN, fixture_path

TYPE_IDS = {
    "Hello": 1,
    "Welcome": 2,
    "KeepAlive": 3,
    "Goodbye": 4,
    "Ok": 5,
    "ErrorReply": 6,
    "RegisterRegion": 10,
    "RegionRegistered": 11,
    "DeregisterRegion": 12,
    "Track": 20,
    "RegisterPush": 21,
    "Pull": 22,
    "Finish": 23,
    "Abort": 24,
    "LayersSaved": 29,
    "GetStatus": 30,
    "StatusReply": 31,
    "PingPeer": 32,
    "Drain": 34,
    "AbortRequest": 35,
    "GetTrace": 36,
    "SendFinished": 40,
    "RecvFinished": 41,
    "RecvFailed": 42,
    "SendFailed": 43,
    "SendExpired": 44,
    "Handshake": 60,
    "PushRegistration": 61,
    "Heartbeat": 62,
    "PushDone": 63,
    "PullDone": 64,
    "PullAck": 65,
    "CancelRegistration": 66,
    "RegionDropped": 67,
    "Probe": 68,
    "Resync": 69,
    "ResyncAck": 70,
    "Sealed": 71,
    "LayersPushed": 74,
    "TraceQuery": 75,
    "TraceAnswer": 76,
    "ECAllocate": 80,
    "ECBlocks": 81,
    "ECCommit": 82,
    "ECParams": 83,
    "ECEnsure": 84,
    "ECRelease": 85,
    "ECReady": 86,
    "ECHits": 93,
    "ECUnavailable": 87,
    "ECXferReq": 88,
    "ECXferAck": 89,
    "ECXferCancel": 90,
    "TierOpen": 100,
    "TierOpened": 101,
    "TierLookup": 102,
    "TierFound": 103,
    "TierReserve": 104,
    "TierSlots": 105,
    "TierCommit": 106,
    "TierFlags": 107,
    "TierPin": 108,
    "TierUnpin": 109,
    "TierGrant": 110,
    "TierGranted": 111,
    "TierPut": 112,
    "TierTouch": 113,
    "PeerTierLookup": 120,
    "PeerTierPin": 121,
    "PeerTierPinned": 122,
    "PeerTierUnpin": 123,
}

ERROR_CODES = {
    "PROTOCOL": 1,
    "VERSION": 2,
    "BUSY": 3,
    "NOT_FOUND": 4,
    "INVALID": 5,
    "AUTH": 6,
    "INCOMPATIBLE": 7,
    "TRANSFER": 8,
    "LEASE_EXPIRED": 9,
    "TIMEOUT": 10,
    "INTERNAL": 11,
    "SHUTTING_DOWN": 12,
}

REGISTERED = sorted(cls.__name__ for cls in wire.registry().values())


def test_protocol_version() -> None:
    assert wire.PROTOCOL_VERSION == 13


def test_type_ids_are_pinned() -> None:
    assert {cls.__name__: tid for tid, cls in wire.registry().items()} == TYPE_IDS
    for name, tid in TYPE_IDS.items():
        assert tid == getattr(wire, name).TYPE


def test_error_codes_are_pinned() -> None:
    # ErrorReply.code and the *Failed events carry these numbers on the wire.
    assert {c.name: c.value for c in ErrorCode} == ERROR_CODES


def test_every_message_has_a_golden_instance_and_fixture() -> None:
    assert sorted(GOLDEN) == REGISTERED, "add the new message to tests/wire/make_golden.py"
    on_disk = sorted(p.stem for p in FIXTURE_DIR.glob("*.bin"))
    assert on_disk == REGISTERED, "run `python tests/wire/make_golden.py` and commit the fixture"


def test_golden_instances_are_typed_right() -> None:
    for name, (_, msg) in GOLDEN.items():
        assert type(msg).__name__ == name


@pytest.mark.parametrize("name", REGISTERED)
def test_encoding_matches_fixture(name: str) -> None:
    path = fixture_path(name)
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python tests/wire/make_golden.py`")
    corr, msg = GOLDEN[name]
    assert wire.encode(msg, corr) == path.read_bytes()


@pytest.mark.parametrize("name", REGISTERED)
def test_fixture_decodes_to_golden_instance(name: str) -> None:
    path = fixture_path(name)
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python tests/wire/make_golden.py`")
    data = path.read_bytes()
    corr, msg = GOLDEN[name]
    # Frame header: [PROTOCOL_VERSION, type id, corr, ...]: an array (a fixarray up to 15
    # elements, else array 16: 0xdc and two length bytes), then both as positive fixints.
    head = 1 if data[0] & 0xF0 == 0x90 else 3
    assert data[0] & 0xF0 == 0x90 or data[0] == 0xDC
    assert data[head] == wire.PROTOCOL_VERSION
    assert data[head + 1] == TYPE_IDS[name]
    assert wire.decode(data) == (corr, msg)
    assert wire.decode(bytearray(data)) == (corr, msg)
    assert wire.decode(memoryview(data)) == (corr, msg)


def test_block_ids_are_little_endian_int32() -> None:
    _, msg = GOLDEN["Finish"]
    assert isinstance(msg, wire.Finish)
    packed = b"".join(i.to_bytes(4, "little", signed=True) for i in msg.block_ids)
    assert packed in fixture_path("Finish").read_bytes()
