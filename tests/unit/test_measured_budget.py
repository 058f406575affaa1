"""The chunk budget of an engine raypd starts: from the rates its role's live engines measured when
there are some, else from the placement priors; an operator-written value always wins; a GPU engine
runs a measured budget only above `vllm serve`'s default. The autoscaler hands the measured rates to the
engines it starts (pure: no Ray cluster, fake engine loads and hands)."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.config import EngineConfig
from actors.engine.load import EngineLoad
from actors.engine.vllm.args import platform_defaults
from actors.protocol.stats import LoadSnapshot
from serving.cluster import engines
from serving.cluster.autoscaler import Autoscaler, ScaleEvent
from serving.config import DeploymentConfig
from serving.placement_config import VLLM_DEFAULT_BUDGET, MeasuredRates, chunked_prefill_budget, vllm_default_budget

FAST = MeasuredRates(prefill_tokens_per_s=30000.0, step_s=0.02)  # a GPU-like engine
SLOW = MeasuredRates(prefill_tokens_per_s=800.0, step_s=0.03)  # a CPU-like engine


def deployment(decode_kwargs: dict | None = None, **extra) -> DeploymentConfig:
    """One prefill and one decode engine with GPU-sized blocks (16 tokens)."""
    return DeploymentConfig.from_dict({"backend": "vllm", "model": "m", "prefill": {"count": 1, "block_size": 16},
                                       "decode": {"count": 1, "block_size": 16, "engine_kwargs": decode_kwargs or {}},
                                       **extra})


def budget_on(cfg: DeploymentConfig, role: str, measured: MeasuredRates | None, is_cpu: bool) -> int | None:
    """What the engine applies on that platform (operator-written values included)."""
    e = cfg.engine_config(role, measured=measured)
    return {**platform_defaults(e, is_cpu=is_cpu), **e.engine_kwargs}.get("max_num_batched_tokens")


def test_measured_rates_are_the_medians_of_what_the_engines_measured():
    assert MeasuredRates.of([100.0, 300.0, 200.0], [0.25, None, 0.75]) == MeasuredRates(200.0, 0.5)


@pytest.mark.parametrize("rates, steps", [([None, None], [0.05]), ([400.0], []), ([0.0], [0.05]), ([], [])])
def test_no_measurement_unless_a_prefill_rate_and_a_step_time_were_measured(rates, steps):
    assert MeasuredRates.of(rates, steps) is None


def test_the_budget_comes_from_the_measured_rates_by_the_placement_formula():
    cfg = deployment()
    slo = cfg.router.slo
    want = chunked_prefill_budget(SLOW.step_s, SLOW.prefill_tokens_per_s, slo.itl_target_s, block_size=16)
    budget = cfg.chunk_budget_of("decode", SLOW)
    assert (budget.tokens, budget.source) == (want, "measured")
    assert want != cfg.chunk_budget("decode")  # not the priors' value
    assert budget_on(cfg, "decode", SLOW, is_cpu=True) == want


def test_without_measurements_the_priors_give_the_budget():
    cfg = deployment()
    slo = cfg.router.slo
    want = chunked_prefill_budget(slo.prior_step_s, slo.prior_prefill_tokens_per_s, slo.itl_target_s, block_size=16)
    assert cfg.chunk_budget_of("decode").source == "priors"
    assert budget_on(cfg, "decode", None, is_cpu=True) == want
    assert budget_on(cfg, "decode", None, is_cpu=False) is None  # a GPU runs vLLM's default


@pytest.mark.parametrize("measured", [None, SLOW, FAST])
@pytest.mark.parametrize("is_cpu", [True, False])
def test_an_operator_written_budget_always_wins(measured, is_cpu):
    cfg = deployment({"max_num_batched_tokens": 512})
    assert cfg.chunk_budget_of("decode", measured).source == "operator"
    assert budget_on(cfg, "decode", measured, is_cpu) == 512


def test_a_gpu_engine_runs_a_measured_budget_only_above_vllms_default():
    cfg = deployment()
    assert budget_on(cfg, "decode", SLOW, is_cpu=False) is None  # below 2048: vLLM's default stands
    fast = budget_on(cfg, "decode", FAST, is_cpu=False)
    assert fast == cfg.chunk_budget("decode", FAST) > VLLM_DEFAULT_BUDGET


def test_vllms_throughput_mode_raises_the_default_a_measured_budget_must_beat():
    cfg = deployment(engine_kwargs={"performance_mode": "throughput"})
    between = MeasuredRates(prefill_tokens_per_s=12000.0, step_s=0.02)  # ~2.7k tokens: above 2048, below 4096
    assert VLLM_DEFAULT_BUDGET < cfg.chunk_budget("decode", between) < vllm_default_budget(cfg.engine_kwargs)
    assert budget_on(cfg, "decode", between, is_cpu=False) is None


def test_prefill_engines_get_no_budget_and_batch_prompts_on_a_gpu():
    cfg = deployment()
    for measured in (None, FAST):
        e = cfg.engine_config("prefill", measured=measured)
        assert platform_defaults(e, is_cpu=True) == {"max_num_seqs": 1, "distributed_executor_backend": "uni"}
        assert platform_defaults(e, is_cpu=False) == {}


def test_vllms_default_budget_is_the_one_vllm_serve_uses_on_this_host():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    assert VLLM_DEFAULT_BUDGET == EngineArgs.get_batch_defaults(1)[0][UsageContext.OPENAI_API_SERVER]


# ----------------------------------------------------------- where engines are created
def load(engine: str, role: str, prefill_rate: float | None, step_s: float | None) -> EngineLoad:
    meter = LoadSnapshot(0, 0.0, 0, 0.0, None, None, prefill_tokens_per_s=prefill_rate, step_s=step_s)
    return EngineLoad(engine, role, 0, 0, 0.1, meter)


class Hands:
    def __init__(self):
        self.started: list[tuple[str, int, MeasuredRates | None]] = []

    async def start_engine(self, role: str, index: int, measured: MeasuredRates | None = None) -> None:
        self.started.append((role, index, measured))

    async def stop_engine(self, engine: str) -> None:
        pass


def test_the_autoscaler_starts_an_engine_with_the_rates_its_role_measured():
    hands = Hands()
    s = Autoscaler(DeploymentConfig.from_dict({"backend": "synthetic", "both": {"count": 2}}), hands)
    loads = [load("b0", "both", 900.0, 0.25), load("b1", "both", None, 0.75), load("b2", "both", 1100.0, None)]
    s.roles["both"].measured = s._measured(loads)
    asyncio.run(s._start("both", 2, ScaleEvent(0.0, "both", "up", "test", "b2")))
    assert hands.started == [("both", 2, MeasuredRates(1000.0, 0.5))]


def test_before_any_measurement_the_autoscaler_starts_engines_on_the_priors():
    hands = Hands()
    s = Autoscaler(DeploymentConfig.from_dict({"backend": "synthetic", "both": {"count": 1}}), hands)
    assert s._measured([load("b0", "both", None, 0.05)]) is None
    asyncio.run(s._start("both", 1, ScaleEvent(0.0, "both", "up", "test", "b1")))
    assert hands.started == [("both", 1, None)]


def test_create_engine_builds_the_engine_config_from_the_measured_rates(monkeypatch):
    created: list[EngineConfig] = []

    class FakeActor:
        def options(self, **opts):
            return self

        def remote(self, config, coordinator):
            created.append(EngineConfig.model_validate(config))

    monkeypatch.setattr(engines, "_Engine", FakeActor())
    cfg = deployment()
    engines.create_engine(cfg, "decode", 1, pg=None, measured=SLOW)
    engines.create_engine(cfg, "decode", 2, pg=None)
    budgets = [platform_defaults(e, is_cpu=True)["max_num_batched_tokens"] for e in created]
    assert budgets == [cfg.chunk_budget("decode", SLOW), cfg.chunk_budget("decode")]


def test_an_engine_fits_its_own_rates_from_the_slo_priors_or_from_what_its_role_measured():
    """The engine's one rate model (`EngineConfig.rates`) starts from `router.slo`'s priors, and an
    engine the autoscaler starts beside measuring engines starts from their `MeasuredRates`."""
    cfg = deployment(router={"slo": {"prior_prefill_tokens_per_s": 300.0, "rate_half_life_s": 30.0}})
    plain, started = cfg.engine_config("decode"), cfg.engine_config("decode", measured=SLOW)
    assert (plain.rates.prior_prefill_tokens_per_s, plain.rates.prior_step_s, plain.rates.rate_half_life_s) == (
        300.0, cfg.router.slo.prior_step_s, 30.0)
    assert (started.rates.prior_prefill_tokens_per_s, started.rates.prior_step_s) == (SLOW.prefill_tokens_per_s,
                                                                                     SLOW.step_s)
