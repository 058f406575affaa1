"""Injected failures with real Ray actors and real NIXL (synthetic engines).

Each scenario says what the caller sees and checks that nothing is stranded.
"""

import asyncio
import os
import signal
import time

import pytest
import ray

from actors.synthetic.engine import EngineShape, SyntheticEngine, TransferFailed
from actors.synthetic.rank import SyntheticModel

MODEL = SyntheticModel(model_id="fault-model", num_layers=2, num_kv_heads=2, head_size=32)
PROMPT = list(range(500, 540))


async def engines(coordinator, *specs, **kw):
    out = [SyntheticEngine(eid, role, MODEL, EngineShape(tp, block_size=8, num_blocks=64), coordinator, **kw)
           for eid, role, tp in specs]
    await asyncio.gather(*(e.start() for e in out))
    return out


async def settle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine._held and time.monotonic() < deadline:
        engine._ensure_pump()
        await asyncio.sleep(0.02)
    return engine.pool.num_free == engine.pool.num_blocks


def test_killed_prefill_rank_fails_its_transfer_in_bounded_time_and_others_keep_working(coordinator):
    async def go():
        p, p2, d = await engines(coordinator, ("kf-P", "prefill", 2), ("kf-P2", "prefill", 1), ("kf-D", "decode", 1))
        try:
            # warm up: D has handshaken with P, so the next read needs no wireup
            out = await d.decode("warm", await p.prefill("warm", PROMPT), PROMPT)
            assert out["mismatches"] == 0
            await p.wait_released("warm")
            params = await p.prefill("victim", PROMPT)
            victim = await p.ranks[0].pid.remote()
            # Frozen, its NIXL progress thread too, rank 0 cannot complete a READ: one stays in flight.
            os.kill(victim, signal.SIGSTOP)
            pull = asyncio.ensure_future(d.decode("victim", params, PROMPT, timeout_s=30))
            await asyncio.sleep(0.5)
            assert not pull.done(), "the read should still be in flight while P's rank is frozen"
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(TransferFailed) as failure:
                await pull
            elapsed = time.monotonic() - t0
            assert elapsed < 5.0, f"a dead producer must surface fast, took {elapsed:.2f}s"
            assert failure.value.invalid_block_ids
            assert d.pool.num_free == d.pool.num_blocks
            # the decode engine keeps serving other producers
            out = await d.decode("other", await p2.prefill("other", PROMPT), PROMPT)
            assert out["mismatches"] == 0 and await settle(p2)
            stats = await d.rank_stats()
            assert all(s["transport_in_flight"] == 0 for s in stats)
        finally:
            for e in (p, p2, d):
                await e.shutdown()

    asyncio.run(go())


def test_dead_engine_is_unregistered_and_a_restart_gets_a_fresh_handshake(coordinator):
    async def go():
        p, d = await engines(coordinator, ("rs-P", "prefill", 1), ("rs-D", "decode", 1))
        try:
            out = await d.decode("a", await p.prefill("a", PROMPT), PROMPT)
            assert out["mismatches"] == 0
            old_agent = (await p.rank_stats())[0]["agent"]
            ray.kill(p.ranks[0])
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                ids = {e["engine_id"] for e in await coordinator.engines.remote()}
                if "rs-P" not in ids:
                    break
                await asyncio.sleep(0.2)
            assert "rs-P" not in ids, "the coordinator must notice a dead engine"
            events = await coordinator.recent_events.remote()
            assert any(e["event"] == "removed" and e["engine_id"] == "rs-P" for e in events)
            await asyncio.sleep(0.5)  # the drop notice reaches the decode ranks
            assert (await d.rank_stats())[0]["peers"] == 0, "decode ranks must drop the dead engine's agents"
            (p_new,) = await engines(coordinator, ("rs-P", "prefill", 1))  # same id, new process
            try:
                out = await d.decode("b", await p_new.prefill("b", PROMPT), PROMPT)
                assert out["mismatches"] == 0
                assert (await p_new.rank_stats())[0]["agent"] != old_agent
                assert await settle(p_new)
            finally:
                await p_new.shutdown()
        finally:
            p.closed = True  # its rank is dead; only the decode side needs a clean shutdown
            await d.shutdown()

    asyncio.run(go())


def test_incompatible_engines_are_refused_or_never_paired(coordinator):
    async def go():
        (d,) = await engines(coordinator, ("ic-D", "decode", 2))
        other = SyntheticEngine("ic-X", "prefill", SyntheticModel(num_layers=2, num_kv_heads=2, head_size=64,
                                                                  model_id=MODEL.model_id),
                                EngineShape(1, block_size=8, num_blocks=16), coordinator)
        odd = SyntheticEngine("ic-P3", "prefill", SyntheticModel(num_layers=2, num_kv_heads=6, head_size=32,
                                                                 model_id="six-heads"),
                              EngineShape(3, block_size=8, num_blocks=16), coordinator)
        try:
            with pytest.raises(ray.exceptions.RayTaskError, match="already served with compatibility hash"):
                await other.start()
            verdicts = await odd.start()  # another model: registered, but never paired with ic-D
            assert "different model" in verdicts["ic-P3->ic-D"]
            assert "ic-P3" not in await coordinator.compatible_prefills.remote("ic-D")
            assert await coordinator.pair_verdict.remote("ic-P3", "ic-D")
        finally:
            for e in (d, other, odd):
                await e.shutdown()

    asyncio.run(go())


def test_failed_transfers_open_the_pair_breaker_in_the_ledger(coordinator):
    async def go():
        p, d = await engines(coordinator, ("br-P", "prefill", 1), ("br-D", "decode", 1))
        try:
            assert "br-P" in await coordinator.compatible_prefills.remote("br-D")
            for i in range(3):  # the default threshold
                params = await p.prefill(f"f{i}", PROMPT)
                await coordinator.open_handoff.remote(f"f{i}", "br-P", "br-D")
                params = {**params, "remote_block_ids": [10_000] * len(params["remote_block_ids"])}
                with pytest.raises(TransferFailed, match="BlockRangeError"):
                    await d.decode(f"f{i}", params, PROMPT)
                await p.abort(f"f{i}")
            deadline = time.monotonic() + 5
            while "br-P" in await coordinator.compatible_prefills.remote("br-D") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert "br-P" not in await coordinator.compatible_prefills.remote("br-D")
            state = (await coordinator.transfers.remote())["breakers"]["br-P->br-D"]
            assert state["state"] == "open"
            assert p.pool.num_free == p.pool.num_blocks and d.pool.num_free == d.pool.num_blocks
        finally:
            for e in (p, d):
                await e.shutdown()

    asyncio.run(go())
