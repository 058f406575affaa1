"""`engine_kwargs.distributed_executor_backend: uni` sticks on a CPU host: the actor's environment keeps
vLLM's CPU platform from turning it into `mp`, and the core process is bound as a worker would be."""

from __future__ import annotations

import os

import pytest

from actors.engine.config import EngineConfig
from actors.engine.options import engine_actor_options
from actors.engine.vllm import uniproc


def cfg(**kw) -> EngineConfig:
    return EngineConfig(role="both", backend="vllm", engine_id="e", model="m", **kw)


def test_only_an_engine_that_runs_uni_gets_the_environment():
    uni = cfg(engine_kwargs={"distributed_executor_backend": "uni"}, cpu={"bind": "1"})
    assert engine_actor_options(uni)["runtime_env"]["env_vars"][uniproc.MULTIPROCESSING_ENV] == "0"
    assert uniproc.MULTIPROCESSING_ENV not in engine_actor_options(cfg(cpu={"bind": "1"}))["runtime_env"]["env_vars"]


def test_one_rank_cpu_engines_run_uni_by_default_and_the_operator_can_keep_vllms_mp():
    from serving.config import DeploymentConfig

    base = {"name": "d", "backend": "vllm", "model": "m", "both": {"count": 1}}
    engine = DeploymentConfig.from_dict(base).engine_config("both")
    assert engine.cpu_engine_defaults["distributed_executor_backend"] == "uni"
    assert uniproc.runs_model_in_core(engine) and not uniproc.runs_model_in_core(engine, is_cpu=False)
    kept = DeploymentConfig.from_dict({**base, "engine_kwargs": {"distributed_executor_backend": "mp"}})
    assert not uniproc.runs_model_in_core(kept.engine_config("both"))
    tp2 = DeploymentConfig.from_dict({**base, "both": {"count": 1, "tp_size": 2}})
    assert "distributed_executor_backend" not in tp2.engine_config("both").cpu_engine_defaults


def test_the_core_is_bound_to_the_engines_cores_as_vllms_mp_executor_binds_a_worker():
    uni = cfg(engine_kwargs={"distributed_executor_backend": "uni"}, cpu={"bind": "0,2-3"})
    assert uniproc.core_omp_env(uni) == {"OMP_NUM_THREADS": "3", "OMP_PLACES": "{0,2,3}", "OMP_PROC_BIND": "true"}
    assert uniproc.core_omp_env(cfg(engine_kwargs={"distributed_executor_backend": "uni"}, cpu={"bind": "nobind"})) == {}
    assert uniproc.core_omp_env(cfg(cpu={"bind": "1"})) == {}  # mp: vLLM binds its worker itself


def test_the_binding_is_set_only_while_the_core_is_spawned(monkeypatch):
    monkeypatch.delenv("OMP_PLACES", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    uni = cfg(engine_kwargs={"distributed_executor_backend": "uni"}, cpu={"bind": "1"})
    monkeypatch.setattr("vllm.platforms.current_platform.is_cpu", lambda: True)
    with uniproc.core_process_env(uni):
        inside = (os.environ["OMP_NUM_THREADS"], os.environ["OMP_PLACES"])
    assert inside == ("1", "{1}")
    assert (os.environ["OMP_NUM_THREADS"], "OMP_PLACES" in os.environ) == ("7", False)


def test_a_cpu_list_for_several_ranks_is_refused():
    with pytest.raises(ValueError, match="core ids"):
        uniproc.parse_cpus("0|1")
