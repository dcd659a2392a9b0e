"""The connector's settings, read from vLLM's `kv_connector_extra_config`.

- `kvd_socket` (default: the client's default socket): the local daemon's IPC socket.
- `transfer_mode` (default `"pull"`): `pull`, D's daemon READs P's blocks; `push`, P's
  daemon WRITEs into D's preallocated blocks (decided by D; a kvd P serves both).
- `kv_lease_duration`: the daemon's `transfer.kv_lease_duration` (seconds).
- `push_registration_timeout`: the daemon's `transfer.push_registration_timeout` (seconds).

`kv_lease_duration` and `push_registration_timeout` are *daemon* settings: leases and
registration watchdogs run on the daemon's clock, so the values that count are the ones
in the daemon's config file. They are accepted here so that a NixlConnector config can be
reused unchanged; they must match the daemon config, and the connector warns when
`kv_lease_duration` differs from the one the daemon announces in its Welcome.
NixlConnector's `decoder_kv_blocks_ttl` (its default for `push_registration_timeout`) is
read as `push_registration_timeout`. NIXL transport keys (`backends`, `num_threads`) belong
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
    }
)
_DAEMON_KEYS: Final = {"backends": "nixl.backend", "num_threads": "nixl.num_threads"}
_NIXL_ONLY: Final = frozenset(
    {
        "engine_ttl",
        "enforce_handshake_compat",
        "bidirectional_kv_xfer",
        "kv_recompute_threshold",
        "enable_cross_layers_blocks",
    }
)


@dataclass(frozen=True)
class ConnectorConfig:
    socket: str
    transfer_mode: str = "pull"
    kv_lease_duration: float | None = None
    push_registration_timeout: float | None = None

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
        if reg is None:
            reg = _seconds(extra, "decoder_kv_blocks_ttl")
        return cls(
            socket=sock, transfer_mode=mode, kv_lease_duration=lease, push_registration_timeout=reg
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
