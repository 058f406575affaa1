"""The embedded default's token path through the real front: configs/local.yaml (two role-flexible `both`
SmolLM2 engines on vLLM) as the Serve app in its default mode (HAProxy on the HTTP port -> the ingress
replica's own HTTP server -> the engine actors: Serve's HAProxy mode, serving/cluster/ray_profile.py),
over HTTP, with the settings `make run` uses (only the name and the CPU reservation differ: the session
cluster's CPUs are shared by the test modules).

0. The front's port is HAProxy's (Serve's Python proxy relays no response).
1. A streamed greedy completion is the engine's own greedy answer (the same prompt ids alone on the
   engine's actor, batch 1), token for token (batch 1 both sides: greedy output is deterministic), and
   ends with [DONE]. Its chunks came by the ingress's token inbox (same node), not as Ray items.
2. A client that disconnects mid-stream: the request is aborted on its engine (nothing runs there any
   more), every block is free again (each engine's baseline), no lease is held, and the front counts
   one abort (a client's act, never an engine failure).
3. The deployment is two role-flexible engines with the chunk budget the placement targets imply.
4. A long prompt on idle engines is placed colocated (it saves the handoff) by the SLO model, runs on one
   engine, and its answer is that engine's greedy answer.

The P/D path on vLLM (the pulled KV gives the colocated answer; the producer's lease ends with the
reader's notice, not its TTL): tests/integration/test_vllm_pd.py. Where the SLO model disaggregates:
tests/unit/test_placement.py.

Mid-stream migration through the same front: tests/fault/test_vllm_hang_default.py.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray

from serving.cluster.app import build_app
from serving.cluster.clients import RayEngineClient
from serving.cluster.launcher import shutdown_deployment
from serving.cluster.names import NAMESPACE, actor_name_of
from serving.config import DeploymentConfig, load_config

from greedy import exact_divergence, greedy_request, logprobs_of
from service_helpers import default_app_config, free_port, run_serve_app

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "default-front"
CONFIG = "configs/local.yaml"
MODEL = load_config(CONFIG).served_model_name
ENGINES = [f"{NAME}-both-0", f"{NAME}-both-1"]
PROMPT = "Tell me a long story about a lighthouse keeper."
MAX_TOKENS = 48
SETTLE_S = 30.0  # an aborted request's blocks and leases are back well within this
# ~500 tokens: a prompt that takes several prefill chunks
QUESTION = "The Eiffel Tower stands in the capital of France. " * 50 + "What is the capital of France?"
ANSWER_TOKENS = 16


def engine(engine_id: str):
    return ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE)


def engine_stats() -> dict:
    return {e: ray.get(engine(e).stats.remote()) for e in ENGINES}


@pytest.fixture(scope="module")
def front(coordinator):
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = default_app_config(NAME, CONFIG)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        run_serve_app(build_app(base), NAME, url)
        baseline = {e: s.free_blocks for e, s in engine_stats().items()}  # vLLM keeps a null block
        yield {"url": url, "baseline": baseline, "cfg": DeploymentConfig.from_dict(base)}
    finally:
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)


def stream(url: str, max_tokens: int, stop_after: int | None = None, prompt: str = PROMPT) -> dict:
    """One greedy streamed completion; with `stop_after`, the client disconnects after that many tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    out = {"prompt_ids": [], "ids": [], "done": False, "errors": []}
    with httpx.Client(timeout=120) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    out["errors"].append(event["error"])
                    continue
                choice = event["choices"][0]
                out["prompt_ids"] = choice.get("prompt_token_ids") or out["prompt_ids"]
                out["ids"] += choice.get("token_ids") or []
                if stop_after is not None and len(out["ids"]) >= stop_after:
                    break  # leaving the `with` closes the connection mid-stream
    return out


async def _reference(engine_id: str, prompt_ids: list[int], max_tokens: int):
    client = RayEngineClient(engine_id, engine(engine_id))
    req = greedy_request(f"ref-{time.monotonic_ns()}", prompt_ids, max_tokens, ignore_eos=True)
    chunks = [c async for c in client.generate(req)]
    return [t for c in chunks for t in c.token_ids], logprobs_of(chunks)


def counted(url: str, name: str, label: str | None = None) -> dict[str, float]:
    """Counter `name` on the front's /metrics, its samples summed per value of `label` (all under "")."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith((name + "{", name + " ")):
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0] if label else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def aborts(url: str) -> float:
    return sum(counted(url, "raypd_aborts_total").values())


def test_the_fronts_port_is_served_by_haproxy(front):
    import psutil

    port = int(front["url"].rsplit(":", 1)[1])
    listeners = {psutil.Process(c.pid).name() for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
    assert listeners == {"haproxy"}


def test_a_streamed_answer_through_the_serve_front_is_the_engines_greedy_answer(front):
    import asyncio

    inbox_before = sum(s.inbox_streams for s in engine_stats().values())
    answer = stream(front["url"], MAX_TOKENS)
    inbox_streams = sum(s.inbox_streams for s in engine_stats().values()) - inbox_before
    ref, _ = asyncio.run(_reference(ENGINES[0], answer["prompt_ids"], MAX_TOKENS))
    print(f"streamed {len(answer['ids'])} tokens, done={answer['done']}, errors={answer['errors']}")
    assert (answer["done"], answer["errors"], len(answer["ids"])) == (True, [], MAX_TOKENS)
    assert inbox_streams == 1  # the engine on the ingress's node sent its chunks to the ingress's inbox
    assert exact_divergence(answer["ids"], ref) is None


def test_a_client_that_disconnects_mid_stream_is_aborted_and_frees_its_blocks(front):
    before = aborts(front["url"])
    cut = stream(front["url"], 2000, stop_after=4)  # far from done when the client leaves
    left = time.monotonic()
    while True:
        stats = engine_stats()
        settled = all(s.running == 0 and s.free_blocks == front["baseline"][e] and s.held_leases == 0
                      for e, s in stats.items())
        if settled or time.monotonic() - left > SETTLE_S:
            break
        time.sleep(0.1)
    settle_s = time.monotonic() - left
    print(f"client left after {len(cut['ids'])} tokens; engines settled in {settle_s:.2f} s: "
          f"{ {e: (s.running, s.free_blocks, s.held_leases) for e, s in stats.items()} }")
    assert len(cut["ids"]) >= 4 and not cut["done"]
    assert {e: (s.running, s.free_blocks, s.held_leases) for e, s in stats.items()} == \
        {e: (0, front["baseline"][e], 0) for e in ENGINES}
    assert aborts(front["url"]) == before + 1


def test_the_default_runs_two_role_flexible_engines_with_a_chunk_budget(front):
    budgets = {e: ray.get(engine(e).effective_config.remote()).max_num_batched_tokens for e in ENGINES}
    assert budgets == {e: front["cfg"].chunk_budget("both") for e in ENGINES}


def decisions(url: str) -> dict[str, float]:
    """Requests placed so far by decision (local or remote), from the front's /metrics."""
    return counted(url, "raypd_disagg_decisions_total", "decision")


def test_a_prompt_on_idle_engines_is_colocated_and_answers_the_engines_greedy_answer(front):
    import asyncio

    url = front["url"]
    before, placed = engine_stats(), decisions(url)
    answer = stream(url, ANSWER_TOKENS, prompt=QUESTION)
    assert {k: v - placed.get(k, 0.0) for k, v in decisions(url).items() if v != placed.get(k, 0.0)} == {"local": 1}
    ran = [e for e, s in engine_stats().items() if s.requests > before[e].requests]
    assert len(ran) == 1  # one engine prefilled and decoded it
    ref, _ = asyncio.run(_reference(ran[0], answer["prompt_ids"], ANSWER_TOKENS))
    assert (answer["done"], answer["errors"], exact_divergence(answer["ids"], ref)) == (True, [], None)
