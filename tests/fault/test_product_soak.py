"""A soak of the product: the embedded default (configs/local.yaml: two role-flexible `both` SmolLM2
engines on vLLM) as the Serve app, with `router.placement: disaggregate` so that every request whose
pair is usable is prefilled on one engine and decoded on the other (a KV pull), under faults, for at
least SOAK_S (about 5 minutes).

Load: LOAD_WORKERS clients, one request after another, streaming and non-streaming completions
(greedy, `ignore_eos`, several lengths) of 8 prompts of about 170 to 400 tokens. A pull reads the
blocks the decode engine's prefix cache lacks: the whole prompt the first time, its last, partial
block after that. Faults, the fixed schedule PLAN, one at a time, each once the front routes to both
engines again (two down at once is an outage, not a soak): SIGKILL of an engine's process tree (the
actor and vLLM's engine core), SIGSTOP of one for FREEZE_S then SIGCONT (the coordinator may kill it
meanwhile: both ends are fine); after each, the load pauses, LEAVERS clients ask for LEAVE_TOKENS
tokens and disconnect after 3; and NIXL READ errors on every KV pull with probability FAULT_RATE
throughout (`transfer.fault_rate`; the default `recompute` policy computes a failed pull's prompt on
the decode engine).

Bound: no wrong answer (every completed answer is its greedy reference, token for token or split at
near ties, each followed by the greedy continuation of the accepted branch: tests/greedy.py), no cut
stream and no client timeout, clean errors (an HTTP error body or an SSE error event, each with its
code) at most 2 % of the requests. Every fault of PLAN happened (a kill: a new incarnation
registered; a freeze: every process of the tree seen stopped). Each disconnect is an abort: within
RELEASE_S of it no request runs on either engine and both are back at rest (blocks at baseline, no
lease, no handoff), while finishing the streams would take over a minute. KV pulls (the engines'
counters, summed over every incarnation: tests/fault/soak_counts.py) at least the router's
disaggregated requests, less those whose remote prefill failed (prefilled locally) and what the
faults cut short (IN_FLIGHT each); READ errors injected (> 0); every failed pull recomputed (but for
those the faults cut short). At the end: every engine back and registered, at rest; after the
deployment is shut down no actor, placement group or vLLM process of it is left. The synthetic chaos
soak (test_chaos_soak.py) keeps covering topologies (TP, several pools).
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
from soak_counts import PullCounts, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "product-soak"
CONFIG = "configs/local.yaml"
MODEL = load_config(CONFIG).served_model_name
ENGINES = [f"{NAME}-both-0", f"{NAME}-both-1"]
SOAK_S = 300.0  # the load runs this long, and until PLAN is through
PLAN = (("kill", 0), ("freeze", 1), ("kill", 1), ("freeze", 0))  # (fault, index in ENGINES)
LOAD_WORKERS = 3
FREEZE_S = 15.0
FAULT_RATE = 0.3
MAX_ERROR_SHARE = 0.02
LEAVERS = 2  # clients that disconnect mid-stream after each fault
# A leaver's stream would take LEAVE_TOKENS x the ITL (50-70 ms here; >= 40 ms) >= 72 s to finish
# (its prompt, <= 202 tokens, + LEAVE_TOKENS < max_model_len 2048): released within RELEASE_S is the
# abort's doing (and well within the 30 s lease TTL, which would free a prefill's blocks anyway).
LEAVE_TOKENS = 1800
RELEASE_S = 10.0
IN_FLIGHT = LOAD_WORKERS + LEAVERS  # the most requests one fault can cut short
TOPICS = ["a lighthouse keeper", "a steam engine", "the sea", "the planets of the solar system",
          "a forest in autumn", "bees and honey", "the history of Paris", "the blue sky"]
PROMPTS = [f"Here are my notes about {t}. " + " ".join(f"Note {j}: {t} matters to me for reason {j}."
                                                       for j in range(10 + 2 * i)) + f" Now write an essay about {t}."
           for i, t in enumerate(TOPICS)]
LENGTHS = (8, 24, 48)


@dataclass
class Outcome:
    """One request as its client saw it."""
    prompt: str
    max_tokens: int
    stream: bool
    outcome: str = "cut"  # completed | error (a clean one, with its code) | left | cut | timeout
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


async def at_rest(coordinator, baseline: dict[str, int]) -> dict | None:
    """None when both engines are at rest (no request running, blocks at baseline, no held lease, no
    handoff in flight); else what each has."""
    rest = {}
    for e in ENGINES:
        s = await engine(e).stats.remote()
        rest[e] = (s.running, s.free_blocks, s.held_leases, await coordinator.handoffs_in_flight.remote(e))
    return None if rest == {e: (0, baseline[e], 0, 0) for e in ENGINES} else rest


async def rested(coordinator, baseline: dict[str, int], timeout_s: float) -> dict | None:
    """Polls `at_rest` until None or `timeout_s`; its last answer."""
    deadline = time.monotonic() + timeout_s
    while (rest := await at_rest(coordinator, baseline)) is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return rest


async def released(coordinator, baseline: dict[str, int], timeout_s: float) -> tuple[float | None, float | None, list]:
    """Seconds until no request runs on either engine and no handoff is open (the abort's doing), and
    until both are wholly at rest (`at_rest`: their blocks and leases too); None: not within `timeout_s`.
    And what was seen on the way (seconds, `at_rest`), once per change."""
    t0, idle, seen = time.monotonic(), None, []
    while (t := time.monotonic() - t0) < timeout_s:
        rest = await at_rest(coordinator, baseline)
        if not seen or seen[-1][1] != rest:
            seen.append((round(t, 2), rest))
        if idle is None and (rest is None or all(r[0] == r[3] == 0 for r in rest.values())):
            idle = t
        if rest is None:
            return idle, t, seen
        await asyncio.sleep(0.05)
    return idle, None, seen


async def stopped(pids: list[int], timeout_s: float = 2.0) -> bool:
    """Whether every process of `pids` shows as stopped (SIGSTOP landed) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pids and all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in pids):
                return True
        except psutil.Error:
            return False
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


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


def test_the_default_serve_app_under_kills_freezes_read_errors_and_disconnects(coordinator):
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = default_app_config(NAME, CONFIG)
    base.setdefault("transfer", {})["fault_rate"] = FAULT_RATE
    base.setdefault("router", {})["placement"] = "disaggregate"
    faults: list[tuple[str, str, bool]] = []  # (fault, engine, seen: a new incarnation, or every process stopped)
    releases: list[tuple] = []  # per fault: leavers' outcomes, `released` (seconds to idle, to rest, seen)
    counts = PullCounts()
    seen_pids: set[int] = set()
    frozen: list[int] = []
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        run_serve_app(build_app(base), NAME, url)
        baseline = {e: ray.get(engine(e).stats.remote()).free_blocks for e in ENGINES}

        async def go():
            rng = random.Random(25)
            answers: list[Outcome] = []
            until = time.monotonic() + SOAK_S
            chaos_done = asyncio.Event()
            gate = asyncio.Event()  # open: the workers send; closed: they wait (a disconnect is measured)
            gate.set()
            busy = [0]

            async def worker(i: int):
                wrng = random.Random(i)
                async with httpx.AsyncClient() as client:
                    while time.monotonic() < until or not chaos_done.is_set():
                        await gate.wait()
                        busy[0] += 1
                        answers.append(await send(client, url, wrng.choice(PROMPTS), wrng.choice(LENGTHS),
                                                  stream=wrng.random() < 0.7))
                        busy[0] -= 1

            async def disconnect(client: httpx.AsyncClient) -> None:
                """The load paused and drained, LEAVERS streams that leave after 3 tokens: how long
                until both engines are at rest again."""
                gate.clear()
                while busy[0]:
                    await asyncio.sleep(0.1)
                before = await rested(coordinator, baseline, 60)
                assert before is None, f"not at rest before the disconnects: {before}"
                left = await asyncio.gather(*(send(client, url, p, LEAVE_TOKENS, True, leave_after=3)
                                              for p in PROMPTS[:LEAVERS]))
                releases.append(([a.outcome for a in left], *await released(coordinator, baseline, 3 * RELEASE_S)))
                gate.set()

            async def chaos():
                try:
                    await faults_in_turn()
                finally:  # the workers stop at the end of the soak, whatever happened here
                    chaos_done.set()
                    gate.set()

            async def faults_in_turn():
                async with httpx.AsyncClient() as client:
                    for fault, i in PLAN:
                        await asyncio.sleep(rng.uniform(5, 10))
                        victim = ENGINES[i]
                        gen = await generation(coordinator, victim)
                        stats = await engine(victim).stats.remote()
                        counts.sample(stats)  # its incarnation's last counts, if this fault ends it
                        tree = [stats.pid, *stats.backend.child_pids]
                        seen_pids.update(tree)
                        if fault == "kill":
                            kill_tree(tree)
                            await wait_generation(coordinator, victim, gen, timeout_s=240)
                            faults.append((fault, victim, True))
                        else:
                            frozen.extend(freeze_tree(tree))
                            faults.append((fault, victim, await stopped(tree)))
                            await asyncio.sleep(FREEZE_S)
                            kill_tree(frozen, signal.SIGCONT)
                            frozen.clear()
                        await recovered(client, url)  # one fault at a time: the other engine serves meanwhile
                        await disconnect(client)

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
            rest = await rested(coordinator, baseline, 60)
            for e in ENGINES:
                stats = await engine(e).stats.remote()
                counts.sample(stats)
                seen_pids.update([stats.pid, *stats.backend.child_pids])
            async with httpx.AsyncClient() as client:
                metrics = (await client.get(url + "/metrics", timeout=10)).text
            survivor = ENGINES[0]
            refs = {}
            for a in answers:  # one reference per prompt, as long as the longest answer (greedy, ignore_eos)
                key = tuple(a.prompt_ids)
                if a.outcome == "completed" and key not in refs:
                    refs[key] = await _reference(survivor, a.prompt_ids, max(LENGTHS))
            wrong = [(a.prompt[:40], a.max_tokens, problem) for a in answers if a.outcome == "completed"
                     and (problem := await _wrong(a, *refs[tuple(a.prompt_ids)], survivor)) is not None]
            return answers, rest, wrong, metrics

        answers, rest, wrong, metrics = asyncio.run(go())
    finally:
        kill_tree(frozen, signal.SIGCONT)
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)

    outcomes = {k: sum(1 for a in answers if a.outcome == k) for k in ("completed", "error", "cut", "timeout")}
    errors = [(a.code, a.error) for a in answers if a.outcome == "error"]
    remote = metric_sum(metrics, "raypd_disagg_decisions_total", decision="remote")
    fallbacks = metric_sum(metrics, "raypd_fallbacks_total", reason="prefill_failed")  # of remote decisions
    cut_short = IN_FLIGHT * len(PLAN)
    print(f"faults: {faults}; disconnects (outcomes, seconds to idle, to rest, seen): {releases}; {len(answers)} "
          f"requests: {outcomes}; clean errors {errors}; router: {remote:.0f} disaggregated, {fallbacks:.0f} of "
          f"them prefilled locally after a failed prefill ({metric_sum(metrics, 'raypd_fallbacks_total'):.0f} "
          f"fallbacks in all); "
          f"engines: {counts.summary()}; at rest {rest}")
    assert outcomes["cut"] == outcomes["timeout"] == 0, [(a.outcome, a.error) for a in answers
                                                          if a.outcome in ("cut", "timeout")]
    assert wrong == [], wrong
    assert len(errors) <= MAX_ERROR_SHARE * len(answers), errors
    assert all(code for code, _ in errors), errors  # each clean error names its reason
    # the schedule, each fault seen to happen
    assert faults == [(fault, ENGINES[i], True) for fault, i in PLAN]
    # each disconnect an abort: both engines at rest long before the streams could have finished
    assert [(outcomes_, idle is not None and idle <= RELEASE_S, rest_s is not None and rest_s <= RELEASE_S)
            for outcomes_, idle, rest_s, _ in releases] == [(["left"] * LEAVERS, True, True)] * len(PLAN), releases
    # KV pulls happened: every disaggregated request pulled, but for those whose prefill failed (prefilled
    # on their decode engine) and those the faults cut short
    assert counts.pulls >= remote - fallbacks - cut_short > 0, (counts.summary(), remote, fallbacks)
    assert counts.read_errors > 0  # the knob injected READ errors
    assert counts.recomputed >= counts.failed_pulls - cut_short, counts.summary()  # and each was recomputed
    assert rest is None, rest  # blocks, leases, handoffs: nothing stranded
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
