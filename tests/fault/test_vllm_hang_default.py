"""The embedded default (configs/local.yaml: two role-flexible `both` SmolLM2 engines on vLLM) as the Serve
app, one engine frozen mid-stream, as an operator would see it:

1. 3 greedy streams run; the engine serving most of them is frozen (SIGSTOP of its actor and vLLM
   processes), one more request is sent at that moment: every stream completes within 30 s (none cut,
   no error event) as its greedy reference, token for token or split at near ties, each followed by the
   greedy continuation of the accepted branch (tests/greedy.py), the migrated ones recomputed on the
   other engine;
2. once the router has found the engine hung (its first missed deadline), requests are served by the
   other engine at once: their first token comes well within one token deadline;
3. /health answers 200 throughout (one engine can serve), and the frozen engine is killed and
   restarted by the coordinator and rejoins with no command (a new incarnation).

References: one request at a time on the surviving engine's actor, greedy with top-2 logprobs (the
HTTP API refuses logprobs), on the prompt ids the front tokenized (`return_token_ids`); a branch's
continuation after an accepted near tie the same way.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
import ray

from serving.cluster.app import build_app
from serving.cluster.clients import RayEngineClient
from serving.cluster.launcher import shutdown_deployment
from serving.cluster.names import NAMESPACE, actor_name_of
from serving.config import load_config

from chaos_helpers import freeze_tree, generation, kill_tree, wait_generation
from greedy import divergence, greedy_request, logprobs_of
from service_helpers import default_app_config, free_port, run_serve_app

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "hang-default"
CONFIG = "configs/local.yaml"
MODEL = load_config(CONFIG).served_model_name
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how a steam engine works, step by step.",
           "Write a long poem about the sea.", "List the planets and describe each one.",
           "Describe a walk through a forest in autumn.", "How do bees make honey?"]
MAX_TOKENS = 120  # with ignore_eos: still streaming well after the freeze
ENGINES = [f"{NAME}-both-0", f"{NAME}-both-1"]


class Stream:
    """One streamed greedy completion over HTTP: its prompt ids, answer ids, outcome, first-token time."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []
        self.outcome = "cut"
        self.error: str | None = None
        self.ttft_s: float | None = None
        self.ended = 0.0
        self.started = asyncio.Event()  # a few tokens are out

    async def run(self, client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> "Stream":
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        t0, done = time.monotonic(), False
        try:
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    self.outcome, self.error = "http_error", f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    return self
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.outcome, self.error = "error_event", event["error"]["message"]
                            continue
                        choice = event["choices"][0]
                        self.prompt_ids = choice.get("prompt_token_ids") or self.prompt_ids
                        self.ids += choice.get("token_ids") or []
                        if self.ids and self.ttft_s is None:
                            self.ttft_s = time.monotonic() - t0
                        if len(self.ids) >= 8:
                            self.started.set()
            if done and self.outcome == "cut":
                self.outcome = "completed"
        except httpx.HTTPError as exc:
            self.outcome, self.error = "cut", f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.monotonic()
            self.started.set()
        return self


def engine_pid(engine_id: str) -> int:
    return ray.get(ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE).stats.remote()).pid


async def running_on(engine_id: str) -> int:
    handle = ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE)
    return (await handle.stats.remote()).running


async def deadline_misses(client: httpx.AsyncClient, url: str, engine_id: str) -> float:
    text = (await client.get(url + "/metrics", timeout=30)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("raypd_deadline_misses_total") and f'engine="{engine_id}"' in line)


async def reference(engine_id: str, prompt_ids: list[int], max_tokens: int):
    """The uninterrupted greedy answer, alone on `engine_id` (batch 1), with its top-2 logprobs."""
    client = RayEngineClient(engine_id, ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE))
    req = greedy_request(f"ref-{time.monotonic_ns()}", prompt_ids, max_tokens, ignore_eos=True)
    chunks = [c async for c in client.generate(req)]
    return [t for c in chunks for t in c.token_ids], logprobs_of(chunks)


def test_one_both_engine_frozen_mid_stream_every_stream_completes_on_the_other(coordinator):
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = default_app_config(NAME, CONFIG)
    frozen: list[int] = []
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        run_serve_app(build_app(base), NAME, url)

        async def go():
            out: dict = {"health": []}
            async with httpx.AsyncClient() as client:
                warm = await Stream().run(client, url, PROMPTS[5], max_tokens=4)
                assert warm.outcome == "completed", warm.error
                stop_health = asyncio.Event()

                async def health():
                    while not stop_health.is_set():
                        r = await client.get(url + "/health", timeout=10)
                        out["health"].append(r.status_code)
                        await asyncio.sleep(0.25)

                watch = asyncio.ensure_future(health())
                streams = [Stream() for _ in range(3)]
                tasks = [asyncio.ensure_future(s.run(client, url, p)) for s, p in zip(streams, PROMPTS)]
                await asyncio.gather(*(s.started.wait() for s in streams))
                assert not any(t.done() for t in tasks), [s.error for s in streams]
                load = {e: await running_on(e) for e in ENGINES}
                victim = max(ENGINES, key=lambda e: load[e])
                survivor = next(e for e in ENGINES if e != victim)
                gen = await generation(coordinator, victim)
                frozen.extend(freeze_tree([engine_pid(victim)]))
                t0 = time.monotonic()
                late = Stream()  # sent at the moment of the freeze
                tasks.append(asyncio.ensure_future(late.run(client, url, PROMPTS[3])))
                streams.append(late)
                while not await deadline_misses(client, url, victim):  # the router found it hung
                    assert time.monotonic() - t0 < 60, "no deadline missed on the frozen engine"
                    await asyncio.sleep(0.2)
                out["found_s"] = time.monotonic() - t0
                after = [Stream(), Stream()]  # sent once it is known hung: the other engine, at once
                tasks += [asyncio.ensure_future(s.run(client, url, p)) for s, p in zip(after, PROMPTS[4:6])]
                streams += after
                await asyncio.gather(*tasks)
                out["ended_s"] = max(s.ended for s in streams) - t0
                out["new_gen"] = await wait_generation(coordinator, victim, gen, timeout_s=300)
                stop_health.set()
                await watch
                out["streams"], out["victim"], out["survivor"], out["load"] = streams, victim, survivor, load
                out["refs"] = [await reference(survivor, s.prompt_ids, MAX_TOKENS) for s in streams[:4]]
                out["refs"] += [await reference(survivor, s.prompt_ids, MAX_TOKENS) for s in after]
                out["differ"] = {}  # greedy continuations of their references (tests/greedy.py)
                for i, (s, (ref, lps)) in enumerate(zip(streams, out["refs"])):
                    problem = await divergence(s.ids, ref, lps, s.prompt_ids,
                                               lambda prefix, n: reference(survivor, prefix, n))
                    if problem is not None:
                        out["differ"][i] = problem
            return out, gen

        out, gen = asyncio.run(go())
    finally:
        kill_tree(frozen, signal.SIGCONT)
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)

    streams = out["streams"]
    print(f"frozen {out['victim']} (streams running per engine {out['load']}); found hung after "
          f"{out['found_s']:.1f} s; every stream ended {out['ended_s']:.1f} s after the freeze; first tokens of the "
          f"requests sent once it was known hung: {[round(s.ttft_s or -1, 2) for s in streams[4:]]} s; "
          f"back as incarnation {out['new_gen']} (was {gen})")
    assert [s.outcome for s in streams] == ["completed"] * len(streams), [(s.outcome, s.error) for s in streams]
    assert out["differ"] == {}, out["differ"]  # greedy continuations of their references
    assert out["ended_s"] < 30, out["ended_s"]  # a terminal outcome for every stream within 30 s of the freeze
    token_deadline = load_config(CONFIG).router.token_timeout_s  # what a request waiting on the frozen one takes
    assert all(s.ttft_s < token_deadline / 2 for s in streams[4:]), [s.ttft_s for s in streams[4:]]
    assert out["health"] and set(out["health"]) == {200}, out["health"]  # one engine can serve: ready
    assert out["new_gen"] > gen  # killed, restarted and registered again with no command
