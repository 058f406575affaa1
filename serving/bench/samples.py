"""What every `raypd bench` mode measures with: samples, percentiles, a closed loop, the results writer.

  Sample / summarize   one request's timings -> a concurrency level's percentiles,
                       throughput and goodput (`LevelResult`);
  closed_loop          C workers back to back until N calls were made;
  write_results        JSON + a .txt table under a header of the command and the host's state
                       (`host_state`: what else the machine was doing).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.bench.provenance import git_state, header_line

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar "
         "papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Sample:
    ok: bool
    ttft: float = float("nan")
    e2e: float = float("nan")
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    text: str = ""

    def usage(self, usage: dict) -> None:
        """The usage the server reports with the last event."""
        self.output_tokens = usage.get("completion_tokens", self.output_tokens)

    @property
    def mean_itl(self) -> float:
        return sum(self.itls) / len(self.itls) if self.itls else 0.0


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    ttft_ms: dict
    itl_ms: dict
    e2e_ms: dict
    req_per_s: float
    output_tok_per_s: float
    goodput_req_per_s: float
    first_error: str | None = None


def summarize(concurrency: int, samples: list[Sample], wall_s: float, slo_ttft_s: float,
              slo_itl_s: float) -> LevelResult:
    ok = [s for s in samples if s.ok]

    def pct(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1000, 3) for q in (50, 90, 99)}

    good = [s for s in ok if s.ttft <= slo_ttft_s and s.mean_itl <= slo_itl_s]
    errors = [s for s in samples if not s.ok]
    return LevelResult(
        concurrency=concurrency, requests=len(samples), errors=len(errors), wall_s=round(wall_s, 3),
        ttft_ms=pct([s.ttft for s in ok]), itl_ms=pct([x for s in ok for x in s.itls]),
        e2e_ms=pct([s.e2e for s in ok]),
        req_per_s=round(len(ok) / wall_s, 3) if wall_s else 0.0,
        output_tok_per_s=round(sum(s.output_tokens for s in ok) / wall_s, 3) if wall_s else 0.0,
        goodput_req_per_s=round(len(good) / wall_s, 3) if wall_s else 0.0,
        first_error=errors[0].error if errors else None,
    )


def make_prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


async def closed_loop(worker: Any, concurrency: int, total: int) -> tuple[list[Any], float]:
    """`concurrency` workers call `worker(i)` back to back until `total` calls were made."""
    counter = iter(range(total))
    results: list[Any] = []

    async def loop() -> None:
        for i in counter:
            results.append(await worker(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def print_level(r: LevelResult) -> None:
    def fmt(d: dict) -> str:
        return " / ".join(f"{d[k]:8.2f}" for k in ("p50", "p90", "p99"))

    print(f"concurrency {r.concurrency:>3}: {r.requests} requests, {r.errors} errors, {r.wall_s:.2f}s"
          + (f"  (first error: {r.first_error})" if r.first_error else ""))
    print(f"  TTFT ms p50/p90/p99 {fmt(r.ttft_ms)}")
    print(f"  ITL  ms p50/p90/p99 {fmt(r.itl_ms)}")
    print(f"  e2e  ms p50/p90/p99 {fmt(r.e2e_ms)}")
    print(f"  throughput {r.req_per_s:.2f} req/s, {r.output_tok_per_s:.1f} output tok/s; "
          f"goodput {r.goodput_req_per_s:.2f} req/s", flush=True)


def write_results(path: str, out: dict[str, Any], table: str) -> None:
    """`out` as JSON at `path` and `table` beside it (.txt) under a header of the command, the commit
    measured and the host."""
    out.setdefault("git", git_state(Path(__file__).resolve().parents[2]))
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
    h = out["host"]
    with open(os.path.splitext(path)[0] + ".txt", "w") as fh:
        fh.write(f"# {out['command']}\n{header_line(out['git'])}\n# {out['date']}; host: {h['cpus']} CPUs, load average before "
                 f"{h['loadavg'][0]:.2f} / after {h['loadavg_after'][0]:.2f}, "
                 f"{h['memory_available_gib']} GiB available\n{table}\n")
    print(f"results written to {path} (+ .txt)")


def host_state() -> dict:
    """What else the machine was doing: the results are only as quiet as the host."""
    import os
    import platform

    import psutil

    busy = sorted(((p.info["cpu_percent"] or 0.0, (p.info["name"] or "?")) for p in psutil.process_iter(
        ["cpu_percent", "name"])), reverse=True)
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": list(os.getloadavg()), "memory_available_gib": round(psutil.virtual_memory().available / 2**30, 1),
            "processes": len(busy)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
