"""The embedded default as `make run` serves it (configs/local.yaml): SmolLM2 on two vLLM engines of role
`both`, placed per request by the SLO model, over real HTTP with the official openai client.

Both kinds of path give the same greedy answer: a request on idle engines is colocated (it saves the
handoff); with streams decoding on one engine and the other one prefilling, the same prompt is prefilled on
the prefilling engine (from its prefix cache) and decoded on the other after a KV pull: the P/D split,
chosen per request. Every block is free afterwards.
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
# ~500 tokens: a prefill long enough that running it beside decoding streams would stall them
QUESTION = [{"role": "user", "content": "The Eiffel Tower stands in the capital of France. " * 50
             + "What is the capital of France?"}]


@pytest.fixture(scope="module")
def service(coordinator):
    base = load_config("configs/local.yaml").model_dump(mode="json")
    base.update(name=NAME, max_model_len=1024)
    base["both"]["num_cpus"] = 0
    cfg = DeploymentConfig.from_dict(base)
    dep = launch(cfg)
    router = build_router(cfg, dep)
    port = free_port()
    with UvicornThread(create_app(cfg, router, served_model_of(dep)), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "router": router, "cfg": cfg}
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
    assert "Paris" in colocated
    assert router.planner.decisions == {("local", "ttft"): 1}
    ran = next(e for e in sorted(service["dep"].decodes) if router.pool.rates.rates(e).samples > 0)  # it ran it
    x = next(e for e in sorted(service["dep"].decodes) if e != ran)  # decodes: it does not hold the prompt
    router.pool.decode_load[x].requests += 8  # eight streams decoding on x ...
    with router.pool.prefilling(ran, 50_000):  # ... while the other engine has been prefilling
        pass
    try:
        disaggregated = ask(service)
    finally:
        router.pool.decode_load[x].requests -= 8
    assert disaggregated == colocated  # greedy: the pulled KV gives the colocated answer
    assert router.planner.decisions == {("local", "ttft"): 1, ("remote", "itl_protect"): 1}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the prefill's lease is freed by the reader's notice
        stats = ray.get([h.stats.remote() for h in service["dep"].decodes.values()])
        if all(s.free_blocks == s.num_blocks for s in stats):
            break
        time.sleep(0.2)
    assert all(s.free_blocks == s.num_blocks and s.held_leases == 0 for s in stats)
