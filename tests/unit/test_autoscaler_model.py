"""The autoscaler's model policy: the planner's simulation of the live pools, fed with what the engines
measured of themselves and bounded by the deployment's autoscaler (pure: an Autoscaler object without
Ray, fake engine loads)."""

from __future__ import annotations

import asyncio

from actors.engine.load import EngineLoad
from actors.protocol.stats import LoadSnapshot
from serving.cluster.autoscaler import Autoscaler
from serving.config import DeploymentConfig


def load(engine: str, role: str, *, running: int = 0, queued: int = 0, prefill_rate: float = 400.0,
         step_s: float = 0.05, arrivals: float = 0.0) -> EngineLoad:
    meter = LoadSnapshot(queued, float(queued), 0, 0.0, None, None, prefill_tokens_per_s=prefill_rate,
                         step_s=step_s, arrivals_per_s=arrivals, prompt_tokens_avg=1000.0, output_tokens_avg=64.0)
    return EngineLoad(engine, role, running, 0, 0.1, meter)


def scaler(**groups) -> Autoscaler:
    bounds = {role: {"min": 1, "max": 4} for role in groups}
    return Autoscaler(DeploymentConfig.from_dict({"backend": "synthetic", "autoscaler": bounds, **groups}), hands=None)


def advise(s: Autoscaler, loads: dict[str, list[EngineLoad]]):
    return asyncio.run(s._advice(loads))


def test_a_prefill_pool_behind_its_arrivals_grows_by_one_prefill_engine():
    s = scaler(prefill={"count": 1}, decode={"count": 1})
    advice = advise(s, {"prefill": [load("p0", "prefill", queued=8000)],
                        "decode": [load("d0", "decode", running=3, arrivals=0.6)]})
    assert (advice.role, advice.delta, advice.reason) == ("prefill", 1, "ttft")


def test_role_flexible_engines_whose_decodes_slow_down_grow_in_number():
    s = scaler(both={"count": 2})
    busy = [load(f"b{i}", "both", running=20, step_s=0.3, arrivals=0.2) for i in range(2)]
    advice = advise(s, {"both": busy})
    assert (advice.role, advice.delta) == ("both", 1)


def test_an_idle_pool_shrinks_and_a_quiet_one_holds():
    s = scaler(prefill={"count": 2}, decode={"count": 1})
    quiet = {"prefill": [load("p0", "prefill"), load("p1", "prefill")], "decode": [load("d0", "decode", arrivals=0.01)]}
    advice = advise(s, quiet)
    assert (advice.role, advice.delta) == ("prefill", -1)


def test_a_pool_at_its_maximum_is_not_advised_to_grow():
    s = Autoscaler(DeploymentConfig.from_dict({"backend": "synthetic", "prefill": {"count": 1}, "decode": {"count": 1},
                                               "autoscaler": {"prefill": {"min": 1, "max": 1}}}), hands=None)
    advice = advise(s, {"prefill": [load("p0", "prefill", queued=8000)],
                        "decode": [load("d0", "decode", running=3, arrivals=0.6)]})
    assert (advice.role, advice.delta, advice.reason) == (None, 0, "no_relief")
