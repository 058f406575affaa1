"""Ray's own processes on a serving node, two settings side by side.

Each run starts `raypd up --config configs/local.yaml` (the embedded default: two `both` engines,
one core each; `--config` another, e.g. benchmarks/configs/synthetic_both.yaml: the serving
processes alone at a GPU-class token rate) with one of the pair's two settings (`--pair`):
  profile   `RAYPD_RAY_PROFILE=serving` (raypd's default, serving/cluster/ray_profile.py) against
            `ray` (Ray's own defaults);
  haproxy   the serving profile (Serve's HAProxy mode on) against the same profile with
            `RAY_SERVE_ENABLE_HA_PROXY=0` (Serve's Python proxy relays every response);
waits until /health is ready, then reads every process of that `raypd up` tree from /proc:
  idle   --idle-s seconds with no request: % of one core per process group;
  load   --load-s seconds of --concurrency closed-loop streaming completions (--prompt-words
         words, --tokens tokens each, ignore_eos): ms of CPU per streamed token per group, the
         tokens per second and the inter-token latency p50.
The load client runs in this process, outside the measured tree. Settings alternate
(A B B A ...); the ratios (first / second) compare the runs' medians.

  python benchmarks/ray_profile.py --rounds 2 --out benchmarks/results/ray_profile.txt
  python benchmarks/ray_profile.py --pair haproxy --rounds 2 --out benchmarks/results/front_haproxy.txt
  python benchmarks/ray_profile.py --pair haproxy --config benchmarks/configs/synthetic_both.yaml \
      --concurrency 16 --rounds 2 --out benchmarks/results/front_haproxy_synthetic.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pdbench.procs import CLK_TCK, tree  # noqa: E402
from serving.bench.provenance import git_state, header_line  # noqa: E402
from serving.cluster.ray_profile import HAPROXY_PORT_ENV, PROFILE_ENV, SERVING_NODE_ENV  # noqa: E402
from serving.config import load_config  # noqa: E402

# pair -> the two settings compared: (label, environment of `raypd up`), the first one is the ratio's numerator
PAIRS: dict[str, tuple[tuple[str, dict[str, str]], tuple[str, dict[str, str]]]] = {
    "profile": (("serving", {PROFILE_ENV: "serving"}), ("ray", {PROFILE_ENV: "ray"})),
    "haproxy": (("haproxy", {PROFILE_ENV: "serving"}),
                ("serve-proxy", {PROFILE_ENV: "serving", "RAY_SERVE_ENABLE_HA_PROXY": "0"})),
}
# (group, test on (comm, cmdline)); the first match wins
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("vLLM workers", ("VLLM::Worker",)),
    ("vLLM engine cores", ("VLLM::EngineCor",)),
    ("EngineActors", ("ray::EngineActo",)),
    ("Serve replica (ingress)", ("ray::ServeRepli",)),
    ("Serve proxy", ("ray::ProxyActor",)),
    ("HAProxy (+ its manager)", ("haproxy", "ray::HAProxyMan")),
    ("Serve controller", ("ray::ServeContr",)),
    ("GCS", ("gcs_server",)),
    ("raylet", ("raylet",)),
    ("dashboard agent", ("ray::DashboardA",)),
    ("log monitor", ("log_monitor.py",)),
    ("coordinator + launcher", ("ray::Coordinato", "ray::Launcher")),
]
OTHER = "other (driver, dashboard, autoscaler monitor...)"
OUTSIDE_ENGINES = [g for g, _ in GROUPS[2:]] + [OTHER]


def group_of(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    for name, keys in GROUPS:
        if any(k == comm or k in cmd for k in keys):
            return name
    return OTHER


def ticks(pids: list[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        f = raw[raw.rindex(")") + 2:].split()
        out[pid] = int(f[11]) + int(f[12])
    return out


def cpu_by_group(root: int, window) -> tuple[dict[str, float], object]:
    """CPU seconds per group spent while `window()` runs (processes alive at both ends)."""
    pids = tree(root)
    before = ticks(pids)
    result = window()
    after = ticks(tree(root))
    seconds: dict[str, float] = {}
    for pid, t in after.items():
        if pid in before and (g := group_of(pid)):
            seconds[g] = seconds.get(g, 0.0) + (t - before[pid]) / CLK_TCK
    return seconds, result


async def _stream(client: httpx.AsyncClient, i: int, args) -> tuple[float, list[float]]:
    body = {"model": args.model, "prompt": " ".join(f"word{(i * 7 + k) % 997}" for k in range(args.prompt_words)),
            "max_tokens": args.tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    stamps: list[float] = []  # events with text (one event may carry several tokens: a lagging consumer's)
    tokens = 0
    sent = time.monotonic()
    async with client.stream("POST", args.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                stamps.append(time.monotonic())
    if tokens != args.tokens or len(stamps) < 2:
        raise RuntimeError(f"request {i}: {tokens} tokens in {len(stamps)} events with text, expected {args.tokens}")
    return sent, stamps


def load(args) -> tuple[int, list[float], list[float]]:
    """Closed-loop streams for args.load_s; (tokens streamed, each request's mean inter-token latency,
    each request's time to first token)."""
    async def run():
        tokens, gaps, ttfts = 0, [], []
        end = time.monotonic() + args.load_s
        async with httpx.AsyncClient(timeout=120) as client:
            async def worker(k: int):
                nonlocal tokens
                i = k * 100_000
                while time.monotonic() < end:
                    i += 1
                    sent, stamps = await _stream(client, i, args)
                    tokens += args.tokens
                    gaps.append((stamps[-1] - stamps[0]) / (args.tokens - 1))  # the request's mean ITL
                    ttfts.append(stamps[0] - sent)
            await asyncio.gather(*(worker(k) for k in range(args.concurrency)))
        return tokens, gaps, ttfts
    return asyncio.run(run())


def ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).json().get("ready"):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise TimeoutError(f"raypd up not ready within {timeout_s} s")


def one_run(setting: dict[str, str], args) -> dict:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    for k in [*SERVING_NODE_ENV, *HAPROXY_PORT_ENV]:
        env.pop(k, None)  # the setting alone decides them
    env.update(setting)
    up = subprocess.Popen([str(ROOT / ".venv/bin/raypd"), "up", "--config", args.config,
                           "--temp-dir", "/tmp/raypd-bench-ray"], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ready(args.url, 600)
        asyncio.run(_warm(args))
        time.sleep(args.settle_s)
        idle, _ = cpu_by_group(up.pid, lambda: time.sleep(args.idle_s))
        busy, (tokens, gaps, ttfts) = cpu_by_group(up.pid, lambda: load(args))
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    return {"idle_pct": {g: 100 * s / args.idle_s for g, s in idle.items()},
            "ms_per_token": {g: 1000 * s / tokens for g, s in busy.items()},
            "tokens_per_s": tokens / args.load_s, "itl_p50_ms": 1000 * statistics.median(gaps),  # p50 of mean ITLs
            "ttft_p50_ms": 1000 * statistics.median(ttfts)}


async def _warm(args) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(2):
            await _stream(client, -1 - i, args)


def med(runs: list[dict], key: str, group: str | None = None) -> float:
    return statistics.median(r[key].get(group, 0.0) if group else r[key] for r in runs)


def report(runs: dict[str, list[dict]], args, load_before: float, wall_s: float) -> str:
    (a_name, _), (b_name, _) = PAIRS[args.pair]
    s, r = runs[a_name], runs[b_name]
    state = git_state(ROOT)
    lines = [f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
             f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}",
             header_line(state),
             f"# host: {os.cpu_count()} CPUs; load average before {load_before:.2f} (1 min); wall {wall_s:.0f} s",
             f"raypd up --config {args.config} ({_engines_text(args.config)}); {args.rounds} round(s), "
             f"{a_name} ({_env_text(PAIRS[args.pair][0][1])}) and {b_name} ({_env_text(PAIRS[args.pair][1][1])}) "
             f"alternating; idle {args.idle_s:.0f} s; load {args.load_s:.0f} s of {args.concurrency} closed-loop "
             f"streams ({args.prompt_words}-word prompts, {args.tokens} tokens each); medians of the runs",
             "",
             f"{'process group':<50} {'idle % of a core':>24} {'ms CPU per streamed token':>30}",
             f"{'':<50} {a_name[:8]:>8} {b_name[:7]:>7} {'ratio':>7} {a_name[:10]:>10} {b_name[:9]:>9} {'ratio':>9}"]
    for g in [name for name, _ in GROUPS] + [OTHER]:
        a, b = med(s, "idle_pct", g), med(r, "idle_pct", g)
        c, d = med(s, "ms_per_token", g), med(r, "ms_per_token", g)
        lines.append(f"{g:<50} {a:8.2f} {b:7.2f} {a / b if b else 0:7.2f} {c:10.2f} {d:9.2f} {c / d if d else 0:9.2f}")
    for label, groups in (("outside the engines", OUTSIDE_ENGINES), ("everything", [n for n, _ in GROUPS] + [OTHER])):
        a = statistics.median(sum(x["idle_pct"].get(g, 0.0) for g in groups) for x in s)
        b = statistics.median(sum(x["idle_pct"].get(g, 0.0) for g in groups) for x in r)
        c = statistics.median(sum(x["ms_per_token"].get(g, 0.0) for g in groups) for x in s)
        d = statistics.median(sum(x["ms_per_token"].get(g, 0.0) for g in groups) for x in r)
        lines.append(f"{'total, ' + label:<50} {a:8.2f} {b:7.2f} {a / b:7.2f} {c:10.2f} {d:9.2f} {c / d:9.2f}")
    ts, tr = med(s, "tokens_per_s"), med(r, "tokens_per_s")
    its, itr = med(s, "itl_p50_ms"), med(r, "itl_p50_ms")
    fts, ftr = med(s, "ttft_p50_ms"), med(r, "ttft_p50_ms")
    lines += ["", f"tokens/s under load: {a_name} {ts:.1f}, {b_name} {tr:.1f} (ratio {ts / tr:.2f}); "
                  f"mean ITL per request, p50: {a_name} {its:.1f} ms, {b_name} {itr:.1f} ms (ratio {its / itr:.2f}); "
                  f"TTFT p50: {a_name} {fts:.0f} ms, {b_name} {ftr:.0f} ms (ratio {fts / ftr:.2f})", ""]
    return "\n".join(lines)


def _engines_text(path: str) -> str:
    cfg = load_config(path)
    text = f"{cfg.both.count} x both, {cfg.backend}"
    if cfg.backend == "synthetic":
        text += f", a token every {cfg.synthetic.token_latency_s * 1000:g} ms per stream"
    else:
        text += ", one core each"
    return text


def _env_text(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="profile")
    ap.add_argument("--config", default="configs/local.yaml", help="the deployment `raypd up` serves")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--load-s", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cfg = load_config(args.config)
    args.model, args.url = cfg.served_model_name, f"http://127.0.0.1:{cfg.http.port}"
    load_before, t0 = os.getloadavg()[0], time.monotonic()
    first, second = PAIRS[args.pair]
    runs: dict[str, list[dict]] = {first[0]: [], second[0]: []}
    for k in range(args.rounds):
        for name, setting in (first, second) if k % 2 == 0 else (second, first):
            res = one_run(setting, args)
            runs[name].append(res)
            print(f"{name:11} {res['tokens_per_s']:.1f} tok/s, ITL p50 {res['itl_p50_ms']:.1f} ms, "
                  f"TTFT p50 {res['ttft_p50_ms']:.0f} ms", flush=True)
    text = report(runs, args, load_before, time.monotonic() - t0)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
