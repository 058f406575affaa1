"""raypd's vLLM KV connector. Load it with

    KVTransferConfig(kv_connector="RayNixlConnector", kv_connector_module_path="actors.engine.vllm.connector",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"engine_id": ..., "handshake_dir": ..., ...})
"""

from actors.engine.vllm.connector.connector import RayNixlConnector

__all__ = ["RayNixlConnector"]
