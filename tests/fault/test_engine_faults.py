"""Injected failures with real Ray actors and real NIXL (synthetic engines).

Each scenario says what the caller sees and checks that nothing is stranded.
"""

import asyncio
import os
import signal
import time

import pytest
import ray

from actors.engine.synthetic.engine import EngineShape, SyntheticEngine
from actors.engine.synthetic.outcomes import TransferFailed
from actors.transfer_params import TransferParams
from actors.engine.synthetic.rank import SyntheticModel

pytestmark = pytest.mark.injects_faults

MODEL = SyntheticModel(model_id="fault-model", num_layers=2, num_kv_heads=2, head_size=32)
PROMPT = list(range(500, 540))


async def engines(coordinator, *specs, **kw):
    out = [SyntheticEngine(eid, role, MODEL, EngineShape(tp, block_size=8, num_blocks=64), coordinator, **kw)
           for eid, role, tp in specs]
    await asyncio.gather(*(e.start() for e in out))
    return out


async def usable(coordinator, decode_id):
    """Prefill engines the routers may pair with `decode_id` now (compatible, breaker not open)."""
    return [r.prefill_id for r in (await coordinator.routes.remote()).decodes.get(decode_id, ())]


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
            out = await d.decode("warm", TransferParams.parse(await p.prefill("warm", PROMPT)), PROMPT)
            assert out["mismatches"] == 0
            await p.wait_released("warm")
            params = await p.prefill("victim", PROMPT)
            victim = await p.ranks[0].pid.remote()
            # Frozen, its NIXL progress thread too, rank 0 cannot complete a READ: one stays in flight.
            os.kill(victim, signal.SIGSTOP)
            pull = asyncio.ensure_future(d.decode("victim", TransferParams.parse(params), PROMPT, timeout_s=30))
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
            out = await d.decode("other", TransferParams.parse(await p2.prefill("other", PROMPT)), PROMPT)
            assert out["mismatches"] == 0 and await settle(p2)
            stats = await d.rank_stats()
            assert all(s["transport_in_flight"] == 0 for s in stats)
        finally:
            for e in (p, p2, d):
                await e.shutdown()

    asyncio.run(go())


def test_a_killed_rank_restarts_and_its_engine_rejoins_with_a_fresh_handshake(coordinator):
    async def go():
        p, d = await engines(coordinator, ("rs-P", "prefill", 1), ("rs-D", "decode", 1), read_timeout_s=5)
        try:
            out = await d.decode("a", TransferParams.parse(await p.prefill("a", PROMPT)), PROMPT)
            assert out["mismatches"] == 0
            old_agent = (await p.rank_stats())[0]["agent"]
            old_generation = {e.engine_id: e for e in await coordinator.engines.remote()}["rs-P"].generation
            held = await p.prefill("held", PROMPT)  # blocks held for a reader when the rank dies
            assert p.pool.num_free < p.pool.num_blocks
            os.kill(await p.ranks[0].pid.remote(), signal.SIGKILL)
            deadline = time.monotonic() + 30
            now = {}
            while time.monotonic() < deadline:
                now = {e.engine_id: e for e in await coordinator.engines.remote()}
                if "rs-P" in now and now["rs-P"].generation != old_generation:
                    break
                await asyncio.sleep(0.1)
            assert now["rs-P"].generation > old_generation, "the engine must rejoin as a new incarnation"
            events = [e for e in await coordinator.recent_events.remote() if e["engine_id"] == "rs-P"]
            assert any(e["event"] == "removed" and "died" in e["reason"] for e in events), events
            assert p.pool.num_free == p.pool.num_blocks  # the dead rank's held blocks were freed
            assert (await d.rank_stats())[0]["peers"] == 0, "decode ranks must drop the dead incarnation's agents"
            # the old params name the dead incarnation's lease: the new incarnation's lease board holds
            # no record of it, so the read fails closed (never KV another prompt left in those blocks)
            with pytest.raises(TransferFailed, match="no lease record"):
                await d.decode("stale", TransferParams.parse(held), PROMPT, timeout_s=15)
            out = await d.decode("b", TransferParams.parse(await p.prefill("b", PROMPT)), PROMPT)  # a fresh handshake
            assert out["mismatches"] == 0
            assert (await p.rank_stats())[0]["agent"] != old_agent
            assert await settle(p)
        finally:
            for e in (p, d):
                await e.shutdown()

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
            assert "ic-P3" not in await usable(coordinator, "ic-D")
            assert await coordinator.pair_verdict.remote("ic-P3", "ic-D")
        finally:
            for e in (d, other, odd):
                await e.shutdown()

    asyncio.run(go())


def test_failed_transfers_open_the_pair_breaker_in_the_ledger(coordinator):
    async def go():
        p, d = await engines(coordinator, ("br-P", "prefill", 1), ("br-D", "decode", 1))
        try:
            assert "br-P" in await usable(coordinator, "br-D")
            for i in range(3):  # the default threshold
                params = await p.prefill(f"f{i}", PROMPT)
                await coordinator.open_handoff.remote(f"f{i}", "br-P", "br-D")
                params = {**params, "remote_block_ids": [10_000] * len(params["remote_block_ids"])}
                with pytest.raises(TransferFailed, match="BlockRangeError"):
                    await d.decode(f"f{i}", TransferParams.parse(params), PROMPT)
                await p.abort(f"f{i}")
            deadline = time.monotonic() + 5
            while "br-P" in await usable(coordinator, "br-D") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert "br-P" not in await usable(coordinator, "br-D")
            state = {b.pair: b for b in (await coordinator.transfers.remote()).breakers}["br-P->br-D"]
            assert state.state == "open" and state.last_reason == "KV pull failed"
            assert p.pool.num_free == p.pool.num_blocks and d.pool.num_free == d.pool.num_blocks
        finally:
            for e in (p, d):
                await e.shutdown()

    asyncio.run(go())


def test_a_decode_rank_killed_between_reporting_and_the_verdict_yields_exactly_one_verdict(coordinator):
    """Decode rank 0 has read (and reported) its share, rank 1's READ is still in flight when
    rank 0 is killed: the step is salvaged (`unit_died`), the verdict completes at once, once, and
    the ledger says the salvage decided it. (The decode engine is registered without its ranks as
    liveness handles, so the rank's death does not evict it: an eviction would end the handoff too,
    and the test could not tell the two apart. Salvage exists on synthetic engines only: with vLLM a
    dead worker takes its engine core down, see README "Failure semantics".)"""

    async def go():
        (p,) = await engines(coordinator, ("sv-P", "prefill", 2))
        d = SyntheticEngine("sv-D", "decode", MODEL, EngineShape(2, block_size=8, num_blocks=64), coordinator,
                            register=False)
        await d.start()
        await coordinator.register_engine.remote("sv-D", "decode", list(d.handshakes), [])
        stopped = None
        try:
            out = await d.decode("warm", TransferParams.parse(await p.prefill("warm", PROMPT)), PROMPT)  # handshakes done
            assert out["mismatches"] == 0
            await p.wait_released("warm")
            params = await p.prefill("r", PROMPT)
            # P's rank 1 stopped: NIXL serves a READ through the holder's progress thread, so the
            # READ of D's rank 1 stays in flight while D's rank 0 reads from P's rank 0
            stopped = await p.ranks[1].pid.remote()
            os.kill(stopped, signal.SIGSTOP)
            await coordinator.open_handoff.remote("r", "sv-P", "sv-D")
            snap = await coordinator.transfers.remote()
            before, before_ended = snap.verdicts, snap.ended_by
            pull = asyncio.ensure_future(d.decode("r", TransferParams.parse(params), PROMPT, timeout_s=60))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # D's rank 0 finishes its share and reports it
                if (await coordinator.transfers.remote()).awaiting_units.get("r") == 1:
                    break  # one of D's two ranks reported; the verdict waits for the other
                await asyncio.sleep(0.01)
            assert not pull.done(), "rank 1's read must still be in flight"
            t0 = time.monotonic()
            os.kill(await d.ranks[0].pid.remote(), signal.SIGKILL)  # the rank that reported
            with pytest.raises(TransferFailed, match="died mid-pull"):
                await pull
            took = time.monotonic() - t0
            # the salvage travels in the engine's next ledger batch (fire and forget): wait for its answer
            assert await d.ledger.flush(timeout_s=10.0)
            ledger = await coordinator.transfers.remote()
            events = [e["event"] for e in await coordinator.recent_events.remote() if e["engine_id"] == "sv-D"]
            return took, before, before_ended, ledger, events
        finally:
            if stopped is not None:
                os.kill(stopped, signal.SIGCONT)
            await p.abort("r")
            for e in (p, d):
                await e.shutdown()
            await coordinator.unregister_engine.remote("sv-D", "test over")

    took, before, before_ended, ledger, events = asyncio.run(go())
    assert took < 5.0  # no waiting for a read timeout or the handoff deadline
    assert "unit_died" in events and "removed" not in events
    ended = {k: n - before_ended.get(k, 0) for k, n in ledger.ended_by.items() if n != before_ended.get(k, 0)}
    assert ended == {"salvage": 1}, ended  # decided by the salvaged step, not by an eviction
    assert ledger.in_flight == 0  # nothing left to expire later
    assert ledger.verdicts["failed"] - before["failed"] == 1 and ledger.verdicts["ok"] == before["ok"]
    assert ledger.verdicts["expired"] == before["expired"]



def test_rank_actors_follow_the_deployments_restart_bound(coordinator):
    """restarts.max_restarts reaches the rank actors (EngineConfig.max_restarts -> rank_max_restarts):
    with 0, a killed rank stays dead and its engine says it cannot serve."""

    async def go():
        (p,) = await engines(coordinator, ("rb-P", "prefill", 1), rank_max_restarts=0)
        try:
            os.kill(await p.ranks[0].pid.remote(), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while p.dead is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return p.dead
        finally:
            await p.shutdown()

    dead = asyncio.run(go())
    assert dead == "rank 0 died and was not restarted (ActorDiedError)", dead


def test_a_failed_handshake_decides_the_handoff_once_and_reaches_the_pairs_breaker(coordinator):
    """A decode engine asked to pull from a producer its ranks cannot handshake with (registered,
    but another model: an incompatible payload): the pull fails before any READ, the decode engine
    reports `handshake_failed`, and the ledger closes the open handoff with one failed verdict
    decided by the handshake, on that pair's breaker, with the reason."""

    async def go():
        (d,) = await engines(coordinator, ("hf-D", "decode", 1))
        x = SyntheticEngine("hf-X", "prefill", SyntheticModel(num_layers=2, num_kv_heads=2, head_size=32,
                                                              model_id="another-model"),
                            EngineShape(1, block_size=8, num_blocks=64), coordinator)
        try:
            verdicts = await x.start()
            assert "different model" in verdicts["hf-X->hf-D"]  # never paired by the routers...
            params = await x.prefill("h", PROMPT)
            snap = await coordinator.transfers.remote()
            await coordinator.open_handoff.remote("h", "hf-X", "hf-D")  # ... but a forged request can name it
            with pytest.raises(TransferFailed, match="HandshakeError"):
                await d.decode("h", TransferParams.parse(params), PROMPT)
            deadline = time.monotonic() + 10
            while (await coordinator.transfers.remote()).in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            after = await coordinator.transfers.remote()
            events = [e for e in await coordinator.recent_events.remote() if e["event"] == "handshake_failed"
                      and e["engine_id"] == "hf-D"]
            await x.abort("h")
            return snap, after, events, d.pool.num_free == d.pool.num_blocks
        finally:
            for e in (d, x):
                await e.shutdown()

    before, after, events, decode_free = asyncio.run(go())
    assert after.in_flight == 0
    ended = {k: n - before.ended_by.get(k, 0) for k, n in after.ended_by.items() if n != before.ended_by.get(k, 0)}
    assert ended == {"handshake": 1}, ended  # one verdict, decided by the handshake (not a report, not expiry)
    assert after.verdicts["failed"] - before.verdicts["failed"] == 1
    pair = {b.pair: b for b in after.breakers}["hf-X->hf-D"]
    assert pair.failures == 1 and pair.last_reason.startswith("handshake failed: HandshakeError"), pair
    assert len(events) == 1 and events[0]["prefill_id"] == "hf-X"
    assert decode_free  # nothing held on the decode side
