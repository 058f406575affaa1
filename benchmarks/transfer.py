#!/usr/bin/env python
"""A KV pull as raypd runs it (RankTransfer over NIXL, two Ray actors) vs an in-process gather.

  .venv/bin/python benchmarks/transfer.py [--tokens 1024,4096,8192] [--reps 7] [--layouts HND,HCND]
      [--patterns contiguous,scattered] [--idle-s 5] [--out results.json] [--plot transfer.png] [--profile]

What runs
---------
One local Ray cluster (loopback only) with two actors, one thread each
(torch.set_num_threads(1); UCX's CMA copy is one thread). `NixlTransport`
backs the KV caches it registers with transparent huge pages; the baseline's
source copy gets the same backing, so both methods read and write the same
kind of memory (temporaries stay on normal pages):

  producer  a prefill rank: a KV cache of a realistic shape (30 layers, 3 kv
            heads, head size 64, block size 16, float32) filled with a seeded
            pattern, in each of `--layouts`: HND with K and V planes (60
            registered regions, flash-attention style) and HCND (K/V packed
            per block, vLLM's CPU backend: 30 regions),
            behind a `RankTransfer` with a `NixlTransport`. Before each pull it
            leases the request's blocks (`hold`); an asyncio pump calls
            `step()` every `--producer-poll-us` while a lease is held (lease
            polling: it releases the lease once the reader's notice landed).
            The pull itself does not wait for this pump: NIXL's progress
            thread in the producer serves the READ;
  consumer  a decode rank of the same shape: its own `RankTransfer` +
            `NixlTransport`, plus an in-process copy of the producer's cache
            (same seed) for the baseline and for checking the bytes.

Measured per case (`--reps` times, pull and gather alternating):

  pull      `RankTransfer.start_pull` -> `step()` until the request is done,
            exactly the product's path: plan lookup (prepared at handshake),
            vectorised block-id checks, descriptor indices, NIXL post (the CMA
            copy runs inside it), completion polling every
            `--consumer-poll-us`, layout post-processing;
  gather    for each of the 60 (layer, plane) tensors:
            dst.index_copy_(0, local_ids, src.index_select(0, remote_ids)).

Patterns (`benchmarks/kv_patterns.py`): `contiguous` (blocks 0..n-1 on both
sides), `scattered` (n blocks drawn uniformly from the pool on each side: the
worst case, every block its own extent) and `churned` (what vLLM's free queue
hands out after requests came and went: descending runs). The first pull of
each case is verified byte for byte (sampled layers).

First handshake: the consumer meets the producer engine `--handshake-reps`
times (dropping it in between): fetch its payload over Ray, decode it, add the
peer, connect, prepare both descriptor lists (`RankTransfer.connect`). The
first one in the process is reported on its own (it also prepares our local
list, which later handshakes reuse).

Idle agent: after the pulls, with nothing held and no pump running, the CPU
time of the threads the producer's agent started (NIXL's UCX progress thread
asleep on the worker's fd, UCX's own) is read from /proc over `--idle-s`
seconds.

Goals (issue 13): pull/gather >= 0.8 for 4k and 8k tokens, both patterns;
first handshake <= 50 ms per peer rank.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.kv_patterns import PATTERNS  # noqa: E402
from serving.bench.provenance import git_state  # noqa: E402
from benchmarks.transfer_report import plot, table  # noqa: E402

from benchmarks.transfer_ranks import BLOCK_SIZE, HEAD_SIZE, NUM_HEADS, NUM_LAYERS, Consumer, Producer  # noqa: E402

RAY_TEMP = "/tmp/raypd-bench-ray"


# ------------------------------------------------------------------ driver
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def measure_layout(ray, args, layout: str, tokens: list[int], patterns: list[str], pool: int,
                   deadline: float) -> dict:
    """One producer/consumer pair with caches in `layout`: handshakes, then every case."""
    producer = consumer = None
    rows, profiles = [], {}
    try:
        producer = ray.remote(Producer).options(num_cpus=1).remote(pool, layout, args.seed, args.producer_poll_us)
        consumer = ray.remote(Consumer).options(num_cpus=1).remote(pool, layout, args.seed, producer,
                                                                     args.consumer_poll_us)
        handshakes = ray.get(consumer.first_handshake.remote(args.handshake_reps), timeout=120)
        ray.get([consumer.set_verify.remote("off"), producer.set_verify.remote("off")], timeout=60)
        for n_tok in tokens:
            n_blocks = -(-n_tok // BLOCK_SIZE)
            for pattern in patterns:
                if time.monotonic() > deadline:
                    print(f"time budget reached, skipping {layout} {n_tok} {pattern}", file=sys.stderr)
                    continue
                pulls, gathers = [], []
                for rep in range(args.reps):
                    seed = args.seed * 1000 + rep
                    verify = rep == 0 or args.verify_all
                    prof = args.profile and rep == args.reps - 1
                    pulls.append(ray.get(consumer.pull.remote(n_blocks, pattern, seed, verify, prof), timeout=120))
                    gathers.append(ray.get(consumer.gather.remote(n_blocks, pattern, seed), timeout=120))
                    if verify and not pulls[-1]["verified"]:
                        raise RuntimeError(f"pulled bytes differ from the source ({layout}, {n_tok} tokens, {pattern})")
                    if prof:
                        profiles[f"{layout} {n_tok} {pattern}"] = pulls[-1].pop("profile")
                t_pull, t_gather = median([p["pull_s"] for p in pulls]), median([g["gather_s"] for g in gathers])
                nbytes = gathers[0]["bytes"]
                rows.append({
                    "layout": layout, "tokens": n_tok, "pattern": pattern, "blocks": n_blocks, "bytes": nbytes,
                    "descriptors": pulls[0]["descs"], "spans": pulls[0]["spans"],
                    "pull_s": t_pull, "start_pull_s": median([p["start_s"] for p in pulls]),
                    "data_s": median([p["data_s"] for p in pulls]), "confirm_s": median([p["confirm_s"] for p in pulls]),
                    "gather_s": t_gather, "pull_gbps": nbytes / t_pull / 1e9, "gather_gbps": nbytes / t_gather / 1e9,
                    "ratio_pull_over_gather": t_gather / t_pull,
                    "pull_all_s": [p["pull_s"] for p in pulls], "gather_all_s": [g["gather_s"] for g in gathers],
                    "verified": True,
                })
                print(f"  {layout} {n_tok:>5} tok {pattern:<10} pull {t_pull * 1e3:8.2f} ms  gather "
                      f"{t_gather * 1e3:8.2f} ms  ratio {t_gather / t_pull:.2f}", file=sys.stderr, flush=True)
        verify_rows = measure_verify(ray, args, producer, consumer, layout, tokens, patterns[0], deadline)
        idle = ray.get(producer.idle_agent_cpu.remote(args.idle_s), timeout=args.idle_s + 60)
        print(f"  {layout} idle agent: {idle['threads']} threads, {idle['cpu_s'] * 1e3:.0f} ms CPU in "
              f"{idle['wall_s']:.1f} s", file=sys.stderr, flush=True)
        c_stats = ray.get(consumer.shutdown.remote(), timeout=60)
        p_stats = ray.get(producer.shutdown.remote(), timeout=60)
    finally:
        for h in (consumer, producer):
            if h is not None:
                ray.kill(h)
    return {"layout": layout, "first_handshake": handshakes, "idle_agent": idle, "producer": p_stats,
            "consumer": c_stats, "profiles": profiles, "rows": rows, "verify_rows": verify_rows}


def measure_verify(ray, args, producer, consumer, layout: str, tokens: list[int], pattern: str,
                   deadline: float) -> list[dict]:
    """What `transfer.verify` costs: the same pulls with off, sample and all (producer and reader)."""
    rows = []
    for n_tok in tokens:
        n_blocks = -(-n_tok // BLOCK_SIZE)
        for mode in [m for m in args.verify.split(",") if m]:
            if time.monotonic() > deadline:
                continue
            ray.get([consumer.set_verify.remote(mode), producer.set_verify.remote(mode)], timeout=60)
            pulls = [ray.get(consumer.pull.remote(n_blocks, pattern, args.seed * 1000 + rep, rep == 0), timeout=120)
                     for rep in range(args.reps)]
            if not pulls[0]["verified"]:
                raise RuntimeError(f"pulled bytes differ from the source ({layout}, {n_tok} tokens, verify {mode})")
            row = {"layout": layout, "tokens": n_tok, "pattern": pattern, "verify": mode,
                   "checked_blocks": pulls[0]["checked"],
                   **{k: median([p[k] for p in pulls]) for k in ("pull_s", "hold_s", "confirm_s", "verify_s")}}
            rows.append(row)
            print(f"  {layout} {n_tok:>5} tok verify {mode:<6} pull {row['pull_s'] * 1e3:8.2f} ms  hold "
                  f"{row['hold_s'] * 1e3:7.2f} ms  check {row['verify_s'] * 1e3:7.2f} ms", file=sys.stderr, flush=True)
    ray.get([consumer.set_verify.remote("off"), producer.set_verify.remote("off")], timeout=60)
    return rows


def run(args: argparse.Namespace) -> dict:
    import ray

    tokens = [int(t) for t in args.tokens.split(",")]
    patterns = [p for p in args.patterns.split(",") if p]
    layouts = [x for x in args.layouts.split(",") if x]
    pool = max(args.pool_blocks, max(-(-t // BLOCK_SIZE) for t in tokens))
    started = time.monotonic()
    deadline = started + args.max_seconds
    load_before = os.getloadavg()
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=RAY_TEMP, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        per_layout = [measure_layout(ray, args, layout, tokens, patterns, pool, deadline) for layout in layouts]
    finally:
        ray.shutdown()
    return {
        "benchmark": "transfer",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable.replace(str(ROOT) + "/", ""), *sys.argv]),
        "git": git_state(ROOT),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "shape": {"layers": NUM_LAYERS, "kv_heads": NUM_HEADS, "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE,
                  "dtype": "float32", "pool_blocks": pool},
        "settings": {"reps": args.reps, "producer_poll_us": args.producer_poll_us, "idle_s": args.idle_s,
                     "consumer_poll_us": args.consumer_poll_us, "torch_threads": 1, "seed": args.seed},
        "layouts": per_layout,
        "wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096,8192", help="comma-separated token counts")
    p.add_argument("--patterns", default="contiguous,scattered,churned",
                   help=f"block patterns ({', '.join(PATTERNS)}; benchmarks/kv_patterns.py)")
    p.add_argument("--reps", type=int, default=7, help="repetitions per case (medians are reported)")
    p.add_argument("--handshake-reps", type=int, default=6, help="first handshakes measured")
    p.add_argument("--layouts", default="HND,HCND",
                   help="block layouts, one producer/consumer pair each: HND/NHD (K, V planes), HCND (vLLM CPU)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each cache (>= the largest read)")
    p.add_argument("--producer-poll-us", type=float, default=10000.0,
                   help="producer's lease-polling period while it holds leases (the pull does not wait for it)")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle spell over which the agent's threads are timed")
    p.add_argument("--consumer-poll-us", type=float, default=50.0, help="consumer's sleep between steps")
    p.add_argument("--verify-all", action="store_true", help="verify every pull (default: the first per case)")
    p.add_argument("--verify", default="off,sample,all",
                   help="transfer.verify modes measured (first pattern, every token count)")
    p.add_argument("--profile", action="store_true", help="cProfile the last pull of each case (in the JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop starting new cases after this")
    p.add_argument("--out", default=None, help="write the results JSON here (and the table next to it as .txt)")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    args = p.parse_args(argv)
    res = run(args)
    text = table(res)
    print(text)
    for part in res["layouts"]:
        for case, prof in part["profiles"].items():
            print(f"--- profile of one pull, {case}\n{prof}", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
        Path(args.out).with_suffix(".txt").write_text(text + "\n")
        print(f"results written to {args.out} (+ .txt)")
    if args.plot:
        plot(res, args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
