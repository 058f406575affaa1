#!/usr/bin/env python
"""KV pulls between two processes on one device, through raypd's own `actors/kv`, vs the device's gather and copy.

  python benchmarks/gpu_kv.py --device cuda|cpu [--tokens 1024,4096,8192] [--patterns contiguous,scattered]
      [--variants base,tp2to1,ratio2] [--reps 5] [--out DIR] [--quick]
      [--layers 32 --heads 8 --head-size 128 --dtype bfloat16 --block-size 16]   (Llama-8B's KV shape)

What runs
---------
For each variant the driver spawns two processes (no Ray; `benchmarks/gpu_kv_ranks.py`): a producer
engine whose ranks hold a filled KV cache in the HND layout (K and V planes per layer) on `--device`,
and a consumer rank with its own cache there, each wrapped as the product wraps it (`RankTransfer`
over `NixlTransport`: VRAM registrations on cuda). Handshake payloads travel over a pipe.

  base     producer tp 1 -> consumer tp 1, block 16 both sides
  tp2to1   producer tp 2 (two ranks, half the heads each) -> consumer tp 1 (every head): two READs a pull
  ratio2   producer block 16 -> consumer block 32: two remote blocks fill one local block, permuted on
           receive (`to_local_layout`, on the device)

Per (variant, tokens, pattern), `--reps` times: the producer leases the blocks (`hold`), the consumer
times `start_pull` -> `step()` until done (+ a device sync), checks every byte of every pulled block
against its own copy of the producer's cache, then times the in-process gather of the same blocks on
the same device (index_select + index_copy_ per (layer, plane), block-size permute included). The
device's copy bandwidth is one contiguous copy of the 8k-token pull's size. First handshake: the
consumer meets the producer engine `--handshake-reps` times (fetch payloads over the pipe, decode, add
the peers, connect, prepare lists), reported per peer rank.

Goals (issue 22): pull >= 0.8x the in-process gather for 4k and 8k tokens, scattered and contiguous;
every byte verified; first handshake <= 50 ms per peer rank.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_kv_ranks import Spec, blocks_for, consumer_main, producer_main  # noqa: E402
from benchmarks.gpu_kv_report import provenance, table  # noqa: E402
from benchmarks.kv_patterns import block_ids  # noqa: E402

VARIANTS = ("base", "tp2to1", "ratio2")
CALL_TIMEOUT_S = 300.0


class Pair:
    """One producer process and one consumer process, driven over a pipe."""

    def __init__(self, spec: Spec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, consumer_end = ctx.Pipe()
        to_producer, producer_end = ctx.Pipe()
        self.procs = [ctx.Process(target=producer_main, args=(producer_end, spec), daemon=True),
                      ctx.Process(target=consumer_main, args=(consumer_end, to_producer, spec), daemon=True)]
        for p in self.procs:
            p.start()

    def call(self, *msg, timeout: float = CALL_TIMEOUT_S):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{msg[0]} did not answer in {timeout:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        try:
            self.call("stop", timeout=30)
        except (RuntimeError, TimeoutError, OSError, EOFError):
            pass
        for p in self.procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)


def variant_spec(base: Spec, name: str, max_tokens: int) -> Spec:
    tp = 2 if name == "tp2to1" else 1
    local_block = base.remote_block * (2 if name == "ratio2" else 1)
    remote_pool = 2 * blocks_for(max_tokens, base.remote_block)
    return replace(base, producer_tp=tp, local_block=local_block, remote_pool=remote_pool,
                   local_pool=2 * blocks_for(max_tokens, local_block))


def run_variant(spec: Spec, name: str, args: argparse.Namespace, tokens: list[int], patterns: list[str]) -> dict:
    pair = Pair(spec)
    rows, error = [], None
    try:
        t0 = time.perf_counter()
        handshakes = pair.call("handshakes", args.handshake_reps)
        for n_tok in tokens:
            n_remote, n_local = blocks_for(n_tok, spec.remote_block), blocks_for(n_tok, spec.local_block)
            for pattern in patterns:
                reps = []
                for rep in range(args.reps):
                    seed = args.seed * 1000 + rep
                    local = block_ids(pattern, spec.local_pool, n_local, seed)[0]
                    remote = block_ids(pattern, spec.remote_pool, n_remote, seed)[1]
                    reps.append(pair.call("case", local, remote, n_tok, True))
                pull = statistics.median(r["pull_s"] for r in reps)
                gather = statistics.median(r["gather_s"] for r in reps)
                row = {"variant": name, "tokens": n_tok, "pattern": pattern, "bytes": reps[0]["bytes"],
                       "descriptors": reps[0]["descriptors"], "spans": reps[0]["spans"], "pull_s": pull,
                       "gather_s": gather, "pull_gbps": reps[0]["bytes"] / pull / 1e9,
                       "gather_gbps": reps[0]["bytes"] / gather / 1e9, "ratio_pull_over_gather": gather / pull,
                       "verified_bytes": sum(r["verified_bytes"] for r in reps),
                       "pull_all_s": [r["pull_s"] for r in reps], "gather_all_s": [r["gather_s"] for r in reps]}
                rows.append(row)
                print(f"  {name:<7} {n_tok:>5} tok {pattern:<10} pull {pull * 1e3:8.2f} ms  gather "
                      f"{gather * 1e3:8.2f} ms  ratio {gather / pull:.2f}", file=sys.stderr, flush=True)
        copy_bytes = rows[-1]["bytes"] if rows else 1 << 20
        copy_gbps = pair.call("copy_bandwidth", copy_bytes)
        stats = pair.call("stats")
        wall = time.perf_counter() - t0
    except (RuntimeError, TimeoutError, OSError, EOFError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        handshakes, copy_gbps, stats, wall = [], None, {}, None
    finally:
        pair.close()
    return {"variant": name, "spec": asdict(spec), "rows": rows, "handshakes_s_per_peer": handshakes,
            "copy_gbps": copy_gbps, "consumer_stats": stats, "wall_s": wall, "error": error}


def run(args: argparse.Namespace) -> dict:
    tokens = [int(t) for t in args.tokens.split(",") if t]
    patterns = [p for p in args.patterns.split(",") if p]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)} (have {', '.join(VARIANTS)})")
    base = Spec(device=args.device, layers=args.layers, heads=args.heads, head_size=args.head_size,
                dtype=args.dtype, remote_block=args.block_size, local_block=args.block_size, producer_tp=1,
                remote_pool=0, local_pool=0)
    started = time.monotonic()
    results = [run_variant(variant_spec(base, v, max(tokens)), v, args, tokens, patterns) for v in variants]
    return {
        "benchmark": "gpu_kv",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, "benchmarks/gpu_kv.py", *args.argv]),
        **provenance(ROOT, args.device),
        "host": {"name": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version()},
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
        "settings": {"reps": args.reps, "tokens": tokens, "patterns": patterns, "seed": args.seed},
        "variants": results,
        "wall_s": time.monotonic() - started,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", default="1024,4096,8192")
    p.add_argument("--patterns", default="contiguous,scattered", help="benchmarks/kv_patterns.py")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--handshake-reps", type=int, default=4)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a probe: base variant, 1024 tokens, contiguous, 1 rep")
    p.add_argument("--out", default=None, help="write gpu_kv.json and gpu_kv.txt into this folder")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.tokens, args.patterns, args.variants, args.reps, args.handshake_reps = "1024", "contiguous", "base", 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    res = run(args)
    text = table(res)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_kv.json").write_text(json.dumps(res, indent=2) + "\n")
        (out / "gpu_kv.txt").write_text(text + "\n")
        print(f"results written to {out}/gpu_kv.{{json,txt}}")
    failed = [v["variant"] for v in res["variants"] if v["error"]]
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
