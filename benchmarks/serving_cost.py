"""The serving path at GPU token rates: CPU per streamed token of each serving process (issue 55, item 5).

raypd: `raypd up` as shipped (Serve front with HAProxy, token inbox, the serving Ray profile) over two
role-flexible synthetic engines (`benchmarks/configs/synthetic_both.yaml` with `--token-latency-s`: a
token every T seconds per stream, from the engine actor itself, no model), so the only CPU spent is the
serving path's and Ray's. Each phase is a closed loop of N concurrent streaming completions (short
prompts, `--tokens` tokens each, ignore_eos), N = offered rate x T; phases run in the order of
`--rates`, then reversed (`--rounds 2`). Per phase every process of the `raypd up` tree is read with
psutil (user + system CPU) and grouped by role (`ROLES`, the process title first), and divided by the
tokens the client received; the client (this process) is reported on its own.

vLLM: `vllm.entrypoints.openai.api_server` of the embedded SmolLM2 (float32, both cores, max_num_seqs
128: pdbench's set-up (a'), `pdbench/setups.py` WideVllm) under `--vllm-concurrency` closed-loop
streams each; its API server process is reported apart from its engine core.

Saturation of one ingress replica: the phase whose achieved rate falls short of the offered one, and
per phase the rate at which the ingress replica would need a whole core (1000 / its ms per token).

  flock /tmp/ray.lock python benchmarks/serving_cost.py --out benchmarks/results/serving_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(HERE)]

from ray_profile import GROUPS, _stream  # noqa: E402
from pd_vs_vllm import ENGINE_SETTINGS  # noqa: E402
from pdbench import procs  # noqa: E402
from pdbench.colocated import merged  # noqa: E402
from pdbench.raypd_up import RaypdUp  # noqa: E402
from pdbench.setups import WideVllm  # noqa: E402
from serving.bench.provenance import git_state, header_line  # noqa: E402

# (role, markers): a marker equal to the process's comm or found in its cmdline; the first match wins.
# ray_profile's groups, with the coordinator and the launcher apart, and what this benchmark adds.
ROLES: list[tuple[str, tuple[str, ...]]] = [
    ("synthetic ranks (the engines' compute)", ("ray::SyntheticRankActor", "ray::SyntheticR")),
    ("vLLM API server", ("vllm.entrypoints.openai.api_server", "VLLM::APIServer")),
    ("coordinator", ("ray::Coordinato",)),
    ("launcher", ("ray::Launcher",)),
    *[g for g in GROUPS if g[0] != "coordinator + launcher"],
]
OTHER = "other (driver, dashboard, Ray workers...)"
ENGINE_COMPUTE = {"synthetic ranks (the engines' compute)", "vLLM engine cores", "vLLM workers"}
RELAY = ("EngineActors", "Serve replica (ingress)", "Serve proxy", "HAProxy (+ its manager)")
INGRESS = "Serve replica (ingress)"


def role_of(comm: str, cmdline: str) -> str:
    """The role of a process from its comm (15 characters) and cmdline (Ray's process title)."""
    for name, markers in ROLES:
        if any(m == comm or m in cmdline for m in markers):
            return name
    return OTHER


def concurrency_for(rate: float, token_latency_s: float) -> int:
    """Closed-loop streams that offer `rate` tokens/s when each stream gets a token every token_latency_s."""
    return max(1, round(rate * token_latency_s))


def core_limited_rate(ms_per_token: float) -> float:
    """Tokens/s at which a process costing `ms_per_token` of CPU per token needs one whole core."""
    return 1000.0 / ms_per_token if ms_per_token > 0 else float("inf")


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two samples (pid -> (role, cpu s)); a process new in `after` counts
    whole (it started inside the window), one gone from it is lost (its last seconds are not seen)."""
    out: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        base = before[pid][1] if pid in before else 0.0
        out[role] = out.get(role, 0.0) + max(0.0, cpu - base)
    return out


def sample(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) for `root` and all its descendants alive now."""
    try:
        top = psutil.Process(root)
        ps = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in ps:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (role_of(p.name(), " ".join(p.cmdline())), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


async def _closed_loop(url: str, model: str, streams: int, seconds: float, tokens: int, prompt_words: int):
    """`streams` workers, each sending the next request when its last one ended, for `seconds`."""
    ns = SimpleNamespace(url=url, model=model, tokens=tokens, prompt_words=prompt_words)
    done, errors, itls, ttfts = 0, [], [], []
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def worker(k: int) -> None:
            nonlocal done
            i = k * 1_000_000
            while time.monotonic() < end:
                i += 1
                try:
                    sent, stamps = await _stream(client, i, ns)
                except (httpx.HTTPError, RuntimeError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    await asyncio.sleep(0.2)
                    continue
                done += tokens
                itls.append((stamps[-1] - stamps[0]) / (tokens - 1))
                ttfts.append(stamps[0] - sent)
        await asyncio.gather(*(worker(k) for k in range(streams)))
    return done, errors, itls, ttfts


def phase(root: int, url: str, model: str, streams: int, args) -> dict:
    """One closed-loop window; CPU per role (the server tree) and the client's, per token received."""
    host0 = procs.host_busy_ticks()
    before, ru0, t0 = sample(root), resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    tokens, errors, itls, ttfts = asyncio.run(_closed_loop(url, model, streams, args.phase_s, args.tokens,
                                                           args.prompt_words))
    wall = time.monotonic() - t0
    after, ru1 = sample(root), resource.getrusage(resource.RUSAGE_SELF)
    host = (procs.host_busy_ticks() - host0) / procs.CLK_TCK / wall
    cpu = spent(before, after)
    client = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    per = {r: 1000 * s / tokens for r, s in cpu.items()} if tokens else {}
    return {"streams": streams, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "errors": len(errors), "first_errors": errors[:3], "ms_per_token": per,
            "core_share": {r: s / wall for r, s in cpu.items()},
            "client_ms_per_token": 1000 * client / tokens if tokens else 0.0, "client_core_share": client / wall, "host_cores": host,
            "itl_p50_ms": 1000 * statistics.median(itls) if itls else 0.0,
            "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else 0.0}


def serving_ms(run: dict) -> float:
    """CPU per token of everything but the engines' compute (synthetic ranks, vLLM engine cores/workers)."""
    return sum(v for r, v in run["ms_per_token"].items() if r not in ENGINE_COMPUTE)


def run_raypd(args, run_dir: Path) -> list[dict]:
    import yaml

    base = yaml.safe_load((ROOT / "benchmarks/configs/synthetic_both.yaml").read_text())
    cfg = merged(base, {"name": "raypd-serving-cost", "synthetic": {"token_latency_s": args.token_latency_s}})
    path = run_dir / "raypd-config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    g = RaypdUp({"raypd_config": str(path), "start_timeout_s": 300}, "", run_dir, "B")
    runs = []
    try:
        g.start()
        model = cfg["synthetic"].get("model_id", "synthetic-tiny")
        asyncio.run(_closed_loop(g.url, model, 4, 3, args.tokens, args.prompt_words))  # warm-up
        time.sleep(args.settle_s)
        order = [r for k in range(args.rounds) for r in (args.rates if k % 2 == 0 else args.rates[::-1])]
        for rate in order:
            res = phase(g.procs[0].pid, g.url, model, concurrency_for(rate, args.token_latency_s), args)
            res["offered_tokens_per_s"] = rate
            runs.append(res)
            print(f"raypd offered {rate:.0f}: {res['streams']} streams, {res['tokens_per_s']:.0f} tok/s, serving "
                  f"{serving_ms(res):.3f} ms/token, ingress {res['core_share'].get(INGRESS, 0):.2f} core, "
                  f"errors {res['errors']}", flush=True)
    finally:
        g.stop()
    return runs


def run_vllm(args, run_dir: Path) -> list[dict]:
    from actors.models.local import resolve_model

    settings = dict(ENGINE_SETTINGS, max_num_seqs=128, kv_cache_gib=args.vllm_kv_gib, start_timeout_s=600)
    g = WideVllm(settings, str(resolve_model("smollm2", progress=None)), run_dir)
    runs = []
    try:
        g.start()
        url = g.endpoints["ap"]
        asyncio.run(_closed_loop(url, "smollm2", 4, 3, 16, args.prompt_words))  # warm-up
        for n in args.vllm_concurrency:
            res = phase(g.procs[0].pid, url, "smollm2", n, args)
            runs.append(res)
            print(f"vLLM {n} streams: {res['tokens_per_s']:.0f} tok/s, API server "
                  f"{res['ms_per_token'].get('vLLM API server', 0):.3f} ms/token, errors {res['errors']}", flush=True)
    finally:
        g.stop()
    return runs


def med(runs: list[dict], key: str, sub: str | None = None) -> float:
    return statistics.median((r[key].get(sub, 0.0) if sub else r[key]) for r in runs)


def report(raypd: list[dict], vllm: list[dict], args, load_before: float, wall_s: float) -> tuple[str, dict]:
    """The table (raypd per offered rate, medians over rounds; vLLM at its highest rate) and the summary."""
    rates = list(dict.fromkeys(args.rates))
    cols = {f"raypd {r / 1000:g}k": [x for x in raypd if x["offered_tokens_per_s"] == r] for r in rates}
    best = max(vllm, key=lambda x: x["tokens_per_s"]) if vllm else None
    if best:
        cols[f"vLLM x{best['streams']}"] = [best]
    cols = {k: v for k, v in cols.items() if v}
    roles = [r for r, _ in ROLES] + [OTHER]
    w = 12
    lines = [f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
             f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}",
             header_line(git_state(ROOT)),
             f"# host: {os.cpu_count()} CPUs; load average before {load_before:.2f} (1 min); wall {wall_s:.0f} s",
             f"raypd up (benchmarks/configs/synthetic_both.yaml: 2 x both synthetic engines, num_cpus 0; Serve "
             f"front as shipped) with a token every {args.token_latency_s * 1000:g} ms per stream; closed-loop "
             f"streams = offered rate x {args.token_latency_s:g} s; {args.rounds} round(s), rates in order then "
             f"reversed; {args.phase_s:g} s per phase; medians over rounds",
             f"vLLM: api_server, SmolLM2 float32, both cores, max_num_seqs 128, streams {args.vllm_concurrency}; "
             f"shown: its highest rate. Every request: {args.prompt_words}-word prompt, {args.tokens} tokens "
             f"(ignore_eos), streamed", "",
             f"{'ms CPU per streamed token':<44}" + "".join(f"{c:>{w}}" for c in cols)]
    def row(label: str, f) -> None:
        lines.append(f"{label:<44}" + "".join(f"{f(v):>{w}.3f}" for v in cols.values()))
    for role in roles:
        if any(med(v, "ms_per_token", role) for v in cols.values()):
            row(role, lambda v, role=role: med(v, "ms_per_token", role))
    row("total outside the engines' compute", lambda v: statistics.median(serving_ms(x) for x in v))
    row("  relay: EngineActors+ingress+proxy+HAProxy",
        lambda v: statistics.median(sum(x["ms_per_token"].get(r, 0.0) for r in RELAY) for x in v))
    row("client (this process, apart)", lambda v: med(v, "client_ms_per_token"))
    lines += ["", f"{'rates and shares':<44}" + "".join(f"{c:>{w}}" for c in cols)]
    row("streams", lambda v: med(v, "streams"))
    row("offered tokens/s (streams / token latency)", lambda v: med(v, "offered_tokens_per_s") if "offered_tokens_per_s" in v[0] else 0.0)
    row("achieved tokens/s", lambda v: med(v, "tokens_per_s"))
    row("ingress replica, cores", lambda v: med(v, "core_share", INGRESS))
    row("vLLM API server, cores", lambda v: med(v, "core_share", "vLLM API server"))
    row("host busy, cores (of 2)", lambda v: med(v, "host_cores"))
    row("client, cores", lambda v: med(v, "client_core_share"))
    row("ITL p50 ms (mean per request)", lambda v: med(v, "itl_p50_ms"))
    row("TTFT p50 ms", lambda v: med(v, "ttft_p50_ms"))
    row("failed requests", lambda v: med(v, "errors"))
    summary: dict = {}
    at4 = [x for x in raypd if x["offered_tokens_per_s"] == 4000]
    if at4 and best:
        mine = statistics.median(serving_ms(x) for x in at4)
        theirs = best["ms_per_token"].get("vLLM API server", 0.0)
        summary["goal"] = {"raypd_serving_ms_at_4k": mine, "vllm_api_server_ms": theirs,
                           "vllm_tokens_per_s": best["tokens_per_s"], "ratio": mine / theirs if theirs else None,
                           "met": mine <= theirs}
        lines += ["", f"goal: raypd's serving CPU per token at 4k tokens/s <= vLLM API server's at its highest rate "
                      f"({best['tokens_per_s']:.0f} tokens/s): {mine:.3f} vs {theirs:.3f} ms, ratio "
                      f"{mine / theirs if theirs else float('nan'):.2f}: {'MET' if mine <= theirs else 'MISSED'}"]
    sat = []
    for r in rates:
        xs = [x for x in raypd if x["offered_tokens_per_s"] == r]
        if xs:
            ing = med(xs, "ms_per_token", INGRESS)
            sat.append({"offered": r, "achieved": med(xs, "tokens_per_s"), "ingress_cores": med(xs, "core_share", INGRESS),
                        "ingress_ms_per_token": ing, "ingress_core_limited_rate": core_limited_rate(ing)})
    # Even unloaded a stream gets less than 1 / token latency (the sleep's overshoot, TTFT): scale the
    # lowest rate's achieved tokens/s per stream by the streams, and call a phase short below 0.9x that.
    per_stream = sat[0]["achieved"] / concurrency_for(sat[0]["offered"], args.token_latency_s) if sat else 0.0
    for s in sat:
        s["expected"] = per_stream * concurrency_for(s["offered"], args.token_latency_s)
    short = next((s for s in sat if s["achieved"] < 0.9 * s["expected"]), None)
    summary["saturation"] = {"phases": sat, "first_short_offered": short and short["offered"],
                             "first_short_achieved": short and short["achieved"]}
    for s in sat:
        lines.append(f"one ingress replica at {s['offered']:.0f} offered: {s['achieved']:.0f} achieved "
                     f"({s['achieved'] / s['expected']:.2f}x the lowest rate's per stream), "
                     f"{s['ingress_cores']:.2f} cores, {s['ingress_ms_per_token']:.3f} ms/token -> a whole core "
                     f"at {s['ingress_core_limited_rate']:.0f} tokens/s")
    lines.append("achieved below 0.9x the lowest rate's per stream first at " + (
        f"{short['offered']:.0f} offered ({short['achieved']:.0f} achieved)" if short else "no rate measured"))
    return "\n".join(lines) + "\n", summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1000.0, 4000.0, 10000.0])
    ap.add_argument("--token-latency-s", type=float, default=0.01, help="a synthetic token every T s per stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=8)
    ap.add_argument("--vllm-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE: 128 streams fit")
    ap.add_argument("--skip", choices=["raypd", "vllm"], action="append", default=[])
    ap.add_argument("--out", type=Path, help="results .json (a .txt of the table beside it)")
    args = ap.parse_args()
    run_dir = HERE / "out" / f"serving_cost-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    load_before, t0 = os.getloadavg()[0], time.monotonic()
    raypd = run_raypd(args, run_dir) if "raypd" not in args.skip else []
    vllm = run_vllm(args, run_dir) if "vllm" not in args.skip else []
    text, summary = report(raypd, vllm, args, load_before, time.monotonic() - t0)
    print(text)
    if args.out:
        args.out.with_suffix(".txt").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"git": git_state(ROOT), "settings": {k: v for k, v in vars(args).items() if k != "out"},
             "raypd": raypd, "vllm": vllm, "summary": summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
