"""The backend an engine actor runs: vLLM, or the synthetic one of the tests and benchmarks."""

from __future__ import annotations

from actors.engine.config import EngineConfig
from actors.protocol.backend import Backend


def make_backend(cfg: EngineConfig, engine_id: str) -> Backend:
    if cfg.backend == "synthetic":
        from actors.engine.synthetic.backend import SyntheticBackend

        return SyntheticBackend(cfg, engine_id, token_latency_s=cfg.synthetic.token_latency_s)
    from actors.engine.vllm.backend import VllmBackend

    return VllmBackend(cfg, engine_id)
