"""The embedded default as `make run` serves it (configs/local.yaml): SmolLM2 on two vLLM engines of role
`both`, placed per request by the SLO model, over real HTTP with the official openai client.

Both kinds of path give the same greedy answer: a request on idle engines is colocated (it saves the
handoff); with streams decoding on one engine and the other one prefilling, the same prompt is prefilled on
the prefilling engine (from its prefix cache) and decoded on the other after a KV pull: the P/D split,
chosen per request. Every block is free afterwards, and the producer's lease ends with the reader's
notice (the engine reports it), long before its TTL.
"""

from __future__ import annotations

import time

import openai
import pytest
import ray

from serving.cluster.clients import build_router
from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig, load_config
from serving.front import create_app, served_model_of

from service_helpers import UvicornThread, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "default-smollm2"
# long: a lease that ends within the test ended by the reader's notice, never by this timer
LEASE_TTL_S = 60
# ~500 tokens: a prefill long enough that running it beside decoding streams would stall them
QUESTION = [{"role": "user", "content": "The Eiffel Tower stands in the capital of France. " * 50
             + "What is the capital of France?"}]


@pytest.fixture(scope="module")
def service(coordinator):
    base = load_config("configs/local.yaml").model_dump(mode="json")
    base.update(name=NAME, max_model_len=1024)
    base.setdefault("transfer", {})["lease_ttl_s"] = LEASE_TTL_S
    base["both"]["num_cpus"] = 0
    cfg = DeploymentConfig.from_dict(base)
    dep = launch(cfg)
    baseline = {e: ray.get(h.stats.remote()).free_blocks for e, h in dep.decodes.items()}  # vLLM keeps a null block
    router = build_router(cfg, dep)
    port = free_port()
    with UvicornThread(create_app(cfg, router, served_model_of(dep)), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "router": router, "cfg": cfg, "baseline": baseline}
    shutdown_deployment(NAME, keep_coordinator=True)


def ask(service) -> str:
    client = openai.OpenAI(base_url=service["url"] + "/v1", api_key="none", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=service["cfg"].served_model_name, messages=QUESTION,
                                         max_tokens=16, temperature=0)
    return out.choices[0].message.content


def test_the_default_runs_two_role_flexible_engines_with_a_chunk_budget(service):
    dep = service["dep"]
    assert sorted(dep.prefills) == sorted(dep.decodes) == [f"{NAME}-both-0", f"{NAME}-both-1"]
    budgets = {ray.get(h.effective_config.remote()).max_num_batched_tokens for h in dep.decodes.values()}
    assert budgets == {service["cfg"].chunk_budget("both")}


def test_colocated_on_idle_engines_then_disaggregated_beside_busy_decoding(service):
    router = service["router"]
    colocated = ask(service)
    assert colocated.strip()  # SmolLM2-135M answers, not always right: the test is that both paths agree
    assert router.planner.decisions == {("local", "ttft"): 1}
    ran = next(e for e, h in sorted(service["dep"].decodes.items()) if ray.get(h.stats.remote()).requests)  # it ran it
    x = next(e for e in sorted(service["dep"].decodes) if e != ran)  # decodes: it does not hold the prompt
    router.pool.decode_load[x].requests += 8  # eight streams decoding on x ...
    with router.pool.prefilling(ran, 50_000):  # ... while the other engine has been prefilling
        pass
    before = engine_stats(service)
    sent = time.monotonic()  # the prefill's lease starts after this: its TTL ends after sent + LEASE_TTL_S
    try:
        disaggregated = ask(service)
    finally:
        router.pool.decode_load[x].requests -= 8
    assert disaggregated == colocated  # greedy: the pulled KV gives the colocated answer
    assert router.planner.decisions == {("local", "ttft"): 1, ("remote", "itl_protect"): 1}
    # the reader's notice frees the prefill's blocks and ends the producer's lease: held_leases (what a
    # drain waits for) drops to none as soon as the engine reports the notice, not when the TTL passes
    stats = wait_for(service, lambda e, s: s.free_blocks == service["baseline"][e] and s.held_leases == 0,
                     deadline=sent + LEASE_TTL_S / 2)
    assert time.monotonic() < sent + LEASE_TTL_S  # so no timer ended it
    assert {e: s.free_blocks for e, s in stats.items()} == service["baseline"]
    assert {e: s.held_leases for e, s in stats.items()} == {e: 0 for e in service["baseline"]}
    ended = {e: {k: s.backend.counters[k] - before[e].backend.counters[k]
                 for k in ("leases_released_by_notice", "leases_expired")} for e, s in stats.items()}
    assert ended == {ran: {"leases_released_by_notice": 1, "leases_expired": 0},
                     x: {"leases_released_by_notice": 0, "leases_expired": 0}}


def engine_stats(service) -> dict:
    return {e: ray.get(h.stats.remote()) for e, h in service["dep"].decodes.items()}


def wait_for(service, done, deadline: float) -> dict:
    """Every engine's stats once `done` holds for each of them, or as they are at the deadline."""
    while True:
        stats = engine_stats(service)
        if all(done(e, s) for e, s in stats.items()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
