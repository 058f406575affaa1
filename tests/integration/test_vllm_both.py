"""Two real vLLM engines of role `both` (kv_both): each serves requests end to end, prefills for the
other and decodes the other's prefill. Every path gives the colocated greedy answer token for token,
and the router's SLO placement uses both kinds of path."""

import asyncio
import os
import random
import time
from pathlib import Path

import pytest
import ray

from actors.control.coordinator import COORDINATOR_NAME
from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.engine.config import EngineConfig
from actors.models.tiny_llama import build_tiny_llama
from actors.transfer_config import TransferConfig
from actors.engine.vllm.compute_group import autogroup_enabled
from engine_calls import collect, pd, request, token_ids
from process_helpers import descendants
from serving.cluster.clients import RayDirectory, RayEngineClient
from serving.config import RouterConfig
from serving.placement_config import PlacementConfig
from serving.routing.router import Router

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

Engine = ray.remote(EngineActor)
rng = random.Random(11)
PROMPT = [rng.randrange(1000, 40000) for _ in range(70)]  # three 32-token blocks, the last one partial


def make_engine(engine_id, model, bind):
    cfg = EngineConfig(role="both", backend="vllm", engine_id=engine_id, model=str(model), model_id="tiny-both",
                       max_model_len=512, block_size=32, cpu={"bind": bind}, dtype="float32",
                       engine_kwargs={"enable_prefix_caching": False, "enforce_eager": True},
                       num_cpus=0, transfer=TransferConfig(lease_ttl_s=60, read_timeout_s=10, failure_policy="fail"))
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


@pytest.fixture(scope="module")
def both(coordinator, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-both", seed=3, progress=None)
    e = {"X": make_engine("bx-X", model, "0"), "Y": make_engine("bx-Y", model, "1")}
    ray.get([h.start.remote() for h in e.values()])
    yield e
    ray.get([h.shutdown.remote() for h in e.values()])
    for h in e.values():
        ray.kill(h)


def test_colocated_and_both_directions_of_disaggregation_give_the_colocated_answer(both):
    async def go():
        req = lambda rid: request(rid, token_ids=PROMPT, max_tokens=12)  # noqa: E731
        reference = [t for c in await collect(both["X"], req("ref")) for t in c.token_ids]
        colocated_y = [t for c in await collect(both["Y"], req("col")) for t in c.token_ids]
        pre, chunks = await pd(both["X"], both["Y"], req("x2y"))
        x_to_y = token_ids(pre, chunks)
        pre2, chunks2 = await pd(both["Y"], both["X"], req("y2x"))
        y_to_x = token_ids(pre2, chunks2)
        cached = (chunks[0].num_cached_tokens, chunks2[0].num_cached_tokens)
        return reference, colocated_y, x_to_y, y_to_x, cached, (chunks, chunks2)

    reference, colocated_y, x_to_y, y_to_x, cached, streams = asyncio.run(go())
    assert len(reference) == 12
    assert colocated_y == x_to_y == y_to_x == reference
    assert not any(c.recomputed or c.failed for s in streams for c in s)
    assert cached == (len(PROMPT), len(PROMPT))  # every prompt token pulled: the decode engine computes only t1


def test_slo_placement_colocates_on_idle_engines_and_splits_prefill_from_busy_decoding(both):
    async def go():
        router = Router({"bx-X": RayEngineClient("bx-X", both["X"]), "bx-Y": RayEngineClient("bx-Y", both["Y"])},
                        {"bx-X": RayEngineClient("bx-X", both["X"]), "bx-Y": RayEngineClient("bx-Y", both["Y"])},
                        RayDirectory(ray.get_actor(COORDINATOR_NAME, namespace="raypd")),
                        # the tiny model prefills in milliseconds: a per-step ITL target under any step
                        # makes its stall count, however fast this machine runs it; the request's own
                        # first gap keeps a target a pull can meet (unset, it would follow the 1 ms)
                        RouterConfig(policy="least_outstanding",
                                     slo=PlacementConfig(itl_target_s=0.001, first_gap_target_s=1.0)))
        for _ in range(100):  # both registered and paired with each other
            routes = await router.routes(force=True)
            if {r.prefill_id for rs in routes.decodes.values() for r in rs} >= {"bx-X", "bx-Y"}:
                break
            await asyncio.sleep(0.1)
        idle = await router.open(request("idle", token_ids=PROMPT, max_tokens=4))
        idle_answer = [t for c in [ch async for ch in idle] for t in c.token_ids]
        # X decodes eight streams (a local prefill there would stall them) and Y has been prefilling
        # most of the time (a stream there would wait behind its prefills): prefill on Y, decode on X
        router.pool.decode_load["bx-X"].requests += 8
        # given 100 windows' worth at Y's own learned rate: its prefill share is at the cap, however
        # fast this machine prefills the tiny model (a fixed count left it at 0.2 on a fast CPU)
        y_rate = router.pool.rates.rates("bx-Y").prefill_tokens_per_s
        with router.pool.prefilling("bx-Y", int(100 * y_rate * router.pool.rates.config.prefill_busy_window_s)):
            pass
        # ...and X's streams are already past their TPOT budget (X spent half its time prefilling), so a
        # stall costs them in full: with slack left, a fast moment's stall fit in it (CI once placed the
        # busy prompt colocated on X)
        x_rate = router.pool.rates.rates("bx-X").prefill_tokens_per_s
        with router.pool.prefilling("bx-X", int(0.5 * x_rate * router.pool.rates.config.prefill_busy_window_s)):
            pass
        long_prompt = [rng.randrange(1000, 40000) for _ in range(400)]
        busy = await router.open(request(f"busy{time.monotonic_ns()}", token_ids=long_prompt, max_tokens=4))
        busy_chunks = [ch async for ch in busy]
        router.pool.decode_load["bx-X"].requests -= 8
        await router.drain()
        return idle, idle_answer, busy, busy_chunks

    idle, idle_answer, busy, busy_chunks = asyncio.run(go())
    assert (idle.route.path, len(idle_answer)) == ("local", 4)
    assert (busy.route.path, busy.prefill_id, busy.decode_id) == ("pd", "bx-Y", "bx-X")
    assert not any(c.failed or c.recomputed for c in busy_chunks)


def test_the_compute_runs_in_a_scheduling_group_of_its_own_under_autogroup(both):
    """actors/engine/vllm/compute_group.py: with the kernel's autogroup, each vLLM process of an
    engine leads a session of its own, and the one that runs the model (here the worker) has the
    compute's nice value; without autogroup, they stay in the engine actor's session."""
    for handle in both.values():
        actor = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
        titles = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for p in descendants(actor)}
        vllm = [p for p, t in titles.items() if t.startswith(b"VLLM::")]
        workers = [p for p in vllm if titles[p].startswith(b"VLLM::Worker")]
        assert len(vllm) == 2 and len(workers) == 1
        if autogroup_enabled():
            assert [os.getsid(p) for p in vllm] == vllm
            assert Path(f"/proc/{workers[0]}/autogroup").read_text().split()[-1] == "19"
        else:
            assert {os.getsid(p) for p in vllm} == {os.getsid(actor)}
