"""benchmarks/pd_vs_vllm.py without engines: issue 18's goals on fixed figures, and the whole
report (summary, table, detail sections, --render, --plan) on synthetic request records."""

from __future__ import annotations

import json
import math
import random

from benchmarks import pd_vs_vllm  # puts benchmarks/ on sys.path: `pdbench` is the script's own package
from pdbench import goals, report, summary

NAN = float("nan")


def _load(goodput: float, met: int, n: int = 40, itl_p99: float = 0.2) -> dict:
    return {"goodput_rps": goodput, "slo_met": met, "n": n, "itl_p99": itl_p99}


def _by_goal(rows: list[dict]) -> dict[str, dict]:
    return {r["goal"]: r for r in rows}


def test_goals_pick_the_better_baseline_and_the_last_rate_it_still_serves():
    load = {"a2": {0.3: _load(0.30, 36), 0.6: _load(0.40, 24, itl_p99=0.5), 0.9: _load(0.10, 8)},
            "ap": {0.3: _load(0.28, 34), 0.6: _load(0.45, 30), 0.9: _load(0.05, 4)},
            "e": {0.3: _load(0.30, 36, itl_p99=0.1), 0.6: _load(0.50, 32, itl_p99=0.6), 0.9: _load(0.20, 16)}}
    sm = {"load": load, "ttft_ratios": {128: {"e/a": {50: 1.05}}, 512: {"e/a": {50: 1.2}}, 2048: {}}}
    rows = _by_goal(goals.issue18(sm, [128, 512, 2048], [0.3, 0.6, 0.9]))
    assert goals.baseline(load, 0.6)[0] == "ap" and goals.baseline(load, 0.3)[0] == "a2"  # tie: (a2)
    assert rows["goodput (e) >= 1.0x better of (a2),(a') at 0.3/s"]["met"] is True
    assert rows["goodput (e) >= 1.0x better of (a2),(a') at 0.9/s"]["met"] is True
    # the edge: 0.6/s is the last rate where the better baseline ((a'), 30/40) meets its SLO for half
    edge = [r for g, r in rows.items() if g.startswith("goodput (e) >= 1.3x")]
    assert len(edge) == 1 and "0.6/s, (ap) 30/40" in edge[0]["goal"] and edge[0]["met"] is False  # 0.50 < 1.3 x 0.45
    assert rows["ITL p99 (e) <= (a2) at 0.6/s"]["met"] is False
    assert rows["ITL p99 (e) <= (a2) at 0.3/s"]["met"] is True
    assert rows["low-load TTFT p50 (e)/(a) <= 1.10 at 128"]["met"] is True
    assert rows["low-load TTFT p50 (e)/(a) <= 1.10 at 512"]["met"] is False
    assert rows["low-load TTFT p50 (e)/(a) <= 1.10 at 2048"]["met"] is None  # not measured
    assert rows["rates reach (a2) < 50 % in SLO (the issue's range)"]["met"] is True  # 8/40 at 0.9/s
    assert goals.verdict(None) == "not measured" and goals.verdict(False) == "MISSED"


def test_goals_without_raypd_default_or_an_edge_say_so():
    load = {"a2": {0.3: _load(0.1, 10)}, "e": {0.3: _load(0.2, 12, itl_p99=NAN)}}
    rows = _by_goal(goals.issue18({"load": load, "ttft_ratios": {}}, [128], [0.3]))
    edge = [r for g, r in rows.items() if g.startswith("goodput (e) >= 1.3x")]
    assert edge[0]["met"] is None and "no rate" in edge[0]["value"]
    assert rows["ITL p99 (e) <= (a2) at 0.3/s"]["met"] is None  # NaN: nothing to compare
    assert goals.issue18({"load": {"a2": load["a2"]}, "ttft_ratios": {}}, [256], [0.3])[-1]["goal"].startswith("rates")


def _rec(rng: random.Random, idx: int, n: int, rnd: int, ttft: float, itl: float, tokens: int, trace: bool) -> dict:
    t = [ttft + i * itl * rng.uniform(0.8, 1.2) for i in range(tokens)]
    r = {"idx": idx, "length": n, "at_s": 0.0, "ok": True, "error": None, "ttft_s": ttft, "token_times_s": t,
         "completion_tokens": tokens, "end_s": t[-1], "text": f"t{idx}", "sent_mono": 100.0 + idx,
         "headers_s": 0.01, "trace": None, "round": rnd}
    if trace:
        s = r["sent_mono"]
        r["trace"] = [["front_in", s + .001], ["routed", s + .003], ["engine_in", s + .004],
                      ["vllm_out", s + ttft - .01], ["sse", s + ttft - .004], ["vllm_step_prompt_tokens", n]]
    return r


def _faults(kills: int = 0) -> list[dict]:
    """One raypd set-up's fault counters per phase (pdbench.faults.FaultTrail's entries)."""
    return [{"round": 1, "phase": phase, "reads": 1, "errors": [], "missing": [], "reset": False,
             "includes_unread": [], "series": {"hang_kills{engine=raypd-both-1}": kills} if kills and i == 3 else {},
             "counts": {"deadline_misses": 1 if i == 3 else 0, "deadline_extensions": 2, "migrations": 0,
                        "hang_kills": kills if i == 3 else 0, "aborts": 0}}
            for i, phase in enumerate(("start", "warm-up, idle", "low 128", "load 0.3", "after the last phase"))]


def _fake_run(setups=("a", "a2", "ap", "b", "e", "e0"), rates=(0.3, 0.6), lengths=(128, 512), rounds=2) -> dict:
    rng = random.Random(1)
    speed = {"a": 1.0, "a2": 1.0, "ap": 0.8, "b": 1.1, "e": 0.95, "e0": 1.0}
    res = {"date": "2026-12-01T00:00:00", "command": "pd_vs_vllm.py", "git": {"commit": "0" * 40, "branch": "x",
                                                                              "dirty_files": 0},
           "host": {"cpus": 2, "platform": "linux", "before": {"loadavg": [0.1, 0, 0]}},
           "settings": {"lengths": ",".join(map(str, lengths)), "rates": ",".join(map(str, rates)),
                        "rounds": rounds, "reps": 2, "low_max_tokens": 8, "load_requests": 10,
                        "mix": "128:0.6,512:0.4", "load_max_tokens": 16},
           "schedule": [[1, "A"], [1, "B"], [1, "E"], [1, "AP"]], "planned_s": 420.0,
           "phases": [{"round": 1, "group": "A", "kind": "load", "detail": "a2@0.3", "start": 0, "wall_s": 50,
                       "loadavg_before": [1, 0, 0], "loadavg_after": [3, 0, 0], "others_cpu_pct": 2.0,
                       "others_top": [], "setup_cpu_pct": 190, "load_above_cores": True}],
           "startup_s": {"A": [20.0]}, "pinning": {}, "engine_configs": {"A": ["dtype=torch.float32"]},
           "raypd_engines": {"E": ["both raypd-both-0: max_num_batched_tokens=512 block_size=128"]},
           "idle": {"B": [{"round": 1, "wall_s": 10, "processes": [
               {"pid": 1, "ppid": 0, "name": "ray::EngineActor", "bind": "0", "cpu_pct": 0.3},
               {"pid": 2, "ppid": 1, "name": "VLLM::EngineCore", "bind": None, "cpu_pct": 0.5},
               {"pid": 3, "ppid": 0, "name": "ray::BareAsyncActor", "bind": None, "cpu_pct": 0.2}]}]},
           "low": {}, "low_decisions": {"e": [{"local/idle": 4}], "e0": [{"local/ttft": 4}]}, "load": {},
           "faults": {"b": _faults(), "e": _faults(), "e0": _faults()}, "seen_pids": [], "leftover_pids": []}
    for s in setups:
        for n in lengths if s != "a2" else ():
            res["low"].setdefault(s, {})[str(n)] = [_rec(rng, i, n, rnd, (0.04 + n / 330) * speed[s], 0.055, 8,
                                                         s in ("b", "e", "e0")) for rnd in (1, 2) for i in range(2)]
        for rate in rates if s != "a" else ():
            res["load"].setdefault(s, {})[str(rate)] = [
                {"round": rnd, "duration_s": 10 / rate + 5,
                 "cpu": {"compute": 30.0, "front": 2.0, "rest": 1.0, "tokens": 160, "by_process": {"x": 1.0}},
                 "records": [_rec(rng, i, n, rnd, (0.04 + n / 330) * speed[s] * (1 + 3 * rate * rng.random()),
                                  0.055 * (1 + rate), 16, s in ("b", "e", "e0"))
                             for i, n in enumerate(rng.choice(lengths) for _ in range(10))],
                 **({"decisions": {"local/fits": 6, "remote/ttft": 4}} if s in ("b", "e") else {}),
                 **({"decisions": {"local/ttft": 10}} if s == "e0" else {})}
                for rnd in (1, 2)]
    return res


def test_the_whole_report_renders_from_synthetic_records(tmp_path, capsys):
    res = _fake_run()
    res["summary"] = summary.summarize(res)
    text = report.header(res) + report.table(res)
    for section in ("LOW LOAD", "UNDER LOAD", "PER RATE, every set-up", "ISSUE 18 GOALS", "PLACEMENT DECISIONS",
                    "TOKEN GAPS UNDER 1 MS", "CPU PER STREAMED TOKEN", "FIRST TOKEN PATH of (e)", "IDLE:", "PHASES",
                    "(e) vs others: goodput e/a2", "goodput e/b", "max_num_batched_tokens=512",
                    "ISSUE 30 GOALS", "FAULT COUNTERS per phase", "(e0) raypd 2x both, never disagg",
                    "FIRST TOKEN PATH of (e0)", "(e0) vs others: goodput e0/a2"):
        assert section in text, section
    assert "(e) 0.3/s 20 requests: 12 colocated, 8 disaggregated" in " ".join(text.split())
    goal_rows = res["summary"]["goals"]
    assert {r["goal"] for r in goal_rows} >= {"low-load TTFT p50 (e)/(a) <= 1.10 at 128",
                                              "ITL p99 (e) <= (a2) at 0.6/s"}
    assert all(r["met"] in (True, False, None) for r in goal_rows)
    # the results JSON (NaN and all) re-renders the same table with --render
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    assert pd_vs_vllm.main(["--render", str(path), "--plot", ""]) == 0
    assert "ISSUE 18 GOALS" in capsys.readouterr().out


def test_the_report_prints_issue_30_goals_and_fault_counters_and_a_kill_fails_the_run(tmp_path, capsys):
    res = _fake_run()
    res["summary"] = summary.summarize(res)
    text = report.table(res)
    flat = " ".join(text.split())
    goals30 = {r["goal"]: r for r in res["summary"]["goals30"]}
    assert goals30["throughput (e0) >= 0.95x (a2) at 0.3/s"]["met"] in (True, False)
    assert goals30["CPU per token, everything (e0) runs <= 1.05x (a2)'s"]["value"] == "206.25 vs 206.25 ms = 1.00x"
    assert goals30["(e0) never disaggregates (placement decisions: 0 remote)"]["met"] is True
    assert "low-load ITL p50 (e) <= 1.05x (a) at 512 (requests' mean ITL)" in goals30
    # per phase, summed over rounds: misses, extended, migrations, kills
    assert "load 0.3 1 2 0 0" in flat
    assert "no hang kill in any phase without an injected fault (e0) 0 kills in 5 phases; 1 deadline misses" in flat
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    assert pd_vs_vllm.main(["--render", str(path), "--plot", ""]) == 0
    # a hang kill in a phase without an injected fault: FAILED, and a non-zero exit status
    res["faults"]["e"] = _faults(kills=1)
    res["summary"] = summary.summarize(res)
    flat = " ".join(report.table(res).split())
    assert "(e) 1 kills in 5 phases (r1 load 0.3); 1 deadline misses, 0 migrations FAILED" in flat
    assert "hang_kills{engine=raypd-both-1} 1" in flat
    path.write_text(json.dumps(res, indent=1, default=str))
    capsys.readouterr()
    assert pd_vs_vllm.main(["--render", str(path), "--plot", ""]) == pd_vs_vllm.CHECK_FAILED
    assert "FAILED" in capsys.readouterr().out


def test_plan_starts_nothing_and_the_full_profile_fits_the_issue():
    # issue 30 added (e0) to every profile: ~49 min full, ~9 quick (the issue 18 run planned 38)
    for profile, most_min in (("full", 50), ("quick", 10)):
        args = pd_vs_vllm.parse_args(["--profile", profile])
        schedule = pd_vs_vllm.make_schedule(args)
        p = pd_vs_vllm.plan(args, schedule, pd_vs_vllm.SMOLLM2_VOCAB)
        assert 0 < p["total"] <= most_min * 60 and math.isclose(p["total"], p["start"] + p["low"] + p["load"]
                                                                + p["other"])
    full = pd_vs_vllm.parse_args([])
    assert full.load_requests * full.rounds >= 40  # p99 from at least 40 samples per rate
    assert pd_vs_vllm.parse_args(["--quick"]).out.startswith("benchmarks/out/")  # never a committed result
    assert [g for r, g in pd_vs_vllm.make_schedule(pd_vs_vllm.parse_args(["--profile", "anchors"])) if r == 2] == \
        ["AP", "E0", "E", "B", "A"]


def test_raypd_engines_that_run_their_model_in_the_core_are_compared_by_their_whole_compute():
    from pdbench import stack_goals

    def cpu(compute: float, core: float) -> dict:
        return {"all": {"compute": compute, "front": 1.0, "rest": 1.0, "engine_core": core}}  # ms per token

    sm = {"load": {}, "cpu_per_token": {"e0": cpu(70.0, 69.0), "a2": cpu(75.0, 10.0)}}  # uni: no worker beside the core
    rows = {r["goal"]: r for r in stack_goals.issue30(sm, [], [])}
    row = rows["CPU per token, the engines' compute (core + workers) (e0) <= 1.10x (a2)'s (raypd's cores run the model)"]
    assert (row["value"], row["met"]) == ("70.00 vs 75.00 ms = 0.93x", True)
    sm["cpu_per_token"]["e0"] = cpu(70.0, 10.0)  # mp: a worker computes beside the core
    assert "CPU per token, vLLM engine cores (e0) <= 1.10x (a2)'s" in {r["goal"] for r in stack_goals.issue30(sm, [], [])}


def test_the_planners_shape_is_compared_with_its_prediction_by_the_planners_own_count():
    from pdbench import planned

    # within both targets: TTFT 2 s, then 15 tokens in 1.5 s (TPOT 0.1 s); over TPOT; over TTFT; failed
    ok = {"ok": True, "ttft_s": 2.0, "token_times_s": [2.0 + 0.1 * i for i in range(16)], "completion_tokens": 16}
    slow = dict(ok, token_times_s=[2.0 + 0.11 * i for i in range(16)])
    late = dict(ok, ttft_s=3.5, token_times_s=[3.5 + 0.05 * i for i in range(16)])
    failed = dict(ok, ok=False, ttft_s=None, token_times_s=[])
    assert [planned.within_targets(r["ttft_s"], r["token_times_s"], r["completion_tokens"])
            for r in (ok, slow, late)] == [True, False, False]
    # 2 rounds of 5 sent at 0.5/s (10 s of offered load each), 3 within the targets in all: 3 / 20 s
    runs = [{"records": [ok, ok, slow, failed]}, {"records": [ok, late]}]
    assert math.isclose(planned.measured(runs, 0.5, 5), 0.15)

    res = _fake_run(setups=("a", "a2", "ap", "e"))
    res["load"]["ep"], res["low"]["ep"] = res["load"].pop("e"), res["low"].pop("e")
    res["faults"] = {"ep": _faults()}
    res["plan"] = {"shape": "1x2 both", "per_rate": {"0.3": 0.3, "0.6": 0.45}, "table": "> 1x2 both  2  0.300"}
    res["summary"] = summary.summarize(res)
    text = report.table(res)
    assert "THE PLANNER'S SHAPE (ep): `raypd config --plan` on (e)'s file, for this load, chose 1x2 both" in text
    assert "(ep) vs others: goodput ep/a2" in text and "goodput ep/ap" in text
    row = res["summary"]["planned"][0.3]
    pred, meas, ratio = row["prediction"]
    assert pred == 0.3 and math.isclose(ratio, pred / meas)
    assert math.isclose(meas, planned.measured(res["load"]["ep"]["0.3"], 0.3, 10)) and row["goodput"]["ep"] == meas
    better = max(planned.measured(res["load"][s]["0.3"], 0.3, 10) for s in ("a2", "ap"))
    assert math.isclose(row["ep/better"], meas / better) and "(ep)/better of (a2),(a')" in text


def _timed_rec(ttft_s: float, gaps_s: list[float]) -> dict:
    t = [ttft_s]
    for g in gaps_s:
        t.append(t[-1] + g)
    return {"ok": True, "length": 512, "ttft_s": ttft_s, "token_times_s": t, "completion_tokens": len(t)}


def test_a_fixed_slo_judges_ttft_and_mean_itl_as_vllm_bench_serve_does():
    from pdbench.stats import fixed_slo, meets_slo

    ref = fixed_slo([512], 3.0, 0.1)
    # one 1.5 s gap among short ones: the mean stays under 100 ms, and no single gap is limited
    assert meets_slo(_timed_rec(2.9, [0.05] * 40 + [1.5]), ref) == (True, "ok")
    assert meets_slo(_timed_rec(3.1, [0.05] * 10), ref) == (False, "ttft")
    assert meets_slo(_timed_rec(1.0, [0.12] * 10), ref) == (False, "mean_itl")
