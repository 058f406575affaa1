"""Summary, text table and plot of a pd_vs_vllm run (everything computed from the results JSON)."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

from pdbench import stats

NAMES = {"a": "(a) vLLM colocated, 1 engine", "a2": "(a2) vLLM colocated x2 + balancer",
         "b": "(b) raypd 1P+1D (raypd up)", "c": "(c) vLLM NixlConnector P/D + proxy",
         "d": "(d) Ray Serve LLM P/D", "dc": "(dc) Ray Serve LLM colocated"}
ORDER = ["a", "a2", "b", "c", "d", "dc"]
GROUP_NAMES = {"A": "(a)/(a2) plain vLLM", "B": "(b) raypd up", "C": "(c) vLLM NixlConnector",
               "D": "(d) Serve LLM P/D", "DC": "(dc) Serve LLM colocated"}
RAYPD_ACTORS = ("ray::EngineActor", "ray::Coordinator", "ray::SyntheticRankActor")
IDLE_GOAL = 0.2  # issue 13: each raypd actor process within 0.2 % of a core of a bare idle actor


def git_state(root: Path) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [l for l in git("status", "--porcelain").splitlines() if "benchmarks/results/" not in l]
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty_files": len(dirty)}


def engine_config_lines(group) -> list[str]:
    """The engine settings vLLM itself logged ('Initializing a V1 LLM engine ... with config:')."""
    files = group.log_files()
    keys = ("dtype", "max_seq_len", "enable_prefix_caching", "enable_chunked_prefill")
    out = []
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if "with config:" in line and "Initializing" in line:
                vals = [f"{k}={m.group(1)}" for k in keys if (m := re.search(rf"\b{k}=([^,]+)", line))]
                s = ", ".join(vals)
                if s not in out:
                    out.append(s)
    return out


# ------------------------------------------------------------------ summary
def _low(res: dict, setup: str, n: int) -> list[dict]:
    return res["low"].get(setup, {}).get(str(n), [])


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
        row = {}
        for num, den in (("b", "a"), ("c", "a"), ("d", "a"), ("dc", "a"), ("b", "c"), ("b", "d")):
            if num in low and den in low:
                row[f"{num}/{den}"] = {q: stats.ratio(low[num][n][f"ttft_p{q}"], low[den][n][f"ttft_p{q}"])
                                       for q in (50, 90)}
        ratios[n] = row
    ref = stats.slo_reference({n: _low(res, "a", n) for n in lengths}) if "a" in low else {}
    load = {s: {r: stats.load_stats(res["load"][s][str(r)], ref) for r in rates if str(r) in res["load"][s]}
            for s in ORDER if s in res.get("load", {})}
    headline = {}
    for r in rates:
        b = load.get("b", {}).get(r)
        if not b:
            continue
        row = {}
        for other in ("a2", "c", "d"):
            o = load.get(other, {}).get(r)
            if o:
                row[f"goodput b/{other}"] = [b["goodput_rps"], o["goodput_rps"],
                                             stats.ratio(b["goodput_rps"], o["goodput_rps"])]
        if load.get("a2", {}).get(r):
            row["ITL p90 b/a2"] = [b["itl_p90"] * 1e3, load["a2"][r]["itl_p90"] * 1e3,
                                   stats.ratio(b["itl_p90"], load["a2"][r]["itl_p90"])]
        headline[r] = row
    return {"low": low, "same_text_as_a": same, "ttft_ratios": ratios, "slo_reference": ref, "load": load,
            "load_headline": headline, "idle": idle_rows(res), "cpu_per_token": cpu_per_token(res),
            "hops": {"low": {n: stats.hop_stats(_low(res, "b", n)) for n in lengths if _low(res, "b", n)},
                     "load": {r: stats.hop_stats([x for run in res.get("load", {}).get("b", {}).get(str(r), [])
                                                  for x in run["records"]]) for r in rates
                              if str(r) in res.get("load", {}).get("b", {})}},
            "flagged_phases": [p for p in res["phases"] if p["load_above_cores"]]}


def cpu_per_token(res: dict) -> dict:
    """Per set-up and rate: ms of CPU per streamed token by kind (procs.cpu_seconds_by_kind), pooled
    over rounds; and per set-up over every rate."""
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
            rows["all"] = {k: 1e3 * pooled[k] / pooled["tokens"] for k in ("compute", "front", "rest")} | {
                "tokens": pooled["tokens"],
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


# ------------------------------------------------------------------ text
def f_ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.0f}"


def f_x(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def header(res: dict) -> str:
    h = res["host"]
    return (f"# {res['date']}\n# command: {res['command']}\n# git: {res['git'].get('commit', '?')[:12]} "
            f"({res['git'].get('branch')}, {res['git'].get('dirty_files')} uncommitted files outside results/)\n"
            f"# host: {h['cpus']} CPUs, {h['platform']}; load average before {h['before']['loadavg']}, after "
            f"{h.get('after', {}).get('loadavg')}; wall {res.get('wall_s')} s"
            + (f"; ABORTED: {res['aborted']}" if res.get("aborted") else "") + "\n")


def table(res: dict) -> str:
    sm, st = res["summary"], res["settings"]
    lengths = [int(x) for x in str(st["lengths"]).split(",")]
    out = [f"SmolLM2-135M-Instruct fp32, 1 core per engine, block 128, prefix caching on, max_num_seqs 128; "
           f"openai client streaming over HTTP; {st['rounds']} round(s) in alternating order "
           f"{' '.join(g for _, g in res.get('schedule', []))}", "",
           f"LOW LOAD: one request at a time, {st['reps']} per length per round, {st['low_max_tokens']}-token answers "
           "(ms; p50/p90; tok1->2 p50/p90/p99)"]
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
                   f"(b)/(c) {f_x(rr.get('b/c', {}).get(50))}, (b)/(d) {f_x(rr.get('b/d', {}).get(50))} (goal < 1); "
                   f"p90: (b)/(a) {f_x(rr.get('b/a', {}).get(90))}")
    out += ["", f"UNDER LOAD: open-loop Poisson arrivals, {st['load_requests']} requests per rate per round, prompt "
            f"mix {st['mix']} tokens, {st['load_max_tokens']}-token answers; goodput SLO per request: TTFT <= 3x (a)'s "
            "low-load TTFT p50 at its length, mean ITL <= 1.5x (a)'s, no token gap (tok1->2 included) > 1 s"]
    ref = sm.get("slo_reference", {})
    out.append("  SLO limits: " + "; ".join(f"{n}: TTFT {f_ms(v['ttft_s'])} ms, mean ITL {f_ms(v['mean_itl_s'])} ms"
                                            for n, v in ref.items()))
    hdr = (f"{'rate/s':>6} {'set-up':<36} {'ok':>5} {'thru/s':>6} {'good/s':>6} {'TTFT p50':>8} {'p90':>6} {'p99':>6} "
           f"{'tok1->2 p50':>11} {'p90':>5} {'p99':>5} {'ITL p50':>7} {'p90':>5} {'p99':>5}  SLO misses")
    out += [hdr, "-" * len(hdr)]
    rates = sorted({r for s in sm["load"].values() for r in s})
    for rate in rates:
        for s in ORDER:
            x = sm["load"].get(s, {}).get(rate)
            if not x:
                continue
            out.append(f"{rate:>6} {NAMES[s]:<36} {x['ok']:>2}/{x['n']:<2} {x['throughput_rps']:>6.2f} "
                       f"{x['goodput_rps']:>6.2f} {f_ms(x['ttft_p50']):>8} {f_ms(x['ttft_p90']):>6} "
                       f"{f_ms(x['ttft_p99']):>6} {f_ms(x['tok12_p50']):>11} {f_ms(x['tok12_p90']):>5} "
                       f"{f_ms(x['tok12_p99']):>5} {f_ms(x['itl_p50']):>7} {f_ms(x['itl_p90']):>5} "
                       f"{f_ms(x['itl_p99']):>5}  {x['slo_missed'] or ''}")
        h = sm["load_headline"].get(rate, {})
        if h:
            out.append(f"{'':>6} (b) vs others: " + "; ".join(
                f"{k} {v[0]:.2f}/{v[1]:.2f} = {f_x(v[2])}" if "goodput" in k else f"{k} {v[0]:.0f}/{v[1]:.0f} ms = {f_x(v[2])}"
                for k, v in h.items()))
    out += ["", "TOKEN GAPS UNDER 1 MS: fraction of all gaps between consecutive token chunks (tok1->2 included; "
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
    cpt = sm.get("cpu_per_token", {})
    if cpt:
        out += ["", "CPU PER STREAMED TOKEN under load (ms of CPU per token, /proc utime+stime over each load phase): "
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
        b, a2 = cpt.get("b", {}).get("all"), cpt.get("a2", {}).get("all")
        if b and a2 and a2["front"]:
            out.append(f"  goal: (b) outside the engines / (a2) vLLM API servers = {b['rest']:.2f} / {a2['front']:.2f} "
                       f"= {b['rest'] / a2['front']:.2f} (goal <= 1.0)")
    hops = sm.get("hops", {})
    if any(hops.get("low", {}).values()) or any(hops.get("load", {}).values()):
        out += ["", "FIRST TOKEN PATH of (b), per hop (ms p50/p90/max; X-Raypd-Trace stamps, CLOCK_MONOTONIC of this host)"]
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
    out += ["", "IDLE: CPU % of one core per process over the idle windows (after warm-up, no requests), mean of rounds"]
    bare = {lab.split(" (x")[0]: pct for lab, pct, kind in sm["idle"].get("B", []) if kind == "reference"}
    ref_pct = bare.get("ray::BareAsyncActor")
    for key, rows in sm["idle"].items():
        out.append(f"  {GROUP_NAMES.get(key, key)}")
        for label, pct, kind in rows:
            extra = ""
            if kind == "raypd actor" and ref_pct is not None:
                d = pct - ref_pct
                extra = f"  {d:+.2f} vs bare async actor ({'ok' if d <= IDLE_GOAL else 'ABOVE'} goal <= +{IDLE_GOAL})"
            out.append(f"    {label:<64} {pct:6.2f}{extra}")
    out += ["", "PHASES (load average 1 min before -> after; CPU of processes outside the set-up, % of a core):"]
    for p in res["phases"]:
        if p["kind"] in ("low", "load", "idle"):
            out.append(f"  r{p['round']} {p['kind']:<5} {p['detail']:<10} {p['wall_s']:>6.0f}s  load "
                       f"{p['loadavg_before'][0]:>4.1f} -> {p['loadavg_after'][0]:>4.1f}  others "
                       f"{p['others_cpu_pct']:>5.1f}%" + ("  FLAG: load average above the core count"
                                                          if p["load_above_cores"] else ""))
    out.append("Start-up (s): " + ", ".join(f"{k} {v}" for k, v in res.get("startup_s", {}).items()))
    pins = [f"{k}: " + ", ".join(f"{w['name']} core {w['core']} {'/'.join(w['before'])}->{'/'.join(w['after'])}"
                                 for w in v[0]["workers"]) for k, v in res.get("pinning", {}).items() if v]
    out.append("Worker affinity at first pinning (before->after): " + "; ".join(pins))
    out.append("vLLM's own config lines: " + "; ".join(f"{k}: {' | '.join(v)}" for k, v in
                                                      res.get("engine_configs", {}).items()))
    if res.get("leftover_pids"):
        out.append(f"LEFTOVER PROCESSES: {res['leftover_pids']}")
    return "\n".join(out)


def _step_tokens(x: dict | None) -> str:
    return f"{x['p50']:.0f}/{x['max']:.0f}" if x else "-"


# ------------------------------------------------------------------ plot
def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sm = res["summary"]
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    for s in ORDER:
        low = sm["low"].get(s)
        if low:
            xs = sorted(low)
            ax[0][0].plot(xs, [low[n]["ttft_p50"] * 1e3 for n in xs], marker="o", label=NAMES[s])
            ax[0][1].plot(xs, [low[n]["tok12_p90"] * 1e3 for n in xs], marker="o", label=NAMES[s])
            ax[0][2].plot(xs, [low[n]["itl_p50"] * 1e3 for n in xs], marker="o", label=NAMES[s])
        load = sm["load"].get(s)
        if load:
            rs = sorted(load)
            ax[1][0].plot(rs, [load[r]["goodput_rps"] for r in rs], marker="o", label=NAMES[s])
            ax[1][1].plot(rs, [load[r]["itl_p90"] * 1e3 for r in rs], marker="o", label=NAMES[s])
            ax[1][2].plot(rs, [load[r]["ttft_p90"] * 1e3 for r in rs], marker="o", label=NAMES[s])
    titles = [["low load: TTFT p50 (ms)", "low load: 1st->2nd token gap p90 (ms)", "low load: ITL p50 (ms)"],
              ["load: goodput (requests/s meeting the SLO)", "load: ITL p90 (ms)", "load: TTFT p90 (ms)"]]
    for i in range(2):
        for j in range(3):
            a = ax[i][j]
            a.set_title(titles[i][j], fontsize=10)
            a.grid(True, alpha=0.3)
            a.legend(fontsize=7)
            if i == 0:
                a.set_xscale("log", base=2)
                a.set_xlabel("prompt tokens")
            else:
                a.set_xlabel("Poisson arrival rate (requests/s)")
    ax[0][0].set_yscale("log")
    ax[1][2].set_yscale("log")
    fig.suptitle(f"SmolLM2-135M fp32, 2 cores, one core per engine: {res['date']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
