"""The autoscaler's model policy: the placement model's pool predictions, fed with what the engines
measured of themselves (pure: an Autoscaler object without Ray, fake engine loads)."""

from __future__ import annotations

from actors.engine.load import EngineLoad
from actors.protocol import LoadSnapshot
from serving.cluster.autoscaler import Autoscaler
from serving.config import DeploymentConfig


def load(engine: str, role: str, *, running: int = 0, queued: int = 0, prefill_rate: float = 400.0,
         step_s: float = 0.05, arrivals: float = 0.0) -> EngineLoad:
    meter = LoadSnapshot(queued, float(queued), 0, 0.0, None, None, prefill_tokens_per_s=prefill_rate,
                         step_s=step_s, arrivals_per_s=arrivals, prompt_tokens_avg=1000.0, output_tokens_avg=64.0)
    return EngineLoad(engine, role, running, 0, 0.1, meter)


def scaler(**groups) -> Autoscaler:
    return Autoscaler(DeploymentConfig.from_dict({"backend": "synthetic", **groups}), hands=None)


def test_a_prefill_pool_behind_its_arrivals_grows_by_one_prefill_engine():
    s = scaler(prefill={"count": 1}, decode={"count": 1})
    advice = s._advice({"prefill": [load("p0", "prefill", queued=8000)],
                        "decode": [load("d0", "decode", running=3, arrivals=0.6)]})
    assert (advice.role, advice.delta, advice.reason) == ("prefill", 1, "ttft")


def test_role_flexible_engines_whose_decodes_slow_down_grow_in_number():
    s = scaler(both={"count": 2})
    busy = [load(f"b{i}", "both", running=20, step_s=0.3, arrivals=0.2) for i in range(2)]
    advice = s._advice({"both": busy})
    assert (advice.role, advice.delta) == ("both", 1)


def test_an_idle_pool_shrinks_and_a_quiet_one_holds():
    s = scaler(prefill={"count": 2}, decode={"count": 1})
    quiet = {"prefill": [load("p0", "prefill"), load("p1", "prefill")], "decode": [load("d0", "decode", arrivals=0.01)]}
    assert (s._advice(quiet).role, s._advice(quiet).delta) == ("prefill", -1)
