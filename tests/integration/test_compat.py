"""The KV compatibility check cannot be bypassed: real daemons, real NIXL, real shared memory.

Every region declares a `compat` string (what must agree between the two ends of a
transfer: `kvd_client.layout.compat_hash`). A region without one is refused at
registration; a P and a D whose regions declare different ones never exchange a byte:
D's request fails naming both values, and P's lease ends (by expiry: D never tells P).
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import ErrorCode, InvalidRequest
from kvd_client.shm import SharedRegion, unique_name

from kvd.demo import Engine, make_engine, pattern

from .conftest import StartDaemon, wait_until

HOST = "127.0.0.1"
SENTINEL = 0xA5
"""What D's blocks hold before the request: none of them may change."""


def compat_of(model: str) -> str:
    return kvlayout.compat_hash(
        model=model,
        dtype="bfloat16",
        num_kv_heads=8,
        head_size=128,
        num_layers=2,
        tokens_per_block=16,
        kv_layout="NHD",
        transfer_mode="any",
    )


P_COMPAT = compat_of("org/model-a")
D_COMPAT = compat_of("org/model-b")


def wait_terminal(client: KvdClient, rid: str, kinds: tuple[type, ...], timeout: float) -> Event:
    seen: list[Event] = []

    def done() -> Event | None:
        seen.extend(client.drain_events())
        return next((e for e in seen if e.request_id == rid and isinstance(e, kinds)), None)

    ev: Event = wait_until(done, timeout, f"a terminal event for {rid}")
    return ev


def counters(c: KvdClient) -> dict[str, int]:
    got: dict[str, int] = c.status()["counters"]
    return got


def whole_region(eng: Engine) -> np.ndarray:
    return np.frombuffer(eng.regions[0].buf, dtype=np.uint8)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_mismatched_compat_fails_d_naming_both_and_moves_no_byte(
    daemons: StartDaemon, mode: str
) -> None:
    # a long lease: P's send must end by D's cancel, not by running out
    p_d = daemons("kvd-p", overrides={"transfer": {"kv_lease_duration": 30.0}})
    d_d = daemons("kvd-d")
    geo = {"num_blocks": 32, "num_layers": 2, "chunk_bytes": 4096}
    p = make_engine(p_d.socket, "prefill", compat=P_COMPAT, **geo)
    d = make_engine(d_d.socket, "decode", compat=D_COMPAT, **geo)
    try:
        key = f"cmpl-{secrets.token_hex(8)}-0"
        p_id, d_id = f"{key}-{secrets.token_hex(4)}", f"{key}-{secrets.token_hex(4)}"
        p_blocks, d_blocks = [3, 4, 9], [20, 7, 8]
        for j, b in enumerate(p_blocks):
            p.block(0, b)[:] = pattern(key, j, p.block_bytes)
        whole_region(d)[:] = SENTINEL
        p_before, d_before = p.client.status(), d.client.status()

        d.client.track(d_id, HOST, p_d.side_port, remote_request_id=p_id)
        p.client.finished(p_id, p_blocks)
        if mode == "push":
            d.client.register_push(d_id, d_blocks, HOST, p_d.side_port)
        else:
            d.client.pull(
                d_id,
                d_blocks,
                HOST,
                p_d.side_port,
                remote_request_id=p_id,
                remote_block_ids=p_blocks,
            )

        ev = wait_terminal(d.client, d_id, (wire.RecvFinished, wire.RecvFailed), 10.0)
        assert isinstance(ev, wire.RecvFailed), ev
        assert ev.code == ErrorCode.INCOMPATIBLE, ev
        assert ev.block_ids == tuple(d_blocks)
        assert "KV compatibility differs" in ev.reason, ev.reason
        assert f"P rank 0 {P_COMPAT!r}" in ev.reason, ev.reason
        assert f"D rank 0 {D_COMPAT!r}" in ev.reason, ev.reason

        # D refused before any registration or READ, and cancels at P: P frees at once
        sent = wait_terminal(
            p.client, p_id, (wire.SendFinished, wire.SendFailed, wire.SendExpired), 10.0
        )
        assert isinstance(sent, wire.SendFailed) and "cancelled by D" in sent.reason, sent
        wait_until(lambda: p.client.status("leases")["leases"] == [], 5.0, "P holds no lease")
        wait_until(lambda: d.client.status("leases")["tracked"] == [], 5.0, "D tracks nothing")

        # not one byte moved: D's region is as it was, and neither daemon posted a transfer
        assert bool((whole_region(d) == SENTINEL).all())
        p_after, d_after = p.client.status(), d.client.status()
        for before, after in ((p_before, p_after), (d_before, d_after)):
            assert after["nixl"]["transfers_posted"] == before["nixl"]["transfers_posted"]
        assert p_after["counters"].get("push_registrations", 0) == 0
        assert p_after["counters"].get("pulls_acked", 0) == 0
        assert p_after["counters"].get("leases_expired", 0) == 0
        assert p_after["counters"]["leases_cancelled"] == 1
        assert d_after["counters"].get("recv_ok", 0) == 0
        assert d_after["counters"]["recv_failed"] == 1

        # both ends declaring the same compat still move every byte (same daemons)
        same = make_engine(d_d.socket, "decode-same", compat=P_COMPAT, **geo)
        try:
            key2 = f"cmpl-{secrets.token_hex(8)}-0"
            p2, d2 = f"{key2}-{secrets.token_hex(4)}", f"{key2}-{secrets.token_hex(4)}"
            for j, b in enumerate(p_blocks):
                p.block(0, b)[:] = pattern(key2, j, p.block_bytes)
            p.client.finished(p2, p_blocks)
            same.client.pull(
                d2, d_blocks, HOST, p_d.side_port, remote_request_id=p2, remote_block_ids=p_blocks
            )
            ok = wait_terminal(same.client, d2, (wire.RecvFinished, wire.RecvFailed), 10.0)
            assert isinstance(ok, wire.RecvFinished), ok
            for j, b in enumerate(d_blocks):
                assert np.array_equal(same.block(0, b), pattern(key2, j, p.block_bytes))
        finally:
            same.close()
    finally:
        d.close()
        p.close()


def test_region_without_compat_is_refused_at_registration(daemons: StartDaemon) -> None:
    dd = daemons("kvd-d")
    lay = kvlayout.block_major(16, 2, 4096)
    with (
        SharedRegion(unique_name("kvdt-nocompat"), kvlayout.region_bytes(lay)) as region,
        KvdClient(dd.socket, role="worker", engine_id="nocompat", tp_rank=0) as c,
    ):
        before = counters(c)
        with pytest.raises(InvalidRequest) as err:
            c.register_region(region, layout=lay, compat="")
        assert "compat must identify the model and KV format" in err.value.message
        assert "kvd_client.layout.compat_hash" in err.value.message
        after = counters(c)
        assert after.get("region_rejected", 0) - before.get("region_rejected", 0) == 1
        assert after.get("regions_registered", 0) == before.get("regions_registered", 0)
        assert all(r["engine_id"] != "nocompat" for r in c.status()["regions"])
        # the daemon keeps serving: the same region with a compat registers
        rid = c.register_region(region, layout=lay, compat=compat_of("org/model-a"))
        listed = [r for r in c.status()["regions"] if r["engine_id"] == "nocompat"]
        assert [(r["region_id"], r["compat"]) for r in listed] == [(rid, compat_of("org/model-a"))]
