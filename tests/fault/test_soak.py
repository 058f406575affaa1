"""Soak (bounded, loopback only): 240 concurrent streaming requests against synthetic engines.

Every response arrives exactly once, complete and correct (equal to the
colocated answer); no block or lease is stranded; engine memory stays flat.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline

pytestmark = pytest.mark.slow

NAME = "soak"
MODEL = "synthetic-tiny"
CONCURRENCY = 240
MAX_TOKENS = 6
PROMPTS = [f"soak prompt number {i} " * (1 + i % 4) for i in range(12)]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="module")
def service(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "decode": {**SYNTHETIC["decode"], "num_blocks": 2048},
        "prefill": {**SYNTHETIC["prefill"], "num_blocks": 2048},
        "transfer": {"failure_policy": "fail", "lease_ttl_s": 60, "read_timeout_s": 30},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    port = free_port()
    with UvicornThread(create_app(cfg, build_router(cfg, dep)), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "baseline": baseline}
    shutdown_deployment(NAME, keep_coordinator=True)


async def stream_one(client: httpx.AsyncClient, url: str, prompt: str, tag: int) -> tuple[int, str, int, bool]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "user": str(tag),
            "stream_options": {"include_usage": True}}
    text, tokens, done = "", 0, False
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if event.get("usage"):  # the last event: tokens the stream delivered (chunks merge engine steps)
                tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                text += choice["text"]
    return tag, text, tokens, done


async def reference(url: str) -> dict[str, str]:
    async with httpx.AsyncClient() as client:
        out = {}
        for p in PROMPTS:
            r = await client.post(url + "/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS})
            out[p] = r.json()["choices"][0]["text"]
        return out


def test_soak_concurrent_streams(service):
    url, dep = service["url"], service["dep"]
    # every process of every engine: the engine actors and their rank actors
    pids = [pid for s in ray.get([h.stats.remote() for h in dep.engines.values()])
            for pid in (s.pid, *s.backend.child_pids)]
    assert len(pids) == len(dep.engines) + 1 + 2  # prefill TP=1 + decode TP=2 rank actors
    want = asyncio.run(reference(url))

    async def round_():
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, url, PROMPTS[i % len(PROMPTS)], i)
                                          for i in range(CONCURRENCY)))

    rss = []
    for _ in range(2):
        t0 = time.monotonic()
        results = asyncio.run(round_())
        elapsed = time.monotonic() - t0
        assert sorted(tag for tag, *_ in results) == list(range(CONCURRENCY))  # none lost or duplicated
        for tag, text, tokens, done in results:
            assert done and tokens == MAX_TOKENS, (tag, tokens, done)
            assert text == want[PROMPTS[tag % len(PROMPTS)]], tag  # correct, not just complete
        after = wait_blocks_at_baseline(dep, service["baseline"], timeout_s=30)
        for eid, s in after.items():
            assert s.free_blocks == service["baseline"][eid].free_blocks, (eid, s)
            assert s.held_leases == 0, (eid, s)
        rss.append(sum(rss_mb(p) for p in pids))
        print(f"soak round: {CONCURRENCY} streams in {elapsed:.1f}s, engine RSS {rss[-1]:.0f} MB")
    assert rss[1] < rss[0] * 1.15 + 50, f"engine memory (actors and rank actors) grew: {rss}"
