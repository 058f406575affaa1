"""End to end on the embedded model: SmolLM2 on vLLM, prefill -> NIXL -> decode, over real HTTP.

The official openai client asks the README's question, streaming and not; the
answer must name Paris, must have gone through the prefill engine and a KV
pull (no recompute), and both engines must end with every block free.
"""

from __future__ import annotations

import time

import openai
import pytest
import ray

from serving.front import create_app, served_model_of
from serving.config import DeploymentConfig, load_config
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from engine_calls import collect, pd, request, token_ids
from service_helpers import UvicornThread, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "e2e-smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def stats(dep) -> dict[str, dict]:
    return dict(zip(dep.engines, ray.get([h.stats.remote() for h in dep.engines.values()])))


def all_free(dep, timeout_s: float = 10.0) -> dict[str, dict]:  # < the 30 s lease: freed by notices
    deadline = time.monotonic() + timeout_s
    while True:
        now = stats(dep)
        if all(s.free_blocks == s.num_blocks for s in now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


@pytest.fixture(scope="module")
def service(coordinator):
    base = load_config("configs/local-pd.yaml").model_dump(mode="json")
    base.update(name=NAME, max_model_len=1024)
    for group in ("prefill", "decode"):
        base[group]["num_cpus"] = 0
    cfg = DeploymentConfig.from_dict(base)
    dep = launch(cfg)
    router = build_router(cfg, dep)
    port = free_port()
    with UvicornThread(create_app(cfg, router, served_model_of(dep)), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "router": router, "cfg": cfg}
    shutdown_deployment(NAME, keep_coordinator=True)


def test_chat_answers_paris_through_prefill_and_decode(service):
    client = openai.OpenAI(base_url=service["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    model = service["cfg"].served_model_name
    before = stats(service["dep"])
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.usage.completion_tokens > 1 and reply.usage.prompt_tokens > 10

    pieces = []
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0,
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == text  # streaming and not agree, token for token

    after = all_free(service["dep"])
    decode_id = next(e for e in after if "decode" in e)
    prefill_id = next(e for e in after if "prefill" in e)
    assert after[prefill_id].requests - before[prefill_id].requests == 2  # both went to prefill
    assert after[decode_id].backend.counters["kv_pulls"] - before[decode_id].backend.counters["kv_pulls"] == 2  # and pulled KV
    assert after[decode_id].recomputed == before[decode_id].recomputed
    for eid, s in after.items():
        assert s.free_blocks == s.num_blocks, (eid, s)


def test_pd_equals_colocated_for_short_one_block_and_long_prompts(service):
    """Greedy P/D output equals the decode engine's own (colocated) output, token for token.

    The colocated run goes first, so the decode engine's prefix cache never holds
    transferred KV when the reference is computed.
    """
    import asyncio

    dep = service["dep"]
    (prefill,), (decode,) = dep.prefills.values(), dep.decodes.values()
    word_ids = list(range(1000, 1400))
    prompts = {"short": word_ids[:20], "one block": word_ids[:128], "many blocks": word_ids[:300]}

    async def go():
        for name, ids in prompts.items():
            local = await collect(decode, request(f"co-{name}", token_ids=ids, max_tokens=8))
            pre, chunks = await pd(prefill, decode, request(f"pd-{name}", token_ids=ids, max_tokens=8))
            assert token_ids(pre, chunks) == [t for c in local for t in c.token_ids], name

    asyncio.run(go())
    after = all_free(dep)
    for eid, s in after.items():
        assert s.free_blocks == s.num_blocks, (eid, s)



def test_small_soak_of_concurrent_streams_on_vllm(service):
    """A smaller soak against real vLLM engines: every stream complete, identical (greedy), nothing leaked."""
    import asyncio

    client = openai.AsyncOpenAI(base_url=service["url"] + "/v1", api_key="none", max_retries=0, timeout=300)
    model = service["cfg"].served_model_name

    async def one(i):
        text, n = "", 0
        stream = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                                      temperature=0, stream=True, user=str(i))
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                n += 1
        return i, text

    async def go():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(go())
    assert sorted(i for i, _ in results) == list(range(16))  # none lost or duplicated
    texts = {t for _, t in results}
    assert len(texts) == 1 and "Paris" in texts.pop()  # greedy: every stream the same answer
    after = all_free(service["dep"], timeout_s=20)
    for eid, s in after.items():
        assert s.free_blocks == s.num_blocks, (eid, s)
