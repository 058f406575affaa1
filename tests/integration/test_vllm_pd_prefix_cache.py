"""P/D on real vLLM engines with prefix caching on (vLLM's default, and every shipped config's).

A prompt that comes back, or one that shares a prefix with an earlier one, finds its blocks
cached on the producer, on the consumer, or on both: the consumer then pulls only the blocks it
lacks, at the right offset, and the answer equals a fresh colocated engine's (no cache at all).
"""

import asyncio
import random
import time

import pytest
import ray

from actors.control.coordinator import COORDINATOR_NAME
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.engine.config import EngineConfig
from actors.models.tiny_llama import build_tiny_llama
from actors.transfer_config import TransferConfig
from engine_calls import collect, request, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

Engine = ray.remote(EngineActor)
rng = random.Random(11)
BASE = [rng.randrange(1000, 40000) for _ in range(150)]
OTHER_TAIL = [rng.randrange(1000, 40000) for _ in range(40)]


def make_engine(role, engine_id, model, bind, prefix_caching):
    transfer = TransferConfig(lease_ttl_s=60, read_timeout_s=10, failure_policy="fail")
    cfg = EngineConfig(role=role, backend="vllm", engine_id=engine_id, model=str(model), max_model_len=512,
                       model_id="tiny-a", block_size=32, cpu={"bind": bind}, dtype="float32",
                       engine_kwargs={"enable_prefix_caching": prefix_caching, "enforce_eager": True},
                       num_cpus=0, transfer=transfer)
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    a = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-a", seed=0, progress=None)
    e = {"P": make_engine("prefill", "pc-P", a, "0", True),
         "D": make_engine("decode", "pc-D", a, "1", True),
         "R": make_engine("both", "pc-R", a, "1", False)}
    ray.get([h.start.remote() for h in e.values()])
    yield e
    ray.get([h.shutdown.remote() for h in e.values()])
    for h in e.values():
        ray.kill(h)


async def pd(engines, prompt, max_tokens=12):
    rid = f"r{time.monotonic_ns()}"
    req = request(rid, token_ids=prompt, max_tokens=max_tokens)
    pre = await engines["P"].prefill.remote(req)
    dreq = pre.continuation(req).replace(request_id=rid + "-d", kv_transfer_params=dict(pre.kv_transfer_params))
    chunks = await collect(engines["D"], dreq)
    return token_ids(pre, chunks), chunks[0].num_cached_tokens, any(c.recomputed for c in chunks)


async def local(engine, prompt, max_tokens=12):
    chunks = await collect(engine, request(f"l{time.monotonic_ns()}", token_ids=prompt, max_tokens=max_tokens))
    return [t for c in chunks for t in c.token_ids]


def test_repeated_and_shared_prefix_prompts_equal_a_fresh_engine(engines):
    async def go():
        cases = [("first", BASE), ("again", BASE), ("shared prefix", BASE[:128] + OTHER_TAIL),
                 ("again", BASE)]
        for name, prompt in cases:
            got, cached, recomputed = await pd(engines, prompt)
            want = await local(engines["R"], prompt)
            assert not recomputed, name
            assert got == want, (name, cached)
        # a prompt the consumer already computed itself, never seen by the producer's cache at this length
        own = BASE[:96] + OTHER_TAIL[:20]
        await local(engines["D"], own)
        got, cached, _ = await pd(engines, own)
        assert got == await local(engines["R"], own), cached

    asyncio.run(go())
