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
import asyncio
import cProfile
import datetime as dt
import io
import json
import os
import platform
import pstats
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

from benchmarks.kv_patterns import PATTERNS, block_ids  # noqa: E402
from benchmarks.transfer_report import plot, table  # noqa: E402

NUM_LAYERS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 64, 16
RAY_TEMP = "/tmp/raypd-bench-ray"
PRODUCER, CONSUMER = "bench-P", "bench-D"


# ------------------------------------------------------------------ ranks
def make_rank(engine_id: str, role: str, num_blocks: int, layout: str, seed: int | None):
    """A RankTransfer over NIXL with a [layer][plane] cache filled from `seed` (zeros if None)."""
    import torch

    from actors.kv.handshake import CompatInfo
    from actors.kv.layout import BlockLayout, CacheGeometry
    from actors.kv.rank_transfer import RankIdentity, RankTransfer
    from actors.kv.transport import NixlTransport

    lay = BlockLayout.parse(layout)
    dims = {"KV": 2, "H": NUM_HEADS, "N": BLOCK_SIZE, "D": HEAD_SIZE}
    shape = (num_blocks, *(dims[a] for a in lay.axes))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    planes = 1 if "KV" in lay.axes else 2
    cache = [[torch.zeros(shape) if gen is None else torch.empty(shape).uniform_(-1, 1, generator=gen)
              for _ in range(planes)] for _ in range(NUM_LAYERS)]
    geometry = CacheGeometry.from_tensors(cache, lay, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    compat = CompatInfo(model_id="bench-30L-3H-64D", dtype="float32", num_kv_heads=NUM_HEADS,
                        num_layers=NUM_LAYERS, head_size=HEAD_SIZE, cache_dtype="float32",
                        kv_packing="packed" if planes == 1 else "split")
    identity = RankIdentity(engine_id=engine_id, role=role, tp_rank=0, tp_size=1, block_size=BLOCK_SIZE)
    transport = NixlTransport(f"{engine_id}-{os.getpid()}-{time.monotonic_ns() % 10**6}", geometry,
                              read_timeout_s=60.0)
    return cache, RankTransfer(identity, geometry, cache, compat, transport)


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_cpu_s(tids: set[int]) -> float:
    """User + system CPU seconds of these threads of this process (gone ones count 0)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


class Producer:
    """A prefill rank whose engine loop (an asyncio pump) steps its RankTransfer while leases are held."""

    def __init__(self, num_blocks: int, layout: str, seed: int, poll_us: float):
        import torch

        torch.set_num_threads(1)
        before = thread_ids()
        self.cache, self.xfer = make_rank(PRODUCER, "prefill", num_blocks, layout, seed)
        self.agent_threads = thread_ids() - before  # started with the NIXL agent
        self.poll_s = poll_us / 1e6
        self.steps = 0
        self.released = 0
        self._pump: asyncio.Task | None = None

    async def handshake(self) -> bytes:
        return self.xfer.handshake()

    async def hold(self, req_id: str, block_ids: list[int]) -> bool:
        self.xfer.hold(req_id, block_ids, ttl_s=120.0)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _run(self) -> None:
        """Step while something is held (an idle engine is not polled)."""
        while self.xfer.needs_step:
            self.released += len(self.xfer.step().released)
            self.steps += 1
            await asyncio.sleep(self.poll_s)

    async def idle_agent_cpu(self, seconds: float) -> dict:
        """CPU of the agent's threads while nothing is held and no pump runs."""
        if self._pump is not None:
            await asyncio.wait_for(self._pump, 30)  # the last lease is released, the pump ends
        c0, t0 = thread_cpu_s(self.agent_threads), time.monotonic()
        await asyncio.sleep(seconds)
        c1, t1 = thread_cpu_s(self.agent_threads), time.monotonic()
        return {"threads": len(self.agent_threads), "cpu_s": c1 - c0, "wall_s": t1 - t0,
                "core_pct": 100 * (c1 - c0) / (t1 - t0)}

    async def shutdown(self) -> dict:
        if self._pump is not None:
            self._pump.cancel()
        huge = self.xfer.transport.huge_page_bytes
        return {"pump_steps": self.steps, "leases_released": self.released, "huge_page_bytes": huge,
                **self.xfer.shutdown()}


class Consumer:
    """A decode rank pulling from the producer; also runs the in-process baseline."""

    def __init__(self, num_blocks: int, layout: str, seed: int, producer, poll_us: float):
        import ray
        import torch

        torch.set_num_threads(1)
        self.num_blocks = num_blocks
        self.dst, self.xfer = make_rank(CONSUMER, "decode", num_blocks, layout, None)
        self.src, self.src_huge_bytes = make_src(num_blocks, layout, seed)
        self.producer = producer
        self.poll_s = poll_us / 1e6
        self.fetch_s = 0.0
        self._seq = 0

        def directory(engine_id: str, pp_rank: int, ranks: list[int]) -> list[bytes]:
            t0 = time.perf_counter()
            payload = ray.get(self.producer.handshake.remote())  # as a rank asks the coordinator
            self.fetch_s += time.perf_counter() - t0
            return [payload for _ in ranks]

        self.directory = directory

    # ------------------------------------------------------------ helpers
    def ids(self, n_blocks: int, pattern: str, seed: int) -> tuple[list[int], list[int]]:
        return block_ids(pattern, self.num_blocks, n_blocks, seed)

    def _zero(self, local_ids: list[int]) -> None:
        import torch

        idx = torch.tensor(local_ids, dtype=torch.long)
        for row in self.dst:
            for t in row:
                t.index_fill_(0, idx, 0.0)

    def verify(self, local_ids: list[int], remote_ids: list[int], layers=(0, 14, 29)) -> bool:
        import torch

        li, ri = torch.tensor(local_ids), torch.tensor(remote_ids)
        return all(torch.equal(d.index_select(0, li), s.index_select(0, ri))
                   for layer in layers for d, s in zip(self.dst[layer], self.src[layer]))

    # ------------------------------------------------------------ methods
    def first_handshake(self, reps: int) -> list[dict]:
        """Meet the producer engine `reps` times (dropped in between); times of each meeting."""
        shape = (PRODUCER, 1, 1, 1)
        out = []
        for _ in range(reps):
            self.xfer.drop_engine(PRODUCER)
            self.fetch_s = 0.0
            t0 = time.perf_counter()
            self.xfer.connect(shape, self.directory)
            total = time.perf_counter() - t0
            out.append({"total_s": total, "fetch_s": self.fetch_s, "peer_ranks": 1})
        return out

    def pull(self, n_blocks: int, pattern: str, seed: int, verify: bool, profile: bool = False) -> dict:
        import ray

        from actors.kv.pull_types import PullRequest

        local_ids, remote_ids = self.ids(n_blocks, pattern, seed)
        self._zero(local_ids)
        self._seq += 1
        req_id = f"r{self._seq}"
        ray.get(self.producer.hold.remote(req_id, remote_ids))  # the prefill's lease (not timed)
        req = PullRequest(PRODUCER, remote_ids, 1, 1, 1, local_ids, n_blocks * BLOCK_SIZE)
        prof = cProfile.Profile() if profile else None
        stats = self.xfer.transport.stats
        before, spans_before = stats.descriptors_posted, stats.spans_posted
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        self.xfer.start_pull(req_id, req, self.directory)
        t1 = time.perf_counter()
        while True:
            step = self.xfer.step()
            if req_id in step.done:
                break
            if req_id in step.failed:
                raise RuntimeError(f"pull {req_id} failed: {step.failed[req_id]}")
            if self.poll_s > 0:
                time.sleep(self.poll_s)
        t2 = time.perf_counter()
        if prof:
            prof.disable()
        ok = self.verify(local_ids, remote_ids) if verify else None
        row = {"pull_s": t2 - t0, "start_s": t1 - t0, "descs": stats.descriptors_posted - before,
               "spans": stats.spans_posted - spans_before, "verified": ok}
        if prof:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            row["profile"] = text.getvalue()
        return row

    def gather(self, n_blocks: int, pattern: str, seed: int) -> dict:
        import torch

        local_ids, remote_ids = self.ids(n_blocks, pattern, seed)
        self._zero(local_ids)
        li = torch.tensor(local_ids, dtype=torch.long)
        ri = torch.tensor(remote_ids, dtype=torch.long)
        t0 = time.perf_counter()
        for d_row, s_row in zip(self.dst, self.src):
            for d, s in zip(d_row, s_row):
                d.index_copy_(0, li, s.index_select(0, ri))
        t1 = time.perf_counter()
        nbytes = n_blocks * sum(t[0].numel() * t.element_size() for t in self.dst[0]) * NUM_LAYERS
        return {"gather_s": t1 - t0, "bytes": nbytes}

    def shutdown(self) -> dict:
        huge = self.xfer.transport.huge_page_bytes
        return {"huge_page_bytes": huge, "baseline_src_huge_page_bytes": self.src_huge_bytes, **self.xfer.shutdown()}


def make_src(num_blocks: int, layout: str, seed: int):
    """The producer's cache, rebuilt from the same seed in this process (no NIXL)."""
    import torch

    from actors.kv.layout import BlockLayout

    lay = BlockLayout.parse(layout)
    dims = {"KV": 2, "H": NUM_HEADS, "N": BLOCK_SIZE, "D": HEAD_SIZE}
    shape = (num_blocks, *(dims[a] for a in lay.axes))
    from actors.kv.hugepages import back_with_huge_pages

    gen = torch.Generator().manual_seed(seed)
    planes = 1 if "KV" in lay.axes else 2
    src = [[torch.empty(shape).uniform_(-1, 1, generator=gen) for _ in range(planes)] for _ in range(NUM_LAYERS)]
    huge = back_with_huge_pages([(t.data_ptr(), t.numel() * t.element_size()) for row in src for t in row])
    return src, huge


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
                    "gather_s": t_gather, "pull_gbps": nbytes / t_pull / 1e9, "gather_gbps": nbytes / t_gather / 1e9,
                    "ratio_pull_over_gather": t_gather / t_pull,
                    "pull_all_s": [p["pull_s"] for p in pulls], "gather_all_s": [g["gather_s"] for g in gathers],
                    "verified": True,
                })
                print(f"  {layout} {n_tok:>5} tok {pattern:<10} pull {t_pull * 1e3:8.2f} ms  gather "
                      f"{t_gather * 1e3:8.2f} ms  ratio {t_gather / t_pull:.2f}", file=sys.stderr, flush=True)
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
            "consumer": c_stats, "profiles": profiles, "rows": rows}


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
