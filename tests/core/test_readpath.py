"""Which pulls READ and which go by P's WRITE (`kvd.core.readpath`)."""

from __future__ import annotations

import pytest

from kvd.adapters.nixl import rdma_devices
from kvd.core.readpath import Reach, allows, by_write, local_reach, native_reads

HERE = Reach(machine=0x1234, rdma=False, cma=True)
ELSEWHERE = Reach(machine=0x5678, rdma=False, cma=True)


@pytest.mark.parametrize(
    ("tls", "cma", "rdma"),
    [
        ("", True, True),
        ("all", True, True),
        ("tcp", False, False),
        ("tcp,cma", True, False),
        ("shm,tcp", True, False),
        ("rc,tcp", False, True),
        ("rc_x", False, True),
        ("^cma", False, True),
        ("^tcp", True, True),
        ("^shm", False, True),
        ("^ib", True, False),
        ("tcp,ib", False, True),
        (
            "^rc,rc_x,rc_v,rc_verbs,rc_mlx5,dc,dc_x,dc_mlx5,ud,ud_x,ud_v,ud_verbs,ud_mlx5,srd,gga",
            True,
            False,
        ),
    ],
)
def test_ucx_tls_says_which_transports_may_be_used(tls: str, cma: bool, rdma: bool) -> None:
    from kvd.core.readpath import CMA_GROUPS, RDMA_GROUPS, RDMA_TRANSPORTS

    assert allows(tls, frozenset({"cma"}), CMA_GROUPS) is cma
    assert allows(tls, RDMA_TRANSPORTS, RDMA_GROUPS) is rdma


def test_one_machine_reads_natively_unless_cma_is_excluded_on_either_side() -> None:
    no_cma = Reach(0x1234, False, cma=False)  # UCX_TLS=tcp: UCX emulates over loopback TCP
    assert native_reads(HERE, HERE)
    assert not native_reads(HERE, no_cma) and not native_reads(no_cma, HERE)
    assert not by_write("auto", native_reads(HERE, HERE))
    assert by_write("auto", native_reads(HERE, no_cma))


def test_between_hosts_only_rdma_on_both_sides_reads_natively() -> None:
    rdma_here, rdma_there = Reach(0x1234, True, True), Reach(0x5678, True, True)
    assert not native_reads(HERE, ELSEWHERE)  # TCP: emulated (cma needs one machine)
    assert not native_reads(rdma_here, ELSEWHERE)  # the peer has no RDMA: TCP
    assert native_reads(rdma_here, rdma_there)
    assert by_write("auto", native_reads(HERE, ELSEWHERE))
    assert not by_write("auto", native_reads(rdma_here, rdma_there))


def test_an_unknown_machine_is_never_taken_for_this_one() -> None:
    unknown = Reach(0, False, True)
    assert not native_reads(unknown, unknown)


def test_the_setting_overrides_auto() -> None:
    assert by_write("write", native=True) and not by_write("read", native=False)


def test_local_reach_needs_a_device_and_an_allowed_transport(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert local_reach(7, True, "") == Reach(7, True, True)
    assert local_reach(7, True, "tcp") == Reach(7, False, False)
    assert local_reach(7, False, "rc,cma") == Reach(7, False, True)
    assert not rdma_devices(str(tmp_path / "none"))
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path))
