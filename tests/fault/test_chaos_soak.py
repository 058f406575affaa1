"""Chaos soak (synthetic engines, 1 minute; `RAYPD_CHAOS_S` changes it): steady mixed load over
HTTP while a chaos loop, every few seconds, kill -9s a random engine's process tree or a random rank
actor, or freezes an engine's process tree (SIGSTOP: the routers' deadlines and the coordinator's
probe find it hung, it is killed and restarted), and 5 % of KV pulls fail on purpose.

Every answer is counted by how it ended (chaos_helpers.Answer.outcome): completed and equal to
the colocated reference, a clean error (an HTTP error body, or an SSE error event followed by
[DONE]), or a failure: completed with another answer, cut (the connection ended without [DONE]:
httpx.RemoteProtocolError) or timed out. The test fails on any failure; at the end every engine is
back (registered, healthy) and nothing is held: blocks, leases, ledger handoffs, placement groups.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter

import httpx
import pytest
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from chaos_helpers import CLEAN, Answer, SteadyLoad, deployment_placement_groups, freeze_tree, kill_tree
from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

NAME = "chaos"
MODEL = "synthetic-tiny"
DURATION_S = float(os.environ.get("RAYPD_CHAOS_S", "60"))  # 3-7 faults (the suite's budget); the product soak runs beside it
KILL_EVERY_S = (8.0, 16.0)
SEED = int(os.environ.get("RAYPD_CHAOS_SEED", "5"))  # which faults, in which order
PROMPTS = [f"chaos prompt {i} " * (1 + i % 5) for i in range(10)]
LENGTHS = (4, 12, 30)


class MixedLoad(SteadyLoad):
    """Streaming and non-streaming requests of several lengths."""

    async def _worker(self, i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient() as client:
            while not self._stop:
                prompt, n = rng.choice(self.prompts), rng.choice(LENGTHS)
                if rng.random() < 0.7:
                    answer = await self.one(client, prompt, max_tokens=n)
                else:
                    answer = await self.whole(client, prompt, n)
                answer.prompt = (prompt, n)

    async def whole(self, client: httpx.AsyncClient, prompt: str, n: int):
        t0 = time.monotonic()
        try:
            r = await client.post(self.url + "/v1/completions", timeout=120,
                                  json={"model": self.model, "prompt": prompt, "max_tokens": n})
            body = r.json()
            if r.status_code == 200:
                answer = Answer(prompt, body["choices"][0]["text"], None, body["choices"][0]["finish_reason"],
                                t0, time.monotonic())
            else:
                answer = Answer(prompt, "", f"HTTP {r.status_code}: {body['error']['message']}", None,
                                t0, time.monotonic(), "http_error", r.status_code, body["error"]["code"])
        except httpx.TimeoutException as exc:
            answer = Answer(prompt, "", f"{type(exc).__name__}: {exc}", None, t0, time.monotonic(), "timeout", 0)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            answer = Answer(prompt, "", f"{type(exc).__name__}: {exc}", None, t0, time.monotonic(), "cut", 0)
        self.answers.append(answer)
        return answer


def test_chaos_soak(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.01},
        "prefill": {**SYNTHETIC["prefill"], "count": 2, "tp_size": 2, "block_size": 16, "num_blocks": 1024},
        "decode": {**SYNTHETIC["decode"], "count": 2, "tp_size": 1, "num_blocks": 1024},
        "transfer": {"failure_policy": "recompute", "lease_ttl_s": 20, "read_timeout_s": 5, "fault_rate": 0.05},
        "breaker": {"failure_threshold": 5, "cooldown_s": 3.0, "probe_window_s": 2.0},
        "router": {"migration_wait_s": 30, "placement": "disaggregate"},
        "restarts": {"max_restarts": 50},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    pgs = deployment_placement_groups(NAME)
    router = build_router(cfg, dep)
    decode = next(iter(dep.decodes.values()))
    port = free_port()
    kills: list[str] = []
    frozen: list[int] = []

    async def references():
        return {(p, n): "".join(c.text for c in await collect(decode, request(f"ref-{i}-{n}", p, max_tokens=n)))
                for i, p in enumerate(PROMPTS) for n in LENGTHS}

    async def chaos(rng: random.Random, until: float):
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(*KILL_EVERY_S))
            for _ in range(10):
                eid = rng.choice(sorted(dep.engines))
                try:
                    stats = await asyncio.wait_for(dep.engines[eid].stats.remote(), 5)
                    if stats.generation is not None:
                        break
                    # a restart that has not registered yet: the coordinator cannot probe an incarnation
                    # it does not know, so a freeze now would strand it (a gap of the product: the note
                    # of issue 25); the soak's faults hit registered incarnations
                except (ray.exceptions.RayError, asyncio.TimeoutError):
                    pass  # still restarting from an earlier kill, or frozen: another one
                await asyncio.sleep(1.0)
            else:
                continue
            ranks = stats.backend.child_pids
            action = rng.random()
            if ranks and action < 0.4:
                kill_tree([rng.choice(ranks)])
                kills.append(f"{eid}:rank")
            elif action < 0.8:
                kill_tree([stats.pid, *ranks])
                kills.append(f"{eid}:tree")
            else:
                frozen.extend(freeze_tree([stats.pid, *ranks]))
                kills.append(f"{eid}:freeze")

    try:
        want = asyncio.run(references())
        with UvicornThread(create_app(cfg, router), port):
            async def soak():
                load = MixedLoad(f"http://127.0.0.1:{port}", MODEL, PROMPTS, 8, workers=6).start()
                await chaos(random.Random(SEED), time.monotonic() + DURATION_S)
                await asyncio.sleep(5.0)  # the last kill heals under load too
                return await load.stop()

            answers = asyncio.run(soak())

            # every engine is back: registered with the coordinator and healthy (one frozen near the
            # end does not answer until the coordinator's probes kill it and Ray restarts it)
            def unhealthy() -> set[str]:
                calls = {eid: h.check_health.remote() for eid, h in dep.engines.items()}
                ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=5)
                found = set()
                for eid, ref in calls.items():
                    try:
                        if ref not in ready or not ray.get(ref):
                            found.add(eid)
                    except ray.exceptions.RayError:  # killed meanwhile
                        found.add(eid)
                return found  # frozen (no answer in time), restarting or dead

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                registered = {e.engine_id for e in ray.get(dep.coordinator.engines.remote())}
                sick = unhealthy()
                healthy = not sick
                if registered >= set(dep.engines) and healthy:
                    break
                time.sleep(0.5)
            if not (registered >= set(dep.engines) and healthy):  # say which engine and what befell it
                from ray.util.state import list_actors

                try:
                    actors = [(a.name, a.state, a.pid, str(a.death_cause)[:300]) for a in list_actors(
                        filters=[("class_name", "=", "EngineActor")], detail=True)]
                except Exception as e:  # noqa: BLE001 - the state API is a diagnostic here, not the verdict
                    actors = [f"(state API: {e!r})"]
                pytest.fail(f"not back 120 s after the soak: unregistered {set(dep.engines) - registered}, "
                            f"unhealthy {sick}; faults {kills}; engine actors {actors}")
            after = wait_blocks_at_baseline(dep, baseline, timeout_s=60)
            ledger = ray.get(dep.coordinator.transfers.remote())
    finally:
        kill_tree(frozen, signal.SIGCONT)  # (killed by the coordinator long since)
        left_pgs = deployment_placement_groups(NAME)
        shutdown_deployment(NAME, keep_coordinator=True)

    outcomes = Counter("completed and equal" if a.outcome == "completed" and a.text == want[a.prompt] else
                       "completed but wrong" if a.outcome == "completed" else
                       "clean error" if a.outcome in CLEAN else a.outcome for a in answers)
    print(f"chaos soak {DURATION_S:.0f} s: {len(kills)} kills ({', '.join(kills)}); {len(answers)} requests: "
          f"{dict(outcomes)}; error codes {dict(Counter(a.code for a in answers if a.outcome in CLEAN[1:]))}; "
          f"migrations {dict(router.pool.migrations)}, fallbacks {dict(router.pool.fallbacks)}, "
          f"recomputed {router.pool.counters['recomputed']}")
    assert len(kills) >= DURATION_S / KILL_EVERY_S[1] - 1 and outcomes["completed and equal"]
    wrong = [a for a in answers if a.outcome == "completed" and a.text != want[a.prompt]]
    assert wrong == [], wrong[:3]  # never a wrong answer
    unclean = [a for a in answers if a.outcome not in CLEAN]
    assert unclean == [], unclean[:3]  # never a cut stream or a timeout: every failure is a clean error
    assert registered >= set(dep.engines) and healthy  # every engine is back
    for eid, s in after.items():
        assert s.free_blocks == baseline[eid].free_blocks and s.held_leases == 0, (eid, s)
    assert ledger.in_flight == 0
    assert left_pgs == pgs  # restarts reused the engines' placement groups
