"""The two Ray actors of `benchmarks/transfer.py`: a prefill rank and a decode rank, as raypd runs them.

  Producer  a `RankTransfer` + `NixlTransport` over a seeded KV cache; leases each
            request's blocks (`hold`, timed: with `verify` on it computes the
            checksums) and steps from an asyncio pump while it holds something;
  Consumer  its reader: `pull` (start_pull -> step() until done, with where the time
            went: data READ, lease confirmation, checksum check), the in-process
            `gather` baseline over a copy of the producer's cache, and handshakes.

Both are built able to checksum (`verify="all"`) and switched with `set_verify`,
so one pair measures every `transfer.verify` mode.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import os
import pstats
import time

from benchmarks.kv_patterns import block_ids

NUM_LAYERS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 64, 16
PRODUCER, CONSUMER = "bench-P", "bench-D"


# ------------------------------------------------------------------ ranks
def make_rank(engine_id: str, role: str, num_blocks: int, layout: str, seed: int | None):
    """A RankTransfer over NIXL with a [layer][plane] cache filled from `seed` (zeros if None)."""
    import torch

    from actors.kv.handshake import CompatInfo
    from actors.kv.plan.layout import BlockLayout, CacheGeometry
    from actors.kv.rank_transfer import RankIdentity, RankTransfer
    from actors.kv.nixl.nixl_transport import NixlTransport

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
    return cache, RankTransfer(identity, geometry, cache, compat, transport, verify="all")


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

    async def set_verify(self, mode: str) -> None:
        self.xfer.set_verify(mode)

    async def hold(self, req_id: str, block_ids: list[int]) -> float:
        """Lease the blocks (and checksum them, with verify on); seconds it took."""
        t0 = time.perf_counter()
        self.xfer.hold(req_id, block_ids, ttl_s=120.0)
        hold_s = time.perf_counter() - t0
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())
        return hold_s

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
    def set_verify(self, mode: str) -> None:
        self.xfer.set_verify(mode)

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

        from actors.kv.plan.pull_types import PullRequest

        local_ids, remote_ids = self.ids(n_blocks, pattern, seed)
        self._zero(local_ids)
        self._seq += 1
        req_id = f"r{self._seq}"
        hold_s = ray.get(self.producer.hold.remote(req_id, remote_ids))  # the prefill's lease (not in pull)
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
        t = self.xfer.timings[req_id]
        row = {"pull_s": t2 - t0, "start_s": t1 - t0, "descs": stats.descriptors_posted - before,
               "spans": stats.spans_posted - spans_before, "verified": ok, "hold_s": hold_s,
               "data_s": t.data_s, "confirm_s": t.confirm_s, "verify_s": t.verify_s, "checked": t.checked_blocks}
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

    from actors.kv.plan.layout import BlockLayout

    lay = BlockLayout.parse(layout)
    dims = {"KV": 2, "H": NUM_HEADS, "N": BLOCK_SIZE, "D": HEAD_SIZE}
    shape = (num_blocks, *(dims[a] for a in lay.axes))
    from actors.kv.nixl.hugepages import back_with_huge_pages

    gen = torch.Generator().manual_seed(seed)
    planes = 1 if "KV" in lay.axes else 2
    src = [[torch.empty(shape).uniform_(-1, 1, generator=gen) for _ in range(planes)] for _ in range(NUM_LAYERS)]
    huge = back_with_huge_pages([(t.data_ptr(), t.numel() * t.element_size()) for row in src for t in row])
    return src, huge
