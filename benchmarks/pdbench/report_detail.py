"""The later sections of a pd_vs_vllm table: token gaps under 1 ms, CPU per streamed token, the
first token's path through raypd, idle CPU, the phase log, start-up and the engines' own settings."""

from __future__ import annotations

import math

from pdbench import stats
from pdbench.summary import GROUP_NAMES, NAMES, ORDER, RAYPD

IDLE_GOAL = 0.2  # issue 13: each raypd actor process within 0.2 % of a core of a bare idle actor


def f_ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.0f}"


def sections(res: dict, lengths: list[int], rates: list[float]) -> list[str]:
    sm = res["summary"]
    return (_gaps(sm, lengths, rates) + _cpu(sm) + _hops(sm) + _idle(sm) + _phases(res))


def _gaps(sm: dict, lengths: list[int], rates: list[float]) -> list[str]:
    out = ["", "TOKEN GAPS UNDER 1 MS: fraction of all gaps between consecutive token chunks (tok1->2 included; "
           "goal under load: (b) < 5 %, colocated (a)/(a2) beside it)"]
    for s in ORDER:
        lows = [sm["low"].get(s, {}).get(n) for n in lengths]
        loads = [sm["load"].get(s, {}).get(r) for r in rates]
        if not any(lows) and not any(loads):
            continue
        f = lambda x: "-" if not x or math.isnan(x.get("gaps_under_1ms", math.nan)) else \
            f"{100 * x['gaps_under_1ms']:.1f}% of {x['gaps']}"
        parts = (["low load: " + ", ".join(f"{n}: {f(x)}" for n, x in zip(lengths, lows) if x)] if any(lows) else []) + \
            (["load: " + ", ".join(f"{r}/s: {f(x)}" for r, x in zip(rates, loads) if x)] if any(loads) else [])
        out.append(f"  {NAMES[s]:<36} " + "; ".join(parts))
    return out


def _cpu(sm: dict) -> list[str]:
    cpt = sm.get("cpu_per_token", {})
    if not cpt:
        return []
    out = ["", "CPU PER STREAMED TOKEN under load (ms of CPU per token, /proc utime+stime over each load phase): "
           "rest = outside the engines (raypd: ingress, Serve proxy/controller, coordinator, GCS, raylet, agents; "
           "(a2)/(c): the benchmark's proxy), front = each engine's owning process (vLLM's API server, raypd's "
           "EngineActor), compute = vLLM EngineCore + workers"]
    for s in ORDER:
        rows = cpt.get(s)
        if not rows:
            continue
        out.append(f"  {NAMES[s]:<36} " + "; ".join(
            f"{r}{'/s' if r != 'all' else ''}: rest {v['rest']:.2f} front {v['front']:.2f} compute {v['compute']:.1f}"
            for r, v in rows.items()))
        if "all" in rows:
            out.append("      top: " + ", ".join(f"{n} {ms:.2f}" for n, ms in rows["all"]["top"]))
    a2 = cpt.get("a2", {}).get("all")
    # issue 19's goal line ((b), (e): raypd's rest against vLLM's API servers); (e0)'s is issue 30's, where
    # outside the engines is front + rest on both sides (ISSUE 30 GOALS)
    for s in ("b", "e"):
        x = cpt.get(s, {}).get("all")
        if x and a2 and a2["front"]:
            out.append(f"  goal: ({s}) outside the engines / (a2) vLLM API servers = {x['rest']:.2f} / {a2['front']:.2f} "
                       f"= {x['rest'] / a2['front']:.2f} (goal <= 1.0)")
    return out


def _hops(sm: dict) -> list[str]:
    out = []
    for s in RAYPD:
        hops = sm.get("hops", {}).get(s, {})
        if not any(hops.get("low", {}).values()) and not any(hops.get("load", {}).values()):
            continue
        out += ["", f"FIRST TOKEN PATH of ({s}), per hop (ms p50/p90/max; X-Raypd-Trace stamps, CLOCK_MONOTONIC of "
                "this host" + ("; colocated requests have no separate prefill engine: the same hops on the decode "
                               "engine" if s in ("e", "e0") else "") + ")"]
        cols = [(f"low {n}", h) for n, h in hops.get("low", {}).items()] + \
               [(f"load {r}/s", h) for r, h in hops.get("load", {}).items()]
        out.append(f"  {'hop':<52}" + "".join(f"{c:>20}" for c, _ in cols))
        for label, _, _ in stats.HOPS:
            cells = []
            for _, h in cols:
                x = h.get(label)
                cells.append(f"{f_ms(x['p50'])}/{f_ms(x['p90'])}/{f_ms(x['max'])}" if x else "-")
            out.append(f"  {label:<52}" + "".join(f"{c:>20}" for c in cells))
        out.append(f"  {'prompt tokens in the step of token 1 (p50/max)':<52}" + "".join(
            f"{_step_tokens(h.get('_step_prompt_tokens')):>20}" for _, h in cols))
    return out


def _step_tokens(x: dict | None) -> str:
    return f"{x['p50']:.0f}/{x['max']:.0f}" if x else "-"


def _idle(sm: dict) -> list[str]:
    out = ["", "IDLE: CPU % of one core per process over the idle windows (after warm-up, no requests), mean of rounds"]
    for key, rows in sm["idle"].items():
        bare = {lab.split(" (x")[0]: pct for lab, pct, kind in rows if kind == "reference"}
        ref_pct = bare.get("ray::BareAsyncActor")  # raypd's groups: bare actors in the same cluster
        out.append(f"  {GROUP_NAMES.get(key, key)}")
        for label, pct, kind in rows:
            extra = ""
            if kind == "raypd actor" and ref_pct is not None:
                d = pct - ref_pct
                extra = f"  {d:+.2f} vs bare async actor ({'ok' if d <= IDLE_GOAL else 'ABOVE'} goal <= +{IDLE_GOAL})"
            out.append(f"    {label:<64} {pct:6.2f}{extra}")
    return out


def _phases(res: dict) -> list[str]:
    out = ["", "PHASES (load average 1 min before -> after; CPU of processes outside the set-up, % of a core):"]
    for p in res["phases"]:
        if p["kind"] in ("low", "load", "idle"):
            out.append(f"  r{p['round']} {p['kind']:<5} {p['detail']:<10} {p['wall_s']:>6.0f}s  load "
                       f"{p['loadavg_before'][0]:>4.1f} -> {p['loadavg_after'][0]:>4.1f}  others "
                       f"{p['others_cpu_pct']:>5.1f}%" + ("  FLAG: load average above the core count"
                                                          if p["load_above_cores"] else ""))
    out.append("Start-up (s): " + ", ".join(f"{k} {v}" for k, v in res.get("startup_s", {}).items()))
    pins = [f"{k}: " + ", ".join(f"{w['name']} core {w['core']} {'/'.join(w['before'])}->{'/'.join(w['after'])}"
                                 for w in v[0]["workers"]) for k, v in res.get("pinning", {}).items() if v]
    out.append("Worker affinity at first pinning (before->after; (a')'s engine binds its 2 threads itself): "
               + "; ".join(pins))
    out.append("vLLM's own config lines: " + "; ".join(f"{k}: {' | '.join(v)}" for k, v in
                                                      res.get("engine_configs", {}).items()))
    if res.get("leftover_pids"):
        out.append(f"LEFTOVER PROCESSES: {res['leftover_pids']}")
    return out
