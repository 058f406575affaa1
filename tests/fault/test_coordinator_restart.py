"""Coordinator death: Ray restarts it (a fresh, empty directory) and the engines register again on
their own, because their pending `watch_registration` call failed; recreated by name works too."""

import asyncio
import os
import signal
import time

import pytest
import ray

from actors.control.coordinator_actor import start_coordinator
from actors.engine.actor import EngineActor
from actors.engine.config import EngineConfig
from engine_calls import pd, request

pytestmark = pytest.mark.injects_faults

NAME = "raypd-coordinator-restart-test"
Engine = ray.remote(EngineActor)


def engine(role, eid):
    cfg = EngineConfig(role=role, backend="synthetic", engine_id=eid, num_cpus=0, block_size=16,
                       synthetic={"model_id": "restart-model", "num_layers": 2, "num_kv_heads": 2})
    return Engine.options(num_cpus=0, max_concurrency=1000).remote(cfg.model_dump(), NAME)


async def pd_chunks(p, d, rid):
    return (await pd(p, d, request(rid, "hello there " * 4, max_tokens=4)))[1]


async def registered(coord, ids, timeout=20.0):
    deadline = time.monotonic() + timeout
    found = set()
    while time.monotonic() < deadline:
        try:
            found = {e.engine_id for e in await coord.engines.remote()}
        except ray.exceptions.RayError:
            found = set()
        if found >= ids:
            return found
        await asyncio.sleep(0.1)
    return found


def test_engines_re_register_after_the_coordinator_is_killed(ray_cluster):
    async def go():
        coord = start_coordinator(name=NAME, max_restarts=2)
        p, d = engine("prefill", "cr-P"), engine("decode", "cr-D")
        await asyncio.gather(p.start.remote(), d.start.remote())
        assert (await pd_chunks(p, d, "before"))[-1].finish_reason == "length"
        os.kill(await coord.pid.remote(), signal.SIGKILL)  # Ray restarts it: same handle, empty directory
        t0 = time.monotonic()
        assert await registered(coord, {"cr-P", "cr-D"}) >= {"cr-P", "cr-D"}
        print(f"engines re-registered {time.monotonic() - t0:.1f}s after the coordinator was killed")
        assert await coord.pair_verdict.remote("cr-P", "cr-D") is None
        chunks = await pd_chunks(p, d, "after-restart")  # the same engine processes
        assert chunks[-1].finish_reason == "length" and all(c.error is None for c in chunks)

        ray.kill(coord)  # gone for good; a new one is created under the same name
        coord = start_coordinator(name=NAME, max_restarts=0)
        assert await registered(coord, {"cr-P", "cr-D"}) >= {"cr-P", "cr-D"}
        chunks = await pd_chunks(p, d, "after-recreate")
        assert chunks[-1].finish_reason == "length" and all(c.error is None for c in chunks)
        await asyncio.gather(p.shutdown.remote(), d.shutdown.remote())
        for h in (p, d, coord):
            ray.kill(h)

    asyncio.run(go())

