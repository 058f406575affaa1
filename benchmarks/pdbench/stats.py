"""From request records to the figures the benchmark reports.

Definitions (every set-up alike, from the client's token-chunk arrival times):
  TTFT        request sent -> first token chunk
  tok1->2     first -> second token chunk (a P/D set-up's KV pull and first decode step sit here)
  ITL         gaps between consecutive token chunks after the second token
  mean ITL    (last - first token) / (completion tokens - 1), per request (vLLM's TPOT)
  max gap     the longest gap between two token chunks of a request, tok1->2 included
  gaps < 1 ms the fraction of all gaps between consecutive token chunks (tok1->2 included) under 1 ms:
              chunks that piled up somewhere and reached the client in a burst
  CPU/token   CPU seconds (utime + stime, /proc) of a set-up's processes over a load phase / tokens
              streamed in it (usage.completion_tokens), split into the engines' compute (vLLM's
              EngineCore and workers), each engine's front process (the process that owns vLLM's
              engine core: vLLM's API server, raypd's EngineActor, Serve LLM's engine replica) and
              the rest (raypd: ingress, Serve proxy and controller, coordinator, GCS, raylet,
              dashboard agents...; (a2)/(c): the benchmark's proxy)
  hops        raypd only: its X-Raypd-Trace stamps (serving/front/trace.py, CLOCK_MONOTONIC, shared
              with the client on this host) as the durations of each hop to the first token
Goodput SLO of a request of prompt length n (reference: the low-load colocated set-up (a), same run):
  TTFT <= 3 x (a)'s low-load TTFT p50 at n, mean ITL <= 1.5 x (a)'s low-load mean ITL p50 at n,
  max gap <= 1 s.
"""

from __future__ import annotations

import math

from serving.bench.samples import percentile

NAN = float("nan")


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else NAN


def gaps(rec: dict) -> list[float]:
    t = rec["token_times_s"]
    return [b - a for a, b in zip(t, t[1:])]


def mean_itl(rec: dict) -> float | None:
    t = rec["token_times_s"]
    n = rec.get("completion_tokens") or len(t)
    if len(t) < 2 or n < 2:
        return None
    return (t[-1] - t[0]) / (n - 1)


def latency_stats(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    first = [gaps(r)[0] for r in ok if len(r["token_times_s"]) > 1]
    itl = [g for r in ok for g in gaps(r)[1:]]
    means = [m for m in (mean_itl(r) for r in ok) if m is not None]
    out = {"n": len(recs), "ok": len(ok),
           "errors": sorted({r["error"] for r in recs if not r["ok"] and r.get("error")})[:3]}
    for name, vals, qs in (("ttft", ttft, (50, 90, 99)), ("tok12", first, (50, 90, 99)),
                           ("itl", itl, (50, 90, 99)), ("mean_itl", means, (50, 90))):
        for q in qs:
            out[f"{name}_p{q}"] = pct(vals, q)
    out["max_gap_max"] = max((max(gaps(r)) for r in ok if len(r["token_times_s"]) > 1), default=NAN)
    every = [g for r in ok for g in gaps(r)]
    out["gaps"] = len(every)
    out["gaps_under_1ms"] = sum(1 for g in every if g < 0.001) / len(every) if every else NAN
    return out


# The hops of raypd's trace, in path order: (label, from stamp, to stamp). "client" stamps are the
# benchmark's own (request sent, first token parsed), on the same clock.
HOPS = (
    ("client -> front (HTTP, Serve proxy, replica, body)", "client_sent", "front_in"),
    ("front: parse, render, sampling params", "front_in", "prepared"),
    ("router: routes, plan", "prepared", "routed"),
    ("router -> prefill actor (Ray call)", "routed", "engine_in"),
    ("actor -> vLLM queue (waits for the running step)", "engine_in", "vllm_queued"),
    ("vLLM queue -> scheduled", "vllm_queued", "vllm_scheduled"),
    ("vLLM prefill step(s)", "vllm_scheduled", "vllm_out"),
    ("vLLM output -> actor returns", "vllm_out", "engine_out"),
    ("prefill actor -> router (Ray reply)", "engine_out", "router_in"),
    ("router -> response start (front)", "router_in", "sse"),
    ("response start -> client parsed token 1", "sse", "client_first"),
)


def hop_stats(recs: list[dict]) -> dict:
    """Per hop: p50 / p90 / max in seconds over the records that carry a trace; and the
    prompt tokens vLLM computed in the step that gave each first token (p50 / max)."""
    rows: dict[str, list[float]] = {label: [] for label, _, _ in HOPS}
    step_tokens: list[float] = []
    for r in recs:
        if not r.get("ok") or not r.get("trace") or r.get("sent_mono") is None:
            continue
        t = {k: v for k, v in r["trace"]}
        step = t.pop("vllm_step_prompt_tokens", None)
        if step is not None:
            step_tokens.append(step)
        t["client_sent"] = r["sent_mono"]
        t["client_first"] = r["sent_mono"] + r["ttft_s"]
        for label, a, b in HOPS:
            if a in t and b in t:
                rows[label].append(t[b] - t[a])
    out = {label: {"n": len(v), "p50": pct(v, 50), "p90": pct(v, 90), "max": max(v) if v else NAN}
           for label, v in rows.items() if v}
    if step_tokens:
        out["_step_prompt_tokens"] = {"p50": pct(step_tokens, 50), "max": max(step_tokens)}
    return out


def slo_reference(low_a: dict[int, list[dict]]) -> dict[int, dict]:
    """Per prompt length: the SLO limits derived from (a)'s low-load records."""
    ref = {}
    for n, recs in low_a.items():
        s = latency_stats(recs)
        ref[n] = {"ttft_s": 3.0 * s["ttft_p50"], "mean_itl_s": 1.5 * s["mean_itl_p50"], "max_gap_s": 1.0}
    return ref


def fixed_slo(lengths: list[int], ttft_s: float, tpot_s: float) -> dict[int, dict]:
    """The same limits for every prompt length, as `vllm bench serve --goodput ttft:.. tpot:..` applies
    them (no limit on a single gap)."""
    return {n: {"ttft_s": ttft_s, "mean_itl_s": tpot_s, "max_gap_s": math.inf} for n in lengths}


def meets_slo(rec: dict, ref: dict[int, dict]) -> tuple[bool, str]:
    if not rec["ok"]:
        return False, "failed"
    lim = ref.get(rec["length"])
    if lim is None:
        return False, "no reference"
    g = gaps(rec)
    if rec["ttft_s"] > lim["ttft_s"]:
        return False, "ttft"
    m = mean_itl(rec)
    if m is not None and m > lim["mean_itl_s"]:
        return False, "mean_itl"
    if g and max(g) > lim["max_gap_s"]:
        return False, "gap>1s"
    return True, "ok"


def load_stats(runs: list[dict], ref: dict[int, dict]) -> dict:
    """Pooled over rounds: `runs` = [{"records": [...], "duration_s": x}, ...] at one rate."""
    recs = [r for run in runs for r in run["records"]]
    duration = sum(run["duration_s"] for run in runs)
    verdicts = [meets_slo(r, ref) for r in recs]
    reasons: dict[str, int] = {}
    for good, why in verdicts:
        if not good:
            reasons[why] = reasons.get(why, 0) + 1
    ok = [r for r in recs if r["ok"]]
    out = latency_stats(recs)
    out.update({
        "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration else NAN,
        "output_tok_per_s": sum((r.get("completion_tokens") or 0) for r in ok) / duration if duration else NAN,
        "goodput_rps": sum(1 for good, _ in verdicts if good) / duration if duration else NAN,
        "slo_met": sum(1 for good, _ in verdicts if good), "slo_missed": reasons,
        "max_gap_p99": pct([max(gaps(r)) for r in ok if len(r["token_times_s"]) > 1], 99),
    })
    return out


def ratio(a: float, b: float) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return NAN
    return a / b
