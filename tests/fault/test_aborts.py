"""Aborts are not failures, and they free blocks (synthetic engines; the vLLM side is in
test_vllm_faults.py):

- a prefill nobody will read, released by the router, frees its blocks at once (lease TTL 60 s);
- clients that go away in the middle of the handoff close it in the ledger as aborted: no handoff
  waits for its deadline and no breaker counts them, however many there are.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from chaos_helpers import pair_states
from engine_calls import request
from service_helpers import SYNTHETIC, engine_stats, wait_blocks_at_baseline

NAME = "aborts"
LEASE_TTL_S = 60


@pytest.fixture(scope="module")
def service(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.05},
        "transfer": {"failure_policy": "fail", "lease_ttl_s": LEASE_TTL_S, "read_timeout_s": 5},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    yield {"dep": dep, "cfg": cfg, "baseline": baseline}
    after = wait_blocks_at_baseline(dep, baseline)
    shutdown_deployment(NAME, keep_coordinator=True)
    for eid, s in after.items():
        assert s.free_blocks == baseline[eid].free_blocks and s.held_leases == 0, (eid, s)


def test_released_prefill_frees_its_blocks_at_once(service):
    (pid, prefill), = service["dep"].prefills.items()
    base = service["baseline"][pid].free_blocks

    async def go():
        pre = await prefill.prefill.remote(request("unread", "nobody reads this " * 8, max_tokens=8))
        held = (await prefill.stats.remote()).free_blocks
        t0 = time.monotonic()
        await prefill.abort.remote("unread")  # what the router does when the client left after token one
        return pre, held, (await prefill.stats.remote()), time.monotonic() - t0

    pre, held, after, took = asyncio.run(go())
    assert held == base - len(pre.kv_transfer_params["remote_block_ids"])
    assert after.free_blocks == base and after.held_leases == 0 and took < 1.0


def test_client_aborts_close_handoffs_and_never_count_against_the_pair(service, coordinator):
    """12 clients leave (more than the breaker threshold, 3), four at each point of a P/D request:
    after the prefill engine's token (no handoff was opened: the decode engine never heard of it),
    during the KV pull (the prefill engine's rank frozen, so the READ stays in flight: the handoff
    closes as aborted), and after a decode token (the pull had its verdict: ok)."""
    dep, cfg = service["dep"], service["cfg"]
    (pid,), (did,) = dep.prefills, dep.decodes
    router = build_router(cfg, dep)
    pair = f"{pid}->{did}"
    rank_pid = ray.get(dep.prefills[pid].stats.remote()).backend.child_pids[0]

    async def in_flight() -> int:
        return (await coordinator.transfers.remote()).in_flight

    async def go():
        before = await coordinator.transfers.remote()
        for i in range(12):
            stream = await router.open(request(f"gone{i}", "a client that leaves " * 6, max_tokens=40))
            await stream.__anext__()  # the prefill engine's token
            if i % 3 == 1:  # during the pull: the producer's rank cannot serve the READ
                os.kill(rank_pid, signal.SIGSTOP)
                try:
                    pending = asyncio.ensure_future(stream.__anext__())  # the decode engine starts pulling
                    deadline = time.monotonic() + 10
                    while not await in_flight() and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    assert await in_flight() == 1, "the handoff should be open while the READ is in flight"
                    stream.close()  # the client disconnects mid-pull
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
                    while await in_flight() and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                finally:
                    os.kill(rank_pid, signal.SIGCONT)
                continue
            if i % 3 == 2:
                await stream.__anext__()  # ... a decode token: the pull has its verdict
            stream.close()  # the client disconnects: aborts on both engines
        await router.drain()
        deadline = time.monotonic() + 10
        while await in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return before, await coordinator.transfers.remote(), await pair_states(coordinator)

    before, after, states = asyncio.run(go())
    delta = {k: after.verdicts[k] - before.verdicts[k] for k in after.verdicts}
    assert after.in_flight == 0  # closed now, not at their deadline
    assert delta == {"ok": 4, "failed": 0, "expired": 0, "aborted": 4}, delta
    assert getattr(states.get(pair), "failures", 0) == 0, states.get(pair)  # no abort counted against it
    assert router.pool.counters["aborted"] == 12
