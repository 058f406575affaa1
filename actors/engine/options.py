"""Ray actor options of an engine actor (`serving.cluster.engines` and tests create engines with them)."""

from __future__ import annotations

from actors.engine.config import EngineConfig
from actors.engine.vllm.plugin import BUSY_LOOP_ENV
from actors.engine.vllm.uniproc import actor_env as uniproc_env


def engine_actor_options(cfg: EngineConfig, max_restarts: int = 0) -> dict:
    """Ray options for an engine: mostly waiting, so it reserves what the config says.

    With `max_restarts`, Ray restarts a crashed engine (bounded). Calls that are safe to
    repeat on the next incarnation (`start`, `stats`, `abort`...) are retried there;
    `prefill`/`generate` are not (the router decides what to do with them), and `watch` and
    `ping` (the liveness probe) must fail, not wait for the next incarnation.
    """
    env = {}
    if cfg.cpu.bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu.bind
    if cfg.backend == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib)
        if cfg.cpu.shm_busy_loop_s is not None:  # how vLLM's shared-memory readers wait (actors/engine/vllm/plugin.py)
            env[BUSY_LOOP_ENV] = repr(cfg.cpu.shm_busy_loop_s)
        env.update(uniproc_env(cfg))  # engine_kwargs.distributed_executor_backend: uni (actors/engine/vllm/uniproc.py)
    return {
        "num_cpus": cfg.num_cpus,
        "resources": dict(cfg.resources),
        "max_concurrency": 1000,
        "max_restarts": max_restarts,
        "max_task_retries": -1 if max_restarts else 0,
        "runtime_env": {"env_vars": env} if env else None,
    }

