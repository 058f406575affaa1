"""The first-to-second-token gap of P/D through two EngineActors, at low load.

One prefill engine (core 0) and one decode engine per `--sync` value (core 1, one
measured at a time), called as the router calls them: `prefill`, then `generate`
with prompt + first token. The gap is from the prefill's answer (the first token,
streamed to the client at once) to the decode engine's first chunk (the second
token). Idle: nothing else runs; busy: one colocated stream decodes on the decode
engine meanwhile (each engine step is then a forward). The colocated inter-token
gap on the same engine is the reference. Works on older checkouts too (no `--sync`
there: PYTHONPATH=<checkout>). The table goes to stdout and, with `--out`, to that
file under a header naming the date, the command, the commit and the host load.

  python benchmarks/second_token_gap.py --model smollm2 --lengths 128,512,1024 --n 8 --sync 0,4096 \
      --out benchmarks/results/second_token_gap.txt
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import ray

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from actors.control.coordinator_actor import COORDINATOR_NAME, start_coordinator  # noqa: E402
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.protocol.request import EngineRequest, SamplingSpec  # noqa: E402
from actors.transfer_config import TransferConfig  # noqa: E402

Engine = ray.remote(EngineActor)


def engine(role, engine_id, model, bind, sync=None, max_model_len=2048):
    transfer = TransferConfig(lease_ttl_s=60, read_timeout_s=10,
                              **({} if sync is None else {"sync_load_max_tokens": sync}))
    cfg = EngineConfig(role=role, backend="vllm", engine_id=engine_id, model=model, max_model_len=max_model_len,
                       cpu={"bind": bind}, dtype="float32", num_cpus=0, transfer=transfer,
                       engine_kwargs={"enforce_eager": True})
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


def request(rid, ids, max_tokens):
    return EngineRequest(rid, SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                         prompt_token_ids=tuple(ids))


async def stream_times(actor, req):
    times = []
    async for ref in actor.generate.options(num_returns="streaming").remote(req):
        chunk = await ref
        if chunk.token_ids:
            times.append(time.perf_counter())
    return times


async def one_pd(p, d, ids, rid):
    req = request(rid, ids, 4)
    pre = await p.prefill.remote(req)
    t1 = time.perf_counter()
    times = await stream_times(d, pre.continuation(req))
    return times[0] - t1


async def busy(d, rng):
    """A colocated stream decoding on `d` (every engine step is then a forward); its id."""
    rid = f"bg{time.monotonic_ns()}"
    task = asyncio.ensure_future(stream_times(d, request(rid, [rng.randrange(1000, 40000) for _ in range(64)], 1500)))
    await asyncio.sleep(1.0)
    return rid, task


async def measure(p, ds, lengths, n, load, rng):
    """Per length: the gaps of `n` requests per decode engine (interleaved), and each engine's
    colocated inter-token gap; `load` busy: one colocated stream runs on the engine measured."""
    rows = {}
    for length in lengths:
        gaps = {s: [] for s in ds}
        itl = {s: [] for s in ds}
        for s, d in ds.items():
            bg = await busy(d, rng) if load == "busy" else None
            try:
                for i in range(n):
                    ids = [rng.randrange(1000, 40000) for _ in range(length)]
                    gaps[s].append(await one_pd(p, d, ids, f"g{s}-{length}-{i}-{time.monotonic_ns()}"))
                local = await stream_times(d, request(f"l{time.monotonic_ns()}",
                                                      [rng.randrange(1000, 40000) for _ in range(length)], 12))
                itl[s] = [b - a for a, b in zip(local[1:], local[2:])]
            finally:
                if bg is not None:
                    bg[1].cancel()
                    await d.abort.remote(bg[0])
                    await asyncio.sleep(0.5)
        for s in ds:
            rows[(s, length)] = (statistics.median(gaps[s]), statistics.mean(gaps[s]), statistics.median(itl[s]))
    return rows


def header() -> str:
    """Date, command, commit (and uncommitted files outside results/) and host load."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()
             if "benchmarks/results/" not in ln]
    return (f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n"
            f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}\n"
            f"# git: {git('rev-parse', 'HEAD')[:12] or '?'} ({git('rev-parse', '--abbrev-ref', 'HEAD')}, "
            f"{len(dirty)} uncommitted files outside results/)\n"
            f"# host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} before (1 min)\n")


async def main_async(args):
    rng = random.Random(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    syncs = [int(x) for x in args.sync.split(",")] if args.sync else [None]
    p = engine("prefill", "gap-P", args.model, "0")
    ds = {s: engine("decode", f"gap-D{s}", args.model, "1", sync=s) for s in syncs}
    await asyncio.gather(p.start.remote(), *(d.start.remote() for d in ds.values()))
    for s, d in ds.items():  # warm up: handshakes, first pulls
        for _ in range(2):
            await one_pd(p, d, [rng.randrange(1000, 40000) for _ in range(64)], f"w{s}-{time.monotonic_ns()}")
    lines = [f"model {args.model}; n={args.n} per point; gap = prefill answer -> decode's first chunk (ms)",
             f"{'sync_load_max_tokens':>20} {'load':>5} {'prompt':>6} {'gap p50':>8} {'gap mean':>8} "
             f"{'colocated ITL p50':>17} {'gap/ITL':>7}"]
    print(*lines, sep="\n")
    for load in ("idle", "busy"):
        rows = await measure(p, ds, lengths, args.n, load, rng)
        for (s, length), (p50, mean, itl) in sorted(rows.items(), key=lambda r: (str(r[0][0]), r[0][1])):
            lines.append(f"{str(s):>20} {load:>5} {length:>6} {p50 * 1e3:8.1f} {mean * 1e3:8.1f} "
                         f"{itl * 1e3:17.1f} {p50 / itl:7.2f}")
            print(lines[-1], flush=True)
    await asyncio.gather(p.shutdown.remote(), *(d.shutdown.remote() for d in ds.values()))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--sync", default="0,4096", help="sync_load_max_tokens values, one decode engine each")
    ap.add_argument("--out", default=None, help="also write the table, under a provenance header, to this file")
    args = ap.parse_args()
    head = header()
    ray.init(num_cpus=4, include_dashboard=False, namespace="raypd", _temp_dir="/tmp/raypd-ray",
             log_to_driver=False)
    coordinator = start_coordinator(max_restarts=0)  # keep the handle: it owns the actor
    ray.get(coordinator.ping.remote())
    lines = asyncio.run(main_async(args))
    ray.shutdown()
    if args.out:
        with open(args.out, "w") as f:
            f.write(head + f"# host: load average {os.getloadavg()[0]:.2f} after (1 min)\n" + "\n".join(lines) + "\n")
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
