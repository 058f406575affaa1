"""Aborts are not failures, and they free blocks (synthetic engines; the vLLM side is in
test_vllm_faults.py):

- a prefill nobody will read, released by the router, frees its blocks at once (lease TTL 60 s);
- clients that go away in the middle of the handoff close it in the ledger as aborted: no handoff
  waits for its deadline and no breaker counts them, however many there are.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import ray

from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from chaos_helpers import freeze_tree, kill_tree, pair_states
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


@pytest.mark.injects_faults  # freezes or kills an engine on purpose
def test_client_aborts_close_handoffs_and_never_count_against_the_pair(service, coordinator):
    """12 clients leave (more than the breaker threshold, 3), six at each point of a P/D request after
    its prefill (the router starts the decode call, and so the KV pull, as the prefill returns):
    during the pull (the decode engine's ranks frozen, so the pull stays in flight and has no outcome:
    the handoff closes as aborted once the engine's ranks answer its abort), and after a decode token
    (the pull had its verdict: ok). Each handoff is seen open (or decided) before the next client
    comes: the order is forced by the ledger, not by sleeps."""
    dep, cfg = service["dep"], service["cfg"]
    (pid,), (did,) = dep.prefills, dep.decodes
    router = build_router(cfg, dep)
    pair = f"{pid}->{did}"
    decode_ranks = ray.get(dep.decodes[did].stats.remote()).backend.child_pids

    async def in_flight() -> int:
        return (await coordinator.transfers.remote()).in_flight

    async def until(done, what: str, i: int) -> None:
        deadline = time.monotonic() + 10
        while not await done():
            assert time.monotonic() < deadline, f"{what} (client {i})"
            await asyncio.sleep(0.01)

    async def go():
        before = await coordinator.transfers.remote()
        for i in range(12):
            mid_pull = i % 2 == 0
            frozen = freeze_tree(decode_ranks) if mid_pull else []  # the reader's ranks: the pull stays in flight
            try:
                stream = await router.open(request(f"gone{i}", f"client {i} leaves " * 6, max_tokens=40))
                await stream.__anext__()  # the prefill engine's token
                if mid_pull:
                    await until(lambda: in_flight_is(1), "the handoff should be open while the pull is in flight", i)
                else:
                    await stream.__anext__()  # a decode token: the pull had its verdict
                stream.close()  # the client disconnects: aborts on both engines
            finally:
                kill_tree(frozen, signal.SIGCONT)  # (the engine's abort waits for its ranks' answers)
            await until(lambda: in_flight_is(0), "the handoff should close when the client leaves", i)
        await router.drain()
        return before, await coordinator.transfers.remote(), await pair_states(coordinator)

    async def in_flight_is(n: int) -> bool:
        return await in_flight() == n

    before, after, states = asyncio.run(go())
    delta = {k: after.verdicts[k] - before.verdicts[k] for k in after.verdicts}
    assert after.in_flight == 0  # closed when the client left, not at their deadline
    assert delta == {"ok": 6, "failed": 0, "expired": 0, "aborted": 6}, delta
    assert getattr(states.get(pair), "failures", 0) == 0, states.get(pair)  # no abort counted against it
    assert router.pool.counters["aborted"] == 12
