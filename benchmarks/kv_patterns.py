"""Which block ids a request's KV occupies, in each cache: the patterns the KV benchmarks pull.

  contiguous  blocks 0..n-1 on both sides (a fresh engine);
  scattered   n blocks drawn uniformly from the pool, in random order, on each
              side independently: the worst case (no two neighbours in both
              caches, so every block is its own extent);
  churned     what vLLM's block pool hands out after a while: its free queue
              gives blocks from the head and takes a finished request's blocks
              back at the tail in reverse order (vLLM frees tail blocks first),
              so a new request gets descending runs left by earlier requests.
              Simulated on each side independently (different seeds) with
              requests of 4-64 blocks coming and going.
"""

from __future__ import annotations

import random
from collections import deque

PATTERNS = ("contiguous", "scattered", "churned")


def churned(pool: int, n: int, seed: int, ops: int = 400) -> list[int]:
    """n block ids as vLLM's free queue would hand them out after `ops` allocations and frees."""
    if n > pool:
        raise ValueError(f"{n} blocks do not fit a pool of {pool}")
    rng = random.Random(seed)
    free: deque[int] = deque(range(pool))
    live: list[list[int]] = []
    for _ in range(ops):
        size = rng.randint(4, 64)
        if live and (rng.random() < 0.5 or len(free) < size):
            blocks = live.pop(rng.randrange(len(live)))
            free.extend(reversed(blocks))  # vLLM: tail blocks are evicted first
        elif len(free) >= size:
            live.append([free.popleft() for _ in range(size)])
    while len(free) < n:
        free.extend(reversed(live.pop(rng.randrange(len(live)))))
    return [free.popleft() for _ in range(n)]


def block_ids(pattern: str, pool: int, n: int, seed: int) -> tuple[list[int], list[int]]:
    """(local ids, remote ids) of one request of n blocks in caches of `pool` blocks."""
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    if pattern == "scattered":
        rng = random.Random(seed)
        return rng.sample(range(pool), n), rng.sample(range(pool), n)
    if pattern == "churned":
        return churned(pool, n, 2 * seed), churned(pool, n, 2 * seed + 1)
    raise ValueError(f"unknown block pattern {pattern!r} (have {', '.join(PATTERNS)})")
