"""A hung engine (SIGSTOP of its actor and rank actors: what a wedged driver call looks like), synthetic
engines through the HTTP front, with the router's and the coordinator's default deadlines:

- two decode engines: every stream on the frozen one misses its token deadline, migrates to the other
  and completes token for token as the uninterrupted answer;
- one decode engine (no restart within `migration_wait_s`): every stream ends with an SSE error
  event (never a cut connection) within 30 s,
  a new request is answered at once with 503 and the reason, /health says 503 with the reason; the
  coordinator's probe times out, it evicts and kills the engine (ray.kill, no_restart=False), Ray
  restarts it as a new incarnation, and /health goes back to 200 and P/D serves again, with no
  command from the test; the hang is counted (raypd_engine_hangs_total).
The same with real vLLM engines: test_vllm_hang.py.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import ray

from serving.cluster.clients import build_router
from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig
from serving.front import create_app

from chaos_helpers import SteadyLoad, freeze_tree, generation, kill_tree, process_tree, wait_generation
from engine_calls import request
from service_helpers import SYNTHETIC, UvicornThread, free_port

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

MODEL = "synthetic-tiny"
PROMPTS = [f"a hung engine prompt {i} " * 3 for i in range(6)]
MAX_TOKENS = 60


def deployment(name: str, decodes: int, **router) -> DeploymentConfig:
    return DeploymentConfig.from_dict({
        **SYNTHETIC, "name": name, "router": router,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.05},
        "decode": {**SYNTHETIC["decode"], "count": decodes},
        "transfer": {"failure_policy": "recompute", "lease_ttl_s": 20, "read_timeout_s": 5},
        "breaker": {"failure_threshold": 3, "cooldown_s": 2.0, "probe_window_s": 2.0},
    })


async def wait_health(url: str, status: int, timeout_s: float) -> tuple[float, dict]:
    t0 = time.monotonic()
    async with httpx.AsyncClient() as client:
        while True:
            r = await client.get(url + "/health", timeout=10)
            if r.status_code == status or time.monotonic() - t0 > timeout_s:
                return time.monotonic() - t0, r.json()
            await asyncio.sleep(0.2)


def test_streams_on_a_hung_decode_engine_migrate_token_for_token(coordinator):
    name = "hang-two"
    cfg = deployment(name, 2)
    dep = launch(cfg)
    router = build_router(cfg, dep)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stopped: list[int] = []
    try:
        with UvicornThread(create_app(cfg, router), port):
            async def go():
                load = SteadyLoad(url, MODEL, PROMPTS, MAX_TOKENS)
                async with httpx.AsyncClient() as client:
                    want = {p: (await load.one(client, p)).text for p in PROMPTS}
                    streams = [asyncio.ensure_future(load.one(client, PROMPTS[i % len(PROMPTS)])) for i in range(8)]
                    await asyncio.sleep(1.0)  # every stream is under way
                    victim = max(router.pool.decode_load, key=lambda d: router.pool.decode_load[d].requests)
                    on_victim = router.pool.decode_load[victim].requests
                    gen = await generation(coordinator, victim)
                    stopped.extend(freeze_tree(await process_tree(dep.decodes[victim])))
                    t0 = time.monotonic()
                    answers = await asyncio.gather(*streams)
                    took = time.monotonic() - t0
                back = await wait_generation(coordinator, victim, gen, timeout_s=90)  # killed, restarted
                return want, answers, on_victim, took, gen, back

            want, answers, on_victim, took, gen, back = asyncio.run(go())
            left = alive(stopped, timeout_s=20)
    finally:
        kill_tree(stopped, signal.SIGCONT)  # whatever is left of it (killed and restarted by now)
        shutdown_deployment(name, keep_coordinator=True)
    print(f"{on_victim} of 8 streams on the frozen engine; all done {took:.1f} s after the freeze; "
          f"migrations {dict(router.pool.migrations)}, deadline misses {dict(router.pool.deadlines.misses)}")
    assert [a.outcome for a in answers] == ["completed"] * 8, [a.error for a in answers]
    assert [a.text for a in answers] == [want[a.prompt] for a in answers]  # token for token
    assert on_victim >= 1 and router.pool.migrations["engine_hung"] == on_victim
    assert back > gen  # the coordinator killed the frozen incarnation; Ray restarted it
    assert left == [], f"frozen processes of the killed incarnation still there: {left}"


def alive(pids: list[int], timeout_s: float) -> list[int]:
    """The processes of `pids` still running (not reaped, not zombies) after up to `timeout_s`."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


HUNG_CODES = {"decode_engines_hung", "no_decode_engine"}  # held back by the router, or evicted


async def watch_health(url: str, load: SteadyLoad, client: httpx.AsyncClient, t0: float, timeout_s: float) -> dict:
    """/health every 0.2 s from the freeze until it is 200 again after a 503; at the first 503 one
    generation request is sent (it must be refused at once)."""
    seen: list[tuple[float, int, str]] = []
    out: dict = {}
    while time.monotonic() - t0 < timeout_s:
        r = await client.get(url + "/health", timeout=10)
        seen.append((time.monotonic() - t0, r.status_code, r.json()["code"]))
        if r.status_code == 503 and "refused" not in out:
            t1 = time.monotonic()
            out["refused"] = await load.one(client, PROMPTS[4])
            out["refused_s"] = time.monotonic() - t1
        if r.status_code == 200 and any(s == 503 for _, s, _ in seen):
            break
        await asyncio.sleep(0.2)
    out["seen"] = seen
    return out


def test_the_only_decode_engine_hung_errors_cleanly_refuses_at_once_and_heals(coordinator):
    name = "hang-one"
    # a synthetic engine is back ~5 s after the kill, within the default migration_wait_s (its
    # streams would complete there); vLLM takes ~50 s (test_vllm_hang.py): wait 2 s, as if it did
    cfg = deployment(name, 1, migration_wait_s=2.0, placement="disaggregate")  # the request at the freeze is P/D
    dep = launch(cfg)
    router = build_router(cfg, dep)
    (did, decode), = dep.decodes.items()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stopped: list[int] = []
    try:
        with UvicornThread(create_app(cfg, router), port):
            async def go():
                load = SteadyLoad(url, MODEL, PROMPTS, MAX_TOKENS)
                async with httpx.AsyncClient() as client:
                    streams = [asyncio.ensure_future(load.one(client, p)) for p in PROMPTS[:3]]
                    await asyncio.sleep(1.0)
                    gen = await generation(coordinator, did)
                    stopped.extend(freeze_tree(await process_tree(decode)))
                    t0 = time.monotonic()
                    streams.append(asyncio.ensure_future(load.one(client, PROMPTS[3])))  # sent to the frozen engine
                    health = asyncio.ensure_future(watch_health(url, load, client, t0, 150))
                    answers = await asyncio.gather(*streams)
                    ended_s = max(a.ended for a in answers) - t0
                    health = await health
                    new_gen = await generation(coordinator, did)
                    deadline = time.monotonic() + 60
                    while True:  # its pair reopens through a probe after the breaker's cooldown
                        stream = await router.open(request(f"after-{time.monotonic_ns()}", PROMPTS[5], max_tokens=4))
                        [c async for c in stream]
                        if stream.route.path == "pd" or time.monotonic() > deadline:
                            break
                        await asyncio.sleep(0.5)
                    metrics = (await client.get(url + "/metrics")).text
                return answers, ended_s, health, gen, new_gen, stream.route.path, metrics

            answers, ended_s, health, gen, new_gen, path, metrics = asyncio.run(go())
            events = [e for e in ray.get(coordinator.recent_events.remote(1000)) if e["engine_id"] == did]
    finally:
        kill_tree(stopped, signal.SIGCONT)
        shutdown_deployment(name, keep_coordinator=True)
    seen, refused = health["seen"], health["refused"]
    unhealthy = [(t, code) for t, status, code in seen if status == 503]
    print(f"streams ended {ended_s:.1f} s after the freeze ({[a.outcome for a in answers]}); /health 503 from "
          f"{unhealthy[0][0]:.1f} s to {unhealthy[-1][0]:.1f} s ({sorted({c for _, c in unhealthy})}), 200 at "
          f"{seen[-1][0]:.1f} s; a request at the first 503 refused in {health['refused_s'] * 1000:.0f} ms: "
          f"{refused.error}")
    assert [a.outcome for a in answers] == ["error_event"] * 4  # never a cut connection
    assert all(a.text for a in answers[:3])  # what was streamed before the freeze stands
    assert ended_s < 30
    statuses = [status for _, status, _ in seen]
    first_bad = statuses.index(503)
    assert set(statuses[:first_bad]) <= {200} and statuses[-1] == 200  # one unhealthy window, then healthy
    assert set(statuses[first_bad:statuses.index(200, first_bad)]) == {503}
    assert unhealthy[0][0] < 15  # the first missed deadline, or the coordinator's probe
    assert {code for _, code in unhealthy} <= HUNG_CODES, unhealthy
    assert (refused.outcome, refused.status, refused.code) == ("http_error", 503, "no_decode_engine")
    assert health["refused_s"] < 1.0  # answered at once: nobody waits on the hung engine
    assert new_gen > gen and path == "pd"  # a new incarnation, serving P/D again
    assert any(e["event"] == "removed" and e["reason"].startswith("hung:") for e in events), events
    assert f'raypd_engine_hangs_total{{engine="{did}"}} 1.0' in metrics
