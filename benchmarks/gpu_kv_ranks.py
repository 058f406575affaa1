"""The two processes of `benchmarks/gpu_kv.py`: a producer engine's ranks and one consumer rank.

Both build their KV caches in the HND layout (a K and a V plane per layer, as
flash-attention keeps them) on `spec.device` and wrap them exactly as the
product does: `RankTransfer` over a `NixlTransport` (VRAM registrations on
cuda, DRAM on cpu). Handshake payloads travel over a multiprocessing pipe
(the product fetches them over Ray). No Ray, no vLLM.

Cache contents are a pure function of (global layer, plane, block, global
head, token, dim) (`fill`), so the consumer rebuilds the producer's cache as
its in-process source (`src`, every head) and checks every pulled byte.

  producer  owns `spec.producer_tp` ranks (heads split between them); serves
            `payloads`, `hold` (lease a request's blocks on every rank) and
            `stop`; between commands it steps its ranks while they hold
            something, as an engine's step loop would (the pull does not wait
            for it: NIXL's progress thread serves the READs);
  consumer  one rank with every head, block size `spec.local_block`; runs
            the cases the driver sends and answers with their figures.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

ENGINE = "gpu-kv-P"


@dataclass(frozen=True)
class Spec:
    device: str  # "cuda" | "cpu"
    layers: int
    heads: int  # kv heads of the model (all of them live on the consumer)
    head_size: int
    dtype: str  # "bfloat16" | "float16" | "float32"
    remote_block: int  # producer tokens per block
    local_block: int  # consumer tokens per block (a multiple: block-size ratio)
    producer_tp: int
    remote_pool: int  # blocks per producer cache
    local_pool: int
    read_timeout_s: float = 60.0


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def fill(t, layer: int, plane: int, head0: int) -> None:
    """Write the pattern of (layer, plane, block, head0 + h, token, dim) into t [B, H, N, D]."""
    import torch

    B, H, N, D = t.shape
    dev = t.device
    key = torch.arange(B, device=dev, dtype=torch.int64).view(B, 1, 1, 1) * 131071
    key = key + (head0 + torch.arange(H, device=dev, dtype=torch.int64)).view(1, H, 1, 1) * 8191
    key = key + torch.arange(N, device=dev, dtype=torch.int64).view(1, 1, N, 1) * 127
    key = key + torch.arange(D, device=dev, dtype=torch.int64).view(1, 1, 1, D) + (layer * 2 + plane) * 1000003
    key = (key * -7046029254386353131) ^ (key >> 7)  # a multiply-xor mix (wraps)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = 8 * t.element_size()
    t.view(ints).copy_(((key & ((1 << bits) - 1)) - (1 << (bits - 1))).to(ints))


def make_rank(spec: Spec, role: str, tp_rank: int, tp_size: int, heads: int, block: int, pool: int, fill_it: bool):
    import torch

    from actors.kv.handshake import CompatInfo
    from actors.kv.plan.layout import HND, CacheGeometry
    from actors.kv.rank_transfer import RankIdentity, RankTransfer
    from actors.kv.nixl.nixl_transport import NixlTransport

    dtype = _torch_dtype(spec.dtype)
    shape = (pool, heads, block, spec.head_size)
    planes = [[torch.zeros(shape, dtype=dtype, device=spec.device) for _ in range(2)] for _ in range(spec.layers)]
    if fill_it:
        for layer, row in enumerate(planes):
            for plane, t in enumerate(row):
                fill(t, layer, plane, tp_rank * heads)
    geometry = CacheGeometry.from_tensors(planes, HND, block, heads, spec.head_size)
    compat = CompatInfo(model_id="gpu-kv-llama8b-shape", dtype=spec.dtype, num_kv_heads=spec.heads,
                        num_layers=spec.layers, head_size=spec.head_size, cache_dtype=spec.dtype,
                        kv_packing="split")
    engine = ENGINE if role == "prefill" else "gpu-kv-D"
    identity = RankIdentity(engine_id=engine, role=role, tp_rank=tp_rank, tp_size=tp_size, block_size=block)
    mem = "VRAM" if spec.device.startswith("cuda") else "DRAM"
    transport = NixlTransport(f"{engine}-tp{tp_rank}-{os.getpid()}", geometry, read_timeout_s=spec.read_timeout_s,
                              mem=mem)
    return planes, RankTransfer(identity, geometry, planes, compat, transport)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _serve(conn, handlers: dict[str, Any], idle_step=None) -> None:
    """Answer (name, *args) messages with ("ok", value) / ("err", traceback) until ("stop",)."""
    while True:
        busy = idle_step is not None and idle_step()
        if not conn.poll(0.001 if busy else 0.2):
            continue
        name, *args = conn.recv()
        if name == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[name](*args)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


def producer_main(conn, spec: Spec) -> None:
    import torch

    torch.set_num_threads(1)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(0)
    heads = spec.heads // spec.producer_tp
    ranks = [make_rank(spec, "prefill", r, spec.producer_tp, heads, spec.remote_block, spec.remote_pool, True)[1]
             for r in range(spec.producer_tp)]
    _sync(spec.device)

    def hold(req_id: str, block_ids: list[int]) -> bool:
        for xfer in ranks:
            xfer.hold(req_id, block_ids, ttl_s=120.0)
        return True

    def step() -> bool:
        busy = False
        for xfer in ranks:
            if xfer.needs_step:
                xfer.step()
                busy = True
        return busy

    handlers = {"payloads": lambda tp_ranks: [ranks[r].handshake() for r in tp_ranks], "hold": hold,
                "stats": lambda: [x.stats() for x in ranks]}
    try:
        _serve(conn, handlers, idle_step=step)
    finally:
        for xfer in ranks:
            xfer.shutdown()


class Consumer:
    """The decode rank: pulls, the in-process gather of the same blocks, checks, copy bandwidth."""

    def __init__(self, spec: Spec, producer) -> None:
        import torch

        self.spec = spec
        self.ratio = spec.local_block // spec.remote_block
        self.dst, self.xfer = make_rank(spec, "decode", 0, 1, spec.heads, spec.local_block, spec.local_pool, False)
        shape = (spec.remote_pool, spec.heads, spec.remote_block, spec.head_size)
        self.src = [[torch.empty(shape, dtype=_torch_dtype(spec.dtype), device=spec.device) for _ in range(2)]
                    for _ in range(spec.layers)]
        for layer, row in enumerate(self.src):
            for plane, t in enumerate(row):
                fill(t, layer, plane, 0)
        _sync(spec.device)
        self.producer = producer
        self.seq = 0

    def _ask(self, *msg):
        self.producer.send(msg)
        status, value = self.producer.recv()
        if status != "ok":
            raise RuntimeError(f"producer: {value}")
        return value

    def directory(self, engine_id: str, pp_rank: int, ranks: list[int]) -> list[bytes]:
        return self._ask("payloads", ranks)

    @property
    def shape(self):
        return (ENGINE, self.spec.producer_tp, 1, 1)

    def handshakes(self, reps: int) -> list[float]:
        """Seconds per peer rank of `reps` first meetings (the engine dropped in between)."""
        out = []
        for _ in range(reps):
            self.xfer.drop_engine(ENGINE)
            t0 = time.perf_counter()
            self.xfer.connect(self.shape, self.directory)
            out.append((time.perf_counter() - t0) / self.spec.producer_tp)
        return out

    def _gathered(self, layer: int, plane: int, ri):
        """The remote blocks `ri` of one region as the local blocks they fill (block-size ratio)."""
        got = self.src[layer][plane].index_select(0, ri)
        if self.ratio == 1:
            return got
        s = self.spec
        k = got.shape[0] // self.ratio
        return got.view(k, self.ratio, s.heads, s.remote_block, s.head_size).transpose(1, 2).reshape(
            k, s.heads, s.local_block, s.head_size)

    def _zero(self, li) -> None:
        for row in self.dst:
            for t in row:
                t.index_fill_(0, li, 0)
        _sync(self.spec.device)

    def case(self, local_ids: list[int], remote_ids: list[int], num_tokens: int, verify: bool) -> dict:
        import torch

        from actors.kv.plan.pull_types import PullRequest

        dev = self.spec.device
        li = torch.tensor(local_ids, dtype=torch.long, device=dev)
        ri = torch.tensor(remote_ids, dtype=torch.long, device=dev)
        self.seq += 1
        req_id = f"r{self.seq}"
        self._zero(li)
        self._ask("hold", req_id, remote_ids)
        req = PullRequest(ENGINE, remote_ids, self.spec.producer_tp, 1, 1, local_ids, num_tokens)
        stats = self.xfer.transport.stats
        d0, s0 = stats.descriptors_posted, stats.spans_posted
        t0 = time.perf_counter()
        self.xfer.start_pull(req_id, req, self.directory)
        while True:
            step = self.xfer.step()
            if req_id in step.failed:
                raise RuntimeError(f"pull {req_id} failed: {step.failed[req_id]}")
            if req_id in step.done:
                break
        _sync(dev)
        pull_s = time.perf_counter() - t0
        checked = 0
        if verify:
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[self.dst[0][0].element_size()]
            for layer in range(self.spec.layers):
                for plane in range(2):
                    got = self.dst[layer][plane].index_select(0, li)
                    if not torch.equal(got.view(ints), self._gathered(layer, plane, ri).view(ints)):
                        raise RuntimeError(f"pulled bytes differ from the source (layer {layer}, plane {plane})")
                    checked += got.numel() * got.element_size()
        self._zero(li)
        t0 = time.perf_counter()
        for layer in range(self.spec.layers):
            for plane in range(2):
                self.dst[layer][plane].index_copy_(0, li, self._gathered(layer, plane, ri))
        _sync(dev)
        gather_s = time.perf_counter() - t0
        nbytes = len(remote_ids) * self.spec.layers * 2 * self.src[0][0][0].numel() * self.src[0][0].element_size()
        return {"pull_s": pull_s, "gather_s": gather_s, "bytes": nbytes, "verified_bytes": checked,
                "descriptors": stats.descriptors_posted - d0, "spans": stats.spans_posted - s0}

    def copy_bandwidth(self, nbytes: int, reps: int = 5) -> float:
        """GB/s of one contiguous device-to-device copy of `nbytes` (median of `reps`)."""
        import torch

        a = torch.empty(nbytes, dtype=torch.uint8, device=self.spec.device)
        b = torch.empty_like(a)
        a.fill_(1)
        times = []
        for _ in range(reps + 1):
            _sync(self.spec.device)
            t0 = time.perf_counter()
            b.copy_(a)
            _sync(self.spec.device)
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        return nbytes / times[len(times) // 2] / 1e9


def consumer_main(conn, producer, spec: Spec) -> None:
    import torch

    torch.set_num_threads(1)
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(0)
    consumer = None
    try:
        consumer = Consumer(spec, producer)
        handlers = {"handshakes": consumer.handshakes, "case": consumer.case,
                    "copy_bandwidth": consumer.copy_bandwidth, "stats": lambda: consumer.xfer.stats()}
        _serve(conn, handlers)
    except Exception:
        conn.send(("err", traceback.format_exc()))
    finally:
        if consumer is not None:
            consumer.xfer.shutdown()
        try:
            producer.send(("stop",))
        except (BrokenPipeError, OSError):
            pass


def blocks_for(tokens: int, block: int) -> int:
    return math.ceil(tokens / block)
