"""A soak of the product: the embedded default (configs/local.yaml: two role-flexible `both` SmolLM2
engines on vLLM, SLO placement) as the Serve app in its default mode, under faults, for SOAK_S.

Load: LOAD_WORKERS clients, one request after another, streaming and non-streaming completions
(greedy, `ignore_eos`, several lengths). Faults, one at a time on registered incarnations, in a loop:
SIGKILL of an engine's process tree (the actor and vLLM's engine core), SIGSTOP of the other's for
FREEZE_S then SIGCONT (the coordinator may kill it meanwhile: both ends are fine), clients that
disconnect mid-stream, each fault once the front routes to both engines again (one engine serves
while the other is down: two down at once is an outage, not a soak), and NIXL READ errors on every KV pull with probability FAULT_RATE throughout
(`transfer.fault_rate`: a pull that fails is recomputed, the default `recompute` policy).

Bound: no wrong answer (every completed answer is its greedy reference, token for token or split at
near ties, each followed by the greedy continuation of the accepted branch: tests/greedy.py), no cut
stream and no client timeout, clean errors (an HTTP error body or an SSE error event, each with its
code) at most 2 % of the requests. At the end: every engine back and registered, each engine's blocks
at its baseline, no held lease, no handoff in flight; after the deployment is shut down no actor,
placement group or vLLM process of it is left. The synthetic chaos soak (test_chaos_soak.py) keeps
covering topologies (TP, several pools).
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
import ray

from serving.cluster.app import build_app
from serving.cluster.clients import RayEngineClient
from serving.cluster.launcher import shutdown_deployment
from serving.cluster.names import NAMESPACE, actor_name_of
from serving.config import load_config

from chaos_helpers import deployment_placement_groups, freeze_tree, generation, kill_tree, wait_generation
from greedy import alone, divergence
from service_helpers import default_app_config, free_port, run_serve_app

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "product-soak"
CONFIG = "configs/local.yaml"
MODEL = load_config(CONFIG).served_model_name
ENGINES = [f"{NAME}-both-0", f"{NAME}-both-1"]
SOAK_S = 150.0  # a kill and a freeze at least (each waits for recovery); longer soaks: edit
LOAD_WORKERS = 3
FREEZE_S = 15.0
FAULT_RATE = 0.3
MAX_ERROR_SHARE = 0.02
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Explain how a steam engine works.",
           "Write a poem about the sea.", "List the planets of the solar system.",
           "Describe a walk through a forest in autumn.", "How do bees make honey?",
           "What is the capital of France? Explain its history.", "Why is the sky blue?"]
LENGTHS = (8, 24, 48)


@dataclass
class Outcome:
    """One request as its client saw it."""
    prompt: str
    max_tokens: int
    stream: bool
    outcome: str = "cut"  # completed | error (a clean one, with its code) | cut | timeout
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    code: str | None = None
    error: str | None = None


def engine(engine_id: str):
    return ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE)


async def send(client: httpx.AsyncClient, url: str, prompt: str, n: int, stream: bool,
               leave_after: int | None = None) -> Outcome:
    out = Outcome(prompt, n, stream)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "stream": stream, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body, timeout=120)
            payload = r.json()
            if r.status_code == 200:
                choice = payload["choices"][0]
                out.outcome, out.prompt_ids, out.ids = "completed", choice["prompt_token_ids"], choice["token_ids"]
            else:
                out.outcome, out.code, out.error = "error", payload["error"]["code"], payload["error"]["message"]
            return out
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                payload = json.loads(await r.aread())
                out.outcome, out.code, out.error = "error", payload["error"]["code"], payload["error"]["message"]
                return out
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.code, out.error = event["error"].get("code"), event["error"]["message"]
                        continue
                    choice = event["choices"][0]
                    out.prompt_ids = choice.get("prompt_token_ids") or out.prompt_ids
                    out.ids += choice.get("token_ids") or []
                    if leave_after is not None and len(out.ids) >= leave_after:
                        out.outcome = "left"  # the client disconnects mid-stream
                        return out
            if done:
                out.outcome = "error" if out.error is not None else "completed"
    except httpx.TimeoutException as exc:
        out.outcome, out.error = "timeout", f"{type(exc).__name__}: {exc}"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.outcome, out.error = "cut", f"{type(exc).__name__}: {exc}"
    return out


async def recovered(client: httpx.AsyncClient, url: str, timeout_s: float = 240.0) -> None:
    """Until the front routes to both engines again (none held as hung, both listed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = (await client.get(url + "/health", timeout=10)).json()
        if not health["hung"] and sorted(health["decode_engines"]) == ENGINES:
            return
        assert time.monotonic() < deadline, f"not recovered: {health}"
        await asyncio.sleep(0.5)


async def _reference(engine_id: str, prompt_ids: list[int], n: int):
    return await alone(RayEngineClient(engine_id, engine(engine_id)), prompt_ids, n)


async def _wrong(answer: Outcome, reference: list[int], logprobs, engine_id: str) -> str | None:
    if len(answer.ids) != answer.max_tokens:
        return f"{len(answer.ids)} tokens, asked for {answer.max_tokens} (ignore_eos)"
    return await divergence(answer.ids, reference[:answer.max_tokens], logprobs[:answer.max_tokens], answer.prompt_ids,
                            lambda prefix, n: _reference(engine_id, prefix, n))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def _tree(engine_id: str) -> list[int]:
    stats = await engine(engine_id).stats.remote()
    return [stats.pid, *stats.backend.child_pids]


def test_the_default_serve_app_under_kills_freezes_read_errors_and_disconnects(coordinator):
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = default_app_config(NAME, CONFIG)
    base.setdefault("transfer", {})["fault_rate"] = FAULT_RATE
    faults: list[str] = []
    seen_pids: set[int] = set()
    frozen: list[int] = []
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        run_serve_app(build_app(base), NAME, url)
        baseline = {e: ray.get(engine(e).stats.remote()).free_blocks for e in ENGINES}

        async def go():
            rng = random.Random(25)
            answers: list[Outcome] = []
            left: list[Outcome] = []
            until = time.monotonic() + SOAK_S

            async def worker(i: int):
                wrng = random.Random(i)
                async with httpx.AsyncClient() as client:
                    while time.monotonic() < until:
                        answers.append(await send(client, url, wrng.choice(PROMPTS), wrng.choice(LENGTHS),
                                                  stream=wrng.random() < 0.7))

            async def chaos():
                async with httpx.AsyncClient() as client:
                    k = 0
                    while time.monotonic() < until - 30:
                        await asyncio.sleep(rng.uniform(5, 10))
                        victim = ENGINES[k % 2]
                        gen = await generation(coordinator, victim)
                        tree = await _tree(victim)
                        seen_pids.update(tree)
                        if k % 2 == 0:
                            kill_tree(tree)
                            faults.append(f"SIGKILL {victim}")
                        else:
                            frozen.extend(freeze_tree(tree))
                            faults.append(f"SIGSTOP {victim} for {FREEZE_S:.0f} s")
                            await asyncio.sleep(FREEZE_S)
                            kill_tree(frozen, signal.SIGCONT)
                            frozen.clear()
                        left.extend(await asyncio.gather(*(send(client, url, p, 200, True, leave_after=3)
                                                           for p in PROMPTS[:2])))
                        faults.append("2 clients left mid-stream")
                        if k % 2 == 0:  # a kill: the incarnation comes back before the next fault
                            await wait_generation(coordinator, victim, gen, timeout_s=240)
                        await recovered(client, url)  # one fault at a time: the other engine serves meanwhile
                        k += 1

            await asyncio.gather(chaos(), *(worker(i) for i in range(LOAD_WORKERS)))
            # every engine registered (a frozen one the coordinator killed comes back too) and at rest
            for e in ENGINES:
                deadline = time.monotonic() + 240
                while True:
                    entry = {x.engine_id: x for x in await coordinator.engines.remote()}.get(e)
                    if entry is not None:
                        break
                    assert time.monotonic() < deadline, f"{e} did not register again"
                    await asyncio.sleep(0.5)
            settle = time.monotonic() + 60
            while True:
                stats = {e: await engine(e).stats.remote() for e in ENGINES}
                inflight = {e: await coordinator.handoffs_in_flight.remote(e) for e in ENGINES}
                rest = {e: (s.running, s.free_blocks, s.held_leases, inflight[e]) for e, s in stats.items()}
                if rest == {e: (0, baseline[e], 0, 0) for e in ENGINES} or time.monotonic() > settle:
                    break
                await asyncio.sleep(0.2)
            for e in ENGINES:
                seen_pids.update(await _tree(e))
            survivor = ENGINES[0]
            refs = {}
            for a in answers:  # one reference per prompt, as long as the longest answer (greedy, ignore_eos)
                key = tuple(a.prompt_ids)
                if a.outcome == "completed" and key not in refs:
                    refs[key] = await _reference(survivor, a.prompt_ids, max(LENGTHS))
            wrong = [(a.prompt, a.max_tokens, problem) for a in answers if a.outcome == "completed"
                     and (problem := await _wrong(a, *refs[tuple(a.prompt_ids)], survivor)) is not None]
            return answers, left, rest, wrong

        answers, left, rest, wrong = asyncio.run(go())
    finally:
        kill_tree(frozen, signal.SIGCONT)
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)

    outcomes = {k: sum(1 for a in answers if a.outcome == k) for k in ("completed", "error", "cut", "timeout")}
    errors = [(a.code, a.error) for a in answers if a.outcome == "error"]
    print(f"faults: {faults}; {len(answers)} requests: {outcomes}; clean errors {errors}; "
          f"clients that left: {[a.outcome for a in left]}; at rest {rest}")
    assert outcomes["cut"] == outcomes["timeout"] == 0, [(a.outcome, a.error) for a in answers
                                                          if a.outcome in ("cut", "timeout")]
    assert wrong == [], wrong
    assert len(errors) <= MAX_ERROR_SHARE * len(answers), errors
    assert all(code for code, _ in errors), errors  # each clean error names its reason
    assert [a.outcome for a in left] == ["left"] * len(left)
    assert rest == {e: (0, baseline[e], 0, 0) for e in ENGINES}  # blocks, leases, handoffs: nothing stranded
    # shut down: nothing of the deployment is left
    deadline = time.monotonic() + 60
    while True:
        alive = [p for p in seen_pids if _alive(p)]
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if NAME in (a["name"] if isinstance(a, dict) else a)]
        if (alive, actors, deployment_placement_groups(NAME)) == ([], [], []) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (alive, actors, deployment_placement_groups(NAME)) == ([], [], [])
