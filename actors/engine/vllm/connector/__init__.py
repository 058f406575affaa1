"""raypd's vLLM KV connector. Load it with

    KVTransferConfig(kv_connector="RayNixlConnector", kv_connector_module_path="actors.engine.vllm.connector",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config=ConnectorExtraConfig(...).to_extra_config())

(`actors.engine.vllm.extra_config`: the connector validates that dict back into the same type.)
"""

from actors.engine.vllm.connector.connector import RayNixlConnector

__all__ = ["RayNixlConnector"]
