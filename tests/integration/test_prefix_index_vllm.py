"""Cache-aware routing over real vLLM engines (SmolLM2, prefix caching on; 1 prefill + 2 decode engines).

KV events relayed over Ray land in the coordinator's prefix index under the hashes a router
computes and agree with vLLM's own num_cached_tokens; the router built for the deployment
(`serving.cluster.clients.build_router`, as the Serve app builds it) sends a conversation's next
turn to the decode engine that holds its prefix and prefills it there (counted with its
reason); an engine that is removed takes its index entries with it.

The next turn is sent the instant the previous answer ends (as an agent sends it): the router
counts its own placements at once (`PrefixReplica.note_held`), before the engine's KV events
arrive. The router's rates are recorded, not learned (`RecordedRates`: every engine at the
config's priors), so which option the SLO model prefers depends on what the engines cache,
never on how fast this machine happens to be.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import ray

from actors.protocol.request import EngineRequest, SamplingSpec
from serving.config import DeploymentConfig, load_config
from serving.cluster.engines import stop_engine
from serving.cluster.launcher import launch, shutdown_deployment
from serving.routing.prefix_view import PrefixCacheView
from serving.routing.rates import RateEstimator
from serving.cluster.clients import build_router

from engine_calls import collect, pd, request

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "prefix-smollm2"


@pytest.fixture(scope="module")
def cfg():
    base = load_config("configs/local-pd.yaml").model_dump(mode="json")
    base.update(name=NAME, max_model_len=1024)
    base["decode"].update(count=2, cpu={"bind": ["1", "0"]})
    base["router"].update(policy="cache_aware", placement="slo")
    for group in ("prefill", "decode"):
        base[group]["num_cpus"] = 0
    return DeploymentConfig.from_dict(base)


@pytest.fixture(scope="module")
def deployment(coordinator, cfg):
    dep = launch(cfg)
    yield dep
    shutdown_deployment(NAME, keep_coordinator=True)


@pytest.fixture(scope="module")
def block(deployment):
    return ray.get(next(iter(deployment.decodes.values())).stats.remote()).kv_events.block_size


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def wait_cached(view: PrefixCacheView, tokens: list[int], engine: str, want: int, timeout_s: float = 20.0
                      ) -> int:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        await view.refresh()
        got = view.cached_tokens(tokens, [engine])[engine]
        if got >= want or asyncio.get_running_loop().time() > deadline:
            return got
        await asyncio.sleep(0.1)


def test_events_index_matches_what_vllm_reuses(deployment, coordinator, block):
    decode_id = sorted(deployment.decodes)[0]
    decode = deployment.decodes[decode_id]
    (prefill_id, prefill), = deployment.prefills.items()
    tokens = prompt_ids(3 * block + 40, seed=1)
    view = PrefixCacheView(coordinator.prefix_index_updates.remote, refresh_s=0.0)

    async def go():
        first = await collect(decode, request("prefix-1", token_ids=tokens, max_tokens=4))
        cached_in_index = await wait_cached(view, tokens, decode_id, 3 * block)
        again = await collect(decode, request("prefix-2", token_ids=tokens, max_tokens=4))
        await pd(prefill, decode, request("prefix-pd", token_ids=prompt_ids(2 * block + 5, seed=2), max_tokens=3))
        return first, cached_in_index, again

    first, cached_in_index, again = asyncio.run(go())
    assert first[0].num_cached_tokens == 0
    assert cached_in_index == 3 * block  # the router's hashes find the engine's blocks
    assert again[0].num_cached_tokens == 3 * block  # and vLLM reused exactly those
    stats = ray.get(decode.stats.remote()).kv_events
    assert (stats.hash_checks > 0, stats.hash_mismatch, stats.gaps) == (True, None, 0)
    engines = ray.get(coordinator.prefix_index_updates.remote(None)).ops
    assert {decode_id, prefill_id} <= {op.engine_id for op in engines}  # the prefill engine's prompt too


class RecordedRates(RateEstimator):
    """Every engine and pair at the config's priors: nothing this machine's timing says is read or learned."""

    def adopt(self, *args, **kwargs) -> None:
        pass  # the engines' published rates are not read

    def observe_hop(self, *args, **kwargs) -> None:
        pass

    def observe_transfer(self, *args, **kwargs) -> None:
        pass


async def turn(router, rid: str, tokens: list[int], max_tokens: int = 8):
    """One request through the router; (stream, its chunks)."""
    stream = await router.open(EngineRequest(rid, SamplingSpec(max_tokens=max_tokens),
                                             prompt_token_ids=tuple(tokens)))
    chunks = [c async for c in stream]
    stream.close()
    return stream, chunks


@pytest.fixture(scope="module")
def conversation(deployment, cfg, block, coordinator):
    """Turn one (uncached, while streams decode on both decode engines: remote prefill) and, the
    instant its answer ended, turn two (its prefix held by turn one's decode engine: prefilled
    there); then what the engines' own KV events say once they arrive."""
    router = build_router(cfg, deployment)
    router.pool.rates = RecordedRates(cfg.router.slo)
    first_prompt = prompt_ids(3 * block + 40, seed=7)
    events_only = PrefixCacheView(coordinator.prefix_index_updates.remote, refresh_s=0.0)  # no router's claims

    async def go():
        await router.planner.view.refresh()  # a router in service: its copy of the index is in step
        for d in deployment.decodes:  # as if 8 streams decoded on each: a local prefill would stall them
            router.pool.decode_load[d].requests += 8
        one, one_chunks = await turn(router, "conv-1", first_prompt)
        for d in deployment.decodes:
            router.pool.decode_load[d].requests -= 8
        answer = [t for c in one_chunks for t in c.token_ids]
        second_prompt = first_prompt + answer + prompt_ids(20, seed=8)
        two, two_chunks = await turn(router, "conv-2", second_prompt)  # at once: no wait for KV events
        await wait_cached(events_only, second_prompt, one.decode_id, 3 * block)
        index_claim = events_only.cached_tokens(second_prompt, sorted(deployment.decodes))
        return router, one, two, two_chunks, index_claim, second_prompt

    return asyncio.run(go())


def test_a_conversations_next_turn_sent_at_once_goes_to_the_decode_engine_holding_its_prefix(
        conversation, deployment, block):
    router, one, two, two_chunks, index_claim, _ = conversation
    other = next(d for d in deployment.decodes if d != one.decode_id)
    assert one.route.path == "pd"  # turn one: nothing cached, the prefill engine ran it
    assert two.decode_id == one.decode_id  # (decode ties rotate: by load alone it would be the other)
    assert two_chunks[0].num_cached_tokens == 3 * block  # vLLM reused what the router claimed
    assert index_claim == {one.decode_id: 3 * block, other: 0}  # and the engine's events confirm it


def test_a_prompt_cached_on_the_decode_engine_is_prefilled_there_and_counted(conversation):
    router, one, two, _, _, _ = conversation
    assert (two.route.path, two.prefill_id) == ("local", None)
    assert router.planner.decisions == {("remote", "itl_protect"): 1, ("local", "ttft"): 1}


def test_a_removed_engine_takes_its_entries_and_the_conversation_moves(conversation, deployment, cfg, coordinator):
    router, one, _, _, _, second_prompt = conversation
    asyncio.run(stop_engine(one.decode_id, deployment.decodes.pop(one.decode_id)))
    view = PrefixCacheView(coordinator.prefix_index_updates.remote, refresh_s=0.0)
    asyncio.run(view.refresh())
    assert one.decode_id not in view.index.engines()

    async def go():
        await router.routes(force=True)
        await router.planner.view.refresh()
        return await turn(router, "conv-3", second_prompt)

    three, _ = asyncio.run(go())
    assert (three.decode_id != one.decode_id, three.route.path) == (True, "pd")
