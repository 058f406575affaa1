"""Issue 18's goals, checked on a pd_vs_vllm summary (pure: dicts in, rows out).

  1. goodput of (e) >= 1.0x the better of (a2) and (a') at every rate;
  2. ... and >= 1.3x at the highest rate where that baseline still meets its SLO for at
     least half of its requests;
  3. ITL p99 of (e) <= (a2)'s at every rate;
  4. low-load TTFT p50 of (e) <= 1.10x colocated (a) at 128 / 512 / 2048 tokens.
Also the rate list's reach: the issue's rates go up to where (a2) meets its SLO for fewer
than half of its requests. A goal without the set-ups it needs is "not measured".
"""

from __future__ import annotations

import math

GOODPUT_EVERY_RATE = 1.0
GOODPUT_AT_EDGE = 1.3
TTFT_LOW_LOAD = 1.10
TTFT_LENGTHS = (128, 512, 2048)


def _met_share(x: dict) -> float:
    return x["slo_met"] / x["n"] if x.get("n") else 0.0


def baseline(load: dict, rate: float) -> tuple[str, dict] | None:
    """The better colocated baseline at `rate`: (a2) or (a'), by goodput (ties: (a2))."""
    got = [(s, load[s][rate]) for s in ("a2", "ap") if rate in load.get(s, {})]
    return max(got, key=lambda kv: kv[1]["goodput_rps"]) if got else None


def _row(goal: str, value: str, met: bool | None) -> dict:
    return {"goal": goal, "value": value, "met": met}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("both 0" if not a else "inf")


def issue18(sm: dict, lengths: list[int], rates: list[float]) -> list[dict]:
    load, out = sm["load"], []
    e = load.get("e", {})
    # 1. every rate
    for r in rates:
        base = baseline(load, r)
        if r not in e or base is None:
            continue
        name, b = base
        g, gb = e[r]["goodput_rps"], b["goodput_rps"]
        out.append(_row(f"goodput (e) >= {GOODPUT_EVERY_RATE:.1f}x better of (a2),(a') at {r}/s",
                        f"{g:.3f} vs ({name}) {gb:.3f} req/s = {_ratio(g, gb)}", g >= GOODPUT_EVERY_RATE * gb - 1e-12))
    # 2. the highest rate where the better baseline still meets its SLO for >= half its requests
    edge = [r for r in rates if r in e and (b := baseline(load, r)) and _met_share(b[1]) >= 0.5]
    if e and any(baseline(load, r) for r in rates):
        if edge:
            r = max(edge)
            name, b = baseline(load, r)
            g, gb = e[r]["goodput_rps"], b["goodput_rps"]
            out.append(_row(f"goodput (e) >= {GOODPUT_AT_EDGE:.1f}x the baseline at its last rate with >= 50 % "
                            f"in SLO ({r}/s, ({name}) {b['slo_met']}/{b['n']})",
                            f"{g:.3f} vs {gb:.3f} req/s = {_ratio(g, gb)}", g >= GOODPUT_AT_EDGE * gb - 1e-12))
        else:
            out.append(_row(f"goodput (e) >= {GOODPUT_AT_EDGE:.1f}x the baseline at its last rate with >= 50 % in SLO",
                            "no rate where the baseline meets its SLO for half of its requests", None))
    # 3. ITL p99 at every rate
    for r in rates:
        a2 = load.get("a2", {}).get(r)
        if r not in e or not a2:
            continue
        x, y = e[r]["itl_p99"], a2["itl_p99"]
        met = None if math.isnan(x) or math.isnan(y) else x <= y
        out.append(_row(f"ITL p99 (e) <= (a2) at {r}/s", f"{x * 1e3:.0f} vs {y * 1e3:.0f} ms", met))
    # 4. low-load TTFT against (a)
    for n in TTFT_LENGTHS:
        if n not in lengths:
            continue
        q = sm["ttft_ratios"].get(n, {}).get("e/a", {}).get(50)
        if q is None:
            out.append(_row(f"low-load TTFT p50 (e)/(a) <= {TTFT_LOW_LOAD:.2f} at {n}", "not measured", None))
            continue
        out.append(_row(f"low-load TTFT p50 (e)/(a) <= {TTFT_LOW_LOAD:.2f} at {n}", f"{q:.2f}",
                        None if math.isnan(q) else q <= TTFT_LOW_LOAD))
    # the rate list's reach
    a2 = load.get("a2", {})
    if a2:
        top = max(a2)
        out.append(_row("rates reach (a2) < 50 % in SLO (the issue's range)",
                        f"(a2) at {top}/s: {a2[top]['slo_met']}/{a2[top]['n']} in SLO", _met_share(a2[top]) < 0.5))
    return out


def verdict(met: bool | None) -> str:
    return "not measured" if met is None else ("met" if met else "MISSED")
