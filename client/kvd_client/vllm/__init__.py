"""vLLM integration of the kvd thin client (the optional extra ``kvd-client[vllm]``).

``KvdConnector`` is vLLM's KV connector over kvd and ``KvdECConnector`` its encoder-cache
(EC) connector; load them by module path, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "KvdConnector",
                           "kv_connector_module_path": "kvd_client.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"transfer_mode": "pull"}}'
    --ec-transfer-config '{"ec_connector": "KvdECConnector",
                           "ec_connector_module_path": "kvd_client.vllm",
                           "ec_role": "ec_consumer",
                           "ec_connector_extra_config": {"kvd_socket": "/run/kvd/kvd.sock"}}'

Layout: ``shared`` (one daemon session per process, shared by every connector of it:
``KvdConnector`` and ``KvdECConnector``), ``config`` (the
``kv_connector_extra_config`` keys), ``staging`` (KV tensors <-> host staging, torch only),
``kv`` (the KV connector) and ``ec`` (the EC connector), which import vLLM, and ``tiers``
(``KvdTier``, a secondary tier of vLLM's own ``OffloadingConnector``: load it with
``"secondary_tiers": [{"type": "KvdTier", "module_path": "kvd_client.vllm.tiers"}]``; its
vLLM subclasses live in ``tier_vllm``). The connectors
are resolved lazily, so the helpers import without vLLM; ``import kvd_client`` alone never
imports vLLM or torch, and nothing here imports the daemon (``kvd``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvd_client.vllm.ec import KvdECConnector, KvdECConnectorMetadata
    from kvd_client.vllm.kv import KvdConnector, KvdConnectorMetadata

__all__ = ["KvdConnector", "KvdConnectorMetadata", "KvdECConnector", "KvdECConnectorMetadata"]
_EC = frozenset({"KvdECConnector", "KvdECConnectorMetadata"})


def __getattr__(name: str) -> Any:
    if name in _EC:
        from kvd_client.vllm import ec

        return getattr(ec, name)
    if name in __all__:
        from kvd_client.vllm import kv

        return getattr(kv, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
