"""Issue 30's goals, checked on a pd_vs_vllm summary (pure: dicts in, rows out).

(e0) is raypd with P/D taken out (two `both` engines, never disaggregated), (a2) two plain vLLM
servers on the same cores behind a balancer: what is left between them is the stack's cost.

  1. (e0) against (a2) at every rate: throughput >= 0.95x, TTFT p50 <= 1.05x, ITL p50 <= 1.05x;
  2. CPU per streamed token (pooled over the load phases, procs.cpu_seconds_by_kind): everything
     (e0) runs, engines included, <= 1.05x everything (a2) runs (its vLLM servers and balancer);
     vLLM's engine cores alone <= 1.1x, or, when raypd's engines run their model in the core (vLLM's
     uni executor, raypd's CPU default: actors/engine/vllm/uniproc.py), their compute (core + workers)
     against (a2)'s, since the core alone then holds the model's time; outside the engines (compute = engine cores and workers)
     <= 1.0x: raypd's EngineActors, ingress, Serve, coordinator and Ray's processes against vLLM's
     API servers and the balancer;
  3. low-load ITL p50 of the default (e) <= 1.05x a plain one-core vLLM engine's (a), per length;
  4. the headline stays: goodput of (e) >= 1.0x the better of (a2) and (a') at every rate
     (issue 18's first goal, `pdbench.goals`);
  and (e0) is what it claims: the front's placement counters show no disaggregated request.
A goal without the set-ups it needs is "not measured".
"""

from __future__ import annotations

import math

from pdbench.goals import GOODPUT_EVERY_RATE, baseline

THROUGHPUT = 0.95
TTFT_P50 = 1.05
ITL_P50 = 1.05
CPU_TOTAL = 1.05
CPU_ENGINE_CORE = 1.10
CPU_OUTSIDE = 1.0
LOW_ITL_P50 = 1.05


def _row(goal: str, value: str, met: bool | None) -> dict:
    return {"goal": goal, "value": value, "met": met}


def _nan(*xs: float | None) -> bool:
    return any(x is None or math.isnan(x) for x in xs)


def _at_most(goal: str, x: float | None, y: float | None, limit: float, unit: str = "ms", scale: float = 1e3,
             digits: int = 0) -> dict:
    """x <= limit * y (both > 0 expected; NaN or a missing figure: not measured)."""
    if _nan(x, y):
        return _row(goal, "not measured", None)
    ratio = f" = {x / y:.2f}x" if y else ""
    return _row(goal, f"{x * scale:.{digits}f} vs {y * scale:.{digits}f} {unit}{ratio}", x <= limit * y + 1e-12)


def _at_least(goal: str, x: float | None, y: float | None, limit: float, unit: str) -> dict:
    if _nan(x, y):
        return _row(goal, "not measured", None)
    ratio = f" = {x / y:.2f}x" if y else ""
    return _row(goal, f"{x:.3f} vs {y:.3f} {unit}{ratio}", x >= limit * y - 1e-12)


def issue30(sm: dict, lengths: list[int], rates: list[float]) -> list[dict]:
    load, out = sm["load"], []
    e0, a2 = load.get("e0", {}), load.get("a2", {})
    # 1. the stack's cost in latency and throughput, at every rate both ran
    for r in rates:
        if r not in e0:
            continue
        x, y = e0[r], a2.get(r, {})
        out.append(_at_least(f"throughput (e0) >= {THROUGHPUT:.2f}x (a2) at {r}/s", x["throughput_rps"],
                             y.get("throughput_rps"), THROUGHPUT, "req/s"))
        out.append(_at_most(f"TTFT p50 (e0) <= {TTFT_P50:.2f}x (a2) at {r}/s", x["ttft_p50"], y.get("ttft_p50"),
                            TTFT_P50))
        # each request's mean ITL, not the gaps: a stream that reaches the client in bursts has gap p50 0
        out.append(_at_most(f"ITL p50 (e0) <= {ITL_P50:.2f}x (a2) at {r}/s (requests' mean ITL)", x["mean_itl_p50"],
                            y.get("mean_itl_p50"), ITL_P50))
    # 2. CPU per streamed token, pooled over every load phase
    cpu = sm.get("cpu_per_token", {})
    x, y = cpu.get("e0", {}).get("all"), cpu.get("a2", {}).get("all")
    if x:
        y = y or {}
        total = lambda c: c["compute"] + c["front"] + c["rest"] if c else None  # noqa: E731
        outside = lambda c: c["front"] + c["rest"] if c else None  # noqa: E731
        out.append(_at_most(f"CPU per token, everything (e0) runs <= {CPU_TOTAL:.2f}x (a2)'s", total(x), total(y),
                            CPU_TOTAL, "ms", 1.0, 2))
        if x.get("engine_core", 0.0) >= 0.5 * x["compute"]:  # uni: the core computes, there is no worker to split off
            out.append(_at_most(f"CPU per token, the engines' compute (core + workers) (e0) <= {CPU_ENGINE_CORE:.2f}x "
                                "(a2)'s (raypd's cores run the model)", x["compute"], y.get("compute"), CPU_ENGINE_CORE,
                                "ms", 1.0, 2))
        else:
            out.append(_at_most(f"CPU per token, vLLM engine cores (e0) <= {CPU_ENGINE_CORE:.2f}x (a2)'s",
                                x.get("engine_core"), y.get("engine_core"), CPU_ENGINE_CORE, "ms", 1.0, 2))
        out.append(_at_most(f"CPU per token outside the engines (e0) <= {CPU_OUTSIDE:.2f}x (a2)'s (API servers "
                            "+ balancer)", outside(x), outside(y), CPU_OUTSIDE, "ms", 1.0, 2))
    # 3. low-load ITL of the default against one plain one-core engine
    low = sm.get("low", {})
    if "e" in low:
        for n in lengths:
            ex, ax = low["e"].get(n), low.get("a", {}).get(n)
            out.append(_at_most(f"low-load ITL p50 (e) <= {LOW_ITL_P50:.2f}x (a) at {n} (requests' mean ITL)",
                                ex["mean_itl_p50"] if ex else None, ax["mean_itl_p50"] if ax else None, LOW_ITL_P50))
    # 4. the headline
    e = load.get("e", {})
    for r in rates:
        base = baseline(load, r)
        if r in e and base is not None:
            name, b = base
            out.append(_at_least(f"goodput (e) >= {GOODPUT_EVERY_RATE:.1f}x better of (a2),(a') at {r}/s ({name})",
                                 e[r]["goodput_rps"], b["goodput_rps"], GOODPUT_EVERY_RATE, "req/s"))
    # (e0) serves every request colocated (pdbench/colocated.py's knob did its job)
    dec = sm.get("decisions", {}).get("e0")
    if e0 or dec:
        out.append(never_disaggregated(dec))
    return out


def never_disaggregated(per_phase: dict | None) -> dict:
    """(e0)'s placement decisions (phase -> `decision/reason` -> requests): none remote."""
    goal = "(e0) never disaggregates (placement decisions: 0 remote)"
    if not per_phase:
        return _row(goal, "not measured", None)
    errors = [v for counts in per_phase.values() for k, v in counts.items() if not isinstance(v, (int, float))]
    n = lambda pre: sum(v for c in per_phase.values() for k, v in c.items()  # noqa: E731
                        if k.startswith(pre) and isinstance(v, (int, float)))
    remote, local = n("remote/"), n("local/")
    value = f"{remote:.0f} remote, {local:.0f} local" + (f"; unread: {errors[0]}" if errors else "")
    return _row(goal, value, remote == 0 if not errors or remote else None)
