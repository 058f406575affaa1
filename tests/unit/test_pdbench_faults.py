"""benchmarks/pd_vs_vllm.py's pure new pieces (issues 25 and 30): raypd's /metrics into fault
counters, their per-phase increases, the fail-on-kill check, issue 30's goal lines and set-up
(e0)'s config (raypd's default with placement that never disaggregates)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks import pd_vs_vllm  # noqa: F401 - puts benchmarks/ on sys.path: `pdbench` is the script's package
from pdbench import colocated, faults, report_checks, stack_goals
from serving.config import DeploymentConfig, load_config
from serving.ops.metrics import RouterCollector
from serving.routing.slo_model import EngineEstimate, place
from serving.routing.status import PlannerSnapshot
from typed_fakes import router_snapshot

ROOT = Path(__file__).resolve().parents[2]
NAN = float("nan")


class _Router:
    def __init__(self, **fields):
        self.fields = fields

    def snapshot(self):
        return router_snapshot(**self.fields)


def metrics_text(**fields) -> str:
    """What the front's GET /metrics serves for a router in this state (serving/ops/metrics.py)."""
    registry = CollectorRegistry()
    registry.register(RouterCollector(lambda: _Router(**fields)))
    return generate_latest(registry).decode()


def test_the_fronts_metrics_parse_into_fault_counters():
    text = metrics_text(deadline_misses={("e1", "first chunk"): 2, ("e2", "next chunk"): 1},
                        deadline_extensions={("e1", "next chunk"): 5}, migrations={"decode_hung": 3},
                        hangs={"e1": 1}, counters={"aborted": 4}, fallbacks={},
                        planner=PlannerSnapshot({("local", "ttft"): 9}))
    snap = faults.parse(text)
    assert snap.error is None and snap.missing == ()
    assert snap.series["hang_kills{engine=e1}"] == 1
    assert snap.series["deadline_misses{call=first chunk,engine=e1}"] == 2
    t = faults.totals(snap.series, snap.missing)
    assert (t["deadline_misses"], t["deadline_extensions"], t["migrations"], t["hang_kills"], t["aborts"]) == \
        (3, 5, 3, 1, 4)
    assert t["fallbacks"] == 0  # exported without samples: nothing happened
    assert "disagg" not in " ".join(snap.series)  # only the fault counters


def test_a_front_without_a_counter_says_so_instead_of_zero():
    text = "\n".join(ln for ln in metrics_text().splitlines() if "raypd_engine_hangs" not in ln) + "\n"
    snap = faults.parse(text)
    assert snap.missing == ("hang_kills",)
    assert "hang_kills" not in faults.totals(snap.series, snap.missing)


def _snap(**series: float) -> faults.Snapshot:
    return faults.Snapshot({k.replace("__", "{engine=e1}"): v for k, v in series.items()})


def test_per_phase_increases_add_up_over_reads_failed_reads_and_restarts():
    entries: list[dict] = []
    trail = faults.FaultTrail(entries)
    trail.record(1, "start", _snap(hang_kills__=0, deadline_misses__=0))
    trail.record(1, "low 128", _snap(hang_kills__=0, deadline_misses__=1))
    trail.record(1, "low 512", _snap(hang_kills__=0, deadline_misses__=1))
    trail.record(1, "low 128", _snap(hang_kills__=0, deadline_misses__=3))  # a second read of the same phase
    trail.record(1, "load 0.3", faults.Snapshot(error="ConnectError: refused"))
    trail.record(1, "load 0.6", _snap(hang_kills__=1, deadline_misses__=4))
    by = {e["phase"]: e for e in entries}
    assert [e["phase"] for e in entries] == ["start", "low 128", "low 512", "load 0.3", "load 0.6"]
    assert by["low 128"]["reads"] == 2 and by["low 128"]["counts"]["deadline_misses"] == 3
    assert by["low 512"]["counts"]["deadline_misses"] == 0
    # the failed read's increase is in the next read's, which says so
    assert by["load 0.3"]["errors"] == ["ConnectError: refused"] and by["load 0.3"]["counts"] == {}
    assert by["load 0.6"]["includes_unread"] == ["load 0.3"]
    assert by["load 0.6"]["counts"]["hang_kills"] == 1 and by["load 0.6"]["series"] == {
        "hang_kills{engine=e1}": 1, "deadline_misses{engine=e1}": 1}
    assert trail.round == 1 and trail.last_phase_missed()
    # a counter that went down restarted from zero: its value now is what it gained
    e = trail.record(1, "after the last phase", _snap(hang_kills__=1, deadline_misses__=2))
    assert e["reset"] and e["counts"]["deadline_misses"] == 2 and e["counts"]["hang_kills"] == 0
    # summed over rounds, in run order
    trail2 = faults.FaultTrail(entries)
    trail2.record(2, "start", _snap(hang_kills__=0))
    trail2.record(2, "low 128", _snap(hang_kills__=0, deadline_misses__=1))
    per = faults.per_phase(entries)
    assert list(per)[:3] == ["start", "low 128", "low 512"]
    assert per["low 128"]["rounds"] == 2 and per["low 128"]["counts"]["deadline_misses"] == 4
    assert per["load 0.3"]["errors"] == 1


def _entry(phase: str, kills: float = 0, misses: float = 0, rnd: int = 1, **kw) -> dict:
    return {"round": rnd, "phase": phase, "reads": 1, "errors": [], "missing": [], "reset": False,
            "counts": {"hang_kills": kills, "deadline_misses": misses, "migrations": 0}, "series": {}, **kw}


def test_any_hang_kill_without_an_injected_fault_fails_the_benchmarks_own_check():
    clean = faults.kill_check("e", [_entry("start"), _entry("load 0.9", misses=2)])
    assert clean["met"] is True and clean["value"].startswith("0 kills in 2 phases; 2 deadline misses")
    assert not faults.failed([clean])
    killed = faults.kill_check("e0", [_entry("start"), _entry("load 0.9", kills=1, rnd=2)])
    assert killed["met"] is False and "(r2 load 0.9)" in killed["value"]
    assert faults.failed([clean, killed]) and report_checks.verdict(killed) == "FAILED"
    # nothing read: nothing to tell, and no failure either
    unread = faults.kill_check("b", [_entry("start", reads=1, errors=["ConnectError"])])
    assert unread["met"] is None and not faults.failed([unread])
    old_front = faults.kill_check("b", [_entry("start", missing=["hang_kills"])])
    assert old_front["met"] is None
    # a goal that is missed is not a failed check
    assert not faults.failed([{"goal": "g", "value": "", "met": False}])


def _load(thru: float, ttft: float, itl: float, good: float = 0.3) -> dict:
    return {"throughput_rps": thru, "ttft_p50": ttft, "itl_p50": itl, "mean_itl_p50": itl, "goodput_rps": good, "slo_met": 10, "n": 20}


def _cpu(compute: float, front: float, rest: float, core: float) -> dict:
    return {"all": {"compute": compute, "front": front, "rest": rest, "engine_core": core, "tokens": 1000}}


def test_issue30_goal_lines_compare_e0_with_a2_and_the_default_with_one_plain_engine():
    sm = {"load": {"a2": {0.3: _load(0.30, 1.00, 0.050), 0.6: _load(0.60, 1.20, 0.060)},
                   "e0": {0.3: _load(0.29, 1.04, 0.060), 0.6: _load(0.50, NAN, 0.061)},
                   "e": {0.3: _load(0.3, 1, 0.05, good=0.25)}, "ap": {0.3: _load(0.3, 1, 0.05, good=0.2)}},
          "cpu_per_token": {"a2": _cpu(66.3, 0.54, 0.30, 8.79), "e0": _cpu(66.0, 1.0, 0.5, 9.5)},
          "low": {"a": {128: {"itl_p50": 0.056, "mean_itl_p50": 0.056}, 512: {"itl_p50": 0.056, "mean_itl_p50": 0.056}},
                  "e": {128: {"itl_p50": 0.058, "mean_itl_p50": 0.058}, 512: {"itl_p50": 0.078, "mean_itl_p50": 0.078}}},
          "decisions": {"e0": {"low": {"local/ttft": 16}, 0.3: {"local/ttft": 19, "remote/itl_protect": 1}}}}
    rows = {r["goal"]: r for r in stack_goals.issue30(sm, [128, 512], [0.3, 0.6])}
    assert rows["throughput (e0) >= 0.95x (a2) at 0.3/s"]["met"] is True  # 0.29 >= 0.285
    assert rows["throughput (e0) >= 0.95x (a2) at 0.6/s"]["met"] is False
    assert rows["TTFT p50 (e0) <= 1.05x (a2) at 0.3/s"]["met"] is True
    assert rows["TTFT p50 (e0) <= 1.05x (a2) at 0.6/s"]["met"] is None  # NaN: not measured
    assert rows["ITL p50 (e0) <= 1.05x (a2) at 0.3/s (requests' mean ITL)"]["value"] == "60 vs 50 ms = 1.20x"
    assert rows["ITL p50 (e0) <= 1.05x (a2) at 0.6/s (requests' mean ITL)"]["met"] is True
    total = rows["CPU per token, everything (e0) runs <= 1.05x (a2)'s"]
    assert total["met"] is True and total["value"] == "67.50 vs 67.14 ms = 1.01x"
    assert rows["CPU per token, vLLM engine cores (e0) <= 1.10x (a2)'s"]["met"] is True  # 9.5 <= 9.67
    outside = rows["CPU per token outside the engines (e0) <= 1.00x (a2)'s (API servers + balancer)"]
    assert outside["met"] is False and outside["value"] == "1.50 vs 0.84 ms = 1.79x"
    assert rows["low-load ITL p50 (e) <= 1.05x (a) at 128 (requests' mean ITL)"]["met"] is True
    assert rows["low-load ITL p50 (e) <= 1.05x (a) at 512 (requests' mean ITL)"]["met"] is False
    assert rows["goodput (e) >= 1.0x better of (a2),(a') at 0.3/s (a2)"]["met"] is False  # 0.25 < 0.3
    never = rows["(e0) never disaggregates (placement decisions: 0 remote)"]
    assert never["met"] is False and never["value"] == "1 remote, 35 local"
    # without (e0) and (e): no such lines; with (e0) but no (a2): not measured
    assert stack_goals.issue30({"load": {"a2": sm["load"]["a2"]}}, [128], [0.3]) == []
    alone = stack_goals.issue30({"load": {"e0": sm["load"]["e0"]}}, [128], [0.3])
    assert {r["met"] for r in alone} == {None}


def test_e0_is_the_default_config_with_placement_that_never_disaggregates(tmp_path):
    base_path = ROOT / "benchmarks" / "configs" / "pd_default.yaml"
    e = load_config(base_path)
    e0 = load_config(colocated.write_config(base_path, tmp_path / "e0.yaml"))
    # the same engines, started with the same vLLM arguments (chunk budget included), placement slo
    assert e0.router.placement == e.router.placement == "slo"
    assert e0.engine_config("both").model_dump() == e.engine_config("both").model_dump()
    assert e0.chunk_budget("both") == e.chunk_budget("both")
    assert e0.model_dump(exclude={"name", "router"}) == e.model_dump(exclude={"name", "router"})
    assert e0.router.model_dump(exclude={"slo"}) == e.router.model_dump(exclude={"slo"})
    # where the default splits the request (y keeps prefilling; x's streams, already past their TPOT
    # budget from x's own prefills, would stall), (e0) does not
    x = EngineEstimate("x", "both", 400.0, 0.06, 512, 0.001, decode_streams=16, prefill_busy=0.3)
    y = EngineEstimate("y", "both", 400.0, 0.05, 512, 0.001, prefill_busy=0.8)
    for n in (128, 512, 2048):
        assert place(n, [x, y], e.router.slo, answer_tokens=64).option.kind == "disagg"
        assert place(n, [x, y], e0.router.slo, answer_tokens=64).option.kind == "colocated"
    # only a config with SLO placement can be made colocated-only this way
    with_pools = yaml.safe_load((ROOT / "benchmarks" / "configs" / "pd_1p1d.yaml").read_text())
    with pytest.raises(ValueError, match="placement slo"):
        colocated.colocated_only(with_pools)
    assert DeploymentConfig.from_dict(colocated.colocated_only(yaml.safe_load(base_path.read_text())))
