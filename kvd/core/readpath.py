"""Whether a READ from a peer daemon is native or UCX's software emulation, and so how a
pull moves its bytes.

A NIXL READ is `ucp_get`. Over RDMA (rc, dc, ud: the NIC reads the peer's memory) and on
one machine (`cma`: process_vm_readv) UCX does it natively. Over TCP it emulates it: the
reader sends a GET request as an active message, and the peer's UCX answers it from its
own progress loop. That answer has no error path in UCX 1.23: a GET request read from a
connection whose reader has died since (reset) makes `ucp_progress_get_reply` return the
send error, and `ucp_request_send` calls `ucs_fatal` on it. The serving daemon aborts
(`ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout`). A reader dying while
the server is stopped or starved of CPU (its GET requests wait in the socket) is enough:
`scripts/repro_freeze_kill.py` hits it within two rounds. A WRITE over TCP is native
(`put/zcopy`, errors handled), so where a READ would be emulated kvd pulls by WRITE:
D's daemon sends P a registration naming the P blocks to pull, and P WRITEs them as it
would a push (`wire.PushRegistration.p_block_ids`).

Pure: the facts come from `kvd.adapters.nixl.local_reach` and the peer's handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

RDMA_TRANSPORTS: Final = frozenset(
    {
        "rc",
        "rc_x",
        "rc_v",
        "rc_verbs",
        "rc_mlx5",
        "dc",
        "dc_x",
        "dc_mlx5",
        "ud",
        "ud_x",
        "ud_v",
        "ud_verbs",
        "ud_mlx5",
        "srd",
        "gga",
    }
)
"""UCX_TLS names of transports that reach another host over RDMA."""
RDMA_GROUPS: Final = frozenset({"ib"})
"""UCX_TLS names that stand for every one of them."""
CMA_GROUPS: Final = frozenset({"sm", "shm"})
"""UCX_TLS names that stand for shared-memory transports, `cma` among them (UCX's native
READ between processes of one machine)."""


@dataclass(frozen=True, slots=True)
class Reach:
    """What a daemon's UCX can do, as its handshake says."""

    machine: int = 0
    """UCX's machine id (`ucs_machine_guid`: MAC address and host name); 0 = not known."""
    rdma: bool = False
    """An RDMA device is there and UCX_TLS allows an RDMA transport."""
    cma: bool = False
    """UCX_TLS allows `cma` (both daemons on one machine must, for a native READ)."""


def allows(ucx_tls: str, transports: frozenset[str], groups: frozenset[str] = frozenset()) -> bool:
    """Whether UCX_TLS lets UCX use one of `transports` (`groups`: names standing for all
    of them). `""` or `all`: every transport; `a,b`: those named; `^a,b`: all but those."""
    tls = ucx_tls.strip()
    items = {t.strip() for t in tls.lstrip("^").split(",") if t.strip()}
    if not tls.startswith("^"):
        return not items or "all" in items or bool((transports | groups) & items)
    if "all" in items or groups & items:
        return False
    return bool(transports - items)


def local_reach(machine: int, rdma_devices: bool, ucx_tls: str) -> Reach:
    """This daemon's `Reach` from the facts of its host and its UCX_TLS."""
    return Reach(
        machine,
        rdma=rdma_devices and allows(ucx_tls, RDMA_TRANSPORTS, RDMA_GROUPS),
        cma=allows(ucx_tls, frozenset({"cma"}), CMA_GROUPS),
    )


def native_reads(mine: Reach, theirs: Reach) -> bool:
    """Whether UCX READs natively from the peer: on one machine with `cma` allowed on both
    sides, or between two daemons that both reach other hosts over RDMA. Anything not
    known to be native is taken as emulated (a pull by WRITE costs about what a READ
    does)."""
    if mine.machine and mine.machine == theirs.machine:
        return mine.cma and theirs.cma
    return mine.rdma and theirs.rdma


def by_write(setting: str, native: bool) -> bool:
    """Whether a READ from a peer is replaced (a pull by P's WRITE, a tier load inline):
    `transfer.pull_by` = `write` always, `read` never, `auto` where the READ would not be
    native (`native_reads`)."""
    return setting == "write" or (setting == "auto" and not native)
