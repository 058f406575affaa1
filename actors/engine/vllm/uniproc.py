"""One-rank CPU engines whose model runs in vLLM's engine-core process (vLLM's UniProcExecutor).

A one-rank vLLM engine on a CPU host is otherwise three processes (AsyncLLM client, engine core,
one worker fed through a shared-memory queue); `uni` drops the worker process: it starts faster and
spends less CPU per token, with the same answers (docs/benchmarks.md). It is raypd's default for
one-rank CPU engines (`EngineConfig.cpu_engine_defaults`); `engine_kwargs:
{distributed_executor_backend: mp}` keeps vLLM's. vLLM's CPU platform turns `uni` into `mp`, and
async scheduling off, whatever was asked; with `uni` raypd makes it stick:
- VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine actor's environment (AsyncLLM still runs its core
  in a subprocess: only the worker process goes);
- the core's OpenMP threads bound to the engine's `cpu.bind` cores, as vLLM's mp executor binds a
  worker's (OMP_* set in the core's environment only: the actor's runtime read its own long before).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from actors.engine.config import EngineConfig
from actors.engine.vllm.parent_death import child_env

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def runs_model_in_core(cfg: EngineConfig, is_cpu: bool = True) -> bool:
    """The engine runs vLLM's uni executor on a CPU host (one rank: nothing else can use it)."""
    if cfg.backend != "vllm" or cfg.tp_size * cfg.pp_size != 1 or not is_cpu:
        return False
    return {**cfg.cpu_engine_defaults, **cfg.engine_kwargs}.get("distributed_executor_backend") == "uni"


def actor_env(cfg: EngineConfig) -> dict[str, str]:
    """What the engine actor's environment needs for vLLM's CPU platform to keep `uni` (set where the
    platform is not known yet: on a GPU host AsyncLLM and the uni executor ignore it)."""
    return {MULTIPROCESSING_ENV: "0"} if runs_model_in_core(cfg) else {}


def parse_cpus(spec: str) -> list[int]:
    """"0", "0-3", "0,2,4-5" -> the core ids (one rank: no "|")."""
    try:
        cpus: list[int] = []
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus += list(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        cpus = []
    if not cpus:
        raise ValueError(f"cpu_bind {spec!r}: expected core ids like '0', '0-3' or '0,2'")
    return cpus


def core_omp_env(cfg: EngineConfig, is_cpu: bool = True) -> dict[str, str]:
    """The OpenMP binding vLLM's mp executor would give the worker, for the core process instead."""
    if not runs_model_in_core(cfg, is_cpu) or cfg.cpu.bind in (None, "", "nobind", "auto"):
        return {}
    cpus = parse_cpus(cfg.cpu.bind)
    return {"OMP_NUM_THREADS": str(len(cpus)), "OMP_PLACES": "{" + ",".join(map(str, cpus)) + "}",
            "OMP_PROC_BIND": "true"}


@contextmanager
def core_process_env(cfg: EngineConfig) -> Iterator[None]:
    """Around AsyncLLM's construction (which spawns the core): the core inherits the binding, and the
    mark that makes it end with this actor (`actors.engine.vllm.parent_death`)."""
    from vllm.platforms import current_platform

    values = core_omp_env(cfg, current_platform.is_cpu()) | child_env()
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
