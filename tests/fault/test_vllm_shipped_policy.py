"""Two fault classes of docs/failure-semantics.md on real vLLM engines (SmolLM2, the embedded model) with
the shipped failure policy (`recompute`, `TransferConfig`'s default: the deployment sets none), through
the Serve app the product builds (`build_app`), in its default mode.

The deployment is configs/local-pd.yaml's (1 prefill + 1 decode engine, one core each, placement
`disaggregate`: every request pulls its KV), renamed, its failure policy left to the default. Two of them,
one at a time (2 cores): `transfer.fault_rate` is read when the engines' workers start, so the READ errors
need their own deployment.

1. Coordinator loss (fault_rate 0): 4 greedy streams in flight, the coordinator killed
   (`ray.kill(no_restart=False)`: Ray restarts it, empty). Every stream completes ([DONE], none cut), is
   its batch-1 reference's greedy continuation (the streams batch together: `greedy.divergence`) and ends
   within the coordinator-loss bound of the kill (terminal_bounds.coordinator_bound_s); the coordinator is
   back and both engines registered again within REREGISTER_S; a new request is then served P/D (the
   decode engine pulls its prompt) with its reference's answer; nothing is left held.
2. READ errors (fault_rate 1.0: every NIXL READ fails by injection): N greedy streams of prompts of a few
   hundred tokens, one at a time. Every one completes with exactly its fault-free answer (the same prompt
   through the fault-free deployment, also one at a time: batch 1 on engines set up alike, so token for
   token: `greedy.exact_divergence`); the decode engine counts N pulls, N failed in the transport (the
   injection; the pair's breaker names it) and N recomputed; each recomputed stream's decode token comes
   within the READ-error bound under `recompute` of the prefill engine's (read_timeout_s + the local
   prefill's first-chunk deadline: terminal_bounds.read_error_recompute_bound_s); at rest no lease is held
   and both engines' blocks are back at their baseline. The pair's breaker threshold is raised above N
   for this deployment so all N requests go P/D (at the default of 3 the pair would open and later
   requests would be placed decode-local: the breaker is not what this test is about).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
import ray

from actors.transfer_config import TransferConfig
from serving.cluster.app import build_app, resolve_config
from serving.cluster.clients import RayEngineClient
from serving.cluster.launcher import shutdown_deployment
from serving.cluster.names import NAMESPACE, actor_name_of
from serving.config import DeploymentConfig, load_config

from chaos_helpers import pair_states
from greedy import alone, divergence, exact_divergence
from service_helpers import free_port, run_serve_app
from terminal_bounds import coordinator_bound_s, late, read_error_recompute_bound_s

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

CONFIG = "configs/local-pd.yaml"
MODEL = load_config(CONFIG).served_model_name
FAULT_FREE = "policy-ok"
READ_ERRORS = "policy-read-errors"
# The coordinator restarts (a new actor process), each engine's link finds it (`_await_coordinator`: its
# retries at most 5 s apart) and registers once: measured ~2 s here; asserted with room for a loaded host.
REREGISTER_S = 20.0
REST_S = 45.0  # the longest the test waits for the engines to be at rest (the lease TTL, 30 s, is the backstop)

BODY = ("Write down what you know about it: where it is found, who works there, what a day there looks like "
        "from the early morning to the late evening, which tools and machines are used and how they are kept "
        "in good order, what can go wrong and how people deal with it, how the place has changed over the "
        "last hundred years, what visitors usually notice first, and which stories the older people like to "
        "tell about it. Mention the weather in each season, the sounds and the smells, the food people eat "
        "during their breaks, and the small habits that newcomers have to learn. Then explain why the place "
        "matters to the town around it, what would be lost if it closed, and what could be done to keep it "
        "going for another hundred years. Keep the tone calm and precise, use plain words, and give at least "
        "one concrete example for every point you make, so that a reader who has never been there could "
        "picture it clearly, and end with a short list of the three things you would show a first-time visitor.")
READ_TOPICS = ["a lighthouse", "a steam engine shed", "a bee farm", "a mountain railway", "a glass workshop",
               "a city library"]
STREAM_TOPICS = ["a river ferry", "a clock maker's shop", "a night market", "a desert observatory"]
AFTER_TOPIC = "a fishing harbour"
READ_TOKENS = 24
STREAM_TOKENS = 48


def prompt(topic: str) -> str:
    """A few hundred tokens; the topic comes first so no two prompts share a cached block."""
    return f"This is a report about {topic}. {BODY}"


@dataclass
class Stream:
    """One streamed completion as its client saw it."""

    prompt: str
    outcome: str = "cut"  # completed | error_event | http_error | cut | timeout
    status: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # when each token came (a chunk's tokens share its time)
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None


async def send(client: httpx.AsyncClient, url: str, text: str, max_tokens: int, out: Stream | None = None) -> Stream:
    """A greedy streamed completion (`ignore_eos`: exactly `max_tokens`), recorded in `out` as it comes."""
    out = out or Stream(text)
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    out.started = time.monotonic()
    done = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.outcome, out.error = "http_error", (await r.aread()).decode()[:300]
                return out
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = json.dumps(event["error"])
                        continue
                    choice = event["choices"][0]
                    out.prompt_ids = choice.get("prompt_token_ids") or out.prompt_ids
                    tokens = choice.get("token_ids") or []
                    out.ids += tokens
                    out.arrivals += [time.monotonic()] * len(tokens)
        if done:
            out.outcome = "error_event" if out.error is not None else "completed"
    except httpx.TimeoutException as exc:
        out.outcome, out.error = "timeout", repr(exc)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.outcome, out.error = "cut", repr(exc)
    finally:
        out.ended = time.monotonic()
    return out


def engine(engine_id: str):
    return ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE)


def ids_of(name: str) -> tuple[str, str]:
    return f"{name}-prefill-0", f"{name}-decode-0"


class Apps:
    """The module's Serve front and at most one of its two apps at a time (2 cores): `up` replaces the one
    running. Records each engine's free blocks once the app is up (the baseline at rest)."""

    def __init__(self, url: str):
        self.url = url
        self.name: str | None = None
        self.cfg: DeploymentConfig | None = None
        self.baseline: dict[str, int] = {}

    def up(self, name: str, fault_rate: float, breaker_threshold: int | None = None) -> DeploymentConfig:
        if self.name == name:
            return self.cfg
        self.down()
        base = load_config(CONFIG).model_dump(mode="json", exclude_unset=True)
        base["name"] = name
        for group in ("prefill", "decode"):  # the session cluster's CPUs are shared by the test modules
            base[group]["num_cpus"] = 0
        base["transfer"].pop("failure_policy", None)  # the shipped policy: the config model's default
        base["transfer"]["fault_rate"] = fault_rate
        if breaker_threshold is not None:
            base.setdefault("breaker", {})["failure_threshold"] = breaker_threshold
        cfg = resolve_config(base)  # what the Serve app runs with
        assert cfg.transfer.failure_policy == TransferConfig().failure_policy == "recompute"
        up_s = run_serve_app(build_app(base), name, self.url)
        self.name, self.cfg = name, cfg
        self.baseline = {e: ray.get(engine(e).stats.remote(), timeout=60).free_blocks for e in ids_of(name)}
        print(f"{name} up in {up_s:.0f} s")
        return cfg

    def down(self) -> None:
        from ray import serve

        if self.name is not None:
            name, self.name = self.name, None
            serve.delete(name)
            shutdown_deployment(name, keep_coordinator=True)


@pytest.fixture(scope="module")
def apps(coordinator):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = Apps(f"http://127.0.0.1:{port}")
    try:
        yield apps
    finally:
        try:
            apps.down()
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def fault_free_answers(apps) -> dict[str, Stream]:
    """The READ-error prompts through the fault-free deployment, one at a time: the references."""
    apps.up(FAULT_FREE, fault_rate=0.0)

    async def go():
        async with httpx.AsyncClient() as client:
            return {t: await send(client, apps.url, prompt(t), READ_TOKENS) for t in READ_TOPICS}

    answers = asyncio.run(go())
    assert {t: a.outcome for t, a in answers.items()} == {t: "completed" for t in READ_TOPICS}, \
        {t: a.error for t, a in answers.items()}
    return answers


async def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def at_rest(coordinator, apps: Apps) -> dict[str, tuple]:
    """Until both engines are at rest (nothing running, no held lease, no handoff in flight, every block
    back), or REST_S passed: engine -> (running, free blocks, held leases, handoffs in flight)."""
    want = {e: (0, apps.baseline[e], 0, 0) for e in apps.baseline}
    deadline = time.monotonic() + REST_S
    while True:
        rest = {}
        for e in apps.baseline:
            s = await engine(e).stats.remote()
            rest[e] = (s.running, s.free_blocks, s.held_leases, await coordinator.handoffs_in_flight.remote(e))
        if rest == want or time.monotonic() > deadline:
            return rest
        await asyncio.sleep(0.2)


async def reference(engine_id: str, prompt_ids: list[int], n: int):
    return await alone(RayEngineClient(engine_id, engine(engine_id)), prompt_ids, n)


def counters(engine_id: str) -> dict[str, int]:
    s = ray.get(engine(engine_id).stats.remote(), timeout=60)
    return {**s.backend.counters, "actor_recomputed": s.recomputed}


def moved(before: dict[str, int], after: dict[str, int], keys) -> dict[str, int]:
    return {k: after[k] - before[k] for k in keys}


def test_coordinator_loss_mid_stream_leaves_every_stream_whole(apps, coordinator):
    cfg = apps.up(FAULT_FREE, fault_rate=0.0)
    prefill_id, decode_id = ids_of(FAULT_FREE)
    bound_s = None

    async def go():
        nonlocal bound_s
        async with httpx.AsyncClient() as client:
            # the same load without a fault: its slowest stream is the fault-free time T of the bound
            warm = await asyncio.gather(*(send(client, apps.url, prompt(t), STREAM_TOKENS) for t in STREAM_TOPICS))
            assert [s.outcome for s in warm] == ["completed"] * len(warm), [s.error for s in warm]
            bound_s = coordinator_bound_s(cfg, max(s.ended - s.started for s in warm))
            old_pid = await coordinator.pid.remote()
            streams = [Stream(prompt(t)) for t in STREAM_TOPICS]
            tasks = [asyncio.ensure_future(send(client, apps.url, s.prompt, STREAM_TOKENS, s)) for s in streams]
            await until(lambda: all(len(s.ids) >= 3 for s in streams), 60, "the streams never got going")
            in_flight = [not t.done() for t in tasks]
            t0 = time.monotonic()
            ray.kill(coordinator, no_restart=False)  # Ray restarts it: the same handle, an empty directory
            back_s = None
            while back_s is None:
                try:
                    pid = await coordinator.pid.remote()
                    listed = {e.engine_id for e in await coordinator.engines.remote()}
                    if pid != old_pid and listed >= {prefill_id, decode_id}:
                        back_s = time.monotonic() - t0
                except ray.exceptions.RayError:
                    pass
                assert time.monotonic() - t0 < REREGISTER_S + 60, "the engines never registered again"
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks)
            # P/D again, with a prompt neither engine has seen: the decode engine pulls it
            before = counters(decode_id)
            after_stream = await send(client, apps.url, prompt(AFTER_TOPIC), STREAM_TOKENS)
            after = counters(decode_id)
            rest = await at_rest(coordinator, apps)
            refs = [await reference(decode_id, s.prompt_ids, STREAM_TOKENS) for s in [*streams, after_stream]]
            wrong = {i: problem for i, (s, (ref, lps)) in enumerate(zip([*streams, after_stream], refs))
                     if (problem := await divergence(s.ids, ref, lps, s.prompt_ids,
                                                     lambda p, n: reference(decode_id, p, n))) is not None}
            return t0, in_flight, streams, back_s, before, after_stream, after, rest, wrong

    t0, in_flight, streams, back_s, before, after_stream, after, rest, wrong = asyncio.run(go())
    print(f"engines registered again {back_s:.1f} s after the coordinator was killed; streams ended "
          f"{max(s.ended for s in streams) - t0:.1f} s after it (bound {bound_s:.1f} s); after: "
          f"{moved(before, after, ('kv_pulls', 'prompt_tokens_pulled', 'recomputed'))}; at rest {rest}")
    assert in_flight == [True] * len(streams)  # every stream was mid-way at the kill
    assert [s.outcome for s in streams] == ["completed"] * len(streams), [(s.outcome, s.error) for s in streams]
    assert [len(s.ids) for s in streams] == [STREAM_TOKENS] * len(streams)  # none cut short
    assert late({i: s.ended for i, s in enumerate(streams)}, t0, bound_s) == {}, bound_s
    assert back_s <= REREGISTER_S, back_s
    # served P/D again: one pull, of the whole prompt but its last token, nothing recomputed
    assert after_stream.outcome == "completed", after_stream.error
    pulled = moved(before, after, ("kv_pulls", "recomputed", "kv_failures"))
    assert pulled == {"kv_pulls": 1, "recomputed": 0, "kv_failures": 0}, pulled
    assert after["prompt_tokens_pulled"] - before["prompt_tokens_pulled"] > 100
    assert wrong == {}, wrong  # stream i (the last: the request after the restart) vs its batch-1 reference
    assert rest == {e: (0, apps.baseline[e], 0, 0) for e in apps.baseline}, rest  # nothing stranded


def test_read_errors_are_recomputed_into_the_fault_free_answer(apps, fault_free_answers, coordinator):
    n = len(READ_TOPICS)
    cfg = apps.up(READ_ERRORS, fault_rate=1.0, breaker_threshold=n + 1)
    prefill_id, decode_id = ids_of(READ_ERRORS)
    kinds = [k for k in counters(decode_id) if k.startswith("pull_failures_")]
    keys = ("kv_pulls", "recomputed", "actor_recomputed", "kv_failures", *kinds)
    lease_keys = ("released", "leases_released_by_notice", "leases_expired")
    before, held_before = counters(decode_id), counters(prefill_id)

    async def go():
        async with httpx.AsyncClient() as client:
            answers = {t: await send(client, apps.url, prompt(t), READ_TOKENS) for t in READ_TOPICS}  # batch 1
        t0 = time.monotonic()
        rest = await at_rest(coordinator, apps)
        return answers, rest, time.monotonic() - t0, await pair_states(coordinator)

    answers, rest, rest_s, states = asyncio.run(go())
    after, held_after = counters(decode_id), counters(prefill_id)
    gaps = {t: round(a.arrivals[1] - a.arrivals[0], 2) for t, a in answers.items() if len(a.arrivals) > 1}
    # the local prefill's fault-free time: the same prompt's prefill on the prefill engine (set up alike)
    bounds = {t: read_error_recompute_bound_s(cfg, a.arrivals[0] - a.started) for t, a in answers.items()
              if a.arrivals}
    pair = states.get(f"{prefill_id}->{decode_id}")
    print(f"prompt tokens {[len(a.prompt_ids) for a in answers.values()]}; decode engine {moved(before, after, keys)}; "
          f"first -> second token {gaps} s (bounds {min(bounds.values()):.1f} s+); breaker {pair}; prefill engine's "
          f"leases {moved(held_before, held_after, lease_keys)}; at rest {rest} {rest_s:.1f} s after the last answer")
    assert {t: (a.status, a.outcome) for t, a in answers.items()} == {t: (200, "completed") for t in READ_TOPICS}, \
        {t: a.error for t, a in answers.items()}
    assert all(len(a.prompt_ids) >= 200 for a in answers.values())  # a few hundred tokens each
    wrong = {t: problem for t, a in answers.items()
             if (problem := exact_divergence(a.ids, fault_free_answers[t].ids)) is not None}
    assert wrong == {}, wrong  # token for token the fault-free answer
    # every pull failed in the transport (the injected READ error) and was recomputed; nothing else failed
    want = {k: 0 for k in keys} | {"kv_pulls": n, "recomputed": n, "actor_recomputed": n, "pull_failures_transfer": n}
    assert moved(before, after, keys) == want
    assert pair is not None and (pair.state, pair.failures) == ("closed", n), pair
    assert "fault injected on purpose" in pair.last_reason, pair.last_reason
    assert all(gaps[t] <= bounds[t] for t in READ_TOPICS), (gaps, bounds)
    assert rest == {e: (0, apps.baseline[e], 0, 0) for e in apps.baseline}, rest  # no lease held, blocks back
    # every prefill's lease ended at once, not by its TTL: the router lets the prefill go when the recomputed
    # chunk comes (the injected fault fails each pull before the reader's first contact with the producer,
    # so no reader notice reaches it)
    assert moved(held_before, held_after, lease_keys) == {"released": n, "leases_released_by_notice": 0,
                                                          "leases_expired": 0}
