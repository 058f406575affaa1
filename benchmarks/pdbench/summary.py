"""From a pd_vs_vllm results JSON to its summary: per set-up statistics, ratios, idle rows, CPU per token.

Everything here is computed from the JSON alone (`--render` re-runs it on an earlier run);
`pdbench.goals` turns the summary into issue 18's goals, `pdbench.stack_goals` into issue 30's,
`pdbench.faults` checks raypd's fault counters per phase; `pdbench.report` prints it all.
"""

from __future__ import annotations

from pdbench import faults, goals, planned, stack_goals, stats

NAMES = {"a": "(a) vLLM colocated, 1 engine", "a2": "(a2) vLLM colocated x2 + balancer",
         "ap": "(a') vLLM 1 engine on 2 cores", "b": "(b) raypd 1P+1D (raypd up)",
         "e": "(e) raypd default (2x both, slo)", "e0": "(e0) raypd 2x both, never disagg",
         "ep": "(ep) raypd, the planner's shape",
         "c": "(c) vLLM NixlConnector P/D + proxy", "d": "(d) Ray Serve LLM P/D", "dc": "(dc) Ray Serve LLM colocated"}
ORDER = ["a", "a2", "ap", "b", "e", "e0", "ep", "c", "d", "dc"]
RAYPD = ("b", "e", "e0", "ep")  # the set-ups that answer X-Raypd-Trace and count placement decisions and faults
GROUP_SETUP = {"B": "b", "E": "e", "E0": "e0", "EP": "ep"}  # raypd's groups -> their one set-up
GROUP_NAMES = {"A": "(a)/(a2) plain vLLM", "AP": "(a') vLLM on 2 cores", "B": "(b) raypd up 1P+1D",
               "E": "(e) raypd up default", "E0": "(e0) raypd up colocated-only", "EP": "(ep) raypd up, planned", "C": "(c) vLLM NixlConnector",
               "D": "(d) Serve LLM P/D", "DC": "(dc) Serve LLM colocated"}
ENGINE_CORE = "compute: VLLM::EngineCore"  # vLLM's engine core processes in procs.cpu_seconds_by_kind's labels
RAYPD_ACTORS = ("ray::EngineActor", "ray::Coordinator", "ray::SyntheticRankActor")
TTFT_RATIOS = (("b", "a"), ("e", "a"), ("e0", "a"), ("ep", "a"), ("ap", "a"), ("c", "a"), ("d", "a"), ("dc", "a"), ("b", "c"),
               ("b", "d"))


def _low(res: dict, setup: str, n: int) -> list[dict]:
    return res["low"].get(setup, {}).get(str(n), [])


def _load_records(res: dict, setup: str, rate: float) -> list[dict]:
    return [x for run in res.get("load", {}).get(setup, {}).get(str(rate), []) for x in run["records"]]


def summarize(res: dict) -> dict:
    lengths = [int(x) for x in str(res["settings"]["lengths"]).split(",")]
    rates = [float(x) for x in str(res["settings"]["rates"]).split(",")]
    low = {s: {n: stats.latency_stats(_low(res, s, n)) for n in lengths} for s in ORDER if s in res["low"]}
    same = {}
    for s in low:
        if s == "a":
            continue
        for n in lengths:
            ref = {(r["round"], r["idx"]): r["text"] for r in _low(res, "a", n) if r["ok"]}
            pairs = [(r["text"], ref[(r["round"], r["idx"])]) for r in _low(res, s, n)
                     if r["ok"] and (r["round"], r["idx"]) in ref]
            same.setdefault(s, {})[n] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    ratios = {}
    for n in lengths:
        ratios[n] = {f"{num}/{den}": {q: stats.ratio(low[num][n][f"ttft_p{q}"], low[den][n][f"ttft_p{q}"])
                                      for q in (50, 90)}
                     for num, den in TTFT_RATIOS if num in low and den in low}
    st = res["settings"]
    if st.get("slo_ttft_s") is not None:
        ref = stats.fixed_slo(lengths, st["slo_ttft_s"], st["slo_tpot_s"])
    else:
        ref = stats.slo_reference({n: _low(res, "a", n) for n in lengths}) if "a" in low else {}
    load = {s: {r: stats.load_stats(res["load"][s][str(r)], ref) for r in rates if str(r) in res["load"][s]}
            for s in ORDER if s in res.get("load", {})}
    sm = {"low": low, "same_text_as_a": same, "ttft_ratios": ratios, "slo_reference": ref, "load": load,
          "load_headline": headline(load, rates), "idle": idle_rows(res), "cpu_per_token": cpu_per_token(res),
          "hops": {s: {"low": {n: stats.hop_stats(_low(res, s, n)) for n in lengths if _low(res, s, n)},
                       "load": {r: stats.hop_stats(_load_records(res, s, r)) for r in rates
                                if _load_records(res, s, r)}} for s in RAYPD},
          "decisions": decisions(res, rates), "planned": planner_check(res, rates),
          "faults": {s: faults.per_phase(res["faults"][s]) for s in RAYPD if res.get("faults", {}).get(s)},
          "flagged_phases": [p for p in res["phases"] if p["load_above_cores"]]}
    sm["goals"] = goals.issue18(sm, lengths, rates)
    sm["goals30"] = stack_goals.issue30(sm, lengths, rates)
    # the benchmark's own check: no hang kill in any phase of a raypd set-up (no fault is injected)
    sm["checks"] = [faults.kill_check(s, res["faults"][s]) for s in RAYPD if res.get("faults", {}).get(s)]
    return sm


def headline(load: dict, rates: list[float]) -> dict:
    """Per rate, raypd's set-ups against the others: [raypd's, the other's, ratio] per figure."""
    out: dict = {}
    for r in rates:
        for s, others in (("e", ("a2", "ap", "b")), ("e0", ("a2", "e")), ("ep", ("a2", "ap", "e")),
                          ("b", ("a2", "c", "d"))):
            x = load.get(s, {}).get(r)
            if not x:
                continue
            row = {}
            for other in others:
                o = load.get(other, {}).get(r)
                if o:
                    row[f"goodput {s}/{other}"] = [x["goodput_rps"], o["goodput_rps"],
                                                   stats.ratio(x["goodput_rps"], o["goodput_rps"])]
            if load.get("a2", {}).get(r):
                a2 = load["a2"][r]
                row[f"ITL p99 {s}/a2"] = [x["itl_p99"] * 1e3, a2["itl_p99"] * 1e3, stats.ratio(x["itl_p99"], a2["itl_p99"])]
            out.setdefault(r, {})[s] = row
    return out


def planner_check(res: dict, rates: list[float]) -> dict:
    """(ep) by the planner's own count and targets (pdbench/planned.py), per rate: "prediction":
    [predicted, measured, predicted / measured] goodput; "goodput": every loaded set-up's goodput by
    those targets, and "ep/better": (ep)'s against the better of (a2) and (a'). {} without (ep)."""
    plan = res.get("plan") or {}
    load = res.get("load", {})
    if not plan.get("per_rate") or not load.get("ep"):
        return {}
    sent = int(res["settings"]["load_requests"])
    out = {}
    for r in rates:
        if str(r) not in load["ep"] or str(r) not in plan["per_rate"]:
            continue
        goodput = {s: planned.measured(load[s][str(r)], r, sent) for s in ORDER if str(r) in load.get(s, {})}
        pred, meas = plan["per_rate"][str(r)], goodput["ep"]
        better = max((goodput[s] for s in ("a2", "ap") if s in goodput), default=float("nan"))
        out[r] = {"prediction": [pred, meas, stats.ratio(pred, meas)], "goodput": goodput,
                  "ep/better": stats.ratio(meas, better)}
    return out


def decisions(res: dict, rates: list[float]) -> dict:
    """Per raypd set-up: placement decisions (`decision/reason` -> requests) at low load and per
    load rate, summed over the rounds (the front's counters, read before and after each phase)."""
    out: dict = {}
    for s in RAYPD:
        low = res.get("low_decisions", {}).get(s, [])
        per = {"low": _sum([d for d in low])} if low else {}
        for r in rates:
            runs = res.get("load", {}).get(s, {}).get(str(r), [])
            got = [run["decisions"] for run in runs if run.get("decisions") is not None]
            if got:
                per[r] = _sum(got)
        if per:
            out[s] = per
    return out


def _sum(counts: list[dict]) -> dict:
    acc: dict = {}
    for c in counts:
        for k, v in c.items():
            if isinstance(v, (int, float)):
                acc[k] = acc.get(k, 0) + v
            else:
                acc[k] = v  # an error reading the counters
    return acc


def cpu_per_token(res: dict) -> dict:
    """Per set-up and rate: ms of CPU per streamed token by kind (procs.cpu_seconds_by_kind), pooled
    over rounds; and per set-up over every rate ("all"), with vLLM's engine cores alone (`engine_core`,
    part of `compute`)."""
    out: dict = {}
    for s, by_rate in res.get("load", {}).items():
        pooled = {"compute": 0.0, "front": 0.0, "rest": 0.0, "tokens": 0, "by_process": {}}
        rows = {}
        for rate, runs in by_rate.items():
            acc = {"compute": 0.0, "front": 0.0, "rest": 0.0, "tokens": 0}
            for run in runs:
                cpu = run.get("cpu") or {}
                for k in ("compute", "front", "rest", "tokens"):
                    acc[k] += cpu.get(k, 0)
                    pooled[k] += cpu.get(k, 0)
                for name, sec in (cpu.get("by_process") or {}).items():
                    pooled["by_process"][name] = pooled["by_process"].get(name, 0.0) + sec
            if acc["tokens"]:
                rows[rate] = {k: 1e3 * acc[k] / acc["tokens"] for k in ("compute", "front", "rest")} | \
                    {"tokens": acc["tokens"]}
        if pooled["tokens"]:
            core = sum(sec for name, sec in pooled["by_process"].items() if name.startswith(ENGINE_CORE))
            rows["all"] = {k: 1e3 * pooled[k] / pooled["tokens"] for k in ("compute", "front", "rest")} | {
                "tokens": pooled["tokens"], "engine_core": 1e3 * core / pooled["tokens"],
                "top": sorted(((n, 1e3 * v / pooled["tokens"]) for n, v in pooled["by_process"].items()),
                              key=lambda kv: -kv[1])[:8]}
        out[s] = rows
    return out


def idle_rows(res: dict) -> dict:
    """Per group: [label, mean CPU % over its windows, kind] rows, in report order."""
    out = {}
    for key, windows in res.get("idle", {}).items():
        acc: dict[str, list[float]] = {}
        kinds: dict[str, str] = {}
        for w in windows:
            rows = _window_rows(w["processes"])
            for label, pct, kind in rows:
                acc.setdefault(label, []).append(pct)
                kinds[label] = kind
        out[key] = [[label, sum(v) / len(v), kinds[label]] for label, v in acc.items()]
    return out


def _window_rows(ps: list[dict]) -> list[tuple[str, float, str]]:
    by_pid = {p["pid"]: p for p in ps}
    kids: dict[int, list[int]] = {}
    for p in ps:
        kids.setdefault(p["ppid"], []).append(p["pid"])

    def subtree(pid: int) -> float:
        return by_pid[pid]["cpu_pct"] + sum(subtree(k) for k in kids.get(pid, []))

    def core(p: dict) -> str:
        return f" [core {p['bind']}]" if p.get("bind") else ""

    rows: list[tuple[str, float, str]] = []
    counted: dict[str, list[float]] = {}
    for p in ps:
        name = p["name"]
        if name.startswith("ray::") and name != "ray::IDLE" or name.startswith("VLLM::Worker"):
            label = f"{name}{core(p)}"
            kind = "reference" if name.startswith("ray::Bare") else (
                "raypd actor" if name.startswith(RAYPD_ACTORS) else "process")
            counted.setdefault(label, []).append(p["cpu_pct"])
            rows.append((label, p["cpu_pct"], kind))
    for p in ps:  # engine trees: a process whose child is vLLM's engine core
        if any(by_pid[k]["name"].startswith("VLLM::EngineCore") for k in kids.get(p["pid"], [])):
            rows.append((f"engine tree: {p['name']}{core(p)} + vLLM children", subtree(p["pid"]), "engine tree"))
    idle_workers = [p["cpu_pct"] for p in ps if p["name"] == "ray::IDLE"]
    if idle_workers:
        rows.append((f"ray::IDLE pool workers (x{len(idle_workers)})", sum(idle_workers), "process"))
    rows.append(("whole set-up (every process it started)", sum(p["cpu_pct"] for p in ps), "total"))
    seen, out = set(), []
    for label, pct, kind in rows:  # two identical labels (e.g. two bare actors) are summed with a count
        if label in seen:
            continue
        seen.add(label)
        n = len(counted.get(label, [None]))
        if n > 1:
            out.append((f"{label} (x{n})", sum(counted[label]), kind))
        else:
            out.append((label, pct, kind))
    return out
