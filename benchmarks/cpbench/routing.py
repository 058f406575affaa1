"""The real Router over simulated engines: per-request routing time, the decision mix, awaited coordinator
calls, and a router's first requests after the coordinator restarts.

Life cycle of one measured request:

  1. a task is started at its arrival time (paced, `rate` per second), so time spent by the
     router's event loop on anything else (the view's background refresh, applying the prefix
     index's deltas) shows up as waiting, as it would in a real front;
  2. `Router.open` runs as in production: the cached `DirectoryView` (a real `RayDirectory`
     polling the real coordinator), the planner with the real `PrefixCacheView` synced from
     the coordinator (the prompt's block hashes, the index lookup), the default `slo`
     placement; on a remote decision `pick_prefill` (the breaker states of the route table,
     `admit_probe` awaited for a half-open pair), the prefill call, and on a failed prefill
     the report to the ledger and the retry on another prefill engine;
  3. the simulated engine notes the time of the first engine call (prefill, or generate for
     a local decision): routing time = that minus the arrival; the request's path (remote,
     colocated, fallback), its attempts and the probes it awaited are kept (`cpbench.mix`);
  4. coordinator calls that the request's own task awaited are counted
     (`CountingDirectory`, the prefix view's fetch): background refreshes run in their own
     tasks and are not the request's.

Simulated engines answer at once and publish no rates: the router predicts them with
`router.slo`'s priors. Decode engines carry streams this router opened before the measured
requests (`hold_streams`), so a local prefill of a long turn would stall them (`cpbench.mix`).
"""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from collections import Counter, deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.prefix_wire import IndexCursor, IndexUpdate
from actors.protocol.request import EngineRequest, PrefillResult, SamplingSpec, TokenChunk
from actors.routes import RouteTable
from cpbench.mix import (
    ERROR,
    LONG_OWN_TOKENS,
    SHORT_OWN_TOKENS,
    BreakerCount,
    FaultyPairs,
    MixSummary,
    RoutedPath,
    counter_delta,
    is_short_turn,
    tally,
)
from serving.cluster.clients import RayDirectory
from serving.config import RouterConfig
from serving.routing.planner import planner_for
from serving.routing.prefix_view import PrefixCacheView
from serving.routing.router import Router
from serving.routing.stream import RoutedStream


@dataclass(frozen=True)
class Attempt:
    """What `pick_prefill` is choosing for: the request's task and the decode engine. The router awaits
    `admit_probe` and the prefill call inside tasks of their own (`asyncio.wait_for`), which inherit it.
    The task is held weakly: the attempt lives in the task's own context, and a strong reference would
    make every request a cycle that only the collector's full pass frees (the harness's garbage, not
    the router's, stalling the routing it measures)."""

    task_ref: weakref.ReferenceType[asyncio.Task] | None
    decode_id: str

    @property
    def task(self) -> asyncio.Task | None:
        return self.task_ref() if self.task_ref is not None else None


ATTEMPT: ContextVar[Attempt | None] = ContextVar("attempt", default=None)


class Marks:
    """The first engine call of each request (by request id)."""

    def __init__(self):
        self.first_call: dict[str, float] = {}

    def called(self, request_id: str) -> None:
        self.first_call.setdefault(request_id.split("-retry")[0].split("-local")[0], time.perf_counter())


class SimClient:
    """An engine that answers at once: prefill returns transfer params (or fails, for a faulty pair),
    generate one last chunk."""

    def __init__(self, engine_id: str, marks: Marks, faults: FaultyPairs | None = None):
        self.engine_id, self.marks, self.faults = engine_id, marks, faults

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        self.marks.called(req.request_id)
        attempt = ATTEMPT.get()
        if self.faults is not None and self.faults.fails(attempt.decode_id if attempt else None, self.engine_id):
            raise RuntimeError(f"simulated fault: prefills of {self.engine_id} for this decode engine fail")
        return PrefillResult(req.prompt_token_ids, (7,), " x", "length",
                             {"remote_engine_id": self.engine_id, "remote_block_ids": [0]})

    async def generate(self, req: EngineRequest):
        self.marks.called(req.request_id)
        yield TokenChunk(req.request_id, (8,), " y", finished=True, finish_reason="length",
                         num_prompt_tokens=req.num_prompt_tokens)

    async def abort(self, request_id: str) -> None:
        return None

    async def stats(self) -> Any:
        raise RuntimeError("simulated engine: no stats")


class CountingRouter(Router):
    """The real Router; counts `pick_prefill` calls and names the decode engine of the prefill attempt
    that follows (what the simulated faulty pairs need to know)."""

    pick_prefill_calls = 0  # per instance once counted (the class's 0 until then)

    async def pick_prefill(self, decode_id: str, *args: Any, **kwargs: Any) -> str | None:
        self.pick_prefill_calls += 1
        task = asyncio.current_task()
        ATTEMPT.set(Attempt(weakref.ref(task) if task is not None else None, decode_id))
        return await super().pick_prefill(decode_id, *args, **kwargs)


class CountingDirectory(RayDirectory):
    """The real RayDirectory; counts the calls a request's own task awaited, and the probes granted."""

    def __init__(self, coordinator: Any, name: str):
        super().__init__(coordinator, name=name)
        self.request_tasks: set[asyncio.Task] = set()
        self.awaited: Counter[str] = Counter()
        self.probes_of: Counter[asyncio.Task] = Counter()  # request task -> admit_probe calls it awaited
        self.probes_granted = 0

    def count(self, kind: str, task: asyncio.Task | None = None) -> None:
        task = task or asyncio.current_task()
        if task in self.request_tasks:
            self.awaited[kind] += 1
            if kind == "admit_probe":
                self.probes_of[task] += 1

    async def routes(self):
        self.count("routes")
        return await super().routes()

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        attempt = ATTEMPT.get()  # the probe runs in a task of its own: the request's is the attempt's
        self.count("admit_probe", attempt.task if attempt is not None else None)
        granted = await super().admit_probe(decode_id, prefill_id)
        self.probes_granted += bool(granted)
        return granted


def build_router(coordinator: Any, name: str, prefills: list[str], decodes: list[str], marks: Marks,
                 config: RouterConfig, faults: FaultyPairs | None = None) -> tuple[CountingRouter, CountingDirectory]:
    directory = CountingDirectory(coordinator, name)

    async def fetch(cursor: IndexCursor | None) -> IndexUpdate:
        directory.count("prefix_index_updates")
        return await asyncio.wait_for(directory.coordinator.handle.prefix_index_updates.remote(cursor),
                                      directory.timeout_s)

    view = PrefixCacheView(fetch, config.index_refresh_s)
    router = CountingRouter({p: SimClient(p, marks, faults) for p in prefills},
                            {d: SimClient(d, marks, faults) for d in decodes},
                            directory, config, planner=planner_for(config, view))
    return router, directory


def request(i: int, prompts: list[tuple[int, ...]], rng: random.Random, tag: str = "q",
            short_share: float = 0.0) -> EngineRequest:
    """One of the shared system prompts + `LONG_OWN_TOKENS` of its own, or `SHORT_OWN_TOKENS` for a short turn."""
    own = SHORT_OWN_TOKENS if is_short_turn(i, short_share) else LONG_OWN_TOKENS
    tail = tuple(rng.randrange(49152) for _ in range(own))
    return EngineRequest(f"{tag}{i}", SamplingSpec(max_tokens=64), prompt_token_ids=prompts[i % len(prompts)] + tail)


def breakers_of(table: RouteTable | None) -> BreakerCount:
    return BreakerCount.of((b.state, b.opened_count) for b in (table.breakers if table is not None else ()))


async def hold_streams(router: Router, prompts: list[tuple[int, ...]], n: int, seed: int = 11) -> list[RoutedStream]:
    """Open `n` long turns through the router, one after another, and keep their streams open (unread):
    the decode engines' streams while the measured requests arrive (failures are skipped)."""
    rng = random.Random(seed)
    held = []
    for i in range(n):
        try:
            held.append(await router.open(request(i, prompts, rng, "held")))
        except Exception:  # noqa: BLE001 - a refused one is simply not held
            continue
    return held


@dataclass
class RoutingResult:
    requests: int
    routing_ms: list[float]
    awaited: dict[str, int]
    decisions: dict[str, int]
    mix: MixSummary
    errors: dict[str, int] = field(default_factory=dict)


async def measure(router: CountingRouter, directory: CountingDirectory, marks: Marks, prompts: list[tuple[int, ...]],
                  n: int, rate: float, keep_open: int = 128, seed: int = 0, tag: str = "q",
                  short_share: float = 0.0, faults: FaultyPairs | None = None) -> RoutingResult:
    """`n` requests arriving at `rate`/s; streams stay open (their decode charge with them) a while."""
    rng = random.Random(seed)
    reqs = [request(i, prompts, rng, tag, short_share) for i in range(n)]
    awaited_before = Counter(directory.awaited)
    decisions_before = {f"{d}/{r}": c for (d, r), c in router.planner.decisions.items()}
    picks0, granted0, failed0 = router.pick_prefill_calls, directory.probes_granted, faults.failed if faults else 0
    asked0, carried0 = router.probes.asked, router.probes.carried
    breakers0 = breakers_of(directory.table)
    streams: deque = deque()
    arrivals: dict[str, float] = {}
    errors: Counter[str] = Counter()
    routed: dict[str, tuple[str, int, int]] = {}  # request id -> (path, attempts, probes awaited)

    async def one(req: EngineRequest) -> None:
        try:
            s = await router.open(req)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            errors[type(exc).__name__] += 1
            routed[req.request_id] = (ERROR, 0, directory.probes_of.pop(asyncio.current_task(), 0))
            return
        routed[req.request_id] = (s.route.path, s.route.attempts, directory.probes_of.pop(asyncio.current_task(), 0))
        streams.append(s)
        while len(streams) > keep_open:
            streams.popleft().close()

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(reqs):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        arrivals[req.request_id] = time.perf_counter()
        task = asyncio.get_running_loop().create_task(one(req))
        directory.request_tasks.add(task)
        tasks.append(task)
    await asyncio.gather(*tasks)
    for s in streams:
        s.close()
    await router.drain()
    directory.request_tasks.clear()
    ms = {r: (marks.first_call[r] - arrivals[r]) * 1e3 for r in arrivals if r in marks.first_call}
    decisions_now = {f"{d}/{r}": c for (d, r), c in router.planner.decisions.items()}
    decisions = counter_delta(decisions_now, decisions_before)
    awaited = Counter(directory.awaited)
    awaited.subtract(awaited_before)
    paths = [RoutedPath(path, probes, attempts, ms.get(rid)) for rid, (path, attempts, probes) in routed.items()]
    mix = tally(paths, decisions, router.pick_prefill_calls - picks0, directory.probes_granted - granted0,
                (faults.failed if faults else 0) - failed0, breakers0, breakers_of(directory.table),
                probes_asked=router.probes.asked - asked0, probes_carried=router.probes.carried - carried0)
    return RoutingResult(n, list(ms.values()), {k: v for k, v in awaited.items() if v}, decisions, mix, dict(errors))


async def after_restart(coordinator: Any, name: str, warm: Router, warm_dir: CountingDirectory, marks: Marks,
                        prefills: list[str], decodes: list[str], prompts: list[tuple[int, ...]],
                        config: RouterConfig, deadline_s: float = 120.0) -> dict[str, Any]:
    """Kill the coordinator (Ray restarts it); time a warm router's first request, a cold router's first
    successful one, and when the warm router's view is the new incarnation's."""
    rng = random.Random(7)
    epoch = warm_dir.table.epoch
    ray.kill(coordinator, no_restart=False)
    t_kill = time.perf_counter()
    out: dict[str, Any] = {}
    req = request(10_000_000, prompts, rng)
    awaited0 = Counter(warm_dir.awaited)
    task = asyncio.get_running_loop().create_task(warm.open(req))
    warm_dir.request_tasks.add(task)
    s = await task
    out["warm_first_route_ms"] = (marks.first_call[req.request_id] - t_kill) * 1e3
    out["warm_first_awaited"] = counter_delta(warm_dir.awaited, awaited0)
    s.close()
    cold, _ = build_router(coordinator, name, prefills, decodes, marks, config)
    attempts, i = 0, 0
    while time.perf_counter() - t_kill < deadline_s:
        attempts += 1
        i += 1
        req = request(20_000_000 + i, prompts, rng)
        try:
            s = await cold.open(req)
            out["cold_first_route_ms"] = (marks.first_call[req.request_id] - t_kill) * 1e3
            s.close()
            break
        except Exception as exc:  # noqa: BLE001 - no engine registered yet: try again soon
            out.setdefault("cold_errors", Counter())[type(exc).__name__] += 1
            await asyncio.sleep(0.02)
    out["cold_attempts"] = attempts
    while time.perf_counter() - t_kill < deadline_s:
        await warm.routes()
        table = warm_dir.table
        if table is not None and table.epoch != epoch and len(table.decodes) == len(decodes):
            out["warm_view_new_epoch_ms"] = (time.perf_counter() - t_kill) * 1e3
            break
        await asyncio.sleep(0.02)
    out["cold_errors"] = dict(out.get("cold_errors", {}))
    await cold.drain()
    return out


async def repair_pairs(coordinator: Any, router: Router, faults: FaultyPairs) -> int:
    """The faulty pairs work again, and each reports one successful handoff (as its decode engine would),
    which closes its breaker whatever its state; the router takes the new table. Run before the restart
    phase, whose first route must not meet a half-open pair (its probe would wait for the dead coordinator)."""
    from actors.control.ledger_records import HandoffOpened, LedgerBatch, TransferOutcomes, UnitOutcome

    pairs = faults.repair()
    for d, p in sorted(pairs):
        rid = f"repair-{d}-{p}"
        await coordinator.report_batch.remote(
            LedgerBatch(d, (HandoffOpened(rid, p), TransferOutcomes((UnitOutcome((rid,), (), (), 1),)))))
    await router.routes(force=True)
    return len(pairs)


async def breaker_change(coordinator: Any, router: Router, directory: CountingDirectory, decode_id: str,
                         prefill_id: str, threshold: int = 3) -> dict[str, Any]:
    """One pair's breaker opens (failed transfers reported as a decode engine reports them): what the
    change costs the coordinator (its answer to a router holding the previous table) and a router."""
    import pickle

    from actors.control.ledger_records import HandoffOpened, LedgerBatch, TransferOutcomes, UnitOutcome

    before = directory.table
    records = []
    for i in range(threshold):
        rid = f"trip-{decode_id}-{i}"
        records += [HandoffOpened(rid, prefill_id), TransferOutcomes((UnitOutcome((rid,), (rid,), (), 1),))]
    await coordinator.report_batch.remote(LedgerBatch(decode_id, tuple(records)))
    t0 = time.perf_counter()
    answer = await coordinator.routes_if_changed.remote(before.epoch, before.version)
    coordinator_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    table = await router.routes(force=True)
    router_ms = (time.perf_counter() - t0) * 1e3
    return {"answer": type(answer).__name__, "answer_kb": len(pickle.dumps(answer)) / 1024,
            "coordinator_call_ms": coordinator_ms, "router_refresh_ms": router_ms,
            "pair_left_routes": prefill_id not in {r.prefill_id for r in table.decodes.get(decode_id, ())}}
