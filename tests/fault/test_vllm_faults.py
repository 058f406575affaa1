"""Failure behaviour that lives in vLLM, with real engines (a tiny random Llama: one prefill engine,
two decode engines):

- a prefill nobody will read is released through vLLM's rejection hook: its blocks are free
  within an engine step, far under the lease TTL; while it waits for its reader it is a held
  lease the autoscaler's drain sees (the engine is not idle);
- 30 requests vLLM refuses (out-of-vocabulary ids, longer than the context): all 400, never
  retried, every breaker still closed, P/D still used afterwards;
- migration: 20 concurrent greedy streams through the router, one decode engine killed (-9, actor
  and engine core) mid-stream: every stream completes without an error, within the crash class's
  terminal-outcome bound of the kill (token_timeout_s + deadline_margin x the references' time:
  terminal_bounds.crash_bound_s, docs/failure-semantics.md), and is its uninterrupted reference's
  greedy continuation (the other decode engine recomputed prompt + streamed tokens), and the killed
  engine rejoins by itself;
- a hung decode engine: the same 20 streams, one decode engine frozen (SIGSTOP of its actor and
  vLLM processes) mid-stream: every stream completes by migration, a greedy continuation of its
  uninterrupted reference; the coordinator kills the frozen engine and it rejoins as a new incarnation.

The streams batch differently from their references (migrated ones join the survivor's batch)
and vLLM's CPU kernels are not batch-invariant, so "equal" is `greedy.divergence`: equal, or split
from the reference at a near tie of its two best tokens and, after it, the greedy continuation of the
accepted branch (one more greedy request through the router, alone), checked the same way
(tests/greedy.py).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest
import ray

from actors.models.tiny_llama import build_tiny_llama
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router
from serving.routing.route_errors import InvalidRequest

from chaos_helpers import freeze_tree, generation, kill_tree, pair_states, wait_generation
from engine_calls import request
from greedy import Continuation, divergence, greedy_request, logprobs_of
from terminal_bounds import crash_bound_s, late

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "vllm-faults"
LEASE_TTL_S = 60.0
rng = random.Random(11)


@pytest.fixture(scope="module")
def service(coordinator, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-faults", seed=3, progress=None)
    cfg = DeploymentConfig.from_dict({
        "name": NAME, "backend": "vllm", "model": str(model), "max_model_len": 512,
        "engine_kwargs": {"enforce_eager": True},  # CPU: no torch.compile, short starts
        "prefill": {"count": 1, "num_cpus": 0, "block_size": 32, "cpu_bind": ["0"]},
        "decode": {"count": 2, "num_cpus": 0, "block_size": 32, "cpu_bind": ["1", "1"]},
        "transfer": {"failure_policy": "recompute", "lease_ttl_s": LEASE_TTL_S, "read_timeout_s": 10},
        "router": {"migration_wait_s": 60, "placement": "disaggregate"},
        "restarts": {"max_restarts": 2},
    })
    dep = launch(cfg)
    yield {"dep": dep, "router": build_router(cfg, dep), "cfg": cfg}
    shutdown_deployment(NAME, keep_coordinator=True)


async def wait_free(engine, want: int, timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    while True:
        free = (await engine.stats.remote()).free_blocks
        if free == want or time.monotonic() - t0 > timeout_s:
            return free, time.monotonic() - t0
        await asyncio.sleep(0.02)


def test_unread_prefill_is_released_within_a_step(service):
    (prefill,) = service["dep"].prefills.values()

    async def go():
        total = (await prefill.stats.remote()).num_blocks
        base, _ = await wait_free(prefill, total, 20)
        pre = await prefill.prefill.remote(request("unread", token_ids=[rng.randrange(1000, 40000) for _ in range(150)],
                                                   max_tokens=8))
        held = len(pre.kv_transfer_params["remote_block_ids"])
        assert (await prefill.stats.remote()).free_blocks == base - held
        waiting = await prefill.load.remote()  # what the autoscaler's drain reads
        await prefill.abort.remote("unread")  # the router's release: nobody will read it
        return (base, *(await wait_free(prefill, base, LEASE_TTL_S / 2)), (await prefill.stats.remote()),
                waiting, await prefill.load.remote())

    base, free, took, stats, waiting, released = asyncio.run(go())
    assert (waiting.held_leases, waiting.idle) == (1, False)  # the drain waits for its reader
    assert (released.held_leases, released.idle) == (0, True)
    print(f"unread prefill released in {took * 1000:.0f} ms (lease TTL {LEASE_TTL_S:.0f} s)")
    assert free == base and took < 2.0, (free, base, took)
    assert stats.backend.counters["released"] == 1


def test_engine_side_rejections_are_400_and_open_no_breaker(service, coordinator):
    router = service["router"]
    vocab = 49152  # SmolLM2's tokenizer, which the tiny Llama uses

    async def go():
        for i in range(30):
            ids = [rng.randrange(1000, 40000) for _ in range(20)]
            if i % 2:
                ids[5] = vocab + 1000 + i  # out of vocabulary: only vLLM knows the vocabulary here
                sent = request(f"bad{i}", token_ids=ids, max_tokens=4)
            else:
                sent = request(f"long{i}", token_ids=ids * 30, max_tokens=4)  # 600 tokens > the 512 context
            with pytest.raises(InvalidRequest):
                await router.open(sent)
        await router.drain()
        states = await pair_states(coordinator)
        stream = await router.open(request("good", token_ids=[rng.randrange(1000, 40000) for _ in range(40)],
                                           max_tokens=6))
        chunks = [c async for c in stream]
        return states, stream.route, chunks

    before = dict(router.pool.prefill_failures)
    states, route, chunks = asyncio.run(go())
    assert router.pool.prefill_failures == before and router.pool.counters["prefill_retries"] == 0
    assert all(b.failures == 0 and b.state == "closed" for p, b in states.items() if p.startswith(NAME)), states
    assert route.path == "pd" and route.prefill_id is not None  # P/D still used
    assert chunks[-1].finish_reason == "length" and not any(c.recomputed or c.failed for c in chunks)


@pytest.mark.injects_faults  # freezes or kills an engine on purpose
def test_twenty_greedy_streams_survive_a_decode_engine_kill(service, coordinator):
    prompts, victim_id, reference, answers, back_s, timing = twenty_streams_and_a_fault(service, coordinator, "kill")
    check_every_stream_migrated_as_a_greedy_continuation(service, prompts, victim_id, reference, answers, back_s)
    # a terminal outcome (here: the whole answer) for every stream within the crash class's bound of the
    # kill (the wait in twenty_streams_and_a_fault fails the test on a stream still open at the bound)
    bound_s = timing["bound_s"]
    print(f"references took {timing['reference_s']:.1f} s; every stream ended "
          f"{max(timing['ends'].values()) - timing['t0']:.1f} s after the kill (bound {bound_s:.1f} s)")
    assert all(last.finished and last.finish_reason == "length" for _, last, _, _ in answers)  # none cut
    assert late(timing["ends"], timing["t0"], bound_s) == {}, bound_s


@pytest.mark.injects_faults  # freezes or kills an engine on purpose
def test_twenty_greedy_streams_survive_a_hung_decode_engine(service, coordinator):
    router = service["router"]
    prompts, victim_id, reference, answers, back_s, _ = twenty_streams_and_a_fault(service, coordinator, "freeze")
    check_every_stream_migrated_as_a_greedy_continuation(service, prompts, victim_id, reference, answers, back_s)
    assert router.pool.migrations["engine_hung"] >= 1  # found hung by its deadline, not dead
    events = [e for e in ray.get(coordinator.recent_events.remote(1000)) if e["engine_id"] == victim_id]
    assert any(e["event"] == "removed" and e["reason"].startswith("hung:") for e in events[-5:]), events[-5:]


def twenty_streams_and_a_fault(service, coordinator, fault: str):
    """20 concurrent greedy streams, their uninterrupted references, and one decode engine killed
    (-9, actor and engine core) or frozen (SIGSTOP, the same tree) once a third of the tokens are
    out; returns (the prompts, victim, references, answers, seconds until the victim was back, timing: the
    references' wall time, the fault's moment, when each stream ended and, for a kill, the crash
    class's terminal-outcome bound, which the streams are waited for no longer than)."""
    dep, router = service["dep"], service["router"]
    prompts = [[rng.randrange(1000, 40000) for _ in range(20 + 3 * i)] for i in range(20)]
    max_tokens = 160  # long enough that the engine is still generating when it is killed
    frozen: list[int] = []

    ends: dict[int, float] = {}  # stream -> when its last chunk came (the streams under the fault)

    async def one(i: int, prompt: list[int], ended: dict[int, float] | None = None):
        stream = await router.open(greedy_request(f"mig{i}-{time.monotonic_ns()}", prompt, max_tokens))
        chunks = [c async for c in stream]
        if ended is not None:
            ended[i] = time.monotonic()
        return [t for c in chunks for t in c.token_ids], chunks[-1], stream.migrations, logprobs_of(chunks)

    async def go():
        t_ref = time.monotonic()
        reference = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        timing = {"reference_s": time.monotonic() - t_ref, "ends": ends}  # the same 20 streams, no fault
        assert all(last.finish_reason == "length" for _, last, _, _ in reference)
        streams = [asyncio.ensure_future(one(i, p, ends)) for i, p in enumerate(prompts)]
        victim_id = None
        deadline = time.monotonic() + 60
        while victim_id is None and time.monotonic() < deadline:  # mid-stream: a third of the tokens are out
            busy = {d: load for d, load in router.pool.decode_load.items() if load.requests >= 5}
            owed = {d: load.tokens / (load.requests * max_tokens) for d, load in busy.items()}
            ready = [d for d, share in owed.items() if share < 0.7]
            if ready:
                victim_id = max(ready, key=lambda d: busy[d].requests)
            await asyncio.sleep(0.02)
        assert victim_id is not None, "the streams never got going"
        stats = await dep.decodes[victim_id].stats.remote()
        gen = await generation(coordinator, victim_id)
        t0 = timing["t0"] = time.monotonic()
        if fault == "kill":
            kill_tree([stats.pid, *stats.backend.child_pids])
            # every stream ends within the crash class's bound of the kill: one still open then fails the test
            bound_s = timing["bound_s"] = crash_bound_s(service["cfg"], timing["reference_s"])
            _, open_ = await asyncio.wait(streams, timeout=t0 + bound_s - time.monotonic())
            for task in open_:
                task.cancel()
            assert not open_, f"{len(open_)} streams still open {bound_s:.0f} s after the kill"
        else:
            frozen.extend(freeze_tree([stats.pid]))  # the actor and every vLLM process under it
        answers = await asyncio.gather(*streams)
        await wait_generation(coordinator, victim_id, gen, timeout_s=300)  # it rejoins by itself
        return reference, answers, victim_id, time.monotonic() - t0, timing

    try:
        reference, answers, victim_id, back_s, timing = asyncio.run(go())
    finally:
        kill_tree(frozen, signal.SIGCONT)  # (killed by the coordinator by now)
    return prompts, victim_id, reference, answers, back_s, timing


def alone_through(router) -> Continuation:
    """The greedy continuation of a prefix: one more greedy request through the router, alone."""
    async def continuation(prefix: list[int], max_tokens: int):
        stream = await router.open(greedy_request(f"branch-{time.monotonic_ns()}", prefix, max_tokens))
        chunks = [c async for c in stream]
        return [t for c in chunks for t in c.token_ids], logprobs_of(chunks)
    return continuation


def check_every_stream_migrated_as_a_greedy_continuation(service, prompts, victim_id, reference, answers, back_s):
    migrated = [i for i, (_, _, m, _) in enumerate(answers) if m]
    print(f"{victim_id}: {len(migrated)} of 20 streams migrated; the engine was back in {back_s:.0f} s")
    assert [last.error for _, last, _, _ in answers] == [None] * 20  # no error on any stream
    branch = alone_through(service["router"])

    async def problems():
        return [await divergence(ans, ref, ref_lps, prompt, branch)
                for prompt, (ans, _, _, _), (ref, _, _, ref_lps) in zip(prompts, answers, reference)]

    differ = {i: (i in migrated, problem) for i, problem in enumerate(asyncio.run(problems())) if problem is not None}
    assert differ == {}, f"(migrated?, how it differs) per stream: {differ}"  # greedy continuations
    assert migrated
