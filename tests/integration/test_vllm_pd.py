"""Real vLLM prefill and decode engines (Ray actors) moving KV through raypd's connector.

Tiny random Llamas keep it fast: P and D share weights "a"; D2 has weights "b"
under the same compatibility id, so its answers show whose KV it used.
Prefix caching is off so a colocated reference never reuses transferred KV.
P has a small KV cache (`P_BLOCKS`), so a test can make vLLM hand all of it out.
Leases last 60 s and every wait for freed blocks is 20 s at most: blocks come
back because readers notified the producer, except in the two tests whose
prefill asks for a short lease (`lease_ttl_s`): an unclaimed prefill, and a
reader that comes after its lease ended.
"""

import asyncio
import random
import signal
import time

import psutil
import pytest
import ray

from actors.control.coordinator import COORDINATOR_NAME
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.engine.config import EngineConfig
from actors.kv.plan.pull_types import LEASE_ENDED
from actors.models.tiny_llama import build_tiny_llama
from actors.protocol.request import SamplingSpec
from actors.transfer_config import TransferConfig
from engine_calls import collect, request, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

Engine = ray.remote(EngineActor)
rng = random.Random(7)
PROMPTS = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in (10, 32, 150)}
P_BLOCKS = 48  # P's KV cache (vLLM keeps one of them aside: its null block)


def run(coro):
    return asyncio.run(coro)


def make_engine(role, engine_id, model, bind, failure_policy="fail", num_blocks=None, **kw):
    kw = {"model_id": "tiny-a", "block_size": 32, **kw}
    transfer = TransferConfig(lease_ttl_s=60, read_timeout_s=10, failure_policy=failure_policy)
    extra = {"num_gpu_blocks_override": num_blocks} if num_blocks else {}
    cfg = EngineConfig(role=role, backend="vllm", engine_id=engine_id, model=str(model), max_model_len=512,
                       cpu={"bind": bind}, dtype="float32",
                       engine_kwargs={"enable_prefix_caching": False, "enforce_eager": True, **extra},
                       num_cpus=0, transfer=transfer, **kw)
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    a = build_tiny_llama(root / "tiny-a", seed=0, progress=None)
    b = build_tiny_llama(root / "tiny-b", seed=1, progress=None)
    e = {
        "P": make_engine("prefill", "tp-P", a, "0", num_blocks=P_BLOCKS),
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


def test_a_read_prefills_lease_ends_with_the_readers_notice_not_its_ttl(engines):
    """Exact leases: the producer's held lease (what a drain waits for) ends when the reader's notice
    arrives, long before its 60 s TTL; the notice, not a timer, is counted."""
    def ended(stats):
        return {k: stats.backend.counters[k] for k in ("leases_released_by_notice", "leases_expired")}

    async def go():
        base = await baselines(engines)
        before = ended(await engines["P"].stats.remote())
        sent = time.monotonic()
        await pd(engines, "D", PROMPTS[32])
        after = await until("the reader's notice ends P's lease",
                            lambda: _released(engines["P"], base["P"]), timeout=20.0)
        assert time.monotonic() - sent < 60  # the lease's TTL: no timer ended it
        assert {k: v - before[k] for k, v in ended(after).items()} == \
            {"leases_released_by_notice": 1, "leases_expired": 0}

    run(go())


async def _released(engine, baseline):
    stats = await engine.stats.remote()
    return stats if stats.held_leases == 0 and stats.free_blocks == baseline else None


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


def greedy(rid, prompt, max_tokens, **changes):
    """A greedy request that never stops early (every answer has exactly `max_tokens` tokens)."""
    return request(rid, token_ids=prompt, max_tokens=max_tokens, **changes).replace(
        sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True))


def signal_tree(pids, sig):
    """Send `sig` to the processes and all their descendants; returns every pid signalled."""
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
    return [proc.pid for proc in procs]


async def until(what, check, timeout=20.0):
    """Poll `check()` (a coroutine function) until it returns something truthy; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (got := await check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        await asyncio.sleep(0.05)
    return got


@pytest.mark.injects_faults  # freezes or kills an engine on purpose
def test_a_late_pull_of_reused_blocks_is_refused_by_the_lease_and_recomputed(engines, coordinator):
    """Late pull, forced, under policy recompute (what the shipped deployment files use). D2 (the
    reader) holds the request while its engine core, where its ranks pull, is frozen (SIGSTOP); the
    producer's 1 s lease ends by expiry and vLLM frees the blocks; other prompts then take every
    block P has, so the victim's blocks hold their KV. Thawed, the reader's data READ succeeds (valid
    block ids, other prompts' KV): only the lease board's record (RELEASED) refuses it. The answer is
    D2's own greedy recompute, the failure is counted on D2 by its kind (lease_ended), and the
    ledger's one verdict for the request is a failure whose reason names the lease."""
    async def go():
        base = await baselines(engines)
        assert base["P"] == P_BLOCKS
        fill_rng = random.Random(25)
        prompt, max_tokens, rid = PROMPTS[150], 8, f"late{time.monotonic_ns()}"
        p0, d0 = (await engines["P"].stats.remote()).backend.counters, await engines["D2"].stats.remote()
        ledger0 = await coordinator.transfers.remote()
        late = greedy(rid, prompt, max_tokens, lease_ttl_s=1.0)
        pre = await engines["P"].prefill.remote(late)
        victim = set(pre.kv_transfer_params["remote_block_ids"])
        assert len(victim) == 5  # 150 tokens in blocks of 32
        frozen, fillers, answer, chunks = [], [], None, None
        try:
            frozen = signal_tree(d0.backend.child_pids, signal.SIGSTOP)  # vLLM's engine core: D2's ranks
            assert frozen
            gen = engines["D2"].generate.options(num_returns="streaming").remote(
                pre.continuation(late).replace(request_id=rid + "-d"))
            answer = asyncio.ensure_future(drain(gen))
            # the reader holds the request (its ledger handoff is open); its ranks cannot pull
            await until("D2 holds the request", lambda: running(engines["D2"], 1), timeout=10)
            # the lease ends by expiry (no reader came) and vLLM frees the victim's blocks
            await until("P's lease expired", lambda: expired(engines["P"], p0["leases_expired"] + 1))
            assert (await wait_free(engines["P"], base["P"])).free_blocks == base["P"]
            # other prompts (long leases) take every block P has: vLLM hands the victim's out too
            usable, taken = base["P"] - 1, set()  # less vLLM's null block
            while len(taken) < usable:
                n = min(15, usable - len(taken))
                fid = f"{rid}-fill{len(fillers)}"
                filler = greedy(fid, [fill_rng.randrange(1000, 40000) for _ in range(32 * n - 8)], 2)
                fill = await asyncio.wait_for(engines["P"].prefill.remote(filler), 30)
                fillers.append(fid)
                got = set(fill.kv_transfer_params["remote_block_ids"])
                assert len(got) == n and not got & taken, (n, got, taken)
                taken |= got
            assert victim <= taken, (victim, taken)  # the victim's blocks now hold other prompts' KV
            signal_tree(frozen, signal.SIGCONT)  # the reader pulls now
            frozen = []
            chunks = await asyncio.wait_for(answer, 60)
        finally:
            signal_tree(frozen, signal.SIGCONT)
            if answer is not None and chunks is None:  # no answer: stop the request
                answer.cancel()
                await engines["D2"].abort.remote(rid + "-d")
            for fid in fillers:
                await engines["P"].abort.remote(fid)
        tokens = list(pre.first_token_ids) + [t for c in chunks for t in c.token_ids]
        assert chunks[0].recomputed and chunks[-1].finish_reason == "length", chunks[-1]
        assert len(tokens) == max_tokens
        # after P's first token, D2 computed the whole prompt with its own weights
        own = await local_greedy(engines["D2"], prompt + tokens[:1], max_tokens - 1)
        assert tokens[1:] == own
        # counted on D2 by its kind: the lease check failed it (one pull, nothing else)
        d1 = await engines["D2"].stats.remote()
        moved = {k: d1.backend.counters[k] - d0.backend.counters.get(k, 0)
                 for k in d1.backend.counters if k.startswith("pull_failures_")}
        assert moved == {"pull_failures_lease_ended": 1, "pull_failures_no_lease_record": 0,
                         "pull_failures_integrity": 0, "pull_failures_transfer": 0}, moved
        assert d1.backend.counters["recomputed"] - d0.backend.counters["recomputed"] == 1
        # the ledger: one failed verdict, for this request, naming the lease
        ledger1 = await until("the ledger's failed verdict", lambda: failed_after(coordinator, ledger0))
        assert ledger1.verdicts["failed"] - ledger0.verdicts["failed"] == 1
        assert ledger1.verdicts["ok"] == ledger0.verdicts["ok"]
        events = [e for e in await coordinator.recent_events.remote(1000)
                  if e["event"] == "transfer_failed" and e.get("req_id") == rid + "-d"]
        assert [e["reason"] for e in events] == [f"KV pull failed: {LEASE_ENDED}"], events
        for k in ("P", "D2"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    run(go())


async def drain(gen):
    return [await ref async for ref in gen]


async def running(engine, n):
    return (await engine.stats.remote()).running == n


async def expired(engine, n):
    return (await engine.stats.remote()).backend.counters["leases_expired"] == n


async def failed_after(coordinator, before):
    snap = await coordinator.transfers.remote()
    return snap if snap.verdicts["failed"] > before.verdicts["failed"] else None


async def local_greedy(engine, prompt, max_tokens):
    chunks = await collect(engine, greedy(f"l{time.monotonic_ns()}", prompt, max_tokens))
    return [t for c in chunks for t in c.token_ids]


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
