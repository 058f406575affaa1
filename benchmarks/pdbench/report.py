"""The text table of a pd_vs_vllm run: run facts, low load, load, issue 18's goals, placement decisions,
issue 30's goals and raypd's fault counters with the benchmark's own check (`pdbench.report_checks`).

The later sections (token gaps, CPU per token, the first-token path, idle, phases) are
`pdbench.report_detail`'s; the plot is `pdbench.plot`'s. Everything is printed from the
results JSON and its summary (`pdbench.summary`).
"""

from __future__ import annotations

import math
import re

from pdbench import goals, report_checks, report_detail
from pdbench.summary import GROUP_SETUP, NAMES, ORDER, RAYPD
from serving.bench.provenance import header_line


_SCHED = re.compile(r"'(max_num_seqs|max_num_batched_tokens)': (\d+)")


def engine_config_lines(group) -> list[str]:
    """The engine settings vLLM itself logged ('Initializing a V1 LLM engine ... with config:'), with
    max_num_seqs / max_num_batched_tokens from the API server's 'non-default args' line before it
    in the same file (vLLM's config line omits them; raypd's engines: `RaypdUp.engine_settings`)."""
    keys = ("dtype", "max_seq_len", "enable_prefix_caching", "enable_chunked_prefill")
    out = []
    for f in group.log_files():
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        sched: list[str] = []
        for line in text.splitlines():
            if "non-default args:" in line:
                sched = [f"{k}={v}" for k, v in _SCHED.findall(line)]
            if "with config:" in line and "Initializing" in line:
                vals = [f"{k}={m.group(1)}" for k in keys if (m := re.search(rf"\b{k}=([^,]+)", line))]
                s = ", ".join(vals + sched)
                if s not in out:
                    out.append(s)
    return out


def f_ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.0f}"


def f_x(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def header(res: dict) -> str:
    h = res["host"]
    planned = f"; planned {res['planned_s']:.0f} s" if res.get("planned_s") else ""
    return (f"# {res['date']}\n# command: {res['command']}\n" + header_line(res['git']) + "\n"
            f"# host: {h['cpus']} CPUs, {h['platform']}; load average before {h['before']['loadavg']}, after "
            f"{h.get('after', {}).get('loadavg')}; wall {res.get('wall_s')} s{planned}"
            + (f"; ABORTED: {res['aborted']}" if res.get("aborted") else "") + "\n")


def table(res: dict) -> str:
    sm, st = res["summary"], res["settings"]
    lengths = [int(x) for x in str(st["lengths"]).split(",")]
    rates = sorted({r for s in sm["load"].values() for r in s})
    out = [f"SmolLM2-135M-Instruct fp32, 1 core per engine ((a') one engine on both), block 128, prefix caching on; "
           f"openai client streaming over HTTP; {st['rounds']} round(s) in alternating order "
           f"{' '.join(g for _, g in res.get('schedule', []))}"]
    out += _raypd_engines(res)
    out += ["", f"LOW LOAD: one request at a time, {st['reps']} per length per round, {st['low_max_tokens']}-token "
            "answers (ms; p50/p90; tok1->2 p50/p90/p99)"]
    hdr = (f"{'prompt':>6} {'set-up':<36} {'ok':>5} {'TTFT p50':>8} {'p90':>6} {'ITL p50':>7} {'p90':>5} "
           f"{'tok1->2 p50':>11} {'p90':>5} {'p99':>5} {'TTFT/(a)':>8} {'same text':>9}")
    out += [hdr, "-" * len(hdr)]
    for n in lengths:
        for s in ORDER:
            x = sm["low"].get(s, {}).get(n)
            if not x:
                continue
            r = sm["ttft_ratios"][n].get(f"{s}/a", {}).get(50) if s != "a" else 1.0
            out.append(f"{n:>6} {NAMES[s]:<36} {x['ok']:>2}/{x['n']:<2} {f_ms(x['ttft_p50']):>8} "
                       f"{f_ms(x['ttft_p90']):>6} {f_ms(x['itl_p50']):>7} {f_ms(x['itl_p90']):>5} "
                       f"{f_ms(x['tok12_p50']):>11} {f_ms(x['tok12_p90']):>5} {f_ms(x['tok12_p99']):>5} "
                       f"{f_x(r):>8} {sm['same_text_as_a'].get(s, {}).get(n, 'ref'):>9}")
        rr = sm["ttft_ratios"][n]
        out.append(f"{'':>6} TTFT p50 ratios: (b)/(a) {f_x(rr.get('b/a', {}).get(50))} (goal <= 1.15), "
                   f"(e)/(a) {f_x(rr.get('e/a', {}).get(50))} (goal <= 1.10), "
                   f"(b)/(c) {f_x(rr.get('b/c', {}).get(50))}, (b)/(d) {f_x(rr.get('b/d', {}).get(50))} (goal < 1); "
                   f"p90: (b)/(a) {f_x(rr.get('b/a', {}).get(90))}, (e)/(a) {f_x(rr.get('e/a', {}).get(90))}")
    slo = (f"TTFT <= {f_ms(st['slo_ttft_s'])} ms, mean ITL <= {f_ms(st['slo_tpot_s'])} ms (fixed, as `vllm bench "
           "serve --goodput` applies it)" if st.get("slo_ttft_s") is not None else
           "TTFT <= 3x (a)'s low-load TTFT p50 at its length, mean ITL <= 1.5x (a)'s, no token gap (tok1->2 "
           "included) > 1 s")
    out += ["", f"UNDER LOAD: open-loop Poisson arrivals, {st['load_requests']} requests per rate per round, prompt "
            f"mix {st['mix']} tokens, {st['load_max_tokens']}-token answers; goodput SLO per request: {slo}"]
    ref = sm.get("slo_reference", {})
    out.append("  SLO limits: " + "; ".join(f"{n}: TTFT {f_ms(v['ttft_s'])} ms, mean ITL {f_ms(v['mean_itl_s'])} ms"
                                            for n, v in ref.items()))
    hdr = (f"{'rate/s':>6} {'set-up':<36} {'ok':>5} {'thru/s':>6} {'good/s':>6} {'TTFT p50':>8} {'p90':>6} {'p99':>6} "
           f"{'tok1->2 p50':>11} {'p90':>5} {'p99':>5} {'ITL p50':>7} {'p90':>5} {'p99':>5}  SLO misses")
    out += [hdr, "-" * len(hdr)]
    for rate in rates:
        for s in ORDER:
            x = sm["load"].get(s, {}).get(rate)
            if not x:
                continue
            out.append(f"{rate:>6} {NAMES[s]:<36} {x['ok']:>2}/{x['n']:<2} {x['throughput_rps']:>6.2f} "
                       f"{x['goodput_rps']:>6.2f} {f_ms(x['ttft_p50']):>8} {f_ms(x['ttft_p90']):>6} "
                       f"{f_ms(x['ttft_p99']):>6} {f_ms(x['tok12_p50']):>11} {f_ms(x['tok12_p90']):>5} "
                       f"{f_ms(x['tok12_p99']):>5} {f_ms(x['itl_p50']):>7} {f_ms(x['itl_p90']):>5} "
                       f"{f_ms(x['itl_p99']):>5}  {x['slo_missed'] or ''}"
                       + (f"  errors: {x['errors']}" if x.get("errors") else ""))
        for s, h in sm["load_headline"].get(rate, {}).items():
            if h:
                out.append(f"{'':>6} ({s}) vs others: " + "; ".join(
                    f"{k} {v[0]:.2f}/{v[1]:.2f} = {f_x(v[2])}" if "goodput" in k
                    else f"{k} {v[0]:.0f}/{v[1]:.0f} ms = {f_x(v[2])}" for k, v in h.items()))
    out += _per_rate_p99(sm, rates) + _goals(sm) + _planned(res) + _decisions(sm) + report_checks.sections(sm)
    return "\n".join(out + report_detail.sections(res, lengths, rates))


def _raypd_engines(res: dict) -> list[str]:
    rows = res.get("raypd_engines", {})
    if not rows:
        return []
    out = ["raypd's engines as they run (raypd up's read-back of each engine's VllmConfig; raypd chooses the "
           "chunked-prefill budget max_num_batched_tokens of decode-capable engines under placement slo, and "
           "max_num_seqs 1 on prefill-only engines; every vLLM set-up runs max_num_seqs 128 and "
           "max_num_batched_tokens 2048):"]
    for key, lines in rows.items():
        out += [f"  ({GROUP_SETUP.get(key, key)}) {ln}" for ln in lines]
    return out


def _per_rate_p99(sm: dict, rates: list[float]) -> list[str]:
    present = [s for s in ORDER if sm["load"].get(s)]
    if not present:
        return []
    out = ["", "PER RATE, every set-up (ms): ITL p99 | tok1->2 p99 | max gap p99"]
    out.append(f"  {'rate/s':>6} " + " ".join(f"{'(' + s + ')':>20}" for s in present))
    for r in rates:
        cells = []
        for s in present:
            x = sm["load"][s].get(r)
            cells.append(f"{f_ms(x['itl_p99']):>5} |{f_ms(x['tok12_p99']):>6} |{f_ms(x['max_gap_p99']):>6}" if x else "-")
        out.append(f"  {r:>6} " + " ".join(f"{c:>20}" for c in cells))
    return out


def _goals(sm: dict) -> list[str]:
    rows = sm.get("goals") or []
    if not rows:
        return []
    width = max(len(r["goal"]) for r in rows)
    return ["", "ISSUE 18 GOALS (raypd's default (e) against colocated serving on the same 2 cores):"] + [
        f"  {r['goal']:<{width}}  {r['value']:<44} {goals.verdict(r['met'])}" for r in rows]


def _planned(res: dict) -> list[str]:
    """(ep): what `raypd config --plan` printed, then its prediction against measurement (issue 28)."""
    plan, rows = res.get("plan") or {}, res["summary"].get("planned") or {}
    if not plan:
        return []
    out = ["", f"THE PLANNER'S SHAPE (ep): `raypd config --plan` on (e)'s file, for this load, chose "
           f"{plan.get('shape')}" + (f" with max_num_batched_tokens {plan['budget']}" if plan.get("budget") else "")
           + "; its table (200 simulated requests per rate):"]
    out += [f"  {ln}" for ln in (plan.get("table") or "").splitlines()]
    out.append("  by the planner's count and the targets it was given (TTFT <= 3 s and TPOT <= 0.1 s, requests within "
               "both per second of offered load): (ep) predicted for the very requests sent (each round's arrivals "
               "and lengths) against measured, and every set-up measured:")
    for r, row in rows.items():
        pred, meas, ratio = row["prediction"]
        others = "  ".join(f"({s}) {g:.3f}" for s, g in row["goodput"].items())
        out.append(f"  {r:>6}/s  predicted {pred:.3f}  measured {meas:.3f}  predicted/measured {f_x(ratio)} | "
                   f"{others} | (ep)/better of (a2),(a') {f_x(row['ep/better'])}")
    return out


def _decisions(sm: dict) -> list[str]:
    rows = sm.get("decisions") or {}
    if not rows:
        return []
    out = ["", "PLACEMENT DECISIONS (raypd_disagg_decisions_total of the front's /metrics, read before and after each "
           "phase, summed over rounds; local = colocated, remote = disaggregated):"]
    for s in RAYPD:
        for phase, counts in rows.get(s, {}).items():
            total = sum(v for v in counts.values() if isinstance(v, (int, float)))
            local = sum(v for k, v in counts.items() if k.startswith("local/") and isinstance(v, (int, float)))
            label = "low load" if phase == "low" else f"{phase}/s"
            detail = ", ".join(f"{k} {v:.0f}" if isinstance(v, (int, float)) else f"{k}: {v}"
                               for k, v in sorted(counts.items()))
            out.append(f"  ({s}) {label:<9} {total:>4.0f} requests: {local:.0f} colocated, {total - local:.0f} "
                       f"disaggregated  [{detail}]")
    return out
