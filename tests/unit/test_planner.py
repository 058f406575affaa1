"""The shape planner (serving/sizing, `raypd config --plan`): shapes, the simulation, the choice, the YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.cli.main import main
from serving.config import DeploymentConfig, read_config_file
from serving.sizing.deployment import budget_choices, core_ranges, deployment_config, deployment_yaml, shape_limits
from serving.sizing.plan import plan, render_table
from serving.sizing.profile import EngineProfile, HardwareProfile, ProfileError, load_profile
from serving.sizing.shapes import Shape, enumerate_shapes
from serving.sizing.simulate import ShapeLimits, StepLimits, simulate
from serving.sizing.workload import SloTargets, Workload

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PROFILE = ROOT / "configs" / "profiles" / "smollm2-cpu.yaml"
LOCAL = read_config_file(ROOT / "configs" / "local.yaml")
GPU_EXAMPLE = read_config_file(ROOT / "configs" / "gpu-example.yaml")


def box(*engines: EngineProfile, units: int = 2) -> HardwareProfile:
    return HardwareProfile(unit="cpu", total_units=units, engines=engines, transfer_tokens_per_s=20000.0,
                           transfer_overhead_s=0.1)


ONE_CORE = EngineProfile(cores=1, step_s=0.06, step_per_stream_s=0.002, prefill_tokens_per_s=600.0)


# ------------------------------------------------------------------ shapes
def test_the_shapes_of_a_two_core_box():
    assert [s.label for s in enumerate_shapes(2, (1, 2))] == ["1x2 both", "2x1 both", "1x1 both", "1P(1)+1D(1)"]
    assert enumerate_shapes(2, (2, 1)) == enumerate_shapes(2, (1, 2))  # sorted, whatever the order given


def test_shapes_fit_the_box_and_keep_one_size_per_role():
    shapes = enumerate_shapes(8, (1, 2))
    assert len(shapes) == len(set(shapes)) == 70  # 8 + 4 colocated; P/D: 28 (1,1), 12 (1,2), 12 (2,1), 6 (2,2)
    for shape in shapes:
        assert 1 <= shape.units <= 8
        assert all(len(set(sizes)) == 1 for sizes in (shape.colocated, shape.prefill, shape.decode) if sizes)
    with pytest.raises(ValueError, match="one size"):
        Shape(prefill=(1,), decode=(1, 2))
    with pytest.raises(ValueError, match="decode-capable"):
        Shape(prefill=(1,))


# ------------------------------------------------------------------ profile
def test_the_shipped_profile_loads_and_other_sizes_are_extrapolated():
    profile = load_profile(SHIPPED_PROFILE)
    assert (profile.unit, profile.total_units, profile.sizes) == ("cpu", 2, (1, 2))
    two = profile.for_size(2)
    assert two.measured
    four = profile.for_size(4)  # from the 2-core figures: prefill x2, steps unchanged
    assert not four.measured
    assert (four.prefill_tokens_per_s, four.step_s) == (pytest.approx(2 * two.prefill_tokens_per_s), two.step_s)
    assert "written by `raypd profile`" in SHIPPED_PROFILE.read_text()


def test_a_bad_profile_is_refused_naming_the_field(tmp_path):
    data = yaml.safe_load(SHIPPED_PROFILE.read_text())
    data["engines"][1]["step_s"] = -0.05
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"engines\.1\.step_s"):
        load_profile(path)
    path.write_text("unit: cpu\ntotal_units: 2\nengines: []\ntransfer_tokens_per_s: 1\ntransfer_overhead_s: 0\n")
    with pytest.raises(ProfileError, match="engines: at least one"):
        load_profile(path)
    path.write_text("unit: cpu\ntotal_units: 2\ntypo: 1\n")
    with pytest.raises(ProfileError, match="typo"):
        load_profile(path)
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "missing.yaml")


# ------------------------------------------------------------------ simulation
def test_an_idle_engine_answers_in_its_compute_time():
    profile = box(ONE_CORE)
    a, b, c = ONE_CORE.step_s, ONE_CORE.step_per_stream_s, ONE_CORE.prefill_s_per_token
    work = Workload(prompt_mix=((500, 1.0),), output_tokens=32, rates=(0.001,), requests_per_rate=20)
    slo = SloTargets(ttft_s=10.0, tpot_s=1.0)
    # colocated, 128-token chunks: 4 steps (128 x 3 + 116 tokens), then one stream decoding alone
    colocated = simulate(Shape(colocated=(1,)), profile, work, 0.001, slo, ShapeLimits(both=StepLimits(128)))
    assert colocated.ttft_p90_s == pytest.approx(4 * a + 500 * c, rel=0.01)
    assert colocated.tpot_p50_s == pytest.approx(a + b, rel=0.01)
    # disaggregated: one step of the whole prompt; the KV pull lands in the TPOT (vLLM's definition)
    pd = simulate(Shape(prefill=(1,), decode=(1,)), profile, work, 0.001, slo)
    assert pd.ttft_p50_s == pytest.approx(a + 500 * c, rel=0.01)
    assert pd.tpot_p50_s == pytest.approx((0.1 + 500 / 20000 + 31 * (a + b)) / 31, rel=0.01)
    assert colocated.goodput == pd.goodput == pytest.approx(0.001)  # every request within the targets


def test_goodput_falls_past_capacity_and_runs_are_deterministic():
    profile = box(ONE_CORE)
    work = Workload(prompt_mix=((512, 0.7), (1024, 0.3)), output_tokens=64, rates=(0.25, 0.5, 1.0, 2.0))
    slo = SloTargets(ttft_s=6.0, tpot_s=0.5)
    results = [simulate(Shape(colocated=(1,)), profile, work, rate, slo) for rate in work.rates]
    goodputs = [r.goodput for r in results]
    # its capacity is under 0.8 req/s: 666 prompt tokens on average at 600 tok/s, and the decode steps
    assert goodputs[:2] == pytest.approx([0.25, 0.5])  # below it every request is in time
    assert goodputs[3] <= goodputs[2] < goodputs[1]  # past it the queue grows, and TTFT with it
    assert results[3].throughput == pytest.approx(results[2].throughput, rel=0.05)  # saturated ...
    assert results[3].throughput < 0.8  # ... at its capacity
    assert simulate(Shape(colocated=(1,)), profile, work, 2.0, slo) == results[3]


def test_given_arrivals_are_simulated_instead_of_the_workloads_draw():
    # plan_check predicts the very requests it sends: 48 of them, not the workload's 200. Past capacity
    # that matters: a shorter run's queue has less time to grow.
    profile = box(ONE_CORE)
    work = Workload(prompt_mix=((512, 1.0),), output_tokens=64, rates=(1.5,))
    slo = SloTargets(ttft_s=3.0, tpot_s=0.1)
    shape = Shape(colocated=(1,))
    drawn = work.requests(1.5)
    assert simulate(shape, profile, work, 1.5, slo, requests=drawn) == simulate(shape, profile, work, 1.5, slo)
    first = drawn[:12]
    short = simulate(shape, profile, work, 1.5, slo, requests=tuple(reversed(first)))  # any order: by arrival
    assert short.requests == 12
    assert short.goodput > simulate(shape, profile, work, 1.5, slo).goodput
    planned = plan(profile, work, slo, LOCAL, arrivals={1.5: first})
    assert {r.requests for p in planned.predictions for r in p.results} == {12}
    with pytest.raises(ValueError, match="no requests"):
        simulate(shape, profile, work, 1.5, slo, requests=())


def test_told_the_tpot_target_slo_placement_serves_more_within_it_than_least_loaded():
    # Two one-core `both` engines at 400 tok/s, 30 ms steps; 512- and 1024-token prompts at 0.5 req/s.
    # A local prefill's stall used to be priced per step (every second past the 0.25 s step target, for
    # each decoding stream), so a prompt often went to the other engine's queue instead: 142 requests of
    # 200 within the targets, against 161 for least-loaded. Priced against what it adds past each
    # stream's TPOT budget (the plan's targets, `slo_targets`), it is 164.
    profile = box(EngineProfile(cores=1, step_s=0.03, step_per_stream_s=0.002, prefill_tokens_per_s=400.0))
    work = Workload(prompt_mix=((512, 0.7), (1024, 0.3)), output_tokens=64, rates=(0.5,))
    slo = SloTargets(ttft_s=3.0, tpot_s=0.1)
    shape = Shape(colocated=(1, 1))
    told = deployment_config(shape, LOCAL, "cpu", slo).router.slo
    placed = simulate(shape, profile, work, 0.5, slo, placement=told)
    least_loaded = simulate(shape, profile, work, 0.5, slo)
    assert placed.within_slo >= least_loaded.within_slo


def test_the_plans_targets_reach_the_router_unless_the_operator_set_them():
    slo = SloTargets(ttft_s=3.0, tpot_s=0.1)
    told = deployment_config(Shape(colocated=(1, 1)), LOCAL, "cpu", slo).router.slo
    assert (told.ttft_target_s, told.ttft_slowdown, told.itl_target_mean_s) == (3.0, 0.0, 0.1)
    mine = {**LOCAL, "router": {"slo": {"itl_target_mean_s": 0.2}}}
    assert deployment_config(Shape(colocated=(1, 1)), mine, "cpu", slo).router.slo.itl_target_mean_s == 0.2


# ------------------------------------------------------------------ the choice
def test_a_twice_faster_two_core_prefill_picks_one_two_core_engine():
    # 1000-token prompts: one core prefills at 500 tok/s (2 s > the 1.5 s TTFT target, in any role),
    # two cores at 1000 tok/s (1 s + a few steps: within it). At 0.1 req/s one engine keeps up.
    profile = box(EngineProfile(cores=1, step_s=0.05, step_per_stream_s=0.001, prefill_tokens_per_s=500.0),
                  EngineProfile(cores=2, step_s=0.05, step_per_stream_s=0.001, prefill_tokens_per_s=1000.0))
    result = plan(profile, Workload(prompt_mix=((1000, 1.0),), output_tokens=16, rates=(0.1,)),
                  SloTargets(ttft_s=1.5, tpot_s=0.2))
    assert result.chosen.shape.label == "1x2 both"
    assert all(p.total_goodput == 0 for p in result.predictions if p is not result.chosen)
    hopeless = plan(profile, Workload(prompt_mix=((1000, 1.0),), output_tokens=16, rates=(0.1,)),
                    SloTargets(ttft_s=0.5, tpot_s=0.2))
    assert "no shape meets the targets" in render_table(hopeless)


def test_long_prompts_that_stall_colocated_decodes_pick_prefill_decode_pools():
    # A decode step alone costs 0.021 s, half the 0.04 s TPOT target; a step that also carries a
    # prompt chunk costs 0.02 + chunk / 1000 s (0.148 s at raypd's 128-token budget for colocated
    # CPU engines, more at a larger one). 1536-token prompts take 1.5 s to prefill and arrive every
    # 2-3 s, so on a colocated engine most requests decode beside another's prefill and miss the
    # target; a decode engine never carries a chunk, and its 0.18 s KV pull is 3 ms per token.
    profile = box(EngineProfile(cores=1, step_s=0.02, step_per_stream_s=0.001, prefill_tokens_per_s=1000.0))
    result = plan(profile, Workload(prompt_mix=((1536, 1.0),), output_tokens=64, rates=(0.3, 0.5)),
                  SloTargets(ttft_s=10.0, tpot_s=0.04))
    assert result.chosen.shape.label == "1P(1)+1D(1)"
    by_label = {p.shape.label: p for p in result.predictions}
    assert by_label["1P(1)+1D(1)"].total_goodput > 1.2 * by_label["2x1 both"].total_goodput
    table = render_table(result)
    assert "> 1P(1)+1D(1)" in table and "chosen: 1P(1)+1D(1)" in table


def test_both_engines_are_placed_by_the_routers_slo_model():
    # the stall test's engines and prompts on two `both` engines, the router's ITL target near the TPOT
    # target: its model (placement `slo`) sends a prompt away from an engine whose streams it would stall,
    # so requests prefill on one engine and decode on the other, and more of them meet the TPOT target
    # than when each engine serves its requests end to end (the least loaded one, another policy)
    profile = box(EngineProfile(cores=1, step_s=0.02, step_per_stream_s=0.001, prefill_tokens_per_s=1000.0))
    work = Workload(prompt_mix=((1536, 1.0),), output_tokens=64, rates=(0.5,))
    slo, shape = SloTargets(ttft_s=10.0, tpot_s=0.04), Shape(colocated=(1, 1))
    base = {"router": {"slo": {"itl_target_s": 0.03}}}
    limits = shape_limits(deployment_config(shape, base, "cpu"), "cpu")
    placed = simulate(shape, profile, work, 0.5, slo, limits, DeploymentConfig.model_validate(base).router.slo)
    alone = simulate(shape, profile, work, 0.5, slo, limits)
    assert (placed.disaggregated > 0, alone.disaggregated, placed.goodput > alone.goodput) == (True, 0, True)


def test_a_large_pool_shows_place_the_routers_shortlist(monkeypatch):
    # as the router's SloPlacer: at most SHORTLIST engines with the fewest streams and SHORTLIST with the
    # fewest queued prompt tokens are shown to the SLO model, not all sixteen
    import serving.sizing.simulate as sim
    from serving.routing.shortlist import SHORTLIST

    shown: list[int] = []
    real = sim.place

    def spy(prompt, engines, *args, **kwargs):
        shown.append(len(engines))
        return real(prompt, engines, *args, **kwargs)

    monkeypatch.setattr(sim, "place", spy)
    shape = Shape(colocated=(1,) * 16)
    simulate(shape, box(ONE_CORE, units=16), Workload(prompt_mix=((512, 1.0),), output_tokens=16, rates=(4.0,),
                                                      requests_per_rate=50),
             4.0, SloTargets(ttft_s=3.0, tpot_s=0.1), ShapeLimits(), DeploymentConfig.model_validate({}).router.slo)
    assert (len(shown), max(shown) <= 2 * SHORTLIST) == (50, True)


def test_ties_go_to_fewer_engines_then_colocated():
    profile = load_profile(SHIPPED_PROFILE)
    easy = plan(profile, Workload(prompt_mix=((64, 1.0),), output_tokens=8, rates=(0.05,)),
                SloTargets(ttft_s=30.0, tpot_s=5.0), LOCAL)
    assert all(p.total_goodput == pytest.approx(0.05) for p in easy.predictions)
    assert easy.chosen.shape.engines == 1 and easy.chosen.shape.is_colocated


def test_the_chunk_budget_is_chosen_per_shape_and_deployed():
    # a 0.2 s bare step: at raypd's derived 128-token budget a 2048-token prompt takes 16 steps
    # (3.2 s of fixed cost, past the 3 s TTFT target); at 2048 one step (0.2 s + 2.05 s of compute)
    profile = box(EngineProfile(cores=2, step_s=0.2, step_per_stream_s=0.001, prefill_tokens_per_s=1000.0))
    work, slo = Workload(prompt_mix=((2048, 1.0),), output_tokens=16, rates=(0.1,)), SloTargets(3.0, 1.0)
    own = plan(profile, work, slo, LOCAL, budgets=(None,)).chosen
    result = plan(profile, work, slo, LOCAL)
    chosen = result.chosen
    assert (own.budget, own.budget_tokens, own.total_goodput) == (None, 128, 0.0)
    assert (chosen.shape.label, chosen.budget, chosen.budget_tokens) == ("1x2 both", 2048, 2048)
    assert chosen.total_goodput > 0.5 * 0.1  # most requests within the targets (an arrival may queue behind another)
    cfg = DeploymentConfig.from_dict(yaml.safe_load(deployment_yaml(chosen.shape, LOCAL, "cpu", slo, chosen.budget)))
    assert cfg.both.engine_kwargs == {"max_num_batched_tokens": 2048}  # the plan's budget, written down
    assert shape_limits(cfg, "cpu").both.budget_tokens == 2048 == cfg.chunk_budget("both")
    assert "2048*" in render_table(result) and "max_num_batched_tokens 2048" in render_table(result)


def test_the_budgets_tried_and_an_operators_budget_stands():
    colocated = deployment_config(Shape(colocated=(1, 1)), LOCAL, "cpu")
    assert budget_choices(colocated, "cpu") == (None, 128, 256, 512, 1024, 2048)  # block 128 up to vLLM's default
    mine = {**LOCAL, "both": {**LOCAL.get("both", {}), "engine_kwargs": {"max_num_batched_tokens": 384}}}
    assert budget_choices(deployment_config(Shape(colocated=(1, 1)), mine, "cpu"), "cpu") == (None,)
    gpu = deployment_config(Shape(colocated=(4,)), GPU_EXAMPLE, "gpu")
    assert budget_choices(gpu, "gpu") == (None,)  # vLLM's own budget stands on a GPU
    profile = box(EngineProfile(cores=2, step_s=0.2, step_per_stream_s=0.001, prefill_tokens_per_s=1000.0))
    result = plan(profile, Workload(prompt_mix=((2048, 1.0),), output_tokens=16, rates=(0.1,)),
                  SloTargets(3.0, 1.0), mine)
    assert {(p.budget, p.budget_tokens) for p in result.predictions if p.shape.is_colocated} == {(None, 384)}


# ------------------------------------------------------------------ the deployment
@pytest.mark.parametrize("units", [2, 8])
def test_every_shape_makes_a_deployment_that_reads_back(units):
    for shape in enumerate_shapes(units, (1, 2)):
        text = deployment_yaml(shape, LOCAL, "cpu")
        cfg = DeploymentConfig.from_dict(yaml.safe_load(text))
        assert cfg == deployment_config(shape, LOCAL, "cpu")
        assert (cfg.both.count, cfg.prefill.count, cfg.decode.count) == (
            len(shape.colocated), len(shape.prefill), len(shape.decode))
        assert cfg.router.placement == ("slo" if shape.is_colocated else "disaggregate")
        assert (cfg.model, cfg.dtype, cfg.engine_kwargs) == ("smollm2", "float32", {"enforce_eager": True})
        binds = [b for role in ("prefill", "decode", "both") for b in getattr(cfg, role).cpu.bind or []]
        cores = [c for b in binds for c in _cores(b)]
        assert sorted(cores) == list(range(shape.units))  # each core to one engine
        assert cfg.ray.num_cpus >= shape.units
        gpu = DeploymentConfig.from_dict(yaml.safe_load(deployment_yaml(shape, GPU_EXAMPLE, "gpu")))
        assert gpu.model == "/models/Llama-3.1-8B-Instruct"
        for role, sizes in (("both", shape.colocated), ("prefill", shape.prefill), ("decode", shape.decode)):
            if sizes:
                assert getattr(gpu, role).tp_size == sizes[0] and getattr(gpu, role).cpu.bind is None


def _cores(bind: str) -> list[int]:
    first, _, last = bind.partition("-")
    return list(range(int(first), int(last or first) + 1))


def test_core_ranges_and_the_step_limits_a_deployment_runs_with():
    assert core_ranges([2]) == ["0-1"] and core_ranges([1, 1]) == ["0", "1"] and core_ranges([1, 2]) == ["0", "1-2"]
    pd = shape_limits(deployment_config(Shape(prefill=(1,), decode=(1,)), LOCAL, "cpu"), "cpu")
    assert pd.prefill == StepLimits(budget_tokens=2048, max_seqs=1)  # a CPU prefill engine: one prompt at a time
    both = shape_limits(deployment_config(Shape(colocated=(1, 1)), LOCAL, "cpu"), "cpu").both
    assert both.budget_tokens < 2048 and both.max_seqs is None  # raypd's chunk budget under placement slo
    gpu = shape_limits(deployment_config(Shape(prefill=(2,), decode=(4,)), GPU_EXAMPLE, "gpu"), "gpu")
    assert gpu.prefill == StepLimits(2048, None)  # on a GPU vLLM's own defaults stand


# ------------------------------------------------------------------ the CLI
def test_config_plan_prints_the_table_and_a_deployment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAYPD_PROFILE_DIR", str(tmp_path / "profiles"))  # no profile of this host: the shipped one
    base = dict(LOCAL)
    del base["engine_kwargs"]  # nothing for vLLM to check: the test stays off vLLM's import
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(base))
    argv = ["config", "--config", str(path), "--plan", "--rates", "0.25,0.5", "--prompt-tokens", "512:0.8,1024:0.2",
            "--no-measure"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    cfg = DeploymentConfig.from_dict(yaml.safe_load(captured.out))
    assert cfg.name == "raypd-local" and cfg.prefill.count + cfg.decode.count + cfg.both.count >= 1
    assert "chosen:" in captured.err and "0.25/s" in captured.err
    assert (cfg.router.slo.ttft_target_s, cfg.router.slo.itl_target_mean_s) == (3.0, 0.1)  # the default targets
    out = tmp_path / "planned.yaml"
    assert main([*argv, "--plan-out", str(out)]) == 0
    assert DeploymentConfig.from_dict(yaml.safe_load(out.read_text())) == cfg
    assert main(["config", "--config", str(path), "--plan", "--profile", str(tmp_path / "none.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["config", "--config", str(path), "--plan", "--prompt-tokens", "512:x"]) == 2
    assert "TOKENS:SHARE" in capsys.readouterr().err
