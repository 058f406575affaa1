"""CPU per streamed token of one vLLM engine on one core, three comparisons (`--pair`):
  waits   vLLM's shared-memory readers as shipped (spinning on sched_yield for 1 s after each read)
          against `RAYPD_SHM_BUSY_LOOP_S=0` (they sleep on the writer's notification;
          `actors/engine/vllm/plugin.py`);
  layout  vLLM's CPU layout (a worker process beside the engine core, driven through a shared-memory
          queue: the mp executor) against raypd's default for one-rank CPU engines (the model in
          the engine-core process: the uni executor, `actors/engine/vllm/uniproc.py`); also the
          engine's start (AsyncLLM's construction) and whether the greedy answers are the same;
  async   the uni layout with vLLM's async scheduling left to vLLM (its default: a batch queue of
          two steps) against explicitly off. On a CPU host vLLM's platform turns it off in both
          (vllm/platforms/cpu.py), so the two arms run alike: the pair measures this benchmark's noise.

Each run is a fresh process with every thread on one core (`sched_setaffinity`, inherited by
vLLM's engine core and worker, as a raypd engine's share of a 2-core box), the worker's OMP
thread bound to it (`VLLM_CPU_OMP_THREADS_BIND`) and at nice 10 (raypd's `compute_nice`), the
same model and settings as the embedded default (SmolLM2, float32, enforce_eager). It streams
`--requests` answers of `--tokens` tokens to `--prompt`-token random prompts, one at a time, and
reads each process's CPU time (/proc) over them. Set-ups alternate (A B B A ...), and the
ratios compare the runs' medians of TTFT p50, first -> second token p50, ITL p50 and CPU per token.

  python benchmarks/engine_waits.py --rounds 2 --out benchmarks/results/engine_waits.txt
  python benchmarks/engine_waits.py --pair layout --rounds 3 --out benchmarks/results/engine_layout.txt
  python benchmarks/engine_waits.py --pair async --rounds 2 --out benchmarks/results/engine_async.txt
"""

from __future__ import annotations

import argparse
import hashlib
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASYNC_ENV = "ENGINE_WAITS_ASYNC_SCHEDULING"  # "0": vLLM's async_scheduling off (this script's knob only)
# set-up -> (label, environment: None removes the variable)
SETUPS: dict[str, tuple[str, dict[str, str | None]]] = {
    "A": ("vLLM as shipped (mp, busy_loop_s 1)", {"RAYPD_SHM_BUSY_LOOP_S": None}),
    "B": ("busy_loop_s 0 (mp)", {"RAYPD_SHM_BUSY_LOOP_S": "0"}),
    "U": ("raypd's layout (uni: model in the core)", {"RAYPD_SHM_BUSY_LOOP_S": None, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "S": ("uni, async scheduling off", {"RAYPD_SHM_BUSY_LOOP_S": None, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                        ASYNC_ENV: "0"}),
}
PAIRS = {"waits": ("A", "B"), "layout": ("A", "U"), "async": ("U", "S")}


async def _measure(args: argparse.Namespace) -> dict:
    import psutil
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from actors.engine.vllm.compute_priority import lower_compute_priority
    from actors.models.local import resolve_model

    path = str(resolve_model("smollm2"))
    uni = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    t_start = time.monotonic()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, dtype="float32", max_model_len=2048,
                                                    enforce_eager=True, disable_log_stats=False,
                                                    distributed_executor_backend="uni" if uni else None,
                                                    async_scheduling=False if os.environ.get(ASYNC_ENV) == "0" else None))
    start_s = time.monotonic() - t_start
    lower_compute_priority(10)
    me, rng = psutil.Process(), random.Random(0)

    def cpu() -> dict[int, tuple[str, float]]:
        out = {me.pid: ("client (AsyncLLM)", sum(me.cpu_times()[:2]))}
        for p in me.children(recursive=True):
            try:
                title = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                out[p.pid] = ("engine core" if "EngineCore" in title else "worker" if "Worker" in title else title,
                              sum(p.cpu_times()[:2]))
            except (psutil.Error, OSError):
                pass
        return out

    def prompt() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(args.prompt)]

    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    async for _ in llm.generate({"prompt_token_ids": prompt()}, sp, "warm-up"):
        pass
    before, gaps, tokens, t0, answers = cpu(), [], 0, time.monotonic(), []
    ttfts, seconds = [], []  # per request: time to the first token, first -> second token
    for i in range(args.requests):
        last, streamed, ids, sent = None, 0, [], time.monotonic()
        async for out in llm.generate({"prompt_token_ids": prompt()}, sp, f"r{i}"):
            now = time.monotonic()
            if last is None:
                ttfts.append(now - sent)
            else:
                gaps.append(now - last)
                if len(seconds) == i:  # this request's first gap
                    seconds.append(now - last)
            last, streamed, ids = now, len(out.outputs[0].token_ids), out.outputs[0].token_ids  # cumulative
        tokens += streamed
        answers.append(list(ids))
    wall, after = time.monotonic() - t0, cpu()
    llm.shutdown()
    per_process: dict[str, float] = {}
    for pid, (name, t) in after.items():
        if pid in before:
            per_process[name] = per_process.get(name, 0.0) + 1000 * (t - before[pid][1]) / max(1, tokens)
    return {"tokens": tokens, "wall_s": wall, "itl_p50_ms": 1000 * statistics.median(gaps),
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "second_p50_ms": 1000 * statistics.median(seconds),
            "cpu_ms_per_token": per_process, "start_s": start_s,
            "answers": hashlib.sha1(repr(answers).encode()).hexdigest()}


def child(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {args.core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.core)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for key, value in SETUPS[args.child][1].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # the core computes: bound as raypd binds it
        os.environ.update(OMP_NUM_THREADS="1", OMP_PLACES=f"{{{args.core}}}", OMP_PROC_BIND="true")
    print("RESULT " + json.dumps(asyncio.run(_measure(args))), flush=True)


def run_one(setup: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", setup, "--core", str(args.core), "--requests", str(args.requests),
           "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"set-up {setup} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def report(runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    sys.path.insert(0, str(ROOT))
    from serving.bench.provenance import git_state, header_line

    load = os.getloadavg()[0]
    lines = [f"# benchmarks/engine_waits.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"load average {load:.2f} at the end",
             header_line(git_state(ROOT)),
             f"# one engine on one core (core {args.core}), SmolLM2 float32, {args.requests} requests of "
             f"{args.prompt} prompt tokens -> {args.tokens} tokens, one at a time; runs alternate "
             f"{' '.join(s for s, _ in args.order)}", ""]
    names = sorted({n for rs in runs.values() for r in rs for n in r["cpu_ms_per_token"]})
    head = (f"{'set-up':40s} {'runs':>4s} {'start s':>7s} {'TTFT p50':>8s} {'tok1->2':>7s} {'ITL p50 ms':>10s} "
            + " ".join(f"{n[:18]:>18s}" for n in names) + f" {'total':>8s}")
    lines += ["CPU per streamed token (ms), medians over runs:", head]
    med: dict[str, dict[str, float]] = {}
    for setup, rs in runs.items():
        row = {n: statistics.median(r["cpu_ms_per_token"].get(n, 0.0) for r in rs) for n in names}
        row["total"] = statistics.median(sum(r["cpu_ms_per_token"].values()) for r in rs)
        row["itl"] = statistics.median(r["itl_p50_ms"] for r in rs)
        row["ttft"] = statistics.median(r["ttft_p50_ms"] for r in rs)
        row["second"] = statistics.median(r["second_p50_ms"] for r in rs)
        row["start"] = statistics.median(r["start_s"] for r in rs)
        med[setup] = row
        lines.append(f"{SETUPS[setup][0]:40s} {len(rs):4d} {row['start']:7.1f} {row['ttft']:8.1f} "
                     f"{row['second']:7.1f} {row['itl']:10.1f} "
                     + " ".join(f"{row[n]:18.2f}" for n in names) + f" {row['total']:8.2f}")
    first, second = PAIRS[args.pair]
    a, b = med[first], med[second]
    core = next((n for n in names if n == "engine core"), None)
    same = len({r["answers"] for rs in runs.values() for r in rs}) == 1
    lines += ["", f"{SETUPS[second][0]} / {SETUPS[first][0]}:",
              f"  TTFT p50 {b['ttft'] / a['ttft']:.2f}x ({a['ttft']:.1f} -> {b['ttft']:.1f} ms), "
              f"tok1->2 p50 {b['second'] / a['second']:.2f}x, "
              f"ITL p50 {b['itl'] / a['itl']:.2f}x, CPU per token {b['total'] / a['total']:.2f}x, "
              f"start {b['start'] / a['start']:.2f}x ({a['start']:.1f} -> {b['start']:.1f} s)"
              + (f", engine core {b[core] / a[core]:.2f}x ({a[core]:.2f} -> {b[core]:.2f} ms/token)"
                 if core and args.pair == "waits" else ""),
              f"  greedy answers identical in every run: {'yes' if same else 'NO'}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="A B B A per round")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--pair", choices=sorted(PAIRS), default="waits")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    first, second = PAIRS[args.pair]
    args.order = [(s, i) for i in range(args.rounds) for s in (first, second, second, first)]
    runs: dict[str, list[dict]] = {first: [], second: []}
    for setup, _ in args.order:
        r = run_one(setup, args)
        runs[setup].append(r)
        print(f"{setup}: ITL p50 {r['itl_p50_ms']:.1f} ms, CPU/token "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items()), flush=True)
    text = report(runs, args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
