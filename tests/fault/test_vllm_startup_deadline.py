"""A vLLM engine whose restart hangs while it starts (a tiny random Llama, one role-flexible engine):
the coordinator's start-up deadline, derived from the start time measured on this host, finds it.

kill -9 the engine's process tree (its actor and vLLM's engine core); Ray restarts the actor, and the
new process is SIGSTOPped while it builds its vLLM engine (before it registers: no probe can reach
it). The deadline is not the 1200 s fallback: with no `restarts.startup_deadline_s`, it is
`startup_deadline_factor` x the longest start an engine reported when it registered (at least
`startup_deadline_floor_s`). Past it, the coordinator kills the frozen actor for a restart (counted,
a `startup_timeout` event naming the deadline), and the next incarnation registers by itself and
answers. The frozen process is gone. The synthetic version: tests/fault/test_startup_deadline.py.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import ray

from actors.models.tiny_llama import build_tiny_llama
from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig

from chaos_helpers import (actor_row, freeze_tree, generation, kill_tree, process_tree, restarted_pid, running,
                           wait_generation)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "vllm-startup-deadline"
FACTOR = 2.0  # x the longest measured start: the restart after the kill must fit in it (not frozen)
FLOOR_S = 5.0  # the test's own floor (the default, 120 s, would make the test wait 2 minutes)
SWEEP_S = 1.0  # restarts.probe_interval_s: how often the coordinator checks the deadlines


def test_a_vllm_restart_frozen_while_it_starts_is_killed_at_the_measured_deadline(coordinator, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-startup", seed=5, progress=None)
    cfg = DeploymentConfig.from_dict({
        "name": NAME, "backend": "vllm", "model": str(model), "max_model_len": 256,
        "engine_kwargs": {"enforce_eager": True},  # CPU: no torch.compile, short starts
        "both": {"count": 1, "num_cpus": 0, "block_size": 32, "cpu_bind": ["0"]},
        "restarts": {"max_restarts": 5, "probe_interval_s": SWEEP_S, "startup_deadline_factor": FACTOR,
                     "startup_deadline_floor_s": FLOOR_S},
    })
    dep = launch(cfg)
    (eid, engine), = dep.decodes.items()
    frozen: list[int] = []
    try:
        async def go():
            stats0 = await coordinator.control_stats.remote()
            gen = await generation(coordinator, eid)
            restarts0 = actor_row(eid)["NumRestarts"]
            tree = await process_tree(engine)
            t_kill = time.time()
            kill_tree(tree)  # kill -9: the coordinator's watch fails, Ray restarts the actor
            pid = await restarted_pid(eid, tree[0], timeout_s=60)
            frozen.extend(freeze_tree([pid]))  # building its vLLM engine, not registered: no probe reaches it
            assert eid not in {e.engine_id for e in await coordinator.engines.remote()}, "registered before the freeze"
            back = await wait_generation(coordinator, eid, gen, timeout_s=stats0.startup_deadline_s * 3 + 60)
            return stats0, gen, back, t_kill, pid, restarts0

        stats0, gen, back, t_kill, pid, restarts0 = asyncio.run(go())
        stats = ray.get(coordinator.control_stats.remote(), timeout=30)
        events = [e for e in ray.get(coordinator.recent_events.remote(1000), timeout=30)
                  if e["engine_id"] == eid and e["event"] == "startup_timeout" and e["t"] >= t_kill]
        healthy = ray.get(engine.check_health.remote(), timeout=60)
        restarts = actor_row(eid)["NumRestarts"]
        still_running = running(pid, timeout_s=20)
    finally:
        kill_tree(frozen, signal.SIGCONT)  # whatever is left of it (killed by the coordinator by now)
        shutdown_deployment(NAME, keep_coordinator=True)
    deadline_s = stats0.startup_deadline_s
    killed_after_s = events[0]["t"] - t_kill if events else None
    print(f"{eid}: longest measured start {stats0.measured_start_s:.1f} s -> start-up deadline {deadline_s:.1f} s; "
          f"the frozen restart was killed {killed_after_s} s after the kill -9; generation {gen} -> {back}; "
          f"restarts {restarts0} -> {restarts}; events {events}")
    assert deadline_s == max(FLOOR_S, FACTOR * stats0.measured_start_s) < 1200  # derived, not the fallback
    assert events and f"start-up deadline {deadline_s:.0f} s" in events[0]["reason"], events
    # killed at its deadline, no later than the next sweep (which probes the registered engines first: up to
    # restarts.probe_timeout_s, 10 s)
    assert deadline_s - 1 <= killed_after_s <= deadline_s + SWEEP_S + 10 + 5
    assert back > gen and healthy  # the next incarnation registered by itself and is healthy
    assert stats.startup_timeouts.get(eid, 0) >= 1 and eid not in stats.startups_awaited
    assert restarts >= restarts0 + 2  # the kill -9's restart, and the coordinator's
    assert not still_running, f"the frozen incarnation (pid {pid}) is still there"
