"""Transfer faults injected at a rate under load: every response is the correct answer (200) or the
failed pull's own error (503 engine_error, Retry-After), nothing else."""

from __future__ import annotations

import asyncio

import httpx
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline

NAME = "fault-rate"
MODEL = "synthetic-tiny"
REQUESTS = 120
PROMPTS = [f"fault rate prompt {i} " * 3 for i in range(6)]


def test_faults_at_a_rate_never_give_a_wrong_answer(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "prefill": {**SYNTHETIC["prefill"], "count": 2},
        "transfer": {"failure_policy": "fail", "lease_ttl_s": 30, "read_timeout_s": 10, "fault_rate": 0.1},
        "breaker": {"failure_threshold": 50},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with UvicornThread(create_app(cfg, build_router(cfg, dep)), port):
            (decode,) = dep.decodes.values()

            async def reference(prompt):
                chunks = await collect(decode, request(f"ref-{hash(prompt)}", prompt, max_tokens=5))
                return "".join(c.text for c in chunks)

            async def load():
                want = {p: await reference(p) for p in PROMPTS}
                async with httpx.AsyncClient() as client:
                    async def one(i):
                        p = PROMPTS[i % len(PROMPTS)]
                        r = await client.post(url + "/v1/completions", timeout=60,
                                              json={"model": MODEL, "prompt": p, "max_tokens": 5})
                        return p, r
                    return want, await asyncio.gather(*(one(i) for i in range(REQUESTS)))

            want, results = asyncio.run(load())
            ok = errors = 0
            for prompt, r in results:
                if r.status_code == 200:
                    assert r.json()["choices"][0]["text"] == want[prompt]  # never silently wrong
                    ok += 1
                else:  # a failed pull under the `fail` policy: the service's error, retry later
                    err = r.json()["error"]
                    assert (r.status_code, err["code"], r.headers.get("retry-after")) == (503, "engine_error", "1"), r.text
                    assert err["message"].startswith("KV transfer failed"), err
                    errors += 1
            stats = ray.get(decode.stats.remote())
            injected = stats.recomputed + stats.errors
            print(f"{ok} correct, {errors} clean errors, decode engine saw {stats}")
            assert ok + errors == REQUESTS and ok > 0
            assert injected > 0 or errors > 0, "the fault knob injected nothing"
            after = wait_blocks_at_baseline(dep, baseline, timeout_s=30)
            for eid, s in after.items():
                assert s.free_blocks == baseline[eid].free_blocks, (eid, s)
                assert s.held_leases == 0, (eid, s)
    finally:
        shutdown_deployment(NAME, keep_coordinator=True)
