"""The fixed P/D deployment (configs/local-pd.yaml: SmolLM2 on vLLM, 1 prefill + 1 decode engine) as the
Serve app, its only decode engine frozen mid-stream, then killed while it restarts. Not the embedded
default: configs/local.yaml now runs two role-flexible `both` engines, which would serve a request
colocated on the other engine; the single-decode-engine case needs fixed pools.

1. SIGSTOP of the decode engine's actor and vLLM processes while 3 streams run, one more request sent
   at once: every stream ends with an SSE error event (never a cut connection) within the hang class's
   terminal-outcome bound of the freeze (token_timeout_s + migration_wait_s: terminal_bounds.hang_bound_s,
   docs/failure-semantics.md), the request sent at once too (its prefill returns first, its decode chunk
   never comes), the first request after
   /health turned 503 is answered at once (503 with the reason), and the coordinator's probe times out
   and it kills the engine for a restart;
2. kill -9 of the restarting incarnation while its vLLM engine core starts: the front stays up;
3. the engine comes back with no command: /health 200, then P/D again (its pair's breaker probes).
Throughout, the ingress replica is never restarted (one replica actor, same pid), and Serve sees it
RUNNING the whole time; /health answers every probe (503 with the reason while no decode engine can
take a request).
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil
import pytest
import ray

from serving.cluster.app import INGRESS_NAME, build_app, resolve_config
from serving.cluster.launcher import shutdown_deployment
from serving.cluster.names import actor_name_of
from serving.config import load_config

from chaos_helpers import SteadyLoad, freeze_tree, kill_tree
from service_helpers import free_port, run_serve_app
from terminal_bounds import hang_bound_s, late

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.injects_faults]

NAME = "vllm-hang"
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how a steam engine works, step by step.",
           "Write a long poem about the sea.", "List the planets and describe each one.",
           "What is the capital of France?"]
MAX_TOKENS = 400  # with ignore_eos (a raw prompt often ends at once): still streaming well after the fault
CONFIG = "configs/local-pd.yaml"
MODEL = load_config(CONFIG).served_model_name


def actors() -> dict[str, dict]:
    """Every actor the GCS knows (dead ones too), without the dashboard's state API."""
    import ray._private.state as state

    return state.actors()


def ingress_replicas() -> list[dict]:
    return [{"id": aid, "pid": a["Pid"], "state": a["State"], "restarts": a["NumRestarts"]}
            for aid, a in actors().items()
            if INGRESS_NAME in (a.get("ActorClassName") or "") and f":{NAME}:" in a["ActorClassName"]]


def engine_actor(engine_id: str) -> dict:
    (a,) = [a for a in actors().values() if a.get("Name") == actor_name_of(engine_id) and a["State"] != "DEAD"]
    return {"pid": a["Pid"], "state": a["State"], "restarts": a["NumRestarts"]}


async def decoding(engine_id: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the engine's actor runs `count` requests and has streamed tokens of each (an event, not a sleep)."""
    from serving.cluster.names import NAMESPACE

    handle = ray.get_actor(actor_name_of(engine_id), namespace=NAMESPACE)
    deadline = time.monotonic() + timeout_s
    owed = None  # the tokens the streams owe once all of them run there; each streamed chunk pays some
    while True:
        stats = await handle.stats.remote()
        if owed is None and stats.running >= count:
            owed = stats.load.outstanding_tokens
        if owed is not None and stats.load.outstanding_tokens <= owed - 2 * count:
            return
        assert time.monotonic() < deadline, f"{engine_id} never streamed {count} requests: {stats.running}"
        await asyncio.sleep(0.1)


def replica_states() -> dict:
    from ray import serve

    return dict(serve.status().applications[NAME].deployments[INGRESS_NAME].replica_states)


class Health:
    """/health every 0.25 s; at the first 503 one generation request (it must be refused at once)."""

    def __init__(self, url: str, load: SteadyLoad):
        self.url, self.load = url, load
        self.seen: list[tuple[float, int, str | None]] = []
        self.serve_states: list[dict] = []
        self.refused = None
        self.refused_s = None

    async def until(self, client: httpx.AsyncClient, t0: float, done, timeout_s: float) -> None:
        while time.monotonic() - t0 < timeout_s:
            try:
                r = await client.get(self.url + "/health", timeout=10)
                self.seen.append((time.monotonic() - t0, r.status_code, r.json().get("code")))
            except httpx.HTTPError as exc:  # the front itself gone: never expected
                self.seen.append((time.monotonic() - t0, 0, type(exc).__name__))
            if self.seen[-1][1] == 503 and self.refused is None:
                t1 = time.monotonic()
                self.refused = await self.load.one(client, PROMPTS[4], max_tokens=8)
                self.refused_s = time.monotonic() - t1
            if len(self.seen) % 20 == 1:
                self.serve_states.append(await asyncio.to_thread(replica_states))
            if done(self.seen):
                return
            await asyncio.sleep(0.25)


def healthy_again(seen) -> bool:
    return seen[-1][1] == 200 and any(s == 503 for _, s, _ in seen)


async def serves_pd(client: httpx.AsyncClient, url: str, timeout_s: float) -> float:
    """Until a request goes prefill -> decode again (the restarted engine's pair reopens through the
    breaker's probe): seconds it took; the P/D decisions are read from /metrics."""
    t0 = time.monotonic()
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 4}
    while time.monotonic() - t0 < timeout_s:
        before = await pd_handoffs(client, url)
        r = await client.post(url + "/v1/completions", json=body, timeout=60)
        if r.status_code == 200 and await pd_handoffs(client, url) > before:
            return time.monotonic() - t0
        await asyncio.sleep(1.0)
    raise AssertionError(f"no P/D request within {timeout_s} s")


async def pd_handoffs(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics", timeout=30)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("raypd_pd_handoff_seconds_count"))


def check_streams(answers, t0: float, phase: str, bound_s: float) -> float:
    ended = max(a.ended for a in answers) - t0
    print(f"{phase}: streams {[a.outcome for a in answers]} (codes {[a.code for a in answers]}) "
          f"ended {ended:.1f} s after the fault (bound {bound_s:.1f} s)")
    # mid-stream: an error event after what was streamed; the request sent at the fault too: its prefill
    # returns long before the router's first token deadline on the frozen engine (so it is not refused),
    # the router answers 200 and streams the prefill engine's token, and the decode engine's never comes;
    # never a cut connection
    assert [a.outcome for a in answers] == ["error_event"] * len(answers), [(a.outcome, a.error) for a in answers]
    # a terminal outcome for every stream within the hang class's bound of the freeze: the chunk deadline
    # (token_timeout_s) finds the engine silent, migration_wait_s passes with no engine to take the streams
    assert late({i: a.ended for i, a in enumerate(answers)}, t0, bound_s) == {}, (bound_s, ended)
    return ended


def check_unhealthy_window(seen, phase: str) -> None:
    statuses = [s for _, s, _ in seen]
    bad = [(t, code) for t, s, code in seen if s != 200]
    print(f"{phase}: /health not 200 from {bad[0][0]:.1f} s to {bad[-1][0]:.1f} s "
          f"({sorted({c for _, c in bad})}), 200 again at {seen[-1][0]:.1f} s")
    assert 0 not in statuses  # the front answered every probe
    first = statuses.index(503)
    assert set(statuses[:first]) <= {200} and statuses[-1] == 200
    assert set(statuses[first:statuses.index(200, first)]) == {503}  # one window, then healthy for good
    assert {c for _, c in bad} <= {"no_decode_engine", "decode_engines_hung"}, bad


def test_a_lone_decode_engine_frozen_then_killed_while_restarting(coordinator):
    from ray import serve

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    base = load_config(CONFIG).model_dump(mode="json", exclude_unset=True)
    base["name"] = NAME
    for group in ("prefill", "decode"):  # the session cluster's CPUs are shared by the test modules
        base[group]["num_cpus"] = 0
    bound_s = hang_bound_s(resolve_config(base))  # the config the Serve app runs with
    did = f"{NAME}-decode-0"
    frozen: list[int] = []
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        up_s = run_serve_app(build_app(base), NAME, url)
        print(f"up in {up_s:.0f} s")
        replicas_before = ingress_replicas()
        assert len(replicas_before) == 1 and replicas_before[0]["state"] == "ALIVE", replicas_before

        async def go():
            out = {}
            load = SteadyLoad(url, MODEL, PROMPTS, MAX_TOKENS, extra={"ignore_eos": True})
            async with httpx.AsyncClient() as client:
                warm = await load.one(client, PROMPTS[4], max_tokens=8)
                assert warm.outcome == "completed", warm.error

                # 1. frozen mid-stream
                streams = [asyncio.ensure_future(load.one(client, p)) for p in PROMPTS[:3]]
                await decoding(did, len(streams))  # every stream is under way on the decode engine
                assert not any(s.done() for s in streams), [s.result() for s in streams if s.done()]
                before = engine_actor(did)
                frozen.extend(freeze_tree([before["pid"]]))
                t0 = time.monotonic()
                streams.append(asyncio.ensure_future(load.one(client, PROMPTS[3])))  # sent to the frozen engine
                health = Health(url, load)

                def killed_and_restarting(seen):
                    return engine_actor(did)["pid"] != before["pid"]

                watch = asyncio.ensure_future(health.until(client, t0, killed_and_restarting, 120))
                answers = await asyncio.gather(*streams)
                out["hang_streams_s"] = check_streams(answers, t0, "frozen", bound_s)
                out["texts"] = [len(a.text) for a in answers]
                await watch
                out["killed_after_s"] = time.monotonic() - t0
                out["refused"], out["refused_s"] = health.refused, health.refused_s

                # 2. kill -9 of the restarting incarnation once its vLLM engine core is starting
                while True:
                    now = engine_actor(did)
                    try:
                        children = psutil.Process(now["pid"]).children(recursive=True)
                    except psutil.Error:
                        children = []
                    if now["state"] == "ALIVE" and children:
                        break
                    assert time.monotonic() - t0 < 240, "the restarted engine never started vLLM"
                    await asyncio.sleep(0.5)
                out["second_kill_after_s"] = time.monotonic() - t0
                kill_tree([now["pid"], *[c.pid for c in children]])
                t_kill = time.monotonic()

                # 3. healthy again by itself, then P/D
                await health.until(client, t0, healthy_again, 600)
                check_unhealthy_window(health.seen, "frozen, then killed while restarting")
                out["healthy_after_s"] = health.seen[-1][0]
                out["restart_after_kill_s"] = time.monotonic() - t_kill
                out["pd_after_s"] = await serves_pd(client, url, 120)
                out["serve_states"] = list(health.serve_states)
                out["metrics"] = (await client.get(url + "/metrics", timeout=30)).text
            return out

        out = asyncio.run(go())
        replicas_after = ingress_replicas()
        events = [e for e in ray.get(coordinator.recent_events.remote(1000)) if e["engine_id"] == did]
    finally:
        kill_tree(frozen, signal.SIGCONT)
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)
    print(f"frozen: streams ended {out['hang_streams_s']:.1f} s after the freeze (chars streamed {out['texts']}); "
          f"killed for a restart {out['killed_after_s']:.0f} s after it, killed again "
          f"{out['second_kill_after_s']:.0f} s after it while restarting; /health 200 at "
          f"{out['healthy_after_s']:.0f} s ({out['restart_after_kill_s']:.0f} s after the second kill), "
          f"P/D {out['pd_after_s']:.0f} s later; a request at the first 503 answered in "
          f"{out['refused_s'] * 1000:.0f} ms: {out['refused'].error}")
    print(f"ingress replicas {replicas_before} -> {replicas_after}")
    refused = out["refused"]
    assert (refused.outcome, refused.status, refused.code) == ("http_error", 503, "no_decode_engine")
    assert out["refused_s"] < 1.0  # answered at once: nobody waits on the hung engine
    # the ingress replica was never restarted: the same actor, the same process, always RUNNING
    assert replicas_after == replicas_before, (replicas_before, replicas_after)
    assert all(s == {"RUNNING": 1} for s in out["serve_states"]), out["serve_states"]
    assert any(e["event"] == "removed" and e["reason"].startswith("hung:") for e in events), events
    assert f'raypd_engine_hangs_total{{engine="{did}"}} 1.0' in out["metrics"], \
        [line for line in out["metrics"].splitlines() if "hangs" in line]
