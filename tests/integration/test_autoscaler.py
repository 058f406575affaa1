"""P:D autoscaler on synthetic engines: each pool grows on its own signal and shrinks back to min
after the load goes, with every request answered while engines drain, and nothing stranded."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from actors.protocol.request import EngineRequest, SamplingSpec
from actors.engine.synthetic.tokenizer import encode_text
from serving.cluster.launcher import find_autoscaler
from serving.cluster.names import launcher_name
from serving.config import DeploymentConfig
from serving.cluster.engines import find_engines
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from service_helpers import SYNTHETIC

pytestmark = pytest.mark.slow

NAME = "scale-test"
CONFIG = {
    **SYNTHETIC,
    "name": NAME,
    "synthetic": {**SYNTHETIC["synthetic"], "model_id": "synthetic-scale", "token_latency_s": 0.02},
    # room for every client's prompt at once (8 x ~170 blocks of 16): this test is about scaling, not capacity
    "prefill": {**SYNTHETIC["prefill"], "num_blocks": 2048},
    "decode": {**SYNTHETIC["decode"], "num_blocks": 1024},
    "autoscaler": {
        "enabled": True, "policy": "thresholds", "interval_s": 0.5, "up_delay_s": 0.5, "up_cooldown_s": 1.0, "down_delay_s": 2.0,
        "cooldown_s": 3.0, "drain_quiet_s": 1.5,
        "prefill": {"min": 1, "max": 2, "queued_tokens_per_engine": 300, "ttft_target_factor": 30},
        "decode": {"min": 1, "max": 2, "outstanding_tokens_per_engine": 200, "kv_usage_high": 1.0,
                   "itl_target_factor": 120},  # x router.slo's 0.25 s: 30 s
    },
}
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 60  # ~2700 tokens (one per byte)
SHORT_PROMPT = "hello there"


@pytest.fixture(scope="module")
def scaled(coordinator):
    cfg = DeploymentConfig.from_dict(CONFIG)
    dep = launch(cfg)
    baseline = {s.engine_id: s.free_blocks for s in ray.get([h.stats.remote() for h in dep.engines.values()])}
    router = build_router(cfg, dep)
    yield {"cfg": cfg, "dep": dep, "router": router, "scaler": find_autoscaler(NAME), "baseline": baseline}
    shutdown_deployment(NAME, keep_coordinator=True)
    left = [n for n in find_engines(NAME)] + [
        p["name"] for p in ray.util.placement_group_table().values()
        if (p.get("name") or "").startswith(f"raypd-{NAME}-") and p["state"] != "REMOVED"]
    assert left == []
    assert find_autoscaler(NAME) is None


class Load:
    """Closed-loop clients through the router; every request must finish with finish_reason length."""

    def __init__(self, router, prompt: str, max_tokens: int, workers: int):
        self.router, self.max_tokens, self.workers = router, max_tokens, workers
        self.token_ids = tuple(encode_text(prompt))  # as the front tokenizes for the synthetic model
        self.stop = asyncio.Event()
        self.sent = self.ok = 0
        self.failures: list[str] = []
        self.tasks: list[asyncio.Task] = []

    async def one(self, i: int) -> None:
        self.sent += 1
        rid = f"load-{i}-{time.monotonic_ns()}"
        try:
            stream = await self.router.open(EngineRequest(rid, SamplingSpec(max_tokens=self.max_tokens),
                                                          prompt_token_ids=self.token_ids))
            chunks = [c async for c in stream]
            stream.close()
            if chunks[-1].finish_reason != "length" or sum(len(c.token_ids) for c in chunks) != self.max_tokens:
                self.failures.append(f"{rid}: {chunks[-1].finish_reason} {chunks[-1].error}")
            else:
                self.ok += 1
        except Exception as exc:  # noqa: BLE001 - a failure is what this test looks for
            self.failures.append(f"{rid}: {type(exc).__name__}: {exc}")

    async def worker(self, w: int) -> None:
        i = 0
        while not self.stop.is_set():
            await self.one(w * 100_000 + i)
            i += 1

    def start(self) -> "Load":
        self.tasks = [asyncio.get_running_loop().create_task(self.worker(w)) for w in range(self.workers)]
        return self

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


async def pools(scaler) -> dict[str, tuple[int, int, int]]:
    st = await scaler.status.remote()
    return {r: (len(s.serving), len(s.starting), len(s.draining)) for r, s in st.roles.items()}


async def wait_for(scaler, want, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        now = await pools(scaler)
        if want(now) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.25)


def at_min(p) -> bool:
    return p == {"prefill": (1, 0, 0), "decode": (1, 0, 0)}


async def step_then_shrink(scaled, prompt: str, max_tokens: int, grows: str) -> tuple[dict, dict, "Load"]:
    """Load until `grows` has 2 engines; then a trickle while the pools shrink back to min."""
    router, scaler = scaled["router"], scaled["scaler"]
    assert at_min(await wait_for(scaler, at_min, 60))
    heavy = Load(router, prompt, max_tokens, workers=8).start()
    grown = await wait_for(scaler, lambda p: p[grows][0] == 2, 60)
    await heavy.finish()
    trickle = Load(router, SHORT_PROMPT, 3, workers=1).start()
    shrunk = await wait_for(scaler, at_min, 90)
    await trickle.finish()
    assert heavy.failures == []
    return grown, shrunk, trickle


def test_long_prompts_grow_the_prefill_pool_and_it_drains_back_to_min(scaled):
    grown, shrunk, trickle = asyncio.run(step_then_shrink(scaled, LONG_PROMPT, 2, grows="prefill"))
    assert grown == {"prefill": (2, 0, 0), "decode": (1, 0, 0)}
    assert at_min(shrunk)
    assert (trickle.failures, trickle.ok > 0) == ([], True)  # nothing failed while prefill-1 drained
    assert f"raypd-{NAME}-prefill-1" not in find_engines(NAME)


def test_long_answers_grow_the_decode_pool_and_it_drains_back_to_min(scaled):
    grown, shrunk, trickle = asyncio.run(step_then_shrink(scaled, SHORT_PROMPT, 200, grows="decode"))
    assert grown == {"prefill": (1, 0, 0), "decode": (2, 0, 0)}
    assert at_min(shrunk)
    assert (trickle.failures, trickle.ok > 0) == ([], True)
    history = ray.get(scaled["scaler"].status.remote()).history
    assert [(e.role, e.direction, e.outcome) for e in history][-2:] == [("decode", "up", "started"),
                                                                        ("decode", "down", "drained")]


def test_remaining_engines_hold_no_blocks_or_leases_after_scaling(scaled):
    stats = ray.get([h.stats.remote() for h in find_engines(NAME).values()])
    assert sorted((s.engine_id, s.free_blocks, s.held_leases) for s in stats) == sorted(
        (eid, free, 0) for eid, free in scaled["baseline"].items())
    assert launcher_name(NAME) in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
