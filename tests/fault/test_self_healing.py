"""Self-healing under steady load (synthetic engines, real Ray actors, NIXL, HTTP):

kill -9 a prefill engine's process tree (its actor and its rank actors), then a decode engine's,
then the coordinator's: Ray restarts each, the engine registers a new incarnation by itself (no
command from the test), the dead engine's pairs open in the ledger and earn their traffic back
with a probe, and the clients see no error at all: prefills are retried on the other prefill
engine, pulls from the dead producer are recomputed (`recompute` policy), streams on the dead
decode engine migrate. Every answer equals the colocated reference; nothing is held at the end.
The coordinator's death is the coordinator-loss class of docs/failure-semantics.md ("Terminal outcome
per fault class"): every request overlapping its absence ends within the class's bound
(terminal_bounds.coordinator_bound_s: the request's fault-free time, the coordinator being on no
request's path).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from chaos_helpers import (
    SteadyLoad,
    deployment_placement_groups,
    generation,
    kill_tree,
    pair_states,
    process_tree,
    wait_generation,
)
from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline
from terminal_bounds import coordinator_bound_s, late

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

NAME = "heal"
MODEL = "synthetic-tiny"
MAX_TOKENS = 8
PROMPTS = [f"self healing prompt {i} " * (2 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def service(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.02},
        "prefill": {**SYNTHETIC["prefill"], "count": 2, "tp_size": 2, "block_size": 16},
        "decode": {**SYNTHETIC["decode"], "count": 2, "tp_size": 1},
        "transfer": {"failure_policy": "recompute", "lease_ttl_s": 20, "read_timeout_s": 5},
        "breaker": {"failure_threshold": 3, "cooldown_s": 3.0, "probe_window_s": 2.0},
        "router": {"migration_wait_s": 30, "placement": "disaggregate"},
        "restarts": {"max_restarts": 3},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    router = build_router(cfg, dep)
    port = free_port()
    decode = next(iter(dep.decodes.values()))

    async def references():
        return {p: "".join(c.text for c in await collect(decode, request(f"ref{i}", p, max_tokens=MAX_TOKENS)))
                for i, p in enumerate(PROMPTS)}

    want = asyncio.run(references())
    with UvicornThread(create_app(cfg, router), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "router": router, "want": want,
               "baseline": baseline, "pgs": deployment_placement_groups(NAME), "cfg": cfg}
    try:
        after = wait_blocks_at_baseline(dep, baseline, timeout_s=30)
        for eid, s in after.items():  # nothing held once the load is over, restarts included
            assert s.free_blocks == baseline[eid].free_blocks and s.held_leases == 0, (eid, s)
    finally:
        shutdown_deployment(NAME, keep_coordinator=True)


def load(service) -> SteadyLoad:
    return SteadyLoad(service["url"], MODEL, PROMPTS, MAX_TOKENS, workers=4).start()


def check_answers(service, answers) -> None:
    assert answers, "no request ran"
    errors = [a for a in answers if a.error]
    assert errors == [], errors[:3]  # retried, recomputed or migrated: never an error
    wrong = [a for a in answers if a.text != service["want"][a.prompt]]
    assert wrong == [], wrong[:3]  # and never a wrong answer


async def served_by(engine, timeout_s: float = 60.0) -> int:
    """Until `engine` (a new incarnation) served requests again; their count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = (await engine.stats.remote()).requests
        if n > 0:
            return n
        await asyncio.sleep(0.2)
    return 0


async def prefills_idle_after(prefills: dict, timeout_s: float) -> set[str]:
    """The prefill engines that served no new request within `timeout_s` from now (the load running).
    Placement may favour one engine for a while (its learned rate is better), so each gets a deadline,
    not a fixed window."""
    before = {p: (await h.stats.remote()).requests for p, h in prefills.items()}
    idle = set(prefills)
    deadline = time.monotonic() + timeout_s
    while idle and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        idle = {p for p in idle if (await prefills[p].stats.remote()).requests <= before[p]}
    return idle


def test_prefill_engine_killed_under_load(service, coordinator):
    dep = service["dep"]
    victim_id, victim = next(iter(dep.prefills.items()))

    async def go():
        steady = load(service)
        await asyncio.sleep(2.0)
        gen = await generation(coordinator, victim_id)
        opened_before = {p: b.opened_count for p, b in (await pair_states(coordinator)).items()}
        t0 = time.monotonic()
        kill_tree(await process_tree(victim))
        new_gen = await wait_generation(coordinator, victim_id, gen)
        restart_s = time.monotonic() - t0
        states = await pair_states(coordinator)
        served = await served_by(victim)  # rejoined: a probe, then traffic
        answers = await steady.stop()
        return restart_s, new_gen, gen, opened_before, states, served, answers

    restart_s, new_gen, gen, opened_before, states, served, answers = asyncio.run(go())
    print(f"prefill engine back in {restart_s:.1f}s; {len(answers)} answers during the test")
    assert new_gen > gen
    for d in dep.decodes:  # every pair of the dead engine opened at its death
        pair = f"{victim_id}->{d}"
        assert states[pair].opened_count > opened_before.get(pair, 0), states[pair]
    assert served > 0, "the restarted prefill engine never took traffic again"
    check_answers(service, answers)
    assert ray.get(victim.stats.remote()).restarted is True
    assert deployment_placement_groups(NAME) == service["pgs"]  # the restart reused its group


def test_decode_engine_killed_under_load(service, coordinator):
    dep = service["dep"]
    victim_id, victim = next(iter(dep.decodes.items()))
    router = service["router"]

    async def go():
        steady = load(service)
        await asyncio.sleep(1.0)
        gen = await generation(coordinator, victim_id)
        migrated_before = sum(router.pool.migrations.values())
        async with httpx.AsyncClient() as client:  # long streams, on both decode engines
            long = [asyncio.ensure_future(steady.one(client, PROMPTS[i % len(PROMPTS)], max_tokens=60))
                    for i in range(6)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            kill_tree(await process_tree(victim))
            await asyncio.gather(*long)
        new_gen = await wait_generation(coordinator, victim_id, gen)
        restart_s = time.monotonic() - t0
        served = await served_by(victim)
        answers = await steady.stop()
        return restart_s, new_gen > gen, sum(router.pool.migrations.values()) - migrated_before, served, answers, long

    restart_s, rejoined, migrated, served, answers, long = asyncio.run(go())
    print(f"decode engine back in {restart_s:.1f}s; {migrated} stream(s) migrated; {len(answers)} answers")
    assert rejoined and served > 0
    assert migrated >= 1  # at least one of the long streams was on it
    long_answers = [t.result() for t in long]
    assert all(a.error is None and a.finish_reason == "length" for a in long_answers), long_answers
    check_answers(service, [a for a in answers if a not in long_answers])


def test_coordinator_killed_under_load(service, coordinator):
    dep = service["dep"]

    async def go():
        steady = load(service)
        await asyncio.sleep(1.0)
        gens = {e: await generation(coordinator, e) for e in dep.engines}
        t0 = time.monotonic()
        kill_tree([await coordinator.pid.remote()])
        for e in dep.engines:  # every engine registers again with the restarted (empty) coordinator
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if e in {x.engine_id for x in await coordinator.engines.remote()}:
                        break
                except ray.exceptions.RayError:
                    pass
                await asyncio.sleep(0.1)
        back_s = time.monotonic() - t0
        registered = {x.engine_id for x in await coordinator.engines.remote()}
        idle = await prefills_idle_after(dep.prefills, timeout_s=30.0)
        answers = await steady.stop()
        return t0, back_s, registered, gens, idle, answers

    t0, back_s, registered, gens, idle, answers = asyncio.run(go())
    print(f"all engines re-registered {back_s:.1f}s after the coordinator was killed; {len(answers)} answers")
    assert registered >= set(dep.engines)
    assert idle == set()  # P/D is used again, on both prefill engines
    check_answers(service, answers)  # every answer completed ([DONE], never cut), equal to its reference
    # A terminal outcome within the coordinator-loss bound for every request overlapping its absence (from
    # the kill until every engine was registered again), measured from the kill or, for one sent later,
    # from its start: its fault-free time (the slowest answer of the same load before the kill) and at most
    # the longest coordinator call a request may wait for.
    fault_free = [a.ended - a.started for a in answers if a.ended < t0]
    assert fault_free, "no answer before the kill to measure the load's fault-free time with"
    bound_s = coordinator_bound_s(service["cfg"], max(fault_free))
    affected = {i: a for i, a in enumerate(answers) if a.ended >= t0 and a.started <= t0 + back_s}
    print(f"{len(affected)} answers overlapped the coordinator's absence; bound {bound_s:.1f} s "
          f"(slowest fault-free answer {max(fault_free):.2f} s)")
    assert affected, "no request overlapped the coordinator's absence"
    assert late({i: a.ended for i, a in affected.items()},
                {i: max(a.started, t0) for i, a in affected.items()}, bound_s) == {}, bound_s
