"""The engine -> ingress hop alone, priced per token (issue 30 item 2: decide the hop by measurement).

Two Ray actors stand in for an EngineActor (producer) and the ingress replica (consumer), on this
host's cores. The producer paces like a decoding engine: every `--step-ms` it emits one `TokenChunk`
(raypd's own type) to each of `--streams` streams; a stream ends after `--tokens` tokens. The consumer
reads every stream to its end, as the ingress does. Hops compared, in alternating order per round:

  ray-items   today's hop: the consumer calls the producer's async generator with
              num_returns="streaming" and awaits one Ray object per chunk (what EngineStream does);
  zmq-side    the Ray call stays as the control (it returns when the stream ends, errors and
              cancellation as today), the chunks travel as msgpack frames over one ZMQ PUSH socket
              per producer to a PULL socket per consumer, demultiplexed by request id.

Printed per hop: CPU per token (ms; /proc utime+stime of producer, consumer, raylet and GCS over the
phase), and the hop's latency (producer's send -> consumer's receive, CLOCK_MONOTONIC of this host)
p50/p99 over every token. Usage: python benchmarks/token_hop.py [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import msgpack
import psutil
import ray
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.protocol.request import TokenChunk  # noqa: E402
from serving.bench.provenance import git_state, header_line  # noqa: E402

HOPS = ("ray-items", "zmq-side")


def _chunk(req_id: str, i: int, last: bool) -> TokenChunk:
    return TokenChunk(req_id, (1000 + i,), f" tok{i}", finished=last, finish_reason="length" if last else None,
                      num_prompt_tokens=512, stamps=(("sent", time.monotonic()),))


@ray.remote(num_cpus=0)
class Producer:
    """Emits the chunks of all its streams once per step, as one engine's decode steps do."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self._ctx = zmq.asyncio.Context()
        self._push: dict[str, zmq.asyncio.Socket] = {}

    def pid(self) -> int:
        return os.getpid()

    async def _steps(self, tokens: int):
        for i in range(tokens):
            await asyncio.sleep(self.step_s)
            yield i, i == tokens - 1

    async def stream(self, req_id: str, tokens: int):
        async for i, last in self._steps(tokens):
            yield _chunk(req_id, i, last)

    async def stream_to(self, req_id: str, tokens: int, address: str) -> int:
        sock = self._push.get(address)
        if sock is None:
            sock = self._push[address] = self._ctx.socket(zmq.PUSH)
            sock.connect(address)
        async for i, last in self._steps(tokens):
            c = _chunk(req_id, i, last)
            await sock.send(msgpack.packb((req_id, c.token_ids, c.text, c.finished, c.finish_reason,
                                           c.num_prompt_tokens, c.stamps[0][1])))
        return tokens


@ray.remote(num_cpus=0)
class Consumer:
    """Reads streams to their end; returns each token's hop latency (s)."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    def pid(self) -> int:
        return os.getpid()

    async def _read(self) -> None:
        while True:
            req_id, *rest = msgpack.unpackb(await self._pull.recv())
            self._queues[req_id].put_nowait(rest)

    async def ray_items(self, producer, req_id: str, tokens: int) -> list[float]:
        lat = []
        async for ref in producer.stream.options(num_returns="streaming").remote(req_id, tokens):
            chunk: TokenChunk = await ref
            lat.append(time.monotonic() - chunk.stamps[0][1])
        return lat

    async def zmq_side(self, producer, req_id: str, tokens: int) -> list[float]:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        queue = self._queues[req_id] = asyncio.Queue()
        call = producer.stream_to.remote(req_id, tokens, self.address)
        lat = []
        try:
            while True:
                token_ids, text, finished, reason, n_prompt, sent = await queue.get()
                TokenChunk(req_id, tuple(token_ids), text, finished, reason, n_prompt)  # what the router gets
                lat.append(time.monotonic() - sent)
                if finished:
                    break
            await call  # the control call's verdict (errors surface here)
        finally:
            del self._queues[req_id]
        return lat

    async def run(self, producer, hop: str, streams: int, tokens: int, waves: int) -> list[float]:
        one = self.ray_items if hop == "ray-items" else self.zmq_side
        lat: list[float] = []
        for w in range(waves):
            for got in await asyncio.gather(*(one(producer, f"{hop}-{w}-{s}", tokens) for s in range(streams))):
                lat.extend(got)
        return lat


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _ray_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] in ("raylet", "gcs_server")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=4, help="batches of --streams concurrent streams per phase")
    ap.add_argument("--step-ms", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    load_before = [round(x, 2) for x in os.getloadavg()]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    producer, consumer = Producer.remote(args.step_ms / 1000), Consumer.remote()
    pids = {"producer": ray.get(producer.pid.remote()), "consumer": ray.get(consumer.pid.remote())}
    ray_pids = _ray_pids()
    ray.get(consumer.run.remote(producer, "ray-items", 2, 8, 1))  # warm both paths
    ray.get(consumer.run.remote(producer, "zmq-side", 2, 8, 1))
    order = [h for r in range(args.rounds) for h in (HOPS if r % 2 == 0 else HOPS[::-1])]
    per: dict[str, dict[str, float]] = {h: {"producer": 0.0, "consumer": 0.0, "ray": 0.0, "tokens": 0} for h in HOPS}
    lat: dict[str, list[float]] = {h: [] for h in HOPS}
    for hop in order:
        before = {k: _cpu_s([p]) for k, p in pids.items()} | {"ray": _cpu_s(ray_pids)}
        got = ray.get(consumer.run.remote(producer, hop, args.streams, args.tokens, args.waves))
        after = {k: _cpu_s([p]) for k, p in pids.items()} | {"ray": _cpu_s(ray_pids)}
        for k in before:
            per[hop][k] += after[k] - before[k]
        per[hop]["tokens"] += len(got)
        lat[hop].extend(got)

    lines = [f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; command: {' '.join(sys.argv)}", header_line(git_state(ROOT)),
             f"host: {os.cpu_count()} CPUs, load average before {load_before}", f"{args.streams} streams x {args.tokens} tokens, {args.waves} waves per phase, "
             f"one chunk per stream every {args.step_ms:g} ms, {args.rounds} rounds in order {' '.join(order)}",
             f"{'hop':<10} {'tokens':>7} {'producer':>9} {'consumer':>9} {'raylet+gcs':>11} {'total':>7}"
             f" {'latency p50':>12} {'p99':>7}  (CPU ms per token; latency ms)"]
    totals = {}
    for hop in HOPS:
        p, n = per[hop], per[hop]["tokens"]
        totals[hop] = (p["producer"] + p["consumer"] + p["ray"]) / n * 1e3
        q = statistics.quantiles(lat[hop], n=100)
        lines.append(f"{hop:<10} {n:>7} {p['producer'] / n * 1e3:>9.3f} {p['consumer'] / n * 1e3:>9.3f}"
                     f" {p['ray'] / n * 1e3:>11.3f} {totals[hop]:>7.3f} {q[49] * 1e3:>12.2f} {q[98] * 1e3:>7.2f}")
    lines.append(f"zmq-side / ray-items CPU per token: {totals['zmq-side'] / totals['ray-items']:.2f}x "
                 f"({totals['ray-items'] - totals['zmq-side']:.3f} ms saved per token)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)
    ray.shutdown()


if __name__ == "__main__":
    main()
