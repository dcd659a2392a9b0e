"""`KvdConnector`: vLLM 0.33's KV connector over the kvd thin client.

Load it with `--kv-transfer-config '{"kv_connector": "KvdConnector",
"kv_connector_module_path": "kvd_client.vllm", ...}'`.
vLLM builds it twice: once with the SCHEDULER role in the engine-core process, once with
the WORKER role in every worker rank. Both talk to the node's kvd daemon through the
per-process `SharedClient`; NIXL, leases and heartbeats live in the daemon.

Scheduler side (P and D):
- D: `on_new_request` tracks a `do_remote_prefill` request at arrival (the daemon starts
  heartbeating P). `get_num_new_matched_tokens` claims the prompt past the block-aligned
  local hit as an async load; `update_state_after_alloc` announces the load: the D
  blocks to `register_push` (push) or to `pull` with P's matching logical blocks (pull).
  A request that ends up loading nothing, or that finishes before it was allocated,
  gets an empty transfer so P frees at once.
- P: a `do_remote_decode` request's computed blocks are staged to host memory by the
  workers (`wait_for_save`) in the step that computes them; `request_finished` hands the
  blocks to the daemon (`finished`, which leases them), keeps them (`delay_free`) and
  returns the `kv_transfer_params` a proxy forwards to D.
- P, layer-wise (push): in the step that completes a request's prompt, the metadata names
  it in `stream` with all its blocks; each worker copies every layer to staging as soon as
  `save_kv_layer` hands it over and announces it to the daemon (`layers_saved`, one way),
  which WRITEs it at once if D registered already (both legs run at once). Otherwise the
  notices are dropped there, and `finished` transfers the whole request as before.
- Worker metadata carries, per step: blocks to stage (P), ids whose terminal event the
  workers must report (`recv` with the blocks to copy in, `send`), ids whose terminal
  event must be dropped because vLLM no longer waits for them (`ignore`), and terminal
  events the scheduler's own session saw (`outcomes`), so that a rank in another process
  learns of a refusal or a lost daemon even when its own session never gets an event.

Worker side: `register_kv_caches` registers a block-major host staging region
(`staging.py`); P copies blocks KV -> staging in `wait_for_save`; D copies staging -> KV
when the request's RecvFinished arrives, before reporting it in `finished_recving`.
`get_transfer_results` reports each expected id exactly once per rank (a failed receive in
both `finished_recving` and `failed_recving`, so vLLM applies `kv_load_failure_policy`),
never an id vLLM did not hand over, and nothing through `invalid_block_ids`.

Hybrid models (several KV cache groups: full attention, sliding window, Mamba-style
state; `SupportsHMA`): one hybrid staging region per rank, the groups' ids in one region
id space (`groups.py`); `request_finished_all_groups` hands the daemon the blocks that
move (sliding windows clipped to the window, state groups their running slot), D copies
in only those; with a state group P stops one prompt token short and D computes it.
Hybrid requests are staged whole in the step that completes the prompt (not by layer).

Each rank stages its attention layers as a KV spec region (`staging.staged_format`: K and
V apart, NHD or HND as its tensors lie; compat = model, KV dtype, KV heads, head size,
layers), so the daemons map P and D across TP, block size and token layout and refuse,
naming both sides, a pair that cannot map; P's kv_transfer_params carry its block size
(`remote_block_size`) so D lines up P's blocks by tokens. MLA and unknown tensor shapes
stage opaquely (equal TP, block size and shape only).

Multi-turn (`bidirectional_kv_xfer`, one KV cache group): D stages each decode step's KV to
host memory as P stages its prefill, and when a request finishes `request_finished` asks
the daemon to keep its blocks (`keep`: a fixed lease of `decoder_kv_blocks_ttl`), holds them
(`delay_free`) until the daemon's terminal event, and returns kv_transfer_params naming them
(D as the remote, `remote_blocks_expiry_time`). A P request carrying those params beside
`do_remote_decode` loads the kept prefix (whole blocks, at least `kv_recompute_threshold`
tokens, at least 5 s before the expiry) by an ordinary pull from D's daemon, computes the
rest, and is then sent on as any P request.

Limits: no pipeline or decode-context parallelism.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, daemon_listening
from kvd_client.errors import ErrorCode, KvdError
from kvd_client.shm import SharedRegion, staging_name
from kvd_client.vllm.config import ConnectorConfig
from kvd_client.vllm.groups import HybridStaging, KvGroups, state_parts
from kvd_client.vllm.shared import SharedClient, Subscription, shared_client
from kvd_client.vllm.staging import HostStaging, ModelKv, describe, staged_format

log = logging.getLogger("kvd_client.vllm")

RECV_OK: Final = "recv_ok"
RECV_FAILED: Final = "recv_failed"
SEND_DONE: Final = "send_done"
KEPT_MARGIN: Final = 5.0
"""Seconds a P wants left before kept blocks expire to load them (as vLLM's NixlConnector)."""
REMEMBER_DONE: Final = 1 << 16
"""Reported ids a worker remembers, to drop a second copy of their terminal event."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kind(ev: Event) -> str | None:
    if isinstance(ev, wire.RecvFinished):
        return RECV_OK
    if isinstance(ev, wire.RecvFailed):
        return RECV_FAILED
    if isinstance(ev, (wire.SendFinished, wire.SendFailed, wire.SendExpired)):
        return SEND_DONE
    return None  # encoder-cache events belong to another connector


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers, once per step (pickled into SchedulerOutput)."""

    save: list[tuple[str, list[int]]] = field(default_factory=list)
    """P: copy these blocks from the KV tensors into staging after this step's forward."""
    recv: dict[str, list[int]] = field(default_factory=dict)
    """D: report these ids when their transfer ends; on success copy these blocks in first."""
    send: list[str] = field(default_factory=list)
    """P: report these ids in finished_sending when their transfer ends."""
    ignore: list[str] = field(default_factory=list)
    """Drop the terminal event of these ids: vLLM does not wait for them."""
    outcomes: list[tuple[str, str]] = field(default_factory=list)
    """Terminal events the scheduler's session saw: (request id, recv_ok|recv_failed|send_done)."""
    stream: list[tuple[str, list[int]]] = field(default_factory=list)
    """P (push): requests whose prompt this step completes, with all their blocks: announce
    each layer to the daemon once it is staged (layer-wise push)."""

    def is_empty(self) -> bool:
        return not (
            self.save or self.recv or self.send or self.ignore or self.outcomes or self.stream
        )


# ====================================================================== scheduler side


@dataclass
class _Remote:
    """Where a D request's KV is, from its kv_transfer_params."""

    host: str
    port: int
    engine_id: str
    request_id: str
    block_ids: tuple[int, ...] | None
    incarnation: int = 0
    """P daemon's incarnation (0: not given): a restarted P fails the request at once."""
    session: str = ""
    """P's client session that finished the request: if it ended, P fails it at once."""
    group_ids: tuple[tuple[int, ...], ...] | None = None
    """Hybrid P: its region ids per KV cache group (remote_block_ids of several groups)."""
    block_size: int = 0
    """P's tokens per block (`remote_block_size`; 0: not given)."""

    def ids(self) -> dict[str, Any]:
        return {
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_incarnation": self.incarnation,
        }

    def load_ids(self) -> dict[str, Any]:
        return self.ids() | {"remote_session": self.session}


def _incarnation(raw: Any) -> int:
    """kv_transfer_params carry it as 16 hex digits (a JSON number could lose bits)."""
    if isinstance(raw, str):
        try:
            value = int(raw, 16)
        except ValueError:
            return 0
        return value if 0 <= value < (1 << 64) else 0
    return 0


@dataclass
class _DReq:
    remote: _Remote
    mode: str
    phase: str = "tracked"
    """tracked -> loading -> reported, or tracked -> orphaned (an empty transfer freeing P)."""
    finished: bool = False
    computed: int = 0
    """The local prefix hit (tokens) when the load was claimed."""
    request: Any = None
    kept_tokens: int = 0
    """P, the next turn: tokens of the blocks D kept (0: an ordinary D load)."""
    expiry: float = 0.0
    """P, the next turn: when D's kept blocks expire (wall clock, D's `time.time()`)."""
    staged: int = 0
    """D, bidirectional: tokens staged to host memory (as of the latest step's metadata)."""
    staged_before: int = 0
    """... as of the step before it: staged by workers that have run (safe to keep)."""


@dataclass
class _PReq:
    request: Any
    staged_tokens: int = 0


def _parse_remote(rid: str, params: Mapping[str, Any]) -> _Remote | None:
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        log.warning(
            "kvd: request %s has do_remote_prefill but no remote_host/port: computing it locally",
            rid,
        )
        return None
    raw = params.get("remote_block_ids")
    blocks: tuple[int, ...] | None = None
    groups: tuple[tuple[int, ...], ...] | None = None
    if (
        isinstance(raw, (list, tuple))
        and len(raw) > 1
        and all(
            isinstance(g, (list, tuple))
            and all(isinstance(b, int) and not isinstance(b, bool) for b in g)
            for g in raw
        )
    ):
        groups = tuple(tuple(g) for g in raw)
    elif isinstance(raw, (list, tuple)):
        if raw and isinstance(raw[0], (list, tuple)):  # per KV cache group, NixlConnector style
            raw = raw[0] if len(raw) == 1 else None
        if raw is not None and all(isinstance(b, int) and not isinstance(b, bool) for b in raw):
            blocks = tuple(raw)
    return _Remote(
        host,
        port,
        str(params.get("remote_engine_id") or ""),
        str(params.get("remote_request_id") or ""),
        blocks,
        _incarnation(params.get("remote_incarnation")),
        str(params.get("remote_session") or ""),
        group_ids=groups,
        block_size=_positive(params.get("remote_block_size")),
    )


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)


def _positive(raw: Any) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0 else 0


class _SchedulerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, engine_id: str
    ) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size: int = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.groups = KvGroups.from_config(kv_cache_config)
        """A hybrid model's KV cache groups (None: one full-attention group)."""
        self.shared: SharedClient = shared_client(cfg.socket, engine_id, role="scheduler")
        self.sub: Subscription = self.shared.subscribe()
        welcome = self.shared.welcome
        self.warnings = cfg.check_daemon(welcome.kv_lease_duration)
        self.kv_cache_manager: Any = None
        self._d: dict[str, _DReq] = {}
        self._p: dict[str, _PReq] = {}
        self._sending: set[str] = set()
        self._orphans: set[str] = set()
        self._meta = KvdConnectorMetadata()
        log.info(
            "kvd: scheduler connector for engine %s on %s (%s mode, daemon %s, side channel %s:%d)",
            engine_id,
            cfg.socket,
            cfg.transfer_mode,
            welcome.agent_name,
            welcome.side_host,
            welcome.side_port,
        )

    @property
    def side_host(self) -> str:
        """P's daemon side channel, as its latest Welcome says (a restarted daemon may move)."""
        w = self.shared.client.welcome
        return w.side_host if w is not None else self.shared.welcome.side_host

    @property
    def incarnation(self) -> int:
        """P's daemon incarnation, as its latest Welcome says."""
        w = self.shared.client.welcome
        return w.incarnation if w is not None else self.shared.welcome.incarnation

    @property
    def side_port(self) -> int:
        w = self.shared.client.welcome
        return w.side_port if w is not None else self.shared.welcome.side_port

    # ------------------------------------------------------------------ D

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and self.groups is not None:
            self._back_off(request, params)
        if not params or not params.get("do_remote_prefill"):
            return
        rid = request.request_id
        remote = _parse_remote(rid, params)
        if remote is None:
            return
        if params.get("do_remote_decode"):
            self._track_kept(request, params, remote)
            return
        mode = self.cfg.transfer_mode
        ids = remote.block_ids if self.groups is None else remote.group_ids
        if mode == "pull" and (ids is None or not remote.request_id):
            log.warning(
                "kvd: request %s has no remote_block_ids/remote_request_id (push-style params): "
                "loading it in push mode",
                rid,
            )
            mode = "push"
        self._d[rid] = _DReq(remote, mode, request=request)
        c = self.shared.client
        self.shared.call(c.track, rid, remote.host, remote.port, **remote.ids())

    def _track_kept(self, request: Any, params: Mapping[str, Any], remote: _Remote) -> None:
        """P, the next turn of a conversation: D kept the earlier turns' blocks (its
        kv_transfer_params ride beside `do_remote_decode`); pull them if they are worth it."""
        rid = request.request_id
        expiry, tokens = params.get("remote_blocks_expiry_time"), params.get("remote_num_tokens")
        if not self.cfg.bidirectional or self.groups is not None:
            log.info("kvd: request %s: kept KV offered but bidirectional_kv_xfer is off", rid)
            return
        if (
            isinstance(expiry, bool)
            or not isinstance(expiry, (int, float))
            or not math.isfinite(expiry)
            or isinstance(tokens, bool)
            or not isinstance(tokens, int)
            or tokens <= 0
            or remote.block_ids is None
            or not remote.request_id
        ):
            log.warning("kvd: request %s: unusable kept-KV params: computing it locally", rid)
            return
        if expiry - time.time() < KEPT_MARGIN:
            log.info("kvd: request %s: D's kept KV expires too soon: computing it locally", rid)
            return
        self._d[rid] = _DReq(
            remote, "pull", request=request, kept_tokens=tokens, expiry=float(expiry)
        )
        c = self.shared.client
        self.shared.call(c.track, rid, remote.host, remote.port, **remote.ids())

    def _kept_count(self, request: Any, st: _DReq, num_computed_tokens: int) -> int:
        """P: the tokens to load from D's kept blocks: whole blocks of the prompt only (the
        last prompt token is always computed here), none below the recompute threshold
        or too close to the expiry."""
        assert st.remote.block_ids is not None
        db = st.remote.block_size or self.block_size  # D's tokens per block
        unit = max(db, self.block_size)  # both sides' blocks end on its multiples
        if num_computed_tokens % unit:
            return 0  # our prefix hit ends inside one of D's blocks: compute the rest here
        usable = min(
            st.kept_tokens,
            request.num_prompt_tokens - 1,
            len(st.remote.block_ids) * db,
        )
        count = usable // unit * unit - num_computed_tokens
        if count < self.cfg.kv_recompute_threshold or st.expiry - time.time() < KEPT_MARGIN:
            return 0
        return int(count)

    def _back_off(self, request: Any, params: dict[str, Any]) -> None:
        """P, a model with state: drop the last prompt token (D computes it: its state must
        take it once), as vLLM's NixlConnector does; once per request."""
        n = self.groups.backoff if self.groups is not None else 0
        if (
            not n
            or params.get("_kvd_backed_off")
            or request.num_prompt_tokens <= n
            or request.prompt_token_ids is None
            or request.get_skip_reading_prefix_cache()
        ):
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params["_kvd_backed_off"] = True

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        st = self._d.get(request.request_id)
        if st is None or st.phase != "tracked":
            return 0, False
        if st.kept_tokens:
            count = self._kept_count(request, st, num_computed_tokens)
            return count, count > 0
        count = request.num_prompt_tokens - num_computed_tokens
        if self.groups is not None:
            count -= self.groups.backoff  # D computes what P left out
            st.computed = num_computed_tokens
        if count <= 0:
            return 0, False
        if num_computed_tokens and not self._aligned(request.request_id, st, num_computed_tokens):
            return 0, False
        if self.groups is None and st.mode == "pull" and st.remote.block_ids is not None:
            pb = st.remote.block_size or self.block_size
            need = _cdiv(request.num_prompt_tokens, pb) - num_computed_tokens // pb
            if need > len(st.remote.block_ids):
                log.warning(
                    "kvd: request %s needs %d remote blocks but P offers %d: computing it locally",
                    request.request_id,
                    need,
                    len(st.remote.block_ids),
                )
                return 0, False
        return count, True

    def _aligned(self, rid: str, st: _DReq, hit: int) -> bool:
        """D's blocks take the tail of P's, so a local prefix hit must end on a boundary of
        the larger block size of P and D (the daemon pairs tokens from there). Unknown P
        block size (push params without `remote_block_size`): only no hit is safe."""
        pb = st.remote.block_size
        if pb and hit % max(pb, self.block_size) == 0:
            return True
        log.warning(
            "kvd: request %s: a local prefix hit of %d tokens does not end on a boundary of "
            "P's blocks (%s tokens, D's %d): computing it locally",
            rid,
            hit,
            pb or "unknown: no remote_block_size in kv_transfer_params",
            self.block_size,
        )
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._p[rid] = _PReq(request)  # (re)admitted: its blocks are staged from scratch
        st = self._d.get(rid)
        if st is None or st.phase != "tracked":
            return
        if num_external_tokens <= 0:
            self._release_remote(rid, st)  # full local hit (or nothing to load): P frees now
            return
        if self.groups is not None:
            self._load_groups(request, st, blocks, num_external_tokens)
            return
        hashed = sum(1 for b in blocks.blocks[0] if b.block_hash is not None and not b.is_null)
        new_blocks = [b.block_id for b in blocks.blocks[0][hashed:]]
        count = _cdiv(num_external_tokens, self.block_size)
        local = new_blocks[:count]
        reaches_end = hashed + count == _cdiv(request.num_prompt_tokens, self.block_size)
        st.phase = "loading"
        self._meta.recv[rid] = list(local)
        c = self.shared.client
        r = st.remote
        if st.mode == "pull":
            assert r.block_ids is not None
            pb = r.block_size or self.block_size  # P's blocks holding tokens [hit, end)
            hit = hashed * self.block_size
            # a load of D's kept blocks ends inside the prompt; P's runs to its end
            end = hit + num_external_tokens if st.kept_tokens else request.num_prompt_tokens
            remote_ids = r.block_ids[hit // pb : _cdiv(end, pb)]
            want = _cdiv(end, pb) - hit // pb
            if len(local) == count and len(remote_ids) == want and hit % pb == 0:
                self.shared.call(
                    c.pull, rid, local, r.host, r.port, remote_block_ids=remote_ids, **r.load_ids()
                )
                return
        elif len(local) == count and reaches_end:
            self.shared.call(c.register_push, rid, local, r.host, r.port, **r.load_ids())
            return
        # P's blocks cannot be lined up with ours: fail the load (vLLM's policy applies) and
        # stop heartbeating, so that P's lease on them runs out.
        log.warning(
            "kvd: request %s: cannot map %d local blocks onto P's, failing the load", rid, count
        )
        self.shared.call(c.abort, rid)
        self._meta.outcomes.append((rid, RECV_FAILED))

    def _null(self) -> int:
        """The id of vLLM's null block (a placeholder in a group's list, never moved)."""
        mgr = self.kv_cache_manager
        pool = getattr(mgr, "block_pool", None) if mgr is not None else None
        null = getattr(pool, "null_block", None)
        return int(null.block_id) if null is not None else 0

    def _load_groups(self, request: Any, st: _DReq, blocks: Any, num_external: int) -> None:
        """D, hybrid: every group's blocks that receive tokens [computed, computed + n)
        (windows clipped, the state's running slot), as one region id list."""
        assert self.groups is not None
        rid = request.request_id
        start, end = st.computed, st.computed + num_external
        ids = [[b.block_id for b in group] for group in blocks.blocks]
        local = self.groups.loading(ids, start, end, self._null())
        flat = [b for part in local for b in part]
        st.phase = "loading"
        self._meta.recv[rid] = flat
        c = self.shared.client
        r = st.remote
        whole = all(
            len(part) == _cdiv(end, info.block_size) - start // info.block_size
            for part, info in zip(local, self.groups.groups, strict=True)
            if info.kind == "full"
        )
        if whole and st.mode == "pull":
            remote = None
            if r.group_ids is not None and len(r.group_ids) == len(local):
                remote = self.groups.remote_for(r.group_ids, start, end, r.block_size)
            if remote is not None:
                self.shared.call(
                    c.pull,
                    rid,
                    flat,
                    r.host,
                    r.port,
                    remote_block_ids=remote,
                    num_tokens=end,  # (places window groups whose block sizes differ)
                    **r.load_ids(),
                )
                return
        elif whole:
            self.shared.call(
                c.register_push, rid, flat, r.host, r.port, num_tokens=end, **r.load_ids()
            )
            return
        log.warning(
            "kvd: request %s: cannot map its KV cache groups onto P's, failing the load", rid
        )
        self.shared.call(c.abort, rid)
        self._meta.outcomes.append((rid, RECV_FAILED))

    def _release_remote(self, rid: str, st: _DReq) -> None:
        """An empty transfer: P frees the request's blocks; its terminal event is dropped."""
        c = self.shared.client
        r = st.remote
        if st.mode == "pull":
            self.shared.call(c.pull, rid, (), r.host, r.port, remote_block_ids=(), **r.load_ids())
        else:
            self.shared.call(c.register_push, rid, (), r.host, r.port, **r.load_ids())
        st.phase = "orphaned"
        self._orphans.add(rid)
        self._meta.ignore.append(rid)

    # ------------------------------------------------------------------ P and D ends

    def request_finished(
        self,
        request: Any,
        block_ids: Sequence[int],
        all_groups: Sequence[Sequence[int]] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._d.get(rid)
        if st is not None:
            st.finished = True
            if st.phase == "tracked":  # never allocated (aborted while queued, or a deferred load)
                self._release_remote(rid, st)
            elif st.phase == "loading":  # vLLM keeps the blocks until we report the id
                self.shared.call(self.shared.client.abort, rid)
            elif st.phase == "reported":
                del self._d[rid]
                if not st.kept_tokens:
                    return self._keep(request, st, block_ids)
            if not st.kept_tokens:
                return False, None
            # P, the next turn: its load from D's kept blocks ended; it is sent on below
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return False, None
        p = self._p.pop(rid, None)
        c = self.shared.client
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            if self.cfg.transfer_mode == "push":
                # D may already wait for a push (both legs run at once): an empty finish makes
                # its registration fail now instead of after push_registration_timeout.
                self.shared.call(c.finished, rid, ())
                self._orphans.add(rid)
                self._meta.ignore.append(rid)
            return False, None
        n_prompt = request.num_prompt_tokens
        if self.groups is not None and all_groups is not None:
            per = self.groups.finished(all_groups, n_prompt, self._null())
            blocks = [b for part in per for b in part]
            remote_ids = [list(part) for part in per]
        else:
            blocks = list(block_ids[: _cdiv(n_prompt, self.block_size)])
            remote_ids = [blocks]
        if p is None or p.staged_tokens < n_prompt or not blocks:
            log.warning(
                "kvd: request %s finished without staged KV (%s of %d tokens); not offered to D",
                rid,
                p.staged_tokens if p else 0,
                n_prompt,
            )
            return False, None
        if not self.shared.call(c.finished, rid, blocks, n_prompt):
            # no live session with the daemon (it restarted or ended ours): the send ended
            # already (SendFailed); do not send D after blocks nobody leased
            log.warning("kvd: request %s not offered to D: the daemon is unavailable", rid)
            self._orphans.add(rid)
            self._meta.ignore.append(rid)
            return False, None
        self._sending.add(rid)
        self._meta.send.append(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": remote_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.side_host,
            "remote_port": self.side_port,
            "remote_incarnation": f"{self.incarnation:016x}",
            "remote_session": self.shared.client.session,
            "tp_size": self.tp_size,
            "remote_block_size": self.block_size,
            "transfer_mode": self.cfg.transfer_mode,
            "remote_num_tokens": n_prompt,
        }

    def _keep(
        self, request: Any, st: _DReq, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """D, bidirectional: keep a finished request's blocks (the staged tokens) for the
        next turn's P; vLLM holds them until the daemon's terminal event (delay_free)."""
        if (
            not self.cfg.bidirectional
            or self.groups is not None
            or st.kept_tokens
            or request.status
            not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        ):
            return False, None
        rid = request.request_id
        tokens = min(st.staged_before, request.num_computed_tokens)
        if tokens < self.cfg.kv_recompute_threshold:
            return False, None
        blocks = list(block_ids[: _cdiv(tokens, self.block_size)])
        c = self.shared.client
        try:
            expiry = self.shared.call(c.keep, rid, blocks, self.cfg.decoder_kv_blocks_ttl)
        except ValueError as exc:  # the daemon keeps nothing (decoder_kv_blocks_ttl 0)
            log.warning("kvd: request %s not kept: %s", rid, exc)
            return False, None
        if not expiry:
            log.warning("kvd: request %s not kept: the daemon is unavailable", rid)
            self._orphans.add(rid)
            self._meta.ignore.append(rid)
            return False, None
        self._sending.add(rid)
        self._meta.send.append(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.side_host,
            "remote_port": self.side_port,
            "remote_incarnation": f"{self.incarnation:016x}",
            "remote_session": self.shared.client.session,
            "tp_size": self.tp_size,
            "transfer_mode": "pull",
            "remote_block_size": self.block_size,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": expiry,
        }

    def _stage_decode(self, meta: KvdConnectorMetadata, scheduled: Mapping[str, int]) -> None:
        """D, bidirectional: copy the KV this step computes (and, the first time, all the
        request's blocks before it) to host staging, so that a keep serves every byte."""
        for rid, n in scheduled.items():
            st = self._d.get(rid)
            if st is None or st.phase != "reported" or st.kept_tokens or st.request is None:
                continue
            end = st.request.num_computed_tokens + n
            st.staged_before = st.staged
            if end <= st.staged:
                continue
            ids = self._block_ids(rid)
            meta.save.append((rid, ids[st.staged // self.block_size : _cdiv(end, self.block_size)]))
            st.staged = end

    # ------------------------------------------------------------------ every step

    def _drain(self) -> None:
        for ev in self.sub.take():
            kind = _kind(ev)
            if kind is None:
                continue
            rid = ev.request_id  # type: ignore[union-attr]
            if rid in self._orphans:
                self._orphans.discard(rid)
                st = self._d.get(rid)
                if st is not None and st.phase == "orphaned":
                    del self._d[rid]
                # forwarded too: a rank whose own session never sees this event (a refusal
                # only this session got) still forgets the id it was told to ignore
                self._meta.outcomes.append((rid, kind))
                continue
            st = self._d.get(rid)
            if isinstance(ev, wire.RecvFailed):  # vLLM's kv_load_failure_policy applies
                # Logged here whatever the phase: the workers' sessions may have reported the
                # failure first (the request then "reported", or gone once finished), and this
                # event is the only place that carries the daemon's reason.
                log.warning(
                    "kvd: request %s: loading its KV from %s failed (%s): %s",
                    rid,
                    st.remote.engine_id if st is not None else "P",
                    _code_name(ev.code),
                    ev.reason,
                )
            if (kind != SEND_DONE and st is not None and st.phase == "loading") or (
                kind == SEND_DONE and rid in self._sending
            ):
                self._meta.outcomes.append((rid, kind))

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        self._drain()
        meta, self._meta = self._meta, KvdConnectorMetadata()
        for rid in scheduler_output.preempted_req_ids or ():
            if rid in self._p:
                self._p[rid].staged_tokens = 0
            if (st := self._d.get(rid)) is not None:
                st.staged = st.staged_before = 0
        if self.cfg.bidirectional and self.groups is None:
            self._stage_decode(meta, scheduler_output.num_scheduled_tokens)
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            p = self._p.get(rid)
            if p is None:
                continue
            req = p.request
            end = min(req.num_computed_tokens + n, req.num_prompt_tokens)
            if end <= p.staged_tokens:
                continue
            if self.groups is not None:  # hybrid: every group, whole, once the prompt is done
                if end == req.num_prompt_tokens:
                    all_ids = self.kv_cache_manager.get_block_ids(rid)
                    per = self.groups.finished(all_ids, end, self._null())
                    meta.save.append((rid, [b for part in per for b in part]))
                    p.staged_tokens = end
                continue
            ids = self._block_ids(rid)
            first, last = p.staged_tokens // self.block_size, _cdiv(end, self.block_size)
            meta.save.append((rid, ids[first:last]))
            p.staged_tokens = end
            if end == req.num_prompt_tokens and self.cfg.transfer_mode == "push":
                meta.stream.append((rid, ids[: _cdiv(end, self.block_size)]))
        return meta

    def _block_ids(self, rid: str) -> list[int]:
        assert self.kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return list(self.kv_cache_manager.get_block_ids(rid)[0])

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            st = self._d.get(rid)
            if st is None or st.phase != "loading":
                continue
            if st.finished:
                del self._d[rid]
            else:
                st.phase = (
                    "reported"  # kept until request_finished: a recompute must not load again
                )
        for rid in output.finished_sending or ():
            self._sending.discard(rid)

    def has_pending_push_work(self) -> bool:
        self._drain()
        return not self._meta.is_empty()

    def shutdown(self) -> None:
        self.sub.close()


# ====================================================================== worker side


class _WorkerSide:
    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, engine_id: str
    ) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.engine_id = engine_id
        self.num_blocks: int = kv_cache_config.num_blocks
        self.block_size: int = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.groups = KvGroups.from_config(kv_cache_config)
        self.hybrid: HybridStaging | None = None
        """A hybrid model's staging (then `staging` stays None)."""
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank(self.tp_size)
        self.shared: SharedClient = shared_client(
            cfg.socket, engine_id, role="worker", tp_rank=self.tp_rank
        )
        self.sub: Subscription = self.shared.subscribe()
        self.staging: HostStaging | None = None
        self.region: SharedRegion | None = None
        self.region_id: int | None = None
        self.meta: KvdConnectorMetadata | None = None
        self._recv: dict[str, list[int]] = {}
        self._send: set[str] = set()
        self._ignore: set[str] = set()
        self._pending: dict[tuple[str, bool], str] = {}
        """(request id, a send?) -> its terminal event's kind: one id may end once as a
        receive and once as a send (a P loading D's kept blocks; a D keeping them)."""
        self._done: OrderedDict[tuple[str, bool], None] = OrderedDict()
        self._layer_of: dict[str, int] = {}
        """Layer name -> its index among the staged layers (an aliased layer has none)."""
        self._region_layers = 0
        """Layers of the staging region (1 when uneven layer sizes stage as one chunk)."""
        self._staged: set[int] = set()
        """Staged layers of this step's blocks, so far."""
        self._queued: set[int] = set()
        """Layers of this step queued by `save_kv_layer` (staged once their copy is done)."""
        self._announced = 0
        self._layer_lock = threading.Lock()
        """`_staged` and the announcements: a queued layer is reported staged by the staging
        thread."""

    def _register_hybrid(self, groups: KvGroups, kv_caches: Mapping[str, torch.Tensor]) -> None:
        mc = self.vllm_config.model_config
        cuts = [
            state_parts(info.spec, self.tp_size, mc.hf_config) if info.kind == "state" else ()
            for info in groups.groups
        ]
        hs = HybridStaging(groups, kv_caches, model_kv(self.vllm_config), cuts)
        region = SharedRegion(staging_name(f"vllm-r{self.tp_rank}"), hs.nbytes)
        try:
            hs.attach(region.buf)
            c = self.shared.client
            self.region_id = self.shared.call(
                c.register_region,
                region,
                layout=hs.layout,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                compat=kvlayout.hybrid_compat(str(mc.model)),
                groups=hs.kv_groups,
            )
        except BaseException:
            hs.close()
            region.close()
            raise
        self.hybrid, self.region = hs, region
        log.info(
            "kvd: rank %d staged %d KV cache groups (%s) x %d blocks in %s",
            self.tp_rank,
            len(groups.groups),
            ", ".join(groups.kinds),
            self.num_blocks,
            region.name,
        )

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self.groups is not None:
            self._register_hybrid(self.groups, kv_caches)
            return
        layers = describe(kv_caches, self.num_blocks)
        fmt = staged_format(model_kv(self.vllm_config), layers, self.block_size)
        lay = HostStaging.region_layout(
            layers, self.num_blocks, self.block_size, fmt.kv_layout, fmt.dtype
        )
        region = SharedRegion(staging_name(f"vllm-r{self.tp_rank}"), kvlayout.region_bytes(lay))
        try:
            staging = HostStaging(layers, self.num_blocks, region.buf, fmt.kv_layout)
            compat = fmt.compat
            c = self.shared.client
            self.region_id = self.shared.call(
                c.register_region,
                region,
                layout=lay,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                compat=compat,
            )
        except BaseException:
            region.close()
            raise
        self.staging, self.region = staging, region
        self._layer_of = {lb.name: i for i, lb in enumerate(layers)}
        self._region_layers = lay.num_layers
        log.info(
            "kvd: rank %d staged %d layers x %d blocks (%d bytes per block) in %s",
            self.tp_rank,
            len(layers),
            self.num_blocks,
            staging.block_bytes,
            region.name,
        )

    def bind(self, meta: KvdConnectorMetadata) -> None:
        if self.staging is not None:
            self.staging.flush()  # (the last step's wait_for_save did; never left behind)
        self.meta = meta
        self._staged.clear()
        self._queued.clear()
        self._announced = 0
        self._recv.update(meta.recv)
        self._send.update(meta.send)
        self._ignore.update(meta.ignore)
        for rid, kind in meta.outcomes:
            self._note(rid, kind)

    def save_kv_layer(self, layer_name: str) -> None:
        """Queue this layer of the step's blocks for staging (`HostStaging.save_layer_async`:
        with GPU tensors the forward pass does not wait for the copy); each layer is
        announced once it and every layer before it are staged."""
        meta = self.meta
        i = self._layer_of.get(layer_name)
        if meta is None or not meta.save or i is None or i in self._queued:
            return
        assert self.staging is not None, "register_kv_caches was not called"
        self._queued.add(i)
        blocks = [b for _, ids in meta.save for b in ids]
        self.staging.save_layer_async(blocks, i, self._layer_staged)

    def _layer_staged(self, i: int) -> None:
        with self._layer_lock:
            self._staged.add(i)
            self._announce()

    def wait_for_save(self) -> None:
        if self.meta is None or not self.meta.save:
            return
        if self.hybrid is not None:  # every group's blocks, after the step's forward
            for _, blocks in self.meta.save:
                self.hybrid.save(blocks)
            return
        assert self.staging is not None, "register_kv_caches was not called"
        self.staging.flush()  # the queued layers are staged (and announced) now
        rest = [i for i in range(len(self.staging.layers)) if i not in self._queued]
        if rest:
            for _, blocks in self.meta.save:
                self.staging.save(blocks, rest)
        with self._layer_lock:
            self._staged.update(rest)
            self._queued.update(rest)
            self._announce()

    def _announce(self) -> None:
        """Tell the daemon how many of the region's layers are staged for the requests this
        step completes (one way: the forward pass never waits on it). Under
        `_layer_lock`."""
        meta, staging = self.meta, self.staging
        if meta is None or not meta.stream or staging is None:
            return
        if self._region_layers == len(staging.layers):
            upto = self._announced
            while upto in self._staged:
                upto += 1
        else:  # one chunk holds every layer: complete only once all are staged
            upto = self._region_layers if len(self._staged) == len(staging.layers) else 0
        if upto > self._announced:
            self._announced = upto
            self.shared.call(self.shared.client.layers_saved, upto, meta.stream)

    def _note(self, rid: str, kind: str) -> None:
        key = (rid, kind == SEND_DONE)
        if key not in self._done:
            self._pending.setdefault(key, kind)

    def transfer_results(self) -> KVConnectorTransferResults:
        for ev in self.sub.take():
            kind = _kind(ev)
            if kind is not None:
                self._note(ev.request_id, kind)  # type: ignore[union-attr]
        out = KVConnectorTransferResults()
        for key, kind in list(self._pending.items()):
            rid = key[0]
            if rid in self._ignore:
                self._ignore.discard(rid)
            elif kind == SEND_DONE and rid in self._send:
                self._send.discard(rid)
                out.finished_sending.add(rid)
            elif kind != SEND_DONE and rid in self._recv:
                blocks = self._recv.pop(rid)
                if kind == RECV_OK:
                    staging = self.hybrid or self.staging
                    assert staging is not None, "register_kv_caches was not called"
                    staging.load(blocks)
                else:
                    out.failed_recving.add(rid)
                out.finished_recving.add(rid)
            else:
                continue  # not handed over yet: the metadata naming it comes later
            del self._pending[key]
            self._done[key] = None
            if len(self._done) > REMEMBER_DONE:
                self._done.popitem(last=False)
        return out

    def shutdown(self) -> None:
        c = self.shared.client
        if self.region_id is not None and daemon_listening(c.socket_path):
            try:
                self.shared.call(c.request, wire.DeregisterRegion(self.region_id), timeout=2.0)
            except KvdError as exc:  # the session's end releases it anyway
                log.warning("kvd: deregistering the staging region failed: %s", exc)
        self.region_id = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.hybrid is not None:
            self.hybrid.close()
            self.hybrid = None
        if self.region is not None:
            self.region.close()
            self.region = None
        self.sub.close()


def model_kv(vllm_config: Any) -> ModelKv:
    """What decides the meaning of this engine's KV bytes (the compat a rank declares)."""
    mc = vllm_config.model_config
    return ModelKv(
        model=str(mc.model),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        total_heads=int(mc.get_total_num_kv_heads()),
        rank_heads=int(mc.get_num_kv_heads(vllm_config.parallel_config)),
        head_size=int(mc.get_head_size()),
        mla=bool(getattr(mc, "use_mla", False)),
    )


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


# ====================================================================== the connector


class KvdConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM KV connector that moves KV blocks through the node's kvd daemon (module docstring)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1 or getattr(pc, "decode_context_parallel_size", 1) > 1:
            raise ValueError(
                "KvdConnector does not support pipeline or decode-context parallelism yet"
            )
        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            raise ValueError("KvdConnector needs the engine's KVCacheConfig (KV cache groups)")
        KvGroups.from_config(kv_cache_config)  # refuses, naming it, a group kvd cannot move
        self.engine_id = str(ktc.engine_id)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(vllm_config, kv_cache_config, self.config, self.engine_id)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self.config, self.engine_id)

    @property
    def scheduler_side(self) -> _SchedulerSide:
        assert self._sched is not None, "a scheduler-side call on a worker-side connector"
        return self._sched

    @property
    def worker_side(self) -> _WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler-side connector"
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvdConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(
            request, block_ids[0] if block_ids else [], all_groups=block_ids
        )

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def get_finished_count(self) -> int | None:
        return None  # every worker rank reports every id

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvdConnectorMetadata):
            self.worker_side.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.meta = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # loads are asynchronous, driven by the daemon

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker_side.save_kv_layer(layer_name)  # staged and announced at once

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker_side.transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return (
            set()
        )  # failures go through failed_recving (invalid_block_ids breaks multi-group models)

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
