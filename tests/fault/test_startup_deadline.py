"""A restart that hangs before it registers (synthetic engines, real Ray actors): the coordinator
probes registered incarnations only, so a restarted engine frozen while it starts is nobody's to
probe. The coordinator's start-up deadline finds it:

kill -9 a prefill engine's process tree; Ray restarts its actor, and the new process is SIGSTOPped
while it starts (`synthetic.start_delay_s` holds it before it registers). No registration comes
within `restarts.startup_deadline_s`, so the coordinator kills the actor for a restart
(ray.kill, no_restart=False), counts it (`startup_timeouts` in its control stats, a
`startup_timeout` event with the reason) and waits for the next incarnation, which registers by
itself and is healthy, with no command from the test. The frozen process is gone.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import ray

from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig

from chaos_helpers import (actor_row, freeze_tree, generation, kill_tree, process_tree, restarted_pid, running,
                           wait_generation)
from service_helpers import SYNTHETIC

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

NAME = "startup-deadline"
START_DELAY_S = 3.0  # every start of these engines pauses this long before it registers
DEADLINE_S = 15.0  # a restart must register within this (a start takes START_DELAY_S + its ranks)


def test_a_restart_frozen_before_it_registers_is_killed_and_restarted_again(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "synthetic": {**SYNTHETIC["synthetic"], "start_delay_s": START_DELAY_S},
        "restarts": {"max_restarts": 5, "probe_interval_s": 1.0, "startup_deadline_s": DEADLINE_S},
    })
    dep = launch(cfg)
    (eid, prefill), = dep.prefills.items()
    frozen: list[int] = []
    try:
        async def go():
            gen = await generation(coordinator, eid)
            restarts0 = actor_row(eid)["NumRestarts"]
            tree = await process_tree(prefill)
            kill_tree(tree)  # kill -9: the coordinator's watch fails, Ray restarts the actor
            t0 = time.monotonic()
            pid = await restarted_pid(eid, tree[0], timeout_s=60)
            frozen.extend(freeze_tree([pid]))  # starting, not registered: no probe can reach it
            registered = {e.engine_id for e in await coordinator.engines.remote()}
            assert eid not in registered, "registered before the freeze: raise START_DELAY_S"
            back = await wait_generation(coordinator, eid, gen, timeout_s=DEADLINE_S + 90)
            return gen, back, time.monotonic() - t0, pid, restarts0

        gen, back, took, pid, restarts0 = asyncio.run(go())
        stats = ray.get(coordinator.control_stats.remote(), timeout=30)
        events = [e for e in ray.get(coordinator.recent_events.remote(1000), timeout=30)
                  if e["engine_id"] == eid and e["event"] == "startup_timeout"]
        healthy = ray.get(prefill.check_health.remote(), timeout=60)
        restarts = actor_row(eid)["NumRestarts"]
        still_running = running(pid, timeout_s=20)
    finally:
        kill_tree(frozen, signal.SIGCONT)  # whatever is left of it (killed by the coordinator by now)
        shutdown_deployment(NAME, keep_coordinator=True)
    print(f"{eid}: generation {gen} -> {back} {took:.1f} s after the kill; restarts {restarts0} -> "
          f"{restarts}; start-up timeouts {stats.startup_timeouts}; events {events}")
    assert back > gen and healthy
    assert took >= DEADLINE_S - 1  # not back before its deadline: the frozen restart was waited for
    assert stats.startup_timeouts.get(eid, 0) >= 1 and eid not in stats.startups_awaited
    assert events and "start-up deadline" in events[0]["reason"], events
    assert restarts >= restarts0 + 2  # the kill -9's restart, and the coordinator's
    assert not still_running, f"the frozen incarnation (pid {pid}) is still there"


def test_a_frozen_restart_is_still_awaited_after_the_coordinator_restarts(coordinator):
    """As above, and the coordinator is killed too right after the freeze: Ray restarts it empty (its
    pending starts were in memory), the other engine registers again, and once settled the restarted
    coordinator re-derives the pending start from Ray (the engine actor it has that did not register)
    and kills the frozen restart at the deadline, counted from its own return."""
    name = NAME + "-coordinator"
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": name,
        "synthetic": {**SYNTHETIC["synthetic"], "start_delay_s": START_DELAY_S},
        "restarts": {"max_restarts": 5, "probe_interval_s": 1.0, "startup_deadline_s": DEADLINE_S},
    })
    dep = launch(cfg)
    (eid, prefill), = dep.prefills.items()
    frozen: list[int] = []
    try:
        async def go():
            tree = await process_tree(prefill)
            kill_tree(tree)  # kill -9: Ray restarts the engine actor
            pid = await restarted_pid(eid, tree[0], timeout_s=60)
            frozen.extend(freeze_tree([pid]))  # starting, not registered
            kill_tree([await coordinator.pid.remote()])  # Ray restarts the coordinator, empty
            t0 = time.monotonic()
            while True:  # back: as the launcher configured the first incarnation (its options are Ray's)
                try:
                    await coordinator.configure.remote(probe_interval_s=1.0, startup_deadline_s=DEADLINE_S)
                    break
                except ray.exceptions.RayError:
                    await asyncio.sleep(0.1)
            while eid not in {e.engine_id for e in await coordinator.engines.remote()}:
                assert time.monotonic() - t0 < DEADLINE_S + 90, f"{eid} never registered again"
                await asyncio.sleep(0.1)
            return time.monotonic() - t0, pid

        took, pid = asyncio.run(go())
        stats = ray.get(coordinator.control_stats.remote(), timeout=30)
        events = [e for e in ray.get(coordinator.recent_events.remote(1000), timeout=30)
                  if e["engine_id"] == eid and e["event"] == "startup_timeout"]
        still_running = running(pid, timeout_s=20)
    finally:
        kill_tree(frozen, signal.SIGCONT)
        shutdown_deployment(name, keep_coordinator=True)
    print(f"{eid}: registered with the restarted coordinator {took:.1f} s after it was killed; events {events}")
    assert took >= DEADLINE_S - 1  # the frozen restart was waited for, then killed
    assert events and "coordinator restarted" in events[0]["reason"], events
    assert stats.startup_timeouts.get(eid, 0) >= 1 and eid not in stats.startups_awaited
    assert not still_running, f"the frozen incarnation (pid {pid}) is still there"
