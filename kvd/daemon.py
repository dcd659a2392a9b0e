"""The supervisor: one task group runs every actor; one signal ends them all.

Start order follows dependencies: the NIXL engine, then the registrar (canary
registered), the side channel (bound), sender and receiver, and last the gateway (IPC
socket bound). Only then is the daemon ready (logged, and READY=1 to systemd). SIGTERM
or SIGINT cancels the group; cleanup (peers told, regions deregistered and unmapped,
socket removed) runs shielded and bounded by `daemon.shutdown_timeout`. An actor that
crashes takes the whole daemon down with the reason logged: no half-alive daemon.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import Any, Final

import anyio
import structlog
from kvd_client import wire
from kvd_client.errors import InvalidRequest, KvdError, NotFound

from kvd import __version__
from kvd.actors.base import Clock, Mailbox, StartFailed
from kvd.actors.ecrouter import ECRouter
from kvd.actors.gateway import Gateway
from kvd.actors.messages import (
    AbortByOperator,
    DrainLocalRegion,
    DrainRemoteRegion,
    EventOut,
    LocalRegionsChanged,
    Snapshot,
)
from kvd.actors.notifier import Notifier
from kvd.actors.receiver import Receiver
from kvd.actors.registrar import Registrar
from kvd.actors.sender import Sender
from kvd.actors.sidechannel import SideChannel
from kvd.actors.tiers import Tiers
from kvd.adapters import systemd
from kvd.adapters.nixl import NixlEngine, machine_guid, rdma_devices
from kvd.adapters.staging import StagingArea
from kvd.config import Config, resolve_agent_name, resolve_socket_path
from kvd.core.peersession import Keyring
from kvd.core.readpath import local_reach
from kvd.core.receiver import push_hold_bound
from kvd.core.silence import LastSigns
from kvd.core.trace import StageTrace
from kvd.drain import Drain
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.daemon")

TRACE_CHUNK: Final = 50_000
"""Most stage-trace records in one `trace` status reply (the caller asks again for the
rest): a reply stays well under the default frame limit."""


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.started = time.time()
        self.counters: dict[str, int] = {}
        self.rejects = RejectLog(self.counters, cfg.log.rejection_interval)
        self._metrics: Any = None
        self.socket_path = str(resolve_socket_path(cfg))
        self.agent_name = resolve_agent_name(cfg)
        size = cfg.daemon.mailbox_size
        secret = cfg.auth.load_secret()
        self.authenticated = secret is not None
        self.keyring = Keyring(self.agent_name) if secret is not None else None
        self.clock = Clock()
        self.trace = StageTrace(
            cfg.daemon.trace_records, time.monotonic_ns, requests=cfg.daemon.trace_requests
        )
        self.registrar_box: Mailbox[Any] = Mailbox("registrar", size, self.clock)
        self.sender_box: Mailbox[Any] = Mailbox("sender", size, self.clock)
        self.receiver_box: Mailbox[Any] = Mailbox("receiver", size, self.clock)
        self.ec_box: Mailbox[Any] = Mailbox("ecrouter", size, self.clock)
        self.tiers_box: Mailbox[Any] = Mailbox("tiers", size, self.clock)
        self.events: Mailbox[EventOut] = Mailbox("events", max(size * 64, 65536), self.clock)
        self.engine = NixlEngine(
            self.agent_name,
            backend=cfg.nixl.backend,
            error_handling_mode=cfg.nixl.ucx_error_handling_mode,
            num_threads=cfg.nixl.num_threads,
            poll_max_idle_us=cfg.nixl.poll_max_idle_us,
            poll_deep_idle_us=cfg.nixl.poll_deep_idle_us,
            ucx_tls=cfg.nixl.ucx_tls,
            settle_timeout=cfg.transfer.transfer_timeout,
            trace=self.trace,
            file_backend=cfg.tiers.enabled and bool(cfg.tiers.disk_path),
        )
        self.engine.keyring = self.keyring
        self.side = SideChannel(
            host=cfg.side_channel.host,
            port=cfg.side_channel.port,
            registrar=self.registrar_box,
            drain_remote=self._drain_remote,
            max_frame=cfg.daemon.max_frame_bytes,
            counters=self.counters,
            rejects=self.rejects,
            agent_name=self.agent_name,
            secret=secret,
            trace=self.trace,
            keyring=self.keyring,
            handshake_bytes=cfg.limits.handshake_bytes,
            tiers=self.tiers_box,
        )
        self.signs = LastSigns()
        """Peers' signs of life: the notifier notes their notifications, the registrar
        their side channels' answers, and forgets the silent ones (`kvd.core.silence`)."""
        self.registrar = Registrar(
            engine=self.engine,
            mailbox=self.registrar_box,
            side_host=cfg.side_channel.advertised_host,
            side_port_ref=lambda: self.side.port,
            lease_duration=cfg.transfer.kv_lease_duration,
            handshake_timeout=cfg.side_channel.handshake_timeout,
            forget_silent=cfg.side_channel.forget_silent_peers,
            signs=self.signs,
            # the adapter's settle bound is the transfer timeout (see the engines above)
            write_bound=push_hold_bound(
                cfg.transfer.kv_lease_duration,
                cfg.transfer.transfer_timeout,
                cfg.transfer.transfer_timeout,
            ),
            secret=secret,
            keyring=self.keyring,
            publish=self._publish,
            drain_local=self._drain_local,
            counters=self.counters,
            rejects=self.rejects,
            reap_leftovers=cfg.daemon.reap_leftover_segments,
            trace=self.trace,
            max_frame=cfg.daemon.max_frame_bytes,
            reach=lambda: local_reach(machine_guid(), rdma_devices(), self._ucx_tls()),
            ucx_tls=self._ucx_tls(),
            pull_by=cfg.transfer.pull_by,
        )
        self.staging = (
            StagingArea(cfg.transfer.staging_bytes, self.engine.register, self.engine.deregister)
            if cfg.transfer.staging_bytes
            else None
        )
        self.sender = Sender(
            transport=self.engine,
            mailbox=self.sender_box,
            registrar=self.registrar_box,
            emit=self._emit,
            lease_duration=cfg.transfer.kv_lease_duration,
            lease_wait_timeout=cfg.transfer.lease_wait_timeout,
            registration_timeout=cfg.transfer.push_registration_timeout,
            transfer_timeout=cfg.transfer.transfer_timeout,
            tombstones=cfg.transfer.expired_tombstones,
            max_pending_per_peer=cfg.limits.pending_registrations_per_peer,
            pending_bytes=cfg.limits.pending_bytes,
            counters=self.counters,
            rejects=self.rejects,
            trace=self.trace,
            staging=self.staging,
            gather_part_bytes=cfg.transfer.gather_part_bytes,
            incarnation=self.registrar.incarnation,
        )
        self.receiver = Receiver(
            transport=self.engine,
            mailbox=self.receiver_box,
            registrar=self.registrar_box,
            emit=self._emit,
            lease_duration=cfg.transfer.kv_lease_duration,
            probe_interval=cfg.transfer.peer_probe_interval,
            push_registration_timeout=cfg.transfer.push_registration_timeout,
            transfer_timeout=cfg.transfer.transfer_timeout,
            counters=self.counters,
            incarnation=self.registrar.incarnation,
            side_host=cfg.side_channel.advertised_host,
            side_port_ref=lambda: self.side.port,
            rejects=self.rejects,
            pending_bytes=cfg.limits.pending_bytes,
            trace=self.trace,
            staging=self.staging,
            pull_by=cfg.transfer.pull_by,
        )
        self.ecrouter = ECRouter(
            engine=self.engine,
            mailbox=self.ec_box,
            registrar=self.registrar_box,
            emit=self._emit,
            role=cfg.ec.role,
            host=cfg.side_channel.host,
            advertise_host=cfg.side_channel.advertised_host,
            port=cfg.ec.port,
            region_bytes=cfg.ec.region_bytes,
            block_bytes=cfg.ec.block_bytes,
            xfer_timeout=cfg.ec.xfer_timeout,
            dealer_idle=cfg.ec.producer_socket_idle,
            settle_timeout=cfg.transfer.transfer_timeout,
            side_host=cfg.side_channel.advertised_host,
            side_port_ref=lambda: self.side.port,
            max_frame=cfg.daemon.max_frame_bytes,
            secret=secret,
            counters=self.counters,
            rejects=self.rejects,
            incarnation=self.registrar.incarnation,
            mono_ns=self.trace.clock,
            resolver=self.registrar.resolver,
        )
        self.tiers = Tiers(
            engine=self.engine,
            mailbox=self.tiers_box,
            cfg=cfg.tiers,
            counters=self.counters,
            rejects=self.rejects,
            registrar=self.registrar_box,
            keyring=self.keyring,
            max_frame=cfg.daemon.max_frame_bytes,
            agent_name=self.agent_name,
            incarnation=self.registrar.incarnation,
            resolver=self.registrar.resolver,
            pull_by=cfg.transfer.pull_by,
        )
        self.notifier = Notifier(
            sender=self.sender_box,
            receiver=self.receiver_box,
            registrar=self.registrar_box,
            max_frame=cfg.daemon.max_frame_bytes,
            counters=self.counters,
            rejects=self.rejects,
            notifs_per_peer_per_s=cfg.limits.notifs_per_peer_per_s,
            clock=self.clock,
            trace=self.trace,
            keyring=self.keyring,
            budget=self.sender.proto.budget,
            transport=self.engine,
            notif_bytes=cfg.limits.notif_bytes,
            signs=self.signs,
        )
        self.gateway = Gateway(
            socket_path=self.socket_path,
            socket_mode=cfg.daemon.socket_mode,
            registrar=self.registrar_box,
            sender=self.sender_box,
            receiver=self.receiver_box,
            ecrouter=self.ec_box,
            events=self.events,
            tiers=self.tiers_box,
            client_timeout=cfg.daemon.client_timeout,
            max_frame=cfg.daemon.max_frame_bytes,
            counters=self.counters,
            rejects=self.rejects,
            status=self.status,
            admin=self.admin,
            welcome=self._welcome,
            clock=self.clock,
            close_bound=cfg.transfer.transfer_timeout + cfg.side_channel.handshake_timeout + 5.0,
            max_clients=cfg.limits.max_clients,
            trace=self.trace,
        )
        # An idle NIXL thread pauses longer (nixl.poll_deep_idle_us) only while nothing of
        # ours may wait on the agent; any frame in (a client's, a peer's) wakes it at once
        self.engine.awake = self._awake
        for actor in (self.gateway, self.side, self.ecrouter):
            actor.on_input = self.engine.poke

        self.drain = Drain(
            sender=self.sender_box,
            receiver=self.receiver_box,
            ecrouter=self.ec_box,
            clock=self.clock,
            spawn=self._spawn,
            exit_daemon=self._request_exit,
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._exit: anyio.Event | None = None

    # ---------------------------------------------------------------- wiring

    def _spawn(self, fn: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn)

    def _request_exit(self) -> None:
        if self._exit is not None:
            self._exit.set()

    def _publish(self, msg: Any) -> None:
        """Registrar views: local regions to the sender (it checks finished blocks), the
        receiver and the EC router; peer views to the sender, the receiver, the tiers and
        the EC router (a producer serves a consumer's request through the view it holds).
        Notices between actors: never refused."""
        boxes: tuple[Mailbox[Any], ...] = (self.sender_box, self.receiver_box, self.ec_box)
        if not isinstance(msg, LocalRegionsChanged):
            # peer views: the tiers ask peers' tiers, and drop what a gone peer held
            boxes += (self.tiers_box,)
        for box in boxes:
            box.post(msg)

    async def _drain_local(self, region_id: int) -> None:
        """Before a local region goes: the transfers of both actors that touch it end."""
        await self.sender_box.call(DrainLocalRegion(region_id))
        await self.receiver_box.call(DrainLocalRegion(region_id))

    async def _drain_remote(self, agent: str, region_id: int) -> None:
        """Before a peer frees a region: our transfers into or out of it end."""
        await self.sender_box.call(DrainRemoteRegion(agent, region_id))
        await self.receiver_box.call(DrainRemoteRegion(agent, region_id))

    def _emit(self, ev: EventOut) -> None:
        self.events.post(ev)  # a notice between actors: never refused (see Mailbox.post)

    def _awake(self) -> bool:
        """(On the NIXL thread: plain reads of the actors' tables.) Whether anything may
        wait on a notification or on this agent's progress for a peer's transfer: live
        requests on either side, encoder-cache fetches (or quarantines a late WRITE may
        land in), tier operations (a peer's READ of pinned blocks), ping probes."""
        return (
            self.sender.busy()
            or self.receiver.busy()
            or self.ecrouter.busy()
            or self.tiers.busy()
            or self.registrar.busy()
        )

    def _welcome(self) -> wire.Welcome:
        return wire.Welcome(
            daemon_version=__version__,
            agent_name=self.agent_name,
            side_host=self.cfg.side_channel.advertised_host,
            side_port=self.side.port,
            kv_lease_duration=self.cfg.transfer.kv_lease_duration,
            ec_host=self.cfg.side_channel.advertised_host if self.ecrouter.producing else "",
            ec_port=self.ecrouter.port if self.ecrouter.producing else 0,
            incarnation=self.registrar.incarnation,
            client_timeout=self.cfg.daemon.client_timeout,
            push_registration_timeout=self.cfg.transfer.push_registration_timeout,
            decoder_kv_blocks_ttl=self.cfg.transfer.decoder_kv_blocks_ttl,
        )

    async def status(self, section: str) -> dict[str, Any]:
        boxes = {
            "registrar": self.registrar_box,
            "sender": self.sender_box,
            "receiver": self.receiver_box,
            "ecrouter": self.ec_box,
            "tiers": self.tiers_box,
        }
        if section in ("peers",):
            return await self.registrar_box.call(Snapshot(section))
        if section == "leases":  # P: leases held; D: requests heartbeated
            sent = await self.sender_box.call(Snapshot(section))
            return sent | await self.receiver_box.call(Snapshot(section))
        if section == "transfers":
            sent = await self.sender_box.call(Snapshot(section))
            got = await self.receiver_box.call(Snapshot(section))
            return {
                "in_flight": sent["in_flight"] + got["in_flight"],
                "recent": sorted(sent["recent"] + got["recent"], key=lambda t: t["started"]),
                "receiving": got["receiving"],
            }
        if section == "ec":
            return await self.ec_box.call(Snapshot(section))
        if section == "tiers":
            return await self.tiers_box.call(Snapshot(section))
        if section in ("trace", "trace_on", "trace_off"):
            return self._trace_section(section)
        if section == "drain":
            return await self.drain.status()
        out: dict[str, Any] = {
            "version": __version__,
            "agent_name": self.agent_name,
            "incarnation": f"{self.registrar.incarnation:016x}",
            "uptime_s": round(time.time() - self.started, 3),
            "stalled_s": round(self.clock.core.stalled, 3),
            "stalls": self.clock.stall_count,
            "pid": os.getpid(),
            "socket": self.socket_path,
            "settings": self._settings(),
            "drain": await self.drain.status(),
            "side_channel": f"{self.cfg.side_channel.advertised_host}:{self.side.port}",
            "session_keys": self.keyring.snapshot() if self.keyring is not None else {},
            "mailboxes": {name: box.stats() for name, box in boxes.items()}
            | {"events": self.events.stats()},
            "counters": dict(sorted(self.counters.items())),
            "nixl": self.engine.stats_dict(),
        }
        for name, box in boxes.items():
            out[name] = await box.call(Snapshot("status"))
        out["regions"] = out["registrar"].pop("regions")
        out["limits"] = self._limits(out["sender"].pop("limits"), out["receiver"].pop("limits"))
        out["peers"] = (await self.registrar_box.call(Snapshot("peers")))["peers"]
        out["sessions"] = self.gateway.snapshot()["sessions"]
        return out

    def _settings(self) -> dict[str, Any]:
        """The effective settings an operator checks first (`kvd status`)."""
        c = self.cfg
        return {
            "socket": self.socket_path,
            "socket_mode": f"{c.daemon.socket_mode:#o}",
            "auth": "on" if self.authenticated else "off",
            "kv_lease_duration": c.transfer.kv_lease_duration,
            "lease_wait_timeout": c.transfer.lease_wait_timeout,
            "push_registration_timeout": c.transfer.push_registration_timeout,
            "decoder_kv_blocks_ttl": c.transfer.decoder_kv_blocks_ttl,
            "transfer_timeout": c.transfer.transfer_timeout,
            "handshake_timeout": c.side_channel.handshake_timeout,
            "client_timeout": c.daemon.client_timeout,
            "shutdown_timeout": c.daemon.shutdown_timeout,
            "ucx_tls": c.nixl.ucx_tls,
        }

    async def admin(self, msg: wire.Record) -> dict[str, Any]:
        """An operator's request from a CLI session (`kvd drain`, `kvd abort`)."""
        if isinstance(msg, wire.Drain):
            exit_now = self.drain.start(msg.timeout, msg.exit)
            data = await self.drain.status()
            if exit_now:  # after the answer is made; it is sent before the exit runs
                self._request_exit()
            return data
        if isinstance(msg, wire.AbortRequest):
            return await self._abort_request(msg.request_id)
        raise InvalidRequest(f"{type(msg).__name__} is not an operator request")

    async def _abort_request(self, request_id: str) -> dict[str, Any]:
        """End the request on each side that holds it; NotFound if neither does."""
        out: dict[str, Any] = {"request_id": request_id}
        found = False
        for side, box in (("send", self.sender_box), ("recv", self.receiver_box)):
            try:
                out[side] = await box.call(AbortByOperator(request_id))
                found = True
            except NotFound:
                out[side] = None
            except KvdError as exc:  # e.g. a WRITE in flight: it ends by itself
                out[side] = {"error": exc.message}
                found = True
        if not found:
            raise NotFound(f"no request {request_id!r} on this daemon (neither sent nor received)")
        return out

    def _limits(self, sent: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
        """Each limit of `[limits]`: its value, its current use and the inputs it refused.
        `pending_bytes` bounds each transfer machine: P's (sender) and D's (receiver)."""
        return {
            "max_clients": self.gateway.limits(),
            "pending_registrations_per_peer": sent["pending_registrations_per_peer"],
            "notifs_per_peer_per_s": self.notifier.limits(),
            "pending_bytes_sender": sent["pending_bytes"],
            "pending_bytes_receiver": got["pending_bytes"],
            **self.notifier.byte_limits(),
            "handshake_bytes": self.side.limits(),
        }

    def _trace_section(self, section: str) -> dict[str, Any]:
        """`trace`: the stage-trace records, oldest first, at most TRACE_CHUNK (they leave
        the ring; `left` says how many wait); `trace_on`/`trace_off` switch recording."""
        tr = self.trace
        if section != "trace":
            tr.switch(section == "trace_on")
        full = tr.full
        records = tr.drain(TRACE_CHUNK) if section == "trace" else []
        return {
            "on": tr.on,
            "capacity": tr.capacity,
            "full": full,
            "records": [list(r) for r in records],
            "left": len(tr),
            "requests": tr.requests_held,
            "requests_capacity": tr.requests,
        }

    # ---------------------------------------------------------------- run

    async def run(self) -> None:
        # Before anything of the node's is touched (leftover segments, the tiers' disk,
        # NIXL): a second daemon with this node's config must change nothing.
        self.gateway.check_free()
        ok = False
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._exit = anyio.Event()
                await tg.start(self.clock.run)
                tg.start_soon(self.rejects.run)
                await self._start_engine()
                await tg.start(self.registrar.run)
                # the tiers' pool is registered before any peer can handshake: the NIXL
                # metadata a handshake carries must include it (peers READ out of it)
                await tg.start(self.tiers.run)
                self.side.bind()
                if self.cfg.nixl.doorbell:  # (beside the side channel: its UDP port)
                    self.engine.open_doorbell(self.cfg.side_channel.host, self.side.port)
                await tg.start(self.side.run)
                self.tiers.side_channel_listening()
                await tg.start(self.sender.run)
                await tg.start(self.receiver.run)
                self.ecrouter.bind()
                await tg.start(self.ecrouter.run)
                self.gateway.bind()
                await tg.start(self.gateway.run)
                tg.start_soon(self._watchdog)
                self._start_metrics()
                log.info(
                    "daemon_ready",
                    version=__version__,
                    agent=self.agent_name,
                    socket=self.socket_path,
                    side_channel=f"{self.cfg.side_channel.host}:{self.side.port}",
                )
                if not self.authenticated:
                    log.warning(
                        "peer_auth_off",
                        detail="no [auth] secret_file: any host that reaches the side channel, "
                        "the EC port or the NIXL agent is trusted as a peer",
                    )
                systemd.ready(f"serving {self.socket_path}")
                await self._wait_for_stop()
                ok = True
                tg.cancel_scope.cancel()
        finally:
            systemd.stopping()
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(self.cfg.daemon.shutdown_timeout) as scope,
            ):
                await self._cleanup()
            if scope.cancelled_caught:
                log.error("cleanup_timed_out", timeout=self.cfg.daemon.shutdown_timeout)
            self.gateway.close()
            log.info("daemon_stopped", clean=ok)

    def _ucx_tls(self) -> str:
        """UCX_TLS as the agent is made with: `nixl.ucx_tls`, else the environment's."""
        return self.cfg.nixl.ucx_tls or os.environ.get("UCX_TLS", "")

    async def _start_engine(self) -> None:
        """Start the NIXL agent; a backend that cannot be made (a device named in
        UCX_NET_DEVICES missing or down, a transport of `nixl.ucx_tls` this host lacks) is
        a start failure with one clear line, not a crash."""
        try:
            await self.engine.start(self.notifier.sink)
        except KvdError as exc:
            raise StartFailed(
                "nixl_start_failed",
                error=exc.message,
                backend=self.cfg.nixl.backend,
                ucx_tls=self.cfg.nixl.ucx_tls or os.environ.get("UCX_TLS", ""),
                ucx_net_devices=os.environ.get("UCX_NET_DEVICES", ""),
                hint="NIXL could not create its backend; UCX's own reason is just above in "
                "this log. Check that the devices in UCX_NET_DEVICES exist and are up (a "
                "link that is down is not usable) and that nixl.ucx_tls names transports "
                "this host has. Under systemd the daemon is started again (RestartSec).",
            ) from exc

    def _start_metrics(self) -> None:
        if self.cfg.metrics.port == 0:
            return
        from kvd.adapters.metrics import DaemonCollector, Sources, serve_metrics

        boxes = {
            "registrar": self.registrar_box,
            "sender": self.sender_box,
            "receiver": self.receiver_box,
            "ecrouter": self.ec_box,
            "tiers": self.tiers_box,
            "events": self.events,
        }
        sides = {"sender": self.sender, "receiver": self.receiver}
        sources = Sources(
            counters=self.counters,
            mailboxes=lambda: {name: box.stats() for name, box in boxes.items()},
            nixl=lambda: self.engine.stats_dict(),
            transfer_stats=[actor.book.stats for actor in sides.values()],
            failures={side: actor.failures for side, actor in sides.items()},
            in_flight=lambda: {side: len(a.book.in_flight) for side, a in sides.items()},
            leases=lambda: len(self.sender.proto.leases),
            clients=self.gateway.client_counts,
            tiers=self.tiers.gauges if self.tiers.enabled else None,
        )
        collector = DaemonCollector(self.agent_name, sources)
        self._metrics = serve_metrics(self.cfg.metrics.host, self.cfg.metrics.port, collector)
        log.info("metrics_serving", addr=f"{self.cfg.metrics.host}:{self.cfg.metrics.port}")

    async def _cleanup(self) -> None:
        """Peers told, memory deregistered, the NIXL agent destroyed, and only then the IPC
        socket closed: a client counts its requests lost when its connection to us drops,
        so that must not happen while a transfer could still read its blocks."""
        self.rejects.close()  # the last summaries: what was counted but not yet logged
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics = None
        try:
            await self.registrar.cleanup()
        except Exception as exc:
            log.error("registrar_cleanup_failed", error=repr(exc))
        await self.tiers.cleanup()
        if self.staging is not None:
            try:
                await self.staging.close()
            except Exception as exc:
                log.error("staging_cleanup_failed", error=repr(exc))
        await self.engine.close()
        # only now unmap what peers wrote into: with the NIXL thread gone nothing copies
        # a late byte into our memory any more (UCX's TCP transport does it in-process)
        self.ecrouter.close()
        self.tiers.close()

    async def _wait_for_stop(self) -> None:
        """Until a signal, or a drain started with `exit` is over."""
        exit_event = self._exit
        assert exit_event is not None
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                await self._wait_for_signal()
                tg.cancel_scope.cancel()

            async def on_exit() -> None:
                await exit_event.wait()
                log.info("exiting_after_drain", state=self.drain.state)
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            tg.start_soon(on_exit)

    async def _wait_for_signal(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal_received", signal=signal.Signals(signum).name)
                return

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        if interval is None:
            return
        while True:
            systemd.watchdog_ping()
            await anyio.sleep(interval)


def _start_failure(exc: BaseException) -> StartFailed | None:
    """The StartFailed in `exc` (task groups wrap what their tasks raise), or None."""
    if isinstance(exc, StartFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            if (found := _start_failure(sub)) is not None:
                return found
    return None


def serve(cfg: Config) -> int:
    """Run the daemon until a signal; returns the process exit code."""
    # a crash in native code (NIXL, UCX) leaves every thread's Python stack in the log
    faulthandler.enable(all_threads=True)
    daemon = Daemon(cfg)
    try:
        anyio.run(daemon.run, backend="asyncio", backend_options={"use_uvloop": True})
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        if (failed := _start_failure(exc)) is not None:
            log.error(failed.event, **failed.fields)
            return 1
        log.error("daemon_crashed", error=repr(exc), exc_info=True)
        return 1
    return 0
