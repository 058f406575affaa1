"""Coordinator restart: engines re-register on their own; service recovers without restarting engines."""

import asyncio
import time

import ray

from actors.coordinator import start_coordinator
from actors.engine import EngineActor
from actors.engine_config import EngineConfig
from engine_calls import pd, request

NAME = "raypd-coordinator-restart-test"
Engine = ray.remote(EngineActor)


def engine(role, eid):
    cfg = EngineConfig(role=role, backend="synthetic", engine_id=eid, num_cpus=0, block_size=16,
                       synthetic={"model_id": "restart-model", "num_layers": 2, "num_kv_heads": 2})
    return Engine.options(num_cpus=0).remote(cfg.model_dump(), NAME, heartbeat_s=0.5)


async def pd_chunks(p, d, rid):
    return (await pd(p, d, request(rid, "hello there " * 4, max_tokens=4)))[1]


def test_engines_re_register_after_a_coordinator_restart(ray_cluster):
    async def go():
        coord = start_coordinator(name=NAME, check_interval_s=0.5)
        p, d = engine("prefill", "cr-P"), engine("decode", "cr-D")
        await asyncio.gather(p.start.remote(), d.start.remote())
        assert (await pd_chunks(p, d, "before"))[-1].finish_reason == "length"
        ray.kill(coord)
        await asyncio.sleep(1.0)
        coord = start_coordinator(name=NAME, check_interval_s=0.5)  # a fresh, empty directory
        deadline = time.monotonic() + 20
        ids = set()
        while time.monotonic() < deadline:
            ids = {e["engine_id"] for e in await coord.engines.remote()}
            if ids >= {"cr-P", "cr-D"}:
                break
            await asyncio.sleep(0.2)
        assert ids >= {"cr-P", "cr-D"}, ids
        assert await coord.pair_verdict.remote("cr-P", "cr-D") is None
        chunks = await pd_chunks(p, d, "after")  # the same engine processes, no restart
        assert chunks[-1].finish_reason == "length" and all(c.error is None for c in chunks)
        await asyncio.gather(p.shutdown.remote(), d.shutdown.remote())
        for h in (p, d, coord):
            ray.kill(h)

    asyncio.run(go())
