"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

- `kvd_socket` (default: the client's default socket): the local daemon's IPC socket.
- `transfer_mode` (default `"pull"`): `pull`, D's daemon READs P's blocks; `push`, P's
  daemon WRITEs into D's preallocated blocks (decided by D; a kvd P serves both).
- `kv_lease_duration`: the daemon's `transfer.kv_lease_duration` (seconds).
- `push_registration_timeout`: the daemon's `transfer.push_registration_timeout` (seconds).
- `bidirectional_kv_xfer` (default false): multi-turn. D keeps a finished request's blocks
  (the daemon's fixed lease) and returns kv_transfer_params naming them with
  `remote_blocks_expiry_time`; a P given those params (beside `do_remote_decode`) pulls the
  kept prefix from D instead of recomputing it, if at least `kv_recompute_threshold`
  tokens (default 64) would load and at least 5 s remain before the expiry.
- `decoder_kv_blocks_ttl`: seconds D keeps them (default: the daemon's
  `transfer.decoder_kv_blocks_ttl`).

`kv_lease_duration` and `push_registration_timeout` are *daemon* settings: leases and
registration watchdogs run on the daemon's clock, so the values that count are the ones
in the daemon's config file. They are accepted here so that a NixlConnector config can be
reused unchanged; they must match the daemon config, and the connector warns when
`kv_lease_duration` differs from the one the daemon announces in its Welcome.
NIXL transport keys (`backends`, `num_threads`) belong
to the daemon's `[nixl]` section and are ignored here with a warning.

Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvd_client.client import default_socket_path

log = logging.getLogger("kvd_client.vllm")

TRANSFER_MODES: Final = ("pull", "push")

_KNOWN: Final = frozenset(
    {
        "kvd_socket",
        "transfer_mode",
        "kv_lease_duration",
        "push_registration_timeout",
        "decoder_kv_blocks_ttl",
        "bidirectional_kv_xfer",
        "kv_recompute_threshold",
    }
)
_DAEMON_KEYS: Final = {"backends": "nixl.backend", "num_threads": "nixl.num_threads"}
_NIXL_ONLY: Final = frozenset(
    {
        "engine_ttl",
        "enforce_handshake_compat",
        "enable_cross_layers_blocks",
    }
)


@dataclass(frozen=True)
class ConnectorConfig:
    socket: str
    transfer_mode: str = "pull"
    kv_lease_duration: float | None = None
    push_registration_timeout: float | None = None
    bidirectional: bool = False
    decoder_kv_blocks_ttl: float | None = None
    """None: the daemon's `transfer.decoder_kv_blocks_ttl`."""
    kv_recompute_threshold: int = 64

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate `kv_connector_extra_config`; a bad value raises ValueError naming the key."""
        extra = dict(extra or {})
        for key in sorted(extra):
            if key in _DAEMON_KEYS:
                log.warning(
                    "kvd: kv_connector_extra_config[%r] is ignored: NIXL runs in the kvd daemon; "
                    "set %s in the daemon config",
                    key,
                    _DAEMON_KEYS[key],
                )
            elif key in _NIXL_ONLY:
                log.warning(
                    "kvd: kv_connector_extra_config[%r] is a NixlConnector setting kvd ignores",
                    key,
                )
            elif key not in _KNOWN:
                log.warning("kvd: unknown kv_connector_extra_config key %r ignored", key)
        sock = extra.get("kvd_socket") or default_socket_path()
        if not isinstance(sock, str):
            raise ValueError(
                f"kv_connector_extra_config['kvd_socket'] must be a path, got {sock!r}"
            )
        mode = extra.get("transfer_mode", "pull")
        if mode not in TRANSFER_MODES:
            raise ValueError(
                f"kv_connector_extra_config['transfer_mode'] must be one of {TRANSFER_MODES}, "
                f"got {mode!r}"
            )
        lease = _seconds(extra, "kv_lease_duration")
        reg = _seconds(extra, "push_registration_timeout")
        bidir = extra.get("bidirectional_kv_xfer", False)
        if not isinstance(bidir, bool):
            raise ValueError(
                f"kv_connector_extra_config['bidirectional_kv_xfer'] must be true or false, "
                f"got {bidir!r}"
            )
        ttl = _seconds(extra, "decoder_kv_blocks_ttl")
        if ttl is not None and ttl > 86400:
            raise ValueError(
                f"kv_connector_extra_config['decoder_kv_blocks_ttl'] must be at most 86400 "
                f"seconds, got {ttl!r}"
            )
        threshold = extra.get("kv_recompute_threshold", 64)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(
                "kv_connector_extra_config['kv_recompute_threshold'] must be a positive number "
                f"of tokens, got {threshold!r}"
            )
        return cls(
            socket=sock,
            transfer_mode=mode,
            kv_lease_duration=lease,
            push_registration_timeout=reg,
            bidirectional=bidir,
            decoder_kv_blocks_ttl=ttl,
            kv_recompute_threshold=threshold,
        )

    def check_daemon(self, daemon_lease: float) -> list[str]:
        """Warnings for settings that disagree with what the daemon announced (also logged)."""
        out = []
        if self.kv_lease_duration is not None and not math.isclose(
            self.kv_lease_duration, daemon_lease
        ):
            out.append(
                f"kv_lease_duration is {self.kv_lease_duration}s in kv_connector_extra_config "
                f"but the kvd daemon uses {daemon_lease}s: the daemon's "
                "transfer.kv_lease_duration is what counts"
            )
        for msg in out:
            log.warning("kvd: %s", msg)
        return out


def _seconds(extra: Mapping[str, Any], key: str) -> float | None:
    v = extra.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a positive number of seconds, got {v!r}"
        )
    return float(v)
