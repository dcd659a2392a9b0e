"""`KvdECConnector`: vLLM 0.33's encoder-cache (EC) connector over the kvd thin client.

Load it with `--ec-transfer-config '{"ec_connector": "KvdECConnector",
"ec_connector_module_path": "kvd_client.vllm", "ec_role": "ec_producer"|"ec_consumer"|"ec_both",
"ec_connector_extra_config": {"kvd_socket": ...}}'` (vLLM's EC factory looks in its registry
first, then at the module path; the name is not registered there). Encoder outputs
(e.g. vision embeddings, keyed by vLLM's mm_hash) travel through the node daemon's EC
region: the daemon owns it, registers it with NIXL and moves outputs between daemons;
engine workers only map it by name (`status("ec")`) and copy in or out. The scheduler
side talks to the daemon through the per-process `SharedClient` that `KvdConnector` uses
too (same socket and engine id: the KV engine id when a KV transfer config exists).

Producer (`ec_producer`, an E instance, or `ec_both`):
- `update_state_after_alloc`: an encoder output vLLM will compute this step gets blocks in
  the daemon's EC region (`ECAllocate`, pinned until commit), sized from the request's
  mm feature: `mm_position.get_num_embeds()` rows x the encoder output width (vLLM's
  measured `mm_encoder_output_widths`, else the model's input-embedding size) x the
  model dtype's element size. `build_connector_meta` hands (mm_hash -> blocks, nbytes,
  shape, dtype) to the workers.
- Worker `save_caches` (TP rank 0 only: every rank holds the same output) copies
  `encoder_cache[mm_hash]` into those blocks (a GPU tensor is copied to host first, which
  waits for the stream that produced it) and reports the copy in its worker metadata.
- `update_connector_output` commits (`ECCommit`) each output a worker reported copied:
  a commit never precedes the bytes. The daemon then serves it to consumer daemons.
- `request_finished` (a request that ended normally) returns `ec_transfer_params`
  {mm_hash: {peer_host, peer_port, nbytes, shape, dtype, modality, compat}} (the
  fields of the daemon's `ECParams`). vLLM calls it *before* `update_connector_output`
  of the same step, so an output saved in the step that finished the request is still
  uncommitted then; its entry is the `ECParams` the commit will return (same fields,
  checked when the commit answers), and that commit happens later in the same
  `update_from_output`, before the engine sends the response out. Where the commit comes
  in a later step (below) or a copy fails, a consumer may ask too early: the daemon then
  answers "unknown" and the consumer fails the request. Never wrong bytes.
- An output the daemon evicted (FIFO under pressure) is found by the next allocation
  for its hash (when vLLM encodes it again) and saved again in that step. When a request
  reused vLLM's cached copy instead, `request_finished` asks the daemon whether it still
  holds the output; if not, the workers save it again from vLLM's encoder cache
  (`start_save_caches`) in the next step, so that commit may follow the response.

Consumer (`ec_consumer` or `ec_both`):
- `ensure_cache_available` sends `ECEnsure` for each hash of
  `extra_args["ec_transfer_params"]` (an entry with a `peer_host`; items without one are
  encoded locally) that the request still needs and returns False
  (vLLM defers the request) until the daemon's `ECReady` (the output is in the local EC
  region, pinned for this session) has arrived. `ECUnavailable` (unknown or evicted at
  the producer, refused, timed out, daemon lost) puts the request in
  `take_unavailable_requests`, which vLLM fails (re-issuing the request re-runs the
  encode). `has_cache_item` is True for ready outputs, so vLLM loads them instead of
  encoding; `update_state_after_alloc` turns each load into (mm_hash -> load id, blocks,
  nbytes, shape, dtype) in the metadata.
- Worker `start_load_caches` copies the blocks into a new tensor of that shape and dtype
  on the model's device, `encoder_cache[mm_hash]`, and reports the load id.
- A warm output is loaded in the step that asks for it: when the daemon's EC index
  (`KvdClient.ec_cached`, read from shared memory without a round trip) says the
  daemon holds the output under our compat, `ensure_cache_available` waits for its
  `ECReady` (a local hit, answered at once; at most `EC_HIT_WAIT_S`) instead of
  deferring the request. The pin is still taken by `ECEnsure`: the copy happens later,
  in the worker processes, so the output must stay put until then, which an index
  lookup alone cannot promise (`KvdClient.ec_read`, the client-side copy, is for
  consumers that copy in the process that asks).
- The scheduler releases its pin (`ECRelease`) only once every rank reported the copy and
  no live request still needs the output; the daemon keeps the output in its cache, so a
  later request for the same hash is ensured again and served locally (a local hit).

A save that fails (the output is not the size the scheduler allocated, or the copy
failed) is logged and committed under `VOID_COMPAT`: the daemon cannot drop an
allocation, a commit unpins it, and no consumer is ever served those bytes; FIFO
eviction reclaims the blocks, and the output is saved again once it is gone.

Limits: no pipeline parallelism; outputs are copied through host memory; another engine
on the same daemon that finds an output already there (a restarted E instance) publishes
it without knowing whether it was saved or voided (a void one fails its consumers until
evicted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.v1.request import RequestStatus

from kvd_client import wire
from kvd_client.client import default_socket_path
from kvd_client.errors import InvalidRequest, KvdError
from kvd_client.shm import SHM_DIR, check_name
from kvd_client.vllm.shared import SharedClient, Subscription, shared_client

log = logging.getLogger("kvd_client.vllm")

EC_COMPAT_VERSION: Final = 1
_KNOWN_KEYS: Final = frozenset({"kvd_socket", "ec_compat"})
_PARAM_KEYS: Final = ("peer_host", "peer_port", "nbytes", "shape", "dtype", "modality", "compat")
VOID_COMPAT: Final = "kvd-ec-void"
"""The compatibility hash a failed save is committed under: the daemon has no way to drop
an allocation, and a commit unpins it; no consumer presents this hash, so it is never
served, and FIFO eviction reclaims it like any output."""
EC_HIT_WAIT_S: Final = 0.01
"""How long the scheduler waits for the daemon's answer to an output its EC index holds
(a local hit, answered at once) before deferring the request to the next step as for a
fetch."""
MAX_PRODUCED: Final = 1 << 16
"""Committed outputs a producer remembers (least recently used forgotten first; one
forgotten is asked of the daemon again when a request needs it)."""


# ====================================================================== config and params


@dataclass(frozen=True)
class ECConfig:
    """`ec_connector_extra_config`: `kvd_socket` (default: the client's default socket) and
    `ec_compat` (default: a hash of vLLM's version, the model and its dtype; set the same
    string on producer and consumer when they name the model differently)."""

    socket: str
    compat: str | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ECConfig:
        extra = dict(extra or {})
        for key in sorted(set(extra) - _KNOWN_KEYS):
            log.warning("kvd: unknown ec_connector_extra_config key %r ignored", key)
        sock = extra.get("kvd_socket") or default_socket_path()
        if not isinstance(sock, str):
            raise ValueError(
                f"ec_connector_extra_config['kvd_socket'] must be a path, got {sock!r}"
            )
        compat = extra.get("ec_compat")
        if compat is not None and (not isinstance(compat, str) or not 0 < len(compat) <= 128):
            raise ValueError(
                "ec_connector_extra_config['ec_compat'] must be a string of 1 to 128 "
                f"characters, got {compat!r}"
            )
        return cls(socket=sock, compat=compat)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def ec_compat(vllm_config: Any, override: str | None = None) -> str:
    """What producer and consumer must agree on: vLLM's version, the model and its dtype."""
    if override:
        return override
    from vllm import __version__ as vllm_version

    mc = vllm_config.model_config
    factors = {
        "kvd_ec": EC_COMPAT_VERSION,
        "vllm": vllm_version,
        "model": str(mc.model),
        "dtype": dtype_name(mc.dtype),
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]


def params_to_dict(p: wire.ECParams) -> dict[str, Any]:
    """One `ec_transfer_params` entry (JSON-safe)."""
    return {
        "peer_host": p.peer_host,
        "peer_port": p.peer_port,
        "nbytes": p.nbytes,
        "shape": list(p.shape),
        "dtype": p.dtype,
        "modality": p.modality,
        "compat": p.compat,
    }


def params_from_dict(mm_hash: str, d: Any) -> wire.ECParams:
    """Parse and validate one `ec_transfer_params` entry (it comes from the request)."""
    if not isinstance(d, Mapping):
        raise ValueError("not an object")
    missing = [k for k in _PARAM_KEYS if k not in d]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    shape = d["shape"]
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in shape
    ):
        raise ValueError(f"bad shape {shape!r}")
    for key in ("peer_port", "nbytes"):
        if isinstance(d[key], bool) or not isinstance(d[key], int):
            raise ValueError(f"bad {key} {d[key]!r}")
    for key in ("peer_host", "dtype", "modality", "compat"):
        if not isinstance(d[key], str):
            raise ValueError(f"bad {key} {d[key]!r}")
    p = wire.ECParams(
        mm_hash,
        d["peer_host"],
        d["peer_port"],
        d["nbytes"],
        tuple(shape),
        d["dtype"],
        d["modality"],
        d["compat"],
    )
    _, checked = wire.decode(wire.encode(p))  # the wire's own limits (raises a KvdError)
    assert isinstance(checked, wire.ECParams)
    return checked


# ====================================================================== metadata


@dataclass
class ECSave:
    block_ids: list[int]
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class ECLoad:
    load_id: int
    block_ids: list[int]
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class KvdECConnectorMetadata(ECConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers, once per step (pickled into SchedulerOutput)."""

    region: str = ""
    """The daemon's EC region (a /dev/shm name; it changes when the daemon restarts)."""
    region_bytes: int = 0
    block_bytes: int = 0
    saves: dict[str, ECSave] = field(default_factory=dict)
    """Producer: copy encoder_cache[mm_hash] into these blocks."""
    loads: dict[str, ECLoad] = field(default_factory=dict)
    """Consumer: build encoder_cache[mm_hash] from these blocks."""


@dataclass
class KvdECWorkerMetadata(ECConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler, once per step (vLLM aggregates the ranks' copies)."""

    saved: list[tuple[str, str]] = field(default_factory=list)
    """(mm_hash, "" when copied, else why not)."""
    loaded: list[int] = field(default_factory=list)
    """Load ids copied, once per rank."""

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        assert isinstance(other, KvdECWorkerMetadata)
        self.saved.extend(other.saved)
        self.loaded.extend(other.loaded)
        return self


# ====================================================================== the EC region


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first output block, first region block, count) per run of consecutive blocks."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            s, f, n = out[-1]
            out[-1] = (s, f, n + 1)
        else:
            out.append((i, b, 1))
    return out


class ECRegionView:
    """A worker's mapping of the daemon's EC region (by name, read-write)."""

    def __init__(self, name: str, nbytes: int, block_bytes: int) -> None:
        self.name: Final = check_name(name)
        self.nbytes: Final = nbytes
        self.block_bytes: Final = block_bytes
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buf: torch.Tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def _check(self, block_ids: Sequence[int], nbytes: int) -> None:
        bb = self.block_bytes
        if nbytes > len(block_ids) * bb:
            raise ValueError(f"{nbytes} bytes do not fit in {len(block_ids)} blocks of {bb}")
        if any(b < 0 or (b + 1) * bb > self.nbytes for b in block_ids):
            raise ValueError(f"block ids {list(block_ids)} lie outside the EC region")

    def write(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Copy a flat uint8 CPU tensor into these blocks."""
        nbytes = data.numel()
        self._check(block_ids, nbytes)
        bb = self.block_bytes
        for first, b, n in _runs(block_ids):
            lo = first * bb
            hi = min(nbytes, (first + n) * bb)
            if hi > lo:
                self.buf[b * bb : b * bb + (hi - lo)].copy_(data[lo:hi])

    def read(self, block_ids: Sequence[int], nbytes: int) -> torch.Tensor:
        """A new flat uint8 CPU tensor with the first `nbytes` bytes of these blocks."""
        self._check(block_ids, nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8)
        bb = self.block_bytes
        for first, b, n in _runs(block_ids):
            lo = first * bb
            hi = min(nbytes, (first + n) * bb)
            if hi > lo:
                out[lo:hi].copy_(self.buf[b * bb : b * bb + (hi - lo)])
        return out

    def close(self) -> None:
        if self._mm is None:
            return
        del self.buf
        self._mm.close()
        self._mm = None


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes on the host (a device tensor is copied to host,
    which waits for the work that produced it)."""
    src = t.detach()
    if src.device.type != "cpu":
        src = src.to("cpu")
    return src.contiguous().reshape(-1).view(torch.uint8)


def bytes_to_tensor(
    data: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor of `shape` and `dtype` on `device` from flat uint8 host bytes."""
    t = data.view(dtype).reshape(tuple(shape))
    return t if device.type == "cpu" else t.to(device)


# ====================================================================== scheduler side


@dataclass
class _Prod:
    """Producer: an encoder output on its way into (or in) the daemon's EC region."""

    state: str
    """allocated -> dispatched -> committed, or void (its copy failed: committed under
    VOID_COMPAT, never published, allocated again once the daemon evicted it)."""
    save: ECSave
    params: wire.ECParams
    """What request_finished publishes: the daemon's ECParams once committed, else the
    same fields computed here."""


@dataclass
class _Cons:
    """Consumer: an encoder output ensured through the daemon."""

    params: wire.ECParams
    state: str = "ensuring"
    """ensuring -> ready (pinned for us until ECRelease)."""
    block_ids: tuple[int, ...] = ()
    nbytes: int = 0
    local_hit: bool = False
    loads: int = 0
    """Dispatched loads whose copies are not all reported yet."""


class _ECScheduler:
    def __init__(
        self, vllm_config: Any, cfg: ECConfig, engine_id: str, producer: bool, consumer: bool
    ) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.producer = producer
        self.consumer = consumer
        mc = vllm_config.model_config
        self.dtype: torch.dtype = mc.dtype
        self.compat = ec_compat(vllm_config, cfg.compat)
        ec = vllm_config.ec_transfer_config
        self._widths: dict[str, int] = dict(getattr(ec, "mm_encoder_output_widths", {}) or {})
        pc = vllm_config.parallel_config
        # Every rank copies every load (each holds a full encoder cache); reports of all
        # of them arrive only through the multiprocessing executor's aggregation.
        self.expected_load_reports = (
            pc.tensor_parallel_size * getattr(pc, "prefill_context_parallel_size", 1)
            if pc.distributed_executor_backend == "mp"
            else 1
        )
        self.shared: SharedClient = shared_client(cfg.socket, engine_id, role="scheduler")
        self.sub: Subscription = self.shared.subscribe()
        try:
            self._refresh_region()
        except BaseException:
            self.sub.close()
            raise
        self._reconnects = self.shared.client.reconnects
        self._prod: OrderedDict[str, _Prod] = OrderedDict()
        self._cons: dict[str, _Cons] = {}
        self._reqs: dict[str, Any] = {}
        """Consumer: live requests that need a remote output, by id."""
        self._unavailable: set[str] = set()
        self._load_acks: dict[int, tuple[str, int]] = {}
        self._next_load = 0
        self._meta = KvdECConnectorMetadata()
        log.info(
            "kvd: EC scheduler connector for engine %s on %s (%s%s), EC region %s",
            engine_id,
            cfg.socket,
            "producer" if producer else "",
            "+consumer" if producer and consumer else ("consumer" if consumer else ""),
            self.region,
        )

    def _refresh_region(self) -> None:
        c = self.shared.client
        info = self.shared.call(c.status, "ec")
        role = str(info.get("role", "none"))
        need = []
        if self.producer and role not in ("producer", "both"):
            need.append("producer")
        if self.consumer and role not in ("consumer", "both"):
            need.append("consumer")
        if need:
            raise ValueError(
                f"the kvd daemon at {c.socket_path} has ec.role = {role!r}; this EC connector "
                f"needs an encoder-cache {' and '.join(need)} (set [ec] role in its config)"
            )
        self.region = str(info["region"])
        self.region_bytes = int(info["region_bytes"])
        self.block_bytes = int(info["block_bytes"])

    @property
    def ec_host(self) -> str:
        w = self.shared.client.welcome or self.shared.welcome
        return w.ec_host

    @property
    def ec_port(self) -> int:
        w = self.shared.client.welcome or self.shared.welcome
        return w.ec_port

    # ------------------------------------------------------------------ events

    def _poll(self) -> None:
        """Take this session's EC events (never blocks); notice a restarted daemon."""
        for ev in self.sub.take():
            if isinstance(ev, wire.ECReady):
                self._on_ready(ev)
            elif isinstance(ev, wire.ECUnavailable):
                self._on_unavailable(ev)
        c = self.shared.client
        if c.reconnects != self._reconnects:
            log.warning("kvd: the daemon restarted: its EC region and encoder outputs are new")
            # its outputs, pins and region died with it: start over (loads already
            # dispatched still read the old mapping, which the workers keep)
            self._prod.clear()
            for h, e in list(self._cons.items()):
                if e.state == "ready":
                    del self._cons[h]
            try:
                self._refresh_region()
            except (KvdError, ValueError) as exc:  # tried again on the next poll
                log.error("kvd: cannot read the restarted daemon's EC region: %s", exc)
                return
            self._reconnects = c.reconnects

    def _on_ready(self, ev: wire.ECReady) -> None:
        e = self._cons.get(ev.mm_hash)
        if e is None or e.state != "ensuring":
            log.warning("kvd: unexpected ECReady for %s: releasing it", ev.mm_hash)
            self.shared.call(self.shared.client.ec_release, ev.mm_hash)
            return
        if ev.nbytes != e.params.nbytes:
            log.error(
                "kvd: %s arrived with %d bytes, its params say %d: not using it",
                ev.mm_hash,
                ev.nbytes,
                e.params.nbytes,
            )
            self.shared.call(self.shared.client.ec_release, ev.mm_hash)
            self._fail(ev.mm_hash, "size mismatch")
            return
        e.state, e.block_ids, e.nbytes, e.local_hit = "ready", ev.block_ids, ev.nbytes, ev.local_hit
        self._maybe_release(ev.mm_hash)  # nobody may want it any more

    def _on_unavailable(self, ev: wire.ECUnavailable) -> None:
        e = self._cons.get(ev.mm_hash)
        if e is None or e.state != "ensuring":
            return
        log.warning("kvd: encoder output %s is unavailable: %s", ev.mm_hash, ev.reason)
        self._fail(ev.mm_hash, ev.reason)

    def _fail(self, mm_hash: str, why: str) -> None:
        """Every live request that needs this output fails; a later one ensures it again."""
        self._cons.pop(mm_hash, None)
        for rid, req in list(self._reqs.items()):
            if any(f.identifier == mm_hash for f in self._remote_features(req)):
                log.warning("kvd: request %s fails: encoder output %s: %s", rid, mm_hash, why)
                self._unavailable.add(rid)
                del self._reqs[rid]

    # ------------------------------------------------------------------ consumer

    @staticmethod
    def _remote_features(request: Any) -> list[Any]:
        """The request's items announced with a producer address (others are encoded here)."""
        params = request.ec_transfer_params
        if not isinstance(params, Mapping):
            return []
        return [
            f
            for f in request.mm_features or ()
            if isinstance(params.get(f.identifier), Mapping) and "peer_host" in params[f.identifier]
        ]

    def _needs(self, request: Any, feature: Any, num_computed_tokens: int | None = None) -> bool:
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        pos = feature.mm_position
        return bool(pos.offset + pos.length > n)

    def _params_for(self, request: Any, feature: Any) -> wire.ECParams:
        p = params_from_dict(feature.identifier, request.ec_transfer_params[feature.identifier])
        if p.compat != self.compat:
            raise ValueError(f"compat {p.compat!r} differs from ours {self.compat!r}")
        rows = feature.mm_position.get_num_embeds()
        dt = dtype_of(p.dtype)
        if not p.shape or p.shape[0] != rows:
            raise ValueError(f"shape {list(p.shape)} does not have {rows} rows")
        nbytes = dt.itemsize
        for d in p.shape:
            nbytes *= d
        if nbytes != p.nbytes:
            raise ValueError(f"{p.nbytes} bytes for shape {list(p.shape)} of {p.dtype}")
        return p

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        if not self.consumer:
            return True
        rid = request.request_id
        if rid in self._unavailable:
            return False
        features = self._remote_features(request)
        if not features:
            return True
        self._poll()
        if rid in self._unavailable:
            return False
        pending = False
        for f in features:
            if not self._needs(request, f, num_computed_tokens):
                continue
            e = self._cons.get(f.identifier)
            if e is None:
                try:
                    params = self._params_for(request, f)
                except (ValueError, KvdError) as exc:
                    log.warning(
                        "kvd: request %s: unusable ec_transfer_params for %s: %s",
                        rid,
                        f.identifier,
                        exc,
                    )
                    self._unavailable.add(rid)
                    self._reqs.pop(rid, None)
                    return False
                e = self._cons[f.identifier] = _Cons(params)
                self._reqs[rid] = request  # before the call: its failure event needs it
                c = self.shared.client
                cached = self.shared.call(c.ec_cached, params)
                self.shared.call(c.ec_ensure, params)
                if cached:
                    self._await_hit(f.identifier)
                    if rid in self._unavailable:
                        return False
                    e = self._cons[f.identifier]
            self._reqs[rid] = request
            if e.state != "ready":
                pending = True
        return not pending

    def _await_hit(self, mm_hash: str) -> None:
        """The daemon's EC index says it holds `mm_hash`: its ECReady (a local hit, pinned
        for us) comes at once, so wait for it here, at most `EC_HIT_WAIT_S`, and the
        request loads it in this step instead of being deferred to the next."""
        deadline = time.monotonic() + EC_HIT_WAIT_S
        while True:
            self._poll()
            e = self._cons.get(mm_hash)
            if e is None or e.state != "ensuring" or time.monotonic() >= deadline:
                return
            time.sleep(0.0001)

    def has_cache_item(self, identifier: str) -> bool:
        if not self.consumer:
            return False
        e = self._cons.get(identifier)
        return e is not None and e.state == "ready"

    def _maybe_release(self, mm_hash: str) -> None:
        """Drop our pin once no copy is in flight and no live request still needs it."""
        e = self._cons.get(mm_hash)
        if e is None or e.state != "ready" or e.loads > 0:
            return
        for req in self._reqs.values():
            for f in self._remote_features(req):
                if f.identifier == mm_hash and self._needs(req, f):
                    return
        del self._cons[mm_hash]
        self.shared.call(self.shared.client.ec_release, mm_hash)

    # ------------------------------------------------------------------ producer

    def _spec(self, feature: Any) -> tuple[int, tuple[int, ...]]:
        rows = int(feature.mm_position.get_num_embeds())
        width = self._widths.get(feature.modality) or int(
            self.vllm_config.model_config.get_inputs_embeds_size()
        )
        return rows * width * self.dtype.itemsize, (rows, width)

    def _allocate(self, feature: Any) -> None:
        """Blocks for an output this engine is about to compute (or still holds)."""
        h = feature.identifier
        nbytes, shape = self._spec(feature)
        c = self.shared.client
        try:
            blocks = self.shared.call(c.ec_allocate, h, nbytes)
        except InvalidRequest as exc:
            # already allocated: the daemon still holds it (ours, or an earlier engine's
            # on this node with the same model: its params are the same)
            if h not in self._prod:
                log.info("kvd: encoder output %s is already in the daemon (%s)", h, exc.message)
                params = self._params(h, nbytes, shape, feature.modality)
                self._prod[h] = _Prod("committed", ECSave([], nbytes, shape, params.dtype), params)
            return
        except KvdError as exc:
            log.warning(
                "kvd: no EC blocks for %s (%d bytes): %s; not published", h, nbytes, exc.message
            )
            self._prod.pop(h, None)
            return
        save = ECSave(list(blocks.block_ids), nbytes, shape, dtype_name(self.dtype))
        self._prod[h] = _Prod("allocated", save, self._params(h, nbytes, shape, feature.modality))
        self._prod.move_to_end(h)
        while len(self._prod) > MAX_PRODUCED:
            old = next(iter(self._prod))
            if self._prod[old].state not in ("committed", "void"):
                break  # only committed ones are forgotten (never more than a step in flight)
            del self._prod[old]

    def _params(self, h: str, nbytes: int, shape: tuple[int, ...], modality: str) -> wire.ECParams:
        return wire.ECParams(
            h,
            self.ec_host,
            self.ec_port,
            nbytes,
            shape,
            dtype_name(self.dtype),
            modality,
            self.compat,
        )

    def _commit(self, h: str, why_not: str) -> None:
        p = self._prod.get(h)
        if p is None or p.state != "dispatched":
            return
        c = self.shared.client
        s = p.save
        if why_not:
            log.error("kvd: the worker did not copy encoder output %s (%s); not served", h, why_not)
        try:
            got = self.shared.call(
                c.ec_commit,
                h,
                s.nbytes,
                shape=s.shape,
                dtype=s.dtype,
                modality=p.params.modality,
                compat=VOID_COMPAT if why_not else self.compat,
            )
        except KvdError as exc:
            log.error("kvd: committing encoder output %s failed: %s", h, exc.message)
            del self._prod[h]
            return
        if why_not:
            p.state = "void"
            return
        if got != p.params:
            log.error(
                "kvd: the daemon published %s as %s, this connector announced %s", h, got, p.params
            )
        p.state, p.params = "committed", got

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if self.consumer:
            self._unavailable.discard(rid)
            req = self._reqs.pop(rid, None)
            if req is not None:
                for f in self._remote_features(req):
                    self._maybe_release(f.identifier)
        if not self.producer or not request.mm_features:
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        out: dict[str, Any] = {}
        remote = {f.identifier for f in self._remote_features(request)} if self.consumer else set()
        for f in request.mm_features:
            h = f.identifier
            if h in out or h in remote:
                continue  # loaded from elsewhere: not ours to publish
            p = self._prod.get(h)
            if p is None or p.state == "void" or (p.state == "committed" and p.save.block_ids):
                # this request may have reused vLLM's cached copy: is it (still) in the
                # daemon? If not, it is allocated again and the next step's workers copy it
                # from vLLM's encoder cache, which holds it until then (start_save_caches)
                self._allocate(f)
                p = self._prod.get(h)
            if p is not None and p.state != "void":
                self._prod.move_to_end(h)
                out[h] = params_to_dict(p.params)
        return False, out or None

    # ------------------------------------------------------------------ both

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        f = request.mm_features[index]
        h = f.identifier
        e = self._cons.get(h) if self.consumer else None
        if e is not None and e.state == "ready":
            if h in self._meta.loads:
                return
            lid = self._next_load
            self._next_load += 1
            ep = e.params
            self._meta.loads[h] = ECLoad(
                lid, list(e.block_ids), e.nbytes, tuple(ep.shape), ep.dtype
            )
            self._load_acks[lid] = (h, self.expected_load_reports)
            e.loads += 1
            return
        if self.producer:
            p = self._prod.get(h)
            if p is None or p.state in ("committed", "void"):
                self._allocate(f)  # a committed one may have been evicted: found out here

    def build_connector_meta(self, scheduler_output: Any) -> KvdECConnectorMetadata:
        self._poll()
        meta, self._meta = self._meta, KvdECConnectorMetadata()
        meta.region, meta.region_bytes, meta.block_bytes = (
            self.region,
            self.region_bytes,
            self.block_bytes,
        )
        for h, p in self._prod.items():
            if p.state == "allocated":
                meta.saves[h] = p.save
                p.state = "dispatched"
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, KvdECWorkerMetadata):
            for h, why_not in meta.saved:
                self._commit(h, why_not)
            for lid in meta.loaded:
                ack = self._load_acks.get(lid)
                if ack is None:
                    continue
                h, left = ack
                if left > 1:
                    self._load_acks[lid] = (h, left - 1)
                    continue
                del self._load_acks[lid]
                e = self._cons.get(h)
                if e is not None:
                    e.loads -= 1
        self._poll()
        for h in list(self._cons):
            self._maybe_release(h)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def has_pending_push_work(self) -> bool:
        self._poll()
        for h in list(self._cons):
            self._maybe_release(h)
        if any(p.state in ("allocated", "dispatched") for p in self._prod.values()):
            return True
        # an ensure nobody waits for any more: its event must still be taken (and released)
        wanted = {f.identifier for r in self._reqs.values() for f in self._remote_features(r)}
        return any(e.state == "ensuring" and h not in wanted for h, e in self._cons.items())

    def shutdown(self) -> None:
        self.sub.close()


# ====================================================================== worker side


class _ECWorker:
    def __init__(self, vllm_config: Any, producer: bool, consumer: bool) -> None:
        self.producer = producer
        self.consumer = consumer
        self.device = torch.device(vllm_config.device_config.device)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.save_rank = _tp_rank(tp_size) == 0
        self.region: ECRegionView | None = None
        self.meta: KvdECConnectorMetadata | None = None
        self._saves: dict[str, ECSave] = {}
        self._saved: list[tuple[str, str]] = []
        self._loaded: list[int] = []

    def _view(self, meta: KvdECConnectorMetadata) -> ECRegionView:
        r = self.region
        if r is None or r.name != meta.region:
            if r is not None:
                r.close()
            self.region = None
            self.region = r = ECRegionView(meta.region, meta.region_bytes, meta.block_bytes)
        return r

    def bind(self, meta: KvdECConnectorMetadata) -> None:
        self.meta = meta
        self._saves = dict(meta.saves) if self.save_rank else {}

    def _save(self, mm_hash: str, t: torch.Tensor) -> None:
        s = self._saves.pop(mm_hash)
        assert self.meta is not None
        why = ""
        if dtype_name(t.dtype) != s.dtype or tuple(t.shape) != tuple(s.shape):
            why = f"the output is {list(t.shape)} {t.dtype}, {list(s.shape)} {s.dtype} was sized"
        else:
            try:
                self._view(self.meta).write(s.block_ids, tensor_bytes(t))
            except (OSError, ValueError) as exc:
                why = f"copy failed: {exc}"
        if why:
            log.error("kvd: not saving encoder output %s: %s", mm_hash, why)
        self._saved.append((mm_hash, why))

    def start_save_caches(self, encoder_cache: Mapping[str, torch.Tensor]) -> None:
        """Outputs vLLM already holds (an evicted one published again)."""
        for h in [h for h in self._saves if h in encoder_cache]:
            self._save(h, encoder_cache[h])

    def save_caches(self, encoder_cache: Mapping[str, torch.Tensor], mm_hash: str) -> None:
        if mm_hash in self._saves and mm_hash in encoder_cache:
            self._save(mm_hash, encoder_cache[mm_hash])

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        meta = self.meta
        if meta is None or not meta.loads:
            return
        view = self._view(meta)
        for h, ld in meta.loads.items():
            data = view.read(ld.block_ids, ld.nbytes)
            encoder_cache[h] = bytes_to_tensor(data, ld.shape, dtype_of(ld.dtype), self.device)
            self._loaded.append(ld.load_id)

    def worker_meta(self) -> KvdECWorkerMetadata | None:
        for h in self._saves:  # never seen this step: nothing to copy from
            self._saved.append((h, "the output was not in the encoder cache"))
        self._saves = {}
        if not self._saved and not self._loaded:
            return None
        out = KvdECWorkerMetadata(self._saved, self._loaded)
        self._saved, self._loaded = [], []
        return out

    def shutdown(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


# ====================================================================== the connector


class KvdECConnector(ECConnectorBase):  # type: ignore[misc]
    """vLLM EC connector moving encoder outputs through the node's kvd daemon (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        super().__init__(vllm_config, role)
        ec = vllm_config.ec_transfer_config
        self.config = ECConfig.from_extra(ec.ec_connector_extra_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("KvdECConnector does not support pipeline parallelism yet")
        # one daemon session per process and engine, shared with KvdConnector
        kv = vllm_config.kv_transfer_config
        self.engine_id = str((kv.engine_id if kv is not None else None) or ec.engine_id)
        self._sched: _ECScheduler | None = None
        self._worker: _ECWorker | None = None
        if role == ECConnectorRole.SCHEDULER:
            self._sched = _ECScheduler(
                vllm_config, self.config, self.engine_id, self.is_producer, self.is_consumer
            )
        else:
            self._worker = _ECWorker(vllm_config, self.is_producer, self.is_consumer)

    @property
    def scheduler_side(self) -> _ECScheduler:
        assert self._sched is not None, "a scheduler-side call on a worker-side connector"
        return self._sched

    @property
    def worker_side(self) -> _ECWorker:
        assert self._worker is not None, "a worker-side call on a scheduler-side connector"
        return self._worker

    # ------------------------------------------------------------------ scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler_side.has_cache_item(identifier)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return self.scheduler_side.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> KvdECConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler_side.take_unavailable_requests()

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    # ------------------------------------------------------------------ worker side

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvdECConnectorMetadata):
            self.worker_side.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.meta = None

    def start_save_caches(self, **kwargs: Any) -> None:
        cache = kwargs.get("encoder_cache")
        if cache is not None:
            self.worker_side.start_save_caches(cache)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self.worker_side.save_caches(encoder_cache, mm_hash)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self.worker_side.start_load_caches(encoder_cache)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> KvdECWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
