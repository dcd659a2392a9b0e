"""Golden wire fixtures: one representative instance of every registered message.

`GOLDEN` is the single source of the instances; `test_golden.py` compares their encoding
against the committed `tests/fixtures/wire/<TypeName>.bin` files and never rewrites them.
After an intentional wire change, regenerate and review the diff:

    python tests/wire/make_golden.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from kvd_client import wire
from kvd_client.errors import ErrorCode

FIXTURE_DIR: Final = Path(__file__).resolve().parents[1] / "fixtures" / "wire"

# Unicode on purpose: ids are counted in code points but travel as UTF-8.
REQ: Final = "cmpl-réq-漢字-😀-0-1a2b3c4d"
REMOTE_REQ: Final = "cmpl-ünï-Ω-0"
ENGINE: Final = "engine-δ-prefill"
REMOTE_ENGINE: Final = "engine-ж-decode"
# int32 edge values pin the packed little-endian encoding and its sign handling.
BLOCKS: Final = (0, 1, 2, 255, 256, 65535, 65536, 1 << 24, (1 << 31) - 1, -1, -(1 << 31))
REMOTE_BLOCKS: Final = (7, 3, 1000, 123456, 42)

LAYOUT: Final = wire.RegionLayout(
    num_blocks=4096,
    num_layers=61,
    kv_parts=2,
    chunk_bytes=32768,
    block_stride=61 * 2 * 32768,
    layer_stride=2 * 32768,
    kv_stride=32768,
    tokens_per_block=16,
    physical_per_logical=2,
    kv_layout="HND",
    dtype="bfloat16",
)
LAYOUT_MLA: Final = wire.RegionLayout(
    num_blocks=1 << 31,
    num_layers=1 << 16,
    kv_parts=1,
    chunk_bytes=1 << 40,
    block_stride=1 << 48,
    layer_stride=0,
    kv_stride=0,
    tokens_per_block=1 << 20,
    physical_per_logical=1 << 10,
    kv_layout="NHD",
    dtype="float8_e4m3fn",
)


GROUPS: Final = (
    wire.KvGroup(
        "state",
        0,
        (1 << 48) - 1,
        LAYOUT_MLA,
        "statespec1|float32|65536|30|model-ä",
        (
            wire.StatePart(3, (wire.StateShard(64, 8), wire.StateShard(8, 512))),
            wire.StatePart(1, (wire.StateShard(1 << 24, (1 << 32) - 1),)),
        ),
    ),
    wire.KvGroup("full", 0, 0, LAYOUT, "kvspec1|bfloat16|8|128|61|0|model-ä"),
    wire.KvGroup("window", 4096, 1 << 40, LAYOUT, "kvspec1|bfloat16|8|128|61|0|model-ä"),
)
"""A hybrid region's KV cache groups (RegionInfo.groups pins KvGroup's encoding)."""


def _region(
    region_id: int,
    rank: int,
    layout: wire.RegionLayout,
    mem_type: str,
    device: int,
    groups: tuple[wire.KvGroup, ...] = (),
) -> wire.RegionInfo:
    return wire.RegionInfo(
        region_id=region_id,
        generation=0xFFFFFFFF - region_id,
        engine_id=ENGINE,
        tp_rank=rank,
        tp_size=2,
        base_addr=0x7F00_0000_0000 + rank * 0x1_0000_0000,
        nbytes=min(layout.num_blocks * layout.block_stride, (1 << 64) - 1),
        mem_type=mem_type,
        device=device,
        layout=layout,
        compat="sha256:0f1e2d3c",
        nixl_md=bytes(range(256)) + b"\x00nixl-md\xff",
        groups=groups,
    )


GOLDEN: Final[dict[str, tuple[int, wire.Record]]] = {
    "Hello": (
        1,
        wire.Hello(
            session="sess-é-1",
            role="worker",
            engine_id=ENGINE,
            tp_rank=-1,
            pid=4242,
            client_version="0.1.0",
        ),
    ),
    "Welcome": (
        1,
        wire.Welcome(
            daemon_version="0.1.0",
            agent_name="kvd-host-ø-1234",
            side_host="10.0.0.7",
            side_port=5600,
            kv_lease_duration=30.5,
            ec_host="::1",
            ec_port=0xFFFF,
            incarnation=0xFEDCBA9876543210,
            client_timeout=10.0,
            push_registration_timeout=480.0,
            decoder_kv_blocks_ttl=480.0,
        ),
    ),
    "KeepAlive": (0, wire.KeepAlive(session="sess-é-1")),
    "Goodbye": (2, wire.Goodbye(session="sess-é-1")),
    "Ok": (3, wire.Ok()),
    "ErrorReply": (
        4,
        wire.ErrorReply.of(ErrorCode.LEASE_EXPIRED, f"lease of {REQ} expired — blocks freed"),
    ),
    "RegisterRegion": (
        5,
        wire.RegisterRegion(
            kind="cuda-ipc",
            name="/kvd-region-ü",
            nbytes=1 << 44,
            engine_id=ENGINE,
            tp_rank=1,
            tp_size=2,
            layout=LAYOUT,
            compat="sha256:0f1e2d3c",
            ipc_handle=bytes(range(64)),
            device=-1,
            groups=GROUPS[:2],
        ),
    ),
    "RegionRegistered": (5, wire.RegionRegistered(region_id=3, generation=0xFFFFFFFF)),
    "DeregisterRegion": (6, wire.DeregisterRegion(region_id=3)),
    "Track": (
        7,
        wire.Track(
            request_id=REQ,
            engine_id=REMOTE_ENGINE,
            peer_host="prefill-0.example",
            peer_port=5600,
            remote_engine_id=ENGINE,
            remote_request_id="",
            remote_incarnation=0,
        ),
    ),
    "RegisterPush": (
        8,
        wire.RegisterPush(
            request_id=REQ,
            engine_id=REMOTE_ENGINE,
            block_ids=BLOCKS,
            peer_host="prefill-0.example",
            peer_port=5600,
            remote_engine_id="",
            remote_request_id=REMOTE_REQ,
            remote_incarnation=(1 << 64) - 1,
            remote_session="scheduler-1-abcdef012345",
            num_tokens=1023,
        ),
    ),
    "Pull": (
        9,
        wire.Pull(
            request_id=REQ,
            engine_id=REMOTE_ENGINE,
            block_ids=BLOCKS[:5],
            peer_host="prefill-0.example",
            peer_port=5600,
            remote_engine_id=ENGINE,
            remote_request_id=REMOTE_REQ,
            remote_block_ids=REMOTE_BLOCKS,
            remote_incarnation=0x0123456789ABCDEF,
            remote_session="",
        ),
    ),
    "Finish": (
        10,
        wire.Finish(
            request_id=REQ, engine_id=ENGINE, block_ids=BLOCKS, keep_for=479.5, num_tokens=77
        ),
    ),
    "Abort": (11, wire.Abort(request_id=REQ, engine_id=ENGINE, side="send")),
    "LayersSaved": (
        0,
        wire.LayersSaved(
            engine_id=ENGINE,
            tp_rank=7,
            layers=61,
            requests=(
                wire.SavedRequest(request_id=REQ, block_ids=BLOCKS),
                wire.SavedRequest(request_id="r-2", block_ids=()),
            ),
        ),
    ),
    "GetStatus": (12, wire.GetStatus(section="transfers")),
    "StatusReply": (
        12,
        wire.StatusReply(
            data={
                "version": "0.1.0",
                "uptime_s": 12.25,
                "ready": True,
                "draining": False,
                "ec": None,
                "queues": {"gateway": 0, "transfers": 3, "peers": -1},
                "peers": [
                    {"agent": "kvd-β", "rtt_ms": 0.5, "regions": [1, 2]},
                    {"agent": "kvd-ж", "rtt_ms": 1e-3, "regions": []},
                ],
                "bytes": (1 << 64) - 1,
                "raw": b"\x00\x01\xfe\xff",
            }
        ),
    ),
    "PingPeer": (13, wire.PingPeer(host="decode-1.example", port=5601, timeout=2.5)),
    "GetTrace": (14, wire.GetTrace(request_id=REQ, peer=True, timeout=2.5)),
    "Drain": (15, wire.Drain(timeout=120.5, exit=True)),
    "AbortRequest": (16, wire.AbortRequest(request_id=REQ)),
    "SendFinished": (0, wire.SendFinished(request_id=REQ)),
    "RecvFinished": (0, wire.RecvFinished(request_id=REQ)),
    "RecvFailed": (
        0,
        wire.RecvFailed(
            request_id=REQ,
            code=int(ErrorCode.TRANSFER),
            reason="NIXL_ERR_REMOTE_DISCONNECT: péér gone",
            block_ids=BLOCKS[::2],
        ),
    ),
    "SendFailed": (
        0,
        wire.SendFailed(request_id=REQ, code=int(ErrorCode.NOT_FOUND), reason="aborted"),
    ),
    "SendExpired": (0, wire.SendExpired(request_id=REQ)),
    "Handshake": (
        (1 << 64) - 1,
        wire.Handshake(
            agent_name="kvd-host-ø-1234",
            incarnation=0x0123_4567_89AB_CDEF,
            nixl_md=b"\x89NIXL\r\n" + bytes(range(255, -1, -1)),
            side_host="10.0.0.7",
            side_port=5600,
            kv_lease_duration=30.0,
            write_bound=152.0,
            regions=(
                _region(3, 0, LAYOUT, "DRAM", 0, GROUPS),
                _region(1, 0, LAYOUT, "DRAM", 0),
                _region(2, 1, LAYOUT_MLA, "VRAM", 1 << 10),
            ),
            canary_addr=0x7F00_DEAD_BEEF,
            canary_bytes=64,
            nonce=bytes(range(16, 48)),
            timestamp=1_795_000_000.125,
            mac=bytes(32),
            machine=0x1669_312D_D9B9_B7E8,
            rdma=True,
            cma=True,
            doorbell=True,
        ),
    ),
    "PushRegistration": (
        0,
        wire.PushRegistration(
            request_id=REQ,
            remote_request_id=REMOTE_REQ,
            engine_id=REMOTE_ENGINE,
            remote_engine_id=ENGINE,
            tp_size=4,
            block_ids=BLOCKS,
            side_host="decode-1.example",
            side_port=5601,
            incarnation=0x1122334455667788,
            generations=(7, 8, 0xFFFFFFFF, 0),
            p_session="scheduler-4242-a1b2c3d4e5f6",
            num_tokens=1 << 40,
            p_incarnation=0x8877665544332211,
            p_block_ids=tuple(reversed(BLOCKS)),
        ),
    ),
    "Heartbeat": (0, wire.Heartbeat(request_ids=(REQ, REMOTE_REQ, "r-3"))),
    "PushDone": (
        0,
        wire.PushDone(request_id=REQ, tp_rank=3, ok=False, code=8, reason="write failed: ✗"),
    ),
    "LayersPushed": (
        0,
        wire.LayersPushed(
            tp_rank=3,
            ranges=(
                wire.LayerRange(request_id=REQ, first=0, end=1),
                wire.LayerRange(request_id=REMOTE_REQ, first=60, end=1 << 16),
            ),
        ),
    ),
    "PullDone": (
        0,
        wire.PullDone(
            request_id=REMOTE_REQ,
            d_request_id=REQ,
            generations=(40001, 40002),
            p_session="scheduler-ü-1",
            p_incarnation=0xFEDCBA9876543210,
        ),
    ),
    "PullAck": (0, wire.PullAck(d_request_id=REQ, ok=True, code=0, reason="")),
    "CancelRegistration": (0, wire.CancelRegistration(request_id=REQ)),
    "RegionDropped": (
        0,
        wire.RegionDropped(
            agent_name="kvd-host-ø-1234",
            region_id=2,
            generation=7,
            timestamp=1_790_000_000.25,
            mac=bytes(range(32)),
        ),
    ),
    "Probe": (
        0,
        wire.Probe(
            nonce=(1 << 64) - 2, reply=False, canary_addr=(1 << 47) + 64, canary_bytes=65536
        ),
    ),
    "Resync": (0, wire.Resync(nonce=0x0102030405060708)),
    "ResyncAck": (0, wire.ResyncAck(nonce=(1 << 64) - 1)),
    "TraceQuery": (
        0x0000FFFFFFFFFFFF,
        wire.TraceQuery(
            agent_name="kvd-host-ø-1234",
            request_ids=(REQ, REMOTE_REQ),
            t0=(1 << 64) - 1,
            nonce=bytes(range(16)),
            timestamp=1_790_000_000.25,
            mac=bytes(range(32)),
        ),
    ),
    "TraceAnswer": (
        0x0000FFFFFFFFFFFF,
        wire.TraceAnswer(
            agent_name="kvd-ж-5600",
            t0=(1 << 64) - 1,
            t1=0,
            t2=123_456_789_012_345,
            ids=(REMOTE_REQ,),
            stages=(
                wire.TraceStage(t_ns=1, request_id=REMOTE_REQ, stage="nixl.notif_polled"),
                wire.TraceStage(t_ns=(1 << 64) - 1, request_id=REQ, stage="sender.claimed"),
            ),
            dropped=0xFFFFFFFF,
            mac=b"",
        ),
    ),
    "ECAllocate": (31, wire.ECAllocate(mm_hash="mm-ï-9f8e", nbytes=4_718_592)),
    "ECBlocks": (
        31,
        wire.ECBlocks(
            mm_hash="mm-ï-9f8e",
            block_ids=(3, 4, 5, 9, 10),
            block_bytes=1 << 20,
            region="kvd-ec-1234-abcd",
        ),
    ),
    "ECCommit": (
        32,
        wire.ECCommit(
            mm_hash="mm-ï-9f8e",
            nbytes=4_718_592,
            shape=(576, 4096),
            dtype="bfloat16",
            modality="image",
            compat="c0ffee",
        ),
    ),
    "ECParams": (
        32,
        wire.ECParams(
            mm_hash="mm-ï-9f8e",
            peer_host="10.0.0.7",
            peer_port=5700,
            nbytes=4_718_592,
            shape=(576, 4096),
            dtype="bfloat16",
            modality="image",
            compat="c0ffee",
        ),
    ),
    "ECEnsure": (
        33,
        wire.ECEnsure(
            mm_hash="mm-ï-9f8e",
            peer_host="10.0.0.7",
            peer_port=5700,
            nbytes=4_718_592,
            compat="c0ffee",
        ),
    ),
    "ECRelease": (34, wire.ECRelease(mm_hash="mm-ï-9f8e")),
    "ECHits": (35, wire.ECHits(mm_hashes=("mm-ï-9f8e", "mm-2"))),
    "ECReady": (
        0,
        wire.ECReady(
            mm_hash="mm-ï-9f8e", block_ids=(0, 1, 2, 3, 4), nbytes=4_718_592, local_hit=True
        ),
    ),
    "ECUnavailable": (
        0,
        wire.ECUnavailable(
            mm_hash="mm-ï-9f8e", code=int(ErrorCode.TIMEOUT), reason="no answer from the producer"
        ),
    ),
    "ECXferReq": (
        0,
        wire.ECXferReq(
            mm_hash="mm-ï-9f8e",
            compat="c0ffee",
            agent_name="kvd-consumer-1",
            side_host="10.0.0.8",
            side_port=5600,
            dst_region=3,
            dst_generation=11,
            dst_block_ids=(40, 41, 42, 43, 44),
            timestamp=1_795_000_000.5,
            nonce=bytes(range(100, 116)),
            mac=bytes(range(32, 0, -1)),
            serve_by_ns=123_456_789_012_345,
            incarnation=0x0123_4567_89AB_CDEF,
        ),
    ),
    "ECXferAck": (
        0,
        wire.ECXferAck(
            mm_hash="mm-ï-9f8e",
            ok=False,
            code=int(ErrorCode.NOT_FOUND),
            reason="unknown encoder output",
            nbytes=0,
            nonce=bytes(range(100, 116)),
            mac=bytes(range(100, 132)),
        ),
    ),
    "ECXferCancel": (
        0,
        wire.ECXferCancel(
            mm_hash="mm-ï-9f8e", nonce=bytes(range(100, 116)), mac=bytes(range(64, 96))
        ),
    ),
    "Sealed": (
        0,
        wire.Sealed(
            key_id=bytes(range(16)),
            counter=(1 << 40) + 7,
            body=wire.encode(wire.Heartbeat(("cmpl-a-0", "cmpl-b-1"))),
            mac=bytes(range(200, 232)),
        ),
    ),
    "TierOpen": (
        60,
        wire.TierOpen(
            namespace=b"compat-\x00\xffA", block_bytes=2 * 1024 * 1024, prev="tiers-77-0a1b2c"
        ),
    ),
    "TierOpened": (
        60,
        wire.TierOpened(
            pool="kvd-tiers-123-0a1b2c3d",
            pool_bytes=1 << 30,
            slot_bytes=2 * 1024 * 1024,
            num_slots=512,
            pin_timeout=30.0,
            lookup_timeout=2.0,
            disk=True,
            disk_files="/var/lib/kvd/tiers",
            disk_verify=True,
            gens="kvd-tiers-123-0a1b2c3d-gens",
            directory="kvd-tiers-123-0a1b2c3d-dir",
        ),
    ),
    "TierLookup": (
        61,
        wire.TierLookup(namespace=b"compat-A", key_bytes=4, keys=b"\x00\x01\x02\x03abcd"),
    ),
    "TierFound": (61, wire.TierFound(found=bytes([1, 0, 2]))),
    "TierReserve": (62, wire.TierReserve(namespace=b"compat-A", key_bytes=2, keys=b"k1k2")),
    "TierSlots": (
        62,
        wire.TierSlots(op=7, slots=(5, -1, -2, 1 << 20), gens=bytes(range(32))),
    ),
    "TierCommit": (63, wire.TierCommit(op=7, ok=bytes([1, 0, 1]))),
    "TierFlags": (63, wire.TierFlags(flags=bytes([1, 1, 0]))),
    "TierPin": (64, wire.TierPin(namespace=b"compat-A", key_bytes=3, keys=b"abc", files=True)),
    "TierUnpin": (65, wire.TierUnpin(op=(1 << 64) - 1)),
    "TierGrant": (69, wire.TierGrant(n=32)),
    "TierGranted": (69, wire.TierGranted(slots=(3, 4, 5, 1 << 20))),
    "TierPut": (
        70,
        wire.TierPut(namespace=b"compat-A", key_bytes=2, keys=b"k1k2", slots=(3, 4)),
    ),
    "TierTouch": (
        71,
        wire.TierTouch(namespace=b"compat-A", key_bytes=4, keys=b"\x00\x01\x02\x03abcd", disk=True),
    ),
    "PeerTierLookup": (
        66,
        wire.PeerTierLookup(
            agent_name="kvd-node-β",
            namespace=b"compat-A",
            block_bytes=65536,
            key_bytes=4,
            keys=b"\x00\x01\x02\x03abcd",
        ),
    ),
    "PeerTierPin": (
        67,
        wire.PeerTierPin(
            agent_name="kvd-node-β",
            incarnation=(1 << 64) - 1,
            namespace=b"compat-A",
            block_bytes=65536,
            key_bytes=2,
            keys=b"k1k2",
            inline=True,
        ),
    ),
    "PeerTierPinned": (
        67,
        wire.PeerTierPinned(
            op=9,
            pool_addr=0x7F00_0000_0000,
            pool_bytes=1 << 30,
            slot_bytes=65536,
            slots=(3, -1),
            checksum_kind=1,
            checksums=(1 << 63).to_bytes(8, "little") + bytes(8),
            data=bytes(range(256)) * 4,
        ),
    ),
    "PeerTierUnpin": (68, wire.PeerTierUnpin(agent_name="kvd-node-β", op=9)),
}
"""Type name -> (corr, instance); corr is 0 for events and notifications."""


def fixture_path(name: str) -> Path:
    return FIXTURE_DIR / f"{name}.bin"


def main() -> int:
    names = {cls.__name__ for cls in wire.registry().values()}
    missing = sorted(names - GOLDEN.keys())
    if missing:
        print(f"no GOLDEN instance for: {', '.join(missing)}", file=sys.stderr)
        return 1
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    for stale in sorted(FIXTURE_DIR.glob("*.bin")):
        if stale.stem not in names:
            print(f"removing {stale} (no such message)")
            stale.unlink()
    for name, (corr, msg) in sorted(GOLDEN.items()):
        data = wire.encode(msg, corr)
        path = fixture_path(name)
        if not path.exists() or path.read_bytes() != data:
            print(f"writing {path} ({len(data)} bytes)")
            path.write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
