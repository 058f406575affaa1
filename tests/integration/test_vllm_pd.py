"""Real vLLM prefill and decode engines (Ray actors) moving KV through raypd's connector.

Tiny random Llamas keep it fast: P and D share weights "a"; D2 has weights "b"
under the same compatibility id, so its answers show whose KV it used.
Prefix caching is off so a colocated reference never reuses transferred KV.
Leases last 60 s and every wait for freed blocks is 20 s at most: blocks come
back because readers notified the producer, never because a lease expired.
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
from actors.models.local import build_tiny_llama
from actors.transfer_config import TransferConfig
from engine_calls import collect, request, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

Engine = ray.remote(EngineActor)
rng = random.Random(7)
PROMPTS = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in (10, 32, 150)}


def run(coro):
    return asyncio.run(coro)


def make_engine(role, engine_id, model, bind, failure_policy="fail", **kw):
    kw = {"model_id": "tiny-a", "block_size": 32, **kw}
    transfer = TransferConfig(lease_ttl_s=60, read_timeout_s=10, failure_policy=failure_policy)
    cfg = EngineConfig(role=role, backend="vllm", engine_id=engine_id, model=str(model), max_model_len=512,
                       cpu_bind=bind, dtype="float32",
                       engine_kwargs={"enable_prefix_caching": False, "enforce_eager": True},
                       num_cpus=0, transfer=transfer, **kw)
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a = build_tiny_llama(root / "tiny-a", seed=0, progress=None)
    b = build_tiny_llama(root / "tiny-b", seed=1, progress=None)
    e = {
        "P": make_engine("prefill", "tp-P", a, "0"),
        "D": make_engine("decode", "tp-D", a, "1", failure_policy="fail"),
        "D2": make_engine("decode", "tp-D2", b, "1", failure_policy="recompute"),
    }
    ray.get([h.start.remote() for h in e.values()])
    yield e
    ray.get([h.shutdown.remote() for h in e.values()])
    for h in e.values():
        ray.kill(h)


async def pd(engines, decode, prompt, max_tokens=12, rid=None, forge=False):
    """Prefill on P, decode on `decode`; `forge` replaces a block id with one P never had,
    which the decode ranks' block-id check refuses (a failed pull, nothing on the wire)."""
    rid = rid or f"r{time.monotonic_ns()}"
    req = request(rid, token_ids=prompt, max_tokens=max_tokens)
    pre = await engines["P"].prefill.remote(req)
    params = dict(pre.kv_transfer_params)
    if forge:
        params["remote_block_ids"] = [10**6, *params["remote_block_ids"][1:]]
    dreq = pre.continuation(req).replace(request_id=rid + "-d", kv_transfer_params=params)
    chunks = await collect(engines[decode], dreq)
    # the transfer verdict rides on the first chunk, the finish on the last
    summary = chunks[-1].replace(num_cached_tokens=chunks[0].num_cached_tokens,
                                 recomputed=any(c.recomputed for c in chunks))
    return token_ids(pre, chunks), summary


async def local(engine, prompt, max_tokens=12):
    chunks = await collect(engine, request(f"l{time.monotonic_ns()}", token_ids=prompt, max_tokens=max_tokens))
    return [t for c in chunks for t in c.token_ids]


async def wait_free(engine, baseline, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.stats.remote()
        if stats.free_blocks == baseline or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


async def baselines(engines):
    """At rest every block is free (prefix caching is off); wait for the previous test to settle."""
    out = {}
    for k, e in engines.items():
        total = (await e.stats.remote()).num_blocks
        out[k] = (await wait_free(e, total)).free_blocks
        assert out[k] == total, f"{k} holds blocks between tests"
    return out


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_pd_equals_colocated_token_for_token(engines, length):
    async def go():
        base = await baselines(engines)
        tokens, last = await pd(engines, "D", PROMPTS[length])
        # every prompt token's KV came over the wire; the engine computes only the first token's
        assert last.num_cached_tokens == length, last
        assert not last.recomputed
        want = await local(engines["D"], PROMPTS[length])
        assert tokens == want
        for k in ("P", "D"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())


def test_decode_really_uses_the_transferred_kv(engines):
    async def go():
        prompt = PROMPTS[150]
        with_a_kv, last = await pd(engines, "D2", prompt)
        own = await local(engines["D2"], prompt)
        same_weights = await local(engines["D"], prompt)
        assert last.num_cached_tokens == len(prompt) and not last.recomputed
        assert with_a_kv != own  # weights "b" on KV computed with weights "a"
        assert with_a_kv[0] == same_weights[0]  # the first token was sampled by P (weights "a")

    run(go())


def test_fail_policy_ends_with_an_error_and_frees_both_sides(engines):
    async def go():
        base = await baselines(engines)
        tokens, last = await pd(engines, "D", PROMPTS[32], forge=True)
        assert last.finish_reason == "error" and "KV transfer failed" in last.error
        for k in ("P", "D"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())


def test_recompute_policy_answers_from_a_local_prefill(engines):
    async def go():
        base = await baselines(engines)
        tokens, last = await pd(engines, "D2", PROMPTS[150], forge=True)
        assert last.recomputed and last.finish_reason in ("length", "stop")
        # after P's first token, D2 recomputed the whole prompt with its own weights
        own = await local(engines["D2"], PROMPTS[150] + tokens[:1], max_tokens=len(tokens) - 1)
        assert tokens[1:] == own
        for k in ("P", "D2"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())


def test_unclaimed_prefill_frees_its_blocks_when_the_lease_expires(engines):
    async def go():
        base = await baselines(engines)
        pre = await engines["P"].prefill.remote(request("orphan", token_ids=PROMPTS[150], lease_ttl_s=2.0))
        held = len(pre.kv_transfer_params["remote_block_ids"])
        stats = await engines["P"].stats.remote()
        assert stats.free_blocks == base["P"] - held
        after = await wait_free(engines["P"], base["P"], timeout=15)
        assert after.free_blocks == base["P"]

    run(go())


def test_a_pull_after_the_producers_lease_ended_fails_closed(engines):
    """The decode engine comes late: the producer's lease expired and its blocks went back to vLLM
    (other prompts prefilled meanwhile may hold them). The READ itself succeeds, so only the lease
    board's record (RELEASED, or gone) tells the reader: the pull fails (policy fail: an error),
    never an answer from whatever the blocks hold now."""
    async def go():
        base = await baselines(engines)
        late = request("late", token_ids=PROMPTS[150], max_tokens=8, lease_ttl_s=1.0)
        pre = await engines["P"].prefill.remote(late)
        assert (await wait_free(engines["P"], base["P"], timeout=15)).free_blocks == base["P"]  # expired
        try:
            for i in range(3):  # other prompts prefilled meanwhile, held (their leases last 60 s)
                await engines["P"].prefill.remote(request(f"o{i}", token_ids=PROMPTS[150][i + 1:] + PROMPTS[32],
                                                          max_tokens=8))
            chunks = await collect(engines["D"], pre.continuation(late).replace(request_id="late-d"))
        finally:
            for i in range(3):
                await engines["P"].abort.remote(f"o{i}")
        # vLLM's connector reports the failed load (its policy: fail); the reason is in the engine's log
        assert chunks[-1].finish_reason == "error" and "KV transfer failed" in chunks[-1].error, chunks[-1]
        assert not any(c.token_ids for c in chunks)  # nothing decoded from those blocks
        for k in ("P", "D"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())


def test_aborted_decode_frees_blocks_on_both_sides(engines):
    async def go():
        base = await baselines(engines)
        ab = request("ab", token_ids=PROMPTS[150], max_tokens=301)
        pre = await engines["P"].prefill.remote(ab)
        req = pre.continuation(ab).replace(request_id="ab-d")
        gen = engines["D"].generate.options(num_returns="streaming").remote(req)
        first = await gen.__anext__()
        await first
        await engines["D"].abort.remote("ab-d")
        for k in ("P", "D"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())
