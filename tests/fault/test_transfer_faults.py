"""A P/D request whose KV transfer fails after its prefill, through the HTTP front (synthetic engines,
real Ray actors and NIXL, `transfer.failure_policy: fail`, set here: the default is `recompute`): the partition
and READ-error classes of docs/failure-semantics.md ("Terminal outcome per fault class").

Three streams are prefilled; each is held at the router's call to the decode engine (`DecodeGate`:
the prefill engine's first token is out, its KV is leased, the pull has not started) until all three
are there; then the fault is injected and they are let go, all at once:

- partition: the NIXL link from the decode engine to the prefill engine carries nothing. The producer's
  rank process is frozen (SIGSTOP) after its prefill, over a link that one request has already wired
  up, so the decode ranks' READs neither complete nor fail (NIXL needs the target's progress thread to
  complete a READ: docs/nixl_notes.md), while both engines answer the control plane (a synthetic
  engine actor answers the coordinator's pings itself): nothing but the pull's own timeout can end it;
- READ error: every pull fails in the transport (`transfer.fault_rate: 1.0`, the test knob: the pull is
  failed in the transport before its READs are posted, and from the next poll on takes the path of a
  READ that completed in error: `actors.kv.transport.TransportBase.poll`).

Every held stream then ends with the prefill engine's token followed by an SSE error event and [DONE]
(never cut), within its class's terminal-outcome bound of the moment they were let go
(terminal_bounds: transfer.read_timeout_s; the router's first-chunk deadline, which adds the read
timeout to a prefill deadline, comes later).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

from serving.cluster.clients import build_router
from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig
from serving.front import create_app

from chaos_helpers import SteadyLoad, freeze_tree, kill_tree
from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, free_port
from terminal_bounds import late, partition_bound_s, read_error_bound_s

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

MODEL = "synthetic-tiny"
WARM = "a transfer fault warm-up prompt " * 3
PROMPTS = [f"a transfer fault prompt {i} " * 3 for i in range(3)]
MAX_TOKENS = 20
GATE_S = 60.0  # the longest the test waits for the held streams (a failure to get there, not a bound)


def deployment(name: str, fault_rate: float = 0.0) -> DeploymentConfig:
    return DeploymentConfig.from_dict({
        **SYNTHETIC, "name": name,
        "transfer": {**SYNTHETIC["transfer"], "failure_policy": "fail", "fault_rate": fault_rate},
        "breaker": {"failure_threshold": 50},  # the held streams all go P/D, whatever their failures
    })


class DecodeGate:
    """The router's client of one decode engine, holding every P/D continuation (a request that carries
    transfer params) before it reaches the engine until `go` is set; `all_held` is set once `hold` of
    them wait. The router runs on the front's thread (its own event loop), so these are thread events."""

    def __init__(self, inner, hold: int):
        self.inner, self.hold = inner, hold
        self.asked: dict[str, float] = {}  # engine request id -> when the router called the decode engine
        self.all_held = threading.Event()
        self.go = threading.Event()
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, req):
        if req.kv_transfer_params is None:  # a local run or a migration: not held
            return self.inner.generate(req)
        return self._held(req)

    async def _held(self, req):
        with self._lock:
            self.asked[req.request_id] = time.monotonic()
            if len(self.asked) >= self.hold:
                self.all_held.set()
        await asyncio.to_thread(self.go.wait, GATE_S)
        stream = self.inner.generate(req)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


def held_streams(cfg: DeploymentConfig, inject, warm: bool) -> dict:
    """Launch `cfg`, hold len(PROMPTS) P/D streams at the decode engine's door, `inject(deployment)`
    (returns pids to SIGCONT at the end), let them go at once; their answers, references and moment."""
    dep = launch(cfg)
    (decode_id, decode), = dep.decodes.items()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stopped: list[int] = []
    try:
        router = build_router(cfg, dep)
        want = {p: "".join(c.text for c in asyncio.run(collect(decode, request(f"ref-{i}", p, max_tokens=MAX_TOKENS))))
                for i, p in enumerate(PROMPTS)}
        with UvicornThread(create_app(cfg, router), port):
            async def go():
                out: dict = {}
                load = SteadyLoad(url, MODEL, PROMPTS, MAX_TOKENS)
                async with httpx.AsyncClient() as client:
                    if warm:  # the pair's NIXL link wired up, its READs known to work
                        out["warm"] = await load.one(client, WARM)
                        assert out["warm"].outcome == "completed", out["warm"].error
                    gate = router.pool.decodes[decode_id] = DecodeGate(router.pool.decodes[decode_id], len(PROMPTS))
                    streams = [asyncio.ensure_future(load.one(client, p)) for p in PROMPTS]
                    held = await asyncio.to_thread(gate.all_held.wait, GATE_S)
                    assert held, f"the streams never all reached the decode engine: {[s.done() for s in streams]}"
                    try:
                        stopped.extend(await inject(dep))
                    finally:
                        out["t0"] = time.monotonic()
                        gate.go.set()
                    out["answers"] = await asyncio.gather(*streams)
                return out

            out = asyncio.run(go())
    finally:
        kill_tree(stopped, signal.SIGCONT)
        shutdown_deployment(cfg.name, keep_coordinator=True)
    out["want"] = want
    return out


def check_error_events(out: dict, bound_s: float, kind: str, cause: str) -> None:
    answers, t0 = out["answers"], out["t0"]
    print(f"{kind}: {[a.outcome for a in answers]} ended {max(a.ended for a in answers) - t0:.2f} s after the "
          f"fault (bound {bound_s:.1f} s); errors {[a.error for a in answers]}")
    # one outcome: the prefill engine's first token, then an error event and [DONE] (never cut)
    assert [a.outcome for a in answers] == ["error_event"] * len(answers), [(a.outcome, a.error) for a in answers]
    # ended by the decode engine's failed pull (`cause`: what failed it), not by a router deadline
    assert all(a.code == "engine_error" and "KV transfer failed" in a.error and cause in a.error
               for a in answers), [(a.code, a.error) for a in answers]
    assert all(a.text and out["want"][a.prompt].startswith(a.text) for a in answers)  # what was streamed stands
    # a terminal outcome for every stream within its class's bound of the fault
    assert late({a.prompt: a.ended for a in answers}, t0, bound_s) == {}, bound_s


def test_partition_ends_every_pulling_stream_with_an_error_event(coordinator):
    cfg = deployment("partition")

    async def drop_the_link(dep) -> list[int]:
        (prefill,) = dep.prefills.values()
        ranks = (await prefill.stats.remote()).backend.child_pids  # its rank actors: their NIXL agents
        assert ranks, "the prefill engine reports no rank process"
        return freeze_tree(list(ranks))

    out = held_streams(cfg, drop_the_link, warm=True)
    # nothing but the pulls' own timeout could end them (actors.kv.transport: "reads not done after ...")
    check_error_events(out, partition_bound_s(cfg), "partition", "reads not done after")


def test_read_error_ends_every_pulling_stream_with_an_error_event(coordinator):
    cfg = deployment("read-error", fault_rate=1.0)

    async def nothing(dep) -> list[int]:  # armed by transfer.fault_rate: every pull fails as it starts
        return []

    out = held_streams(cfg, nothing, warm=False)
    check_error_events(out, read_error_bound_s(cfg), "READ error", "fault injected on purpose")
