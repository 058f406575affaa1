"""kill -9 a real vLLM engine (SmolLM2): the prefill EngineActor's process dies, and its vLLM engine core
stops with it, before the next incarnation could reap it: Ray 2.60's raylet SIGKILLs the dead worker's
process group within milliseconds, and the core also watches its parent (actors.engine.vllm.parent_death,
for when the raylet cannot: it died too, or its process-group cleanup is off). Whichever comes first
wins, so the test asserts the outcome, not the stopper. Ray restarts the actor; the new incarnation starts vLLM again,
registers with the coordinator (a new generation, a fresh handshake) and the deployment serves P/D
again, with no command from the test."""

from __future__ import annotations

import asyncio
import glob
import os
import time

import psutil
import pytest
import ray

from serving.config import DeploymentConfig, load_config
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router
from serving.cluster.ray_init import ray_logs_dir

from chaos_helpers import generation, kill_tree, wait_generation
from engine_calls import collect, request

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "vllm-restart"


def _said_in_engine_logs(text: str) -> bool:
    for path in glob.glob(os.path.join(ray_logs_dir(), "worker-*.err")):
        with open(path, errors="replace") as f:
            if text in f.read():
                return True
    return False


def test_killed_vllm_engine_restarts_rejoins_and_serves_pd(coordinator):
    base = load_config("configs/local-pd.yaml").model_dump(mode="json")
    base.update(name=NAME, max_model_len=1024, restarts={"max_restarts": 2})
    for group in ("prefill", "decode"):
        base[group]["num_cpus"] = 0
    cfg = DeploymentConfig.from_dict(base)
    dep = launch(cfg)
    try:
        router = build_router(cfg, dep)
        (pid_, prefill), (did, decode) = next(iter(dep.prefills.items())), next(iter(dep.decodes.items()))

        async def answer(rid):
            stream = await router.open(request(rid, "The capital of France is", max_tokens=8))
            chunks = [c async for c in stream]
            return stream.route, chunks

        async def go():
            route, chunks = await answer("before")
            assert route.path == "pd" and chunks[-1].finish_reason == "length"
            stale_req = request("stale", "The capital of France is", max_tokens=8)
            stale = await prefill.prefill.remote(stale_req)  # a handoff the kill leaves unread
            stats = await prefill.stats.remote()
            orphans = [psutil.Process(p) for p in stats.backend.child_pids]
            vllm_pids = [p.pid for p in orphans if p.name().startswith("VLLM::")]  # not multiprocessing's tracker
            gen = await generation(coordinator, pid_)
            pulls = (await decode.stats.remote()).backend.counters["kv_pulls"]
            t0 = time.monotonic()
            kill_tree([stats.pid])  # the actor only: its engine core loses its parent
            gone, _ = psutil.wait_procs(orphans, timeout=30)
            stopped_s = time.monotonic() - t0
            new_gen = await wait_generation(coordinator, pid_, gen, timeout_s=400)
            back_s = time.monotonic() - t0
            left = [p.pid for p in orphans if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            new = await prefill.stats.remote()
            deadline = time.monotonic() + 60  # its pairs reopen through a probe after the cooldown
            while True:
                route, chunks = await answer(f"after-{time.monotonic_ns()}")
                if route.path == "pd" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            after = await decode.stats.remote()
            # its block ids name the killed incarnation's memory: never read from the new one
            stale_chunks = await collect(decode, stale.continuation(stale_req))
            return back_s, gen, new_gen, left, stats, new, route, chunks, pulls, after, stale_chunks, stopped_s, vllm_pids

        back_s, gen, new_gen, left, old, new, route, chunks, pulls, after, stale_chunks, stopped_s, vllm_pids = \
            asyncio.run(go())
        print(f"SmolLM2 prefill engine's vLLM processes gone {stopped_s:.1f} s after kill -9 of its actor; "
              f"back and registered {back_s:.0f} s after it")
        reaped = _said_in_engine_logs(f"{pid_}: reaped")  # the new incarnation's fallback (orphans.reap_previous)
        assert (vllm_pids != [], reaped) == (True, False)  # gone with the actor: no reaper was needed
        assert new_gen > gen and new.restarted and new.pid != old.pid
        assert left == [], f"orphaned engine-core processes of the killed incarnation: {left}"
        assert route.path == "pd" and route.prefill_id == pid_  # P/D again, through the restarted engine
        assert chunks[-1].finish_reason == "length" and not any(c.recomputed or c.failed for c in chunks)
        assert after.backend.counters["kv_pulls"] > pulls and after.recomputed == 0
        # refused before any READ (remote_incarnation), the prompt recomputed (policy: recompute)
        assert stale_chunks[0].recomputed and stale_chunks[-1].finish_reason == "length"
    finally:
        shutdown_deployment(NAME, keep_coordinator=True)
