"""EngineActor with the synthetic backend: P/D through the coordinator equals colocated."""

import asyncio

import pytest
import ray

from actors.control.coordinator import COORDINATOR_NAME
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.engine.config import EngineConfig
from engine_calls import collect, pd, request, token_ids

Engine = ray.remote(EngineActor)


def start(role, **kw):
    # a model id of its own: the coordinator refuses one model id under two shapes
    cfg = EngineConfig(role=role, backend="synthetic", num_cpus=0,
                       synthetic={"model_id": "engine-actor-model"}, **kw)
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    actor = Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)
    return actor


def test_prefill_then_decode_equals_colocated(coordinator):
    async def scenario():
        p = start("prefill", engine_id="eng-p", tp_size=2, block_size=8)
        d = start("decode", engine_id="eng-d", tp_size=1, block_size=16)
        try:
            return await run(p, d)
        finally:  # a failure must not leave engines registered for the next tests
            await asyncio.gather(p.shutdown.remote(), d.shutdown.remote(), return_exceptions=True)
            for a in (p, d):
                ray.kill(a)

    async def run(p, d):
        await asyncio.gather(p.start.remote(), d.start.remote())
        # whichever engine registered second got the verdict; the coordinator keeps it
        assert await coordinator.pair_verdict.remote("eng-p", "eng-d") is None
        base = await asyncio.gather(p.stats.remote(), d.stats.remote())
        prompt = "What is the capital of France? " * 3
        pre, chunks = await pd(p, d, request("r1", prompt, max_tokens=6))
        params = pre.kv_transfer_params
        assert params["remote_engine_id"] == "eng-p" and params["tp_size"] == 2
        local = await collect(d, request("r2", prompt, max_tokens=6))
        assert token_ids(pre, chunks) == [t for c in local for t in c.token_ids]
        assert chunks[-1].finished and chunks[-1].finish_reason == "length" and len(chunks) == 5
        assert not any(c.recomputed for c in chunks)
        for _ in range(200):  # the prefill engine frees its blocks once the decode ranks notified
            after = await asyncio.gather(p.stats.remote(), d.stats.remote())
            if after[0].free_blocks == base[0].free_blocks:
                break
            await asyncio.sleep(0.02)
        assert [a.free_blocks for a in after] == [b.free_blocks for b in base]
        assert after[0].held_leases == 0
        engines = await coordinator.engines.remote()
        assert {e.engine_id for e in engines} >= {"eng-p", "eng-d"}
        return True

    assert asyncio.run(scenario())


def test_role_and_length_errors(coordinator):
    async def scenario():
        d = start("decode", engine_id="eng-d2", max_model_len=64)
        await d.start.remote()
        with pytest.raises(ray.exceptions.RayTaskError, match="is a decode engine"):
            await d.prefill.remote(request("x", "hi"))
        with pytest.raises(ray.exceptions.RayTaskError, match="exceeds the context length"):
            await collect(d, request("y", "x" * 100, max_tokens=4))
        await d.shutdown.remote()
        ray.kill(d)
        return True

    assert asyncio.run(scenario())
