"""The P:D autoscaler: the launcher's loop that applies `serving.cluster.autoscale_policy`.

Every `interval_s` it sums the deployment's serving engines' loads per role and lets each role's
`RolePolicy` decide; it grows a pool by one engine in its own placement group, or drains the
highest-index engine and stops it once idle. Invariants: a role with a change in progress makes no
other decision; a drain that never gets idle stops after `drain_timeout_s` (counted); it runs in
the launcher actor, the one owner of engine start-up, and owns the pool sizes once it runs. The
life cycle of a pool change: `Autoscaler`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import ray

from actors.control.coordinator_actor import get_coordinator
from actors.engine.load import EngineLoad
from serving.cluster.autoscale_policy import PoolSignals, RolePolicy, ScaleDecision
from serving.routing.slo_model import EngineEstimate
from serving.cluster.engines import Unschedulable, handle_of
from serving.cluster.names import engine_id, engine_index
from serving.config import DeploymentConfig
from serving.sizing.live import LivePool, LoadMix, ScaleAdvice, scale_advice
from serving.placement_config import MeasuredRates

logger = logging.getLogger("raypd.autoscaler")

LOAD_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.5
ROLES = ("prefill", "decode", "both")


class EngineHands(Protocol):
    """What the autoscaler asks of the launcher."""

    async def start_engine(self, role: str, index: int, measured: MeasuredRates | None = None) -> Any: ...
    async def stop_engine(self, engine: str) -> None: ...


@dataclass
class RoleStatus:
    serving: list[str] = field(default_factory=list)
    starting: list[int] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    min: int = 0
    max: int = 0
    last_decision: str = "none yet"
    signals: PoolSignals | None = None
    measured: MeasuredRates | None = None  # what its serving engines measured last (None: not yet)


@dataclass
class ScaleEvent:
    at: float
    role: str
    direction: str
    reason: str
    engine: str
    outcome: str = "in progress"


@dataclass
class AutoscalerStatus:
    deployment: str
    roles: dict[str, RoleStatus]
    counters: dict[str, int]
    history: list[ScaleEvent]


class Autoscaler:
    """Life cycle of a pool change:

      observe  every `interval_s`: the deployment's engines as the coordinator lists
               them (serving or draining) and each serving engine's `load()`,
               summed per role into `PoolSignals`; each role's `RolePolicy` decides;
      grow     one more engine at the lowest free index, in its own STRICT_PACK
               placement group carrying the role's resources (pinned like every
               engine), started with the rates the role's serving engines measured
               last (its chunk budget comes from them: `MeasuredRates`); it registers
               with the coordinator and routers adopt it from the directory. A group
               no node can hold is removed again and the attempt counted (`unschedulable`);
      shrink   the highest-index serving engine is marked draining at the
               coordinator, so routers stop choosing it; once it has been idle (no
               decode stream, no prefill, no lease, no handoff in flight) for
               `drain_quiet_s` it is shut down (it unregisters: its prefix-index
               entries go), killed, and its placement group removed. A drain that
               never gets idle stops after `drain_timeout_s` (counted).

    A role with a change in progress makes no other decision. It runs inside the
    deployment's launcher actor (`serving.cluster.launcher`, the one owner of engine
    start-up), which it asks to start and stop engines (`EngineHands`); once it runs it
    owns the pool sizes.
    """

    def __init__(self, cfg: DeploymentConfig, hands: EngineHands):
        self.cfg, self.hands = cfg, hands
        acfg = self.cfg.autoscaler
        self.active = [r for r in ROLES if getattr(cfg, r).count]  # the roles this deployment runs
        self.policies = {role: RolePolicy(role, getattr(acfg, role), acfg, cfg.router.slo) for role in self.active}
        self.roles = {role: RoleStatus(min=getattr(acfg, role).min, max=getattr(acfg, role).max)
                      for role in self.active}
        self.changes: dict[str, asyncio.Task] = {}  # role -> the change in progress
        self.draining: dict[str, asyncio.Task] = {}  # engine -> its drain
        self.counters: Counter[str] = Counter()
        self.history: deque[ScaleEvent] = deque(maxlen=100)
        self._handles: dict[str, Any] = {}
        self._loop: asyncio.Task | None = None
        self._coordinator: Any = None

    # ------------------------------------------------------------ life cycle
    def start(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the control loop must survive anything
                logger.exception("autoscaler step failed")
            await asyncio.sleep(self.cfg.autoscaler.interval_s)

    def coordinator(self) -> Any:
        if self._coordinator is None:
            self._coordinator = get_coordinator()
        return self._coordinator

    def handle(self, engine: str) -> Any | None:
        """The engine's actor, None when it is gone."""
        if engine not in self._handles:
            handle = handle_of(engine)
            if handle is None:
                return None
            self._handles[engine] = handle
        return self._handles[engine]

    # ----------------------------------------------------------------- step
    async def step(self, now: float | None = None) -> list[ScaleDecision]:
        """Observe, decide and start the changes (they finish in the background)."""
        now = time.monotonic() if now is None else now
        try:
            listed = await self.coordinator().engines.remote()
        except ray.exceptions.RayError as exc:
            self._coordinator = None  # restarting: look it up again next time
            logger.warning("coordinator unavailable: %s", exc)
            return []
        decisions = []
        loads: dict[str, list[EngineLoad]] = {}
        for role in self.active:
            mine = [e for e in listed if engine_index(self.cfg.name, role, e.engine_id) is not None]
            st = self.roles[role]
            st.serving = sorted((e.engine_id for e in mine if not e.draining), key=self._index_of(role))
            st.draining = sorted(e.engine_id for e in mine if e.draining)
            for engine in st.draining:  # e.g. after this actor restarted: finish what was started
                if engine not in self.draining:
                    self._drain(role, engine, ScaleEvent(now, role, "down", "resumed", engine))
            loads[role] = await self._loads(st.serving)
            st.signals = self._signals(len(st.serving), loads[role])
            st.measured = self._measured(loads[role]) or st.measured  # kept through a quiet spell
        advice = await self._advice(loads) if self.cfg.autoscaler.policy == "model" else None
        for role in self.active:
            st = self.roles[role]
            if role in self.changes or st.draining:
                continue
            decision = self.policies[role].decide(st.signals, now, advice)
            st.last_decision = f"{decision.direction}: {decision.reason}"
            decisions.append(decision)
            if decision.direction == "up":
                self._grow(role, decision, now)
            elif decision.direction == "down":
                self._shrink(role, decision, now)
        return decisions

    def _index_of(self, role: str) -> Any:
        return lambda engine: engine_index(self.cfg.name, role, engine)

    async def _loads(self, serving: list[str]) -> list[EngineLoad]:
        async def one(engine: str) -> EngineLoad | None:
            handle = self.handle(engine)
            if handle is None:
                return None
            try:
                return await asyncio.wait_for(handle.load.remote(), LOAD_TIMEOUT_S)
            except (asyncio.TimeoutError, ray.exceptions.RayError) as exc:
                logger.info("no load from %s: %s", engine, exc)
                self._handles.pop(engine, None)
                return None

        return [x for x in await asyncio.gather(*(one(e) for e in serving)) if x is not None]

    @staticmethod
    def _signals(engines: int, loads: list[EngineLoad]) -> PoolSignals:
        p90s = [x.meter.prefill_latency_p90_s for x in loads if x.meter.prefill_latency_p90_s is not None]
        itls = [x.meter.itl_p90_s for x in loads if x.meter.itl_p90_s is not None]
        return PoolSignals(
            engines=engines,
            queued_prompt_tokens=sum(x.meter.queued_prompt_tokens_avg for x in loads),
            prefill_latency_p90_s=max(p90s) if p90s else None,
            outstanding_tokens=sum(x.meter.outstanding_tokens_avg for x in loads),
            kv_usage=max((x.kv_usage for x in loads), default=0.0),
            itl_p90_s=max(itls) if itls else None,
        )

    @staticmethod
    def _measured(loads: list[EngineLoad]) -> MeasuredRates | None:
        """The role's rates as its engines measured them (an engine it starts gets its chunk budget
        from them); None until they measured both a prefill rate and a step time."""
        return MeasuredRates.of([x.meter.prefill_tokens_per_s for x in loads], [x.meter.step_s for x in loads])

    async def _advice(self, loads: dict[str, list[EngineLoad]]) -> ScaleAdvice:
        """The planner's model on the live pools (`serving.sizing.live`), from what the engines measured
        of themselves (the same rate model each engine publishes to the routers: `LoadSnapshot.rates`)."""
        slo = self.cfg.router.slo
        pools = []
        for role, xs in loads.items():
            budget = self.cfg.chunk_budget(role) or slo.chunk_budget_fallback()
            estimates = []
            for x in xs:
                m, r = x.meter, x.meter.rates
                estimates.append(EngineEstimate(
                    x.engine_id, role, m.prefill_tokens_per_s or slo.prior_prefill_tokens_per_s,
                    m.step_s or slo.prior_step_s, (r.chunk_budget_tokens if r else None) or budget,
                    r.step_per_stream_s if r and r.measured else slo.prior_step_per_stream_s,
                    queued_prefill_tokens=m.queued_prompt_tokens, decode_streams=x.running))
            bounds = getattr(self.cfg.autoscaler, role)
            seqs = self.cfg.engine_config(role).engine_kwargs.get("max_num_seqs")
            pools.append(LivePool(role, tuple(estimates), int(seqs) if seqs else None,
                                  can_grow=len(xs) < bounds.max, can_shrink=len(xs) > bounds.min))
        deciding = [x for r in ("decode", "both") for x in loads.get(r, ())]
        prompts = [x.meter.prompt_tokens_avg for x in deciding if x.meter.prompt_tokens_avg is not None]
        outputs = [x.meter.output_tokens_avg for x in deciding if x.meter.output_tokens_avg is not None]
        mix = LoadMix(sum(prompts) / len(prompts) if prompts else 0.0, sum(outputs) / len(outputs) if outputs else 0.0)
        rate = sum(x.meter.arrivals_per_s for x in deciding)  # every request decodes on one engine
        # a few simulations (ms per engine each): off the launcher's event loop
        return await asyncio.to_thread(scale_advice, pools, rate, mix, slo, self.cfg.autoscaler.down_fraction)

    # ------------------------------------------------------------------ grow
    def _grow(self, role: str, decision: ScaleDecision, now: float) -> None:
        st = self.roles[role]
        taken = {engine_index(self.cfg.name, role, e) for e in st.serving + st.draining}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        event = ScaleEvent(now, role, "up", decision.reason, engine_id(self.cfg.name, role, index))
        self.history.append(event)
        self.policies[role].applied(now)
        st.starting = [index]
        self.changes[role] = asyncio.get_running_loop().create_task(self._start(role, index, event))

    async def _start(self, role: str, index: int, event: ScaleEvent) -> None:
        try:
            await self.hands.start_engine(role, index, self.roles[role].measured)
            event.outcome = "started"
            self.counters[f"{role}_scaled_up"] += 1
        except Unschedulable as exc:
            event.outcome = f"unschedulable: {exc}"
            self.counters[f"{role}_unschedulable"] += 1
        except Exception as exc:  # noqa: BLE001 - recorded; the next decision may try again
            event.outcome = f"failed: {type(exc).__name__}: {exc}"
            self.counters[f"{role}_start_failed"] += 1
            logger.warning("starting %s failed: %s", event.engine, exc)
        finally:
            self.roles[role].starting = []
            self.policies[role].applied(time.monotonic())
            self.changes.pop(role, None)

    # ---------------------------------------------------------------- shrink
    def _shrink(self, role: str, decision: ScaleDecision, now: float) -> None:
        engine = self.roles[role].serving[-1]  # the highest index: the pools stay 0..n-1
        event = ScaleEvent(now, role, "down", decision.reason, engine)
        self.history.append(event)
        self.policies[role].applied(now)
        self._drain(role, engine, event)

    def _drain(self, role: str, engine: str, event: ScaleEvent) -> None:
        task = asyncio.get_running_loop().create_task(self._drain_and_stop(role, engine, event))
        self.draining[engine] = self.changes[role] = task

    async def _drain_and_stop(self, role: str, engine: str, event: ScaleEvent) -> None:
        acfg = self.cfg.autoscaler
        t0 = time.monotonic()
        quiet_since: float | None = None
        try:
            while True:
                now = time.monotonic()
                if await self._idle(engine):
                    quiet_since = now if quiet_since is None else quiet_since
                    if now - quiet_since >= acfg.drain_quiet_s:
                        event.outcome = "drained"
                        break
                else:
                    quiet_since = None
                if now - t0 > acfg.drain_timeout_s:
                    event.outcome = "drain timed out, stopped anyway"
                    self.counters[f"{role}_drain_timeouts"] += 1
                    break
                await asyncio.sleep(DRAIN_POLL_S)
            await self.hands.stop_engine(engine)
            self.counters[f"{role}_scaled_down"] += 1
        except Exception as exc:  # noqa: BLE001 - recorded; the engine stays listed and is retried
            event.outcome = f"failed: {type(exc).__name__}: {exc}"
            logger.warning("draining %s failed: %s", engine, exc)
        finally:
            self._handles.pop(engine, None)
            self.draining.pop(engine, None)
            self.changes.pop(role, None)
            self.policies[role].applied(time.monotonic())

    async def _idle(self, engine: str) -> bool:
        """Marked draining (again: a re-registration clears it), and nothing in flight."""
        coordinator, handle = self.coordinator(), self.handle(engine)
        if handle is None or not await coordinator.set_draining.remote(engine):
            return True  # gone, or not registered any more: nothing can reach it
        load, handoffs = await asyncio.gather(handle.load.remote(), coordinator.handoffs_in_flight.remote(engine))
        return load.idle and handoffs == 0

    # ---------------------------------------------------------------- status
    async def status(self) -> AutoscalerStatus:
        return AutoscalerStatus(self.cfg.name, {r: replace(s, serving=list(s.serving), starting=list(s.starting), draining=list(s.draining)) for r, s in self.roles.items()},
                                dict(self.counters), list(self.history))

    def stop(self) -> None:
        """Stop deciding (before the deployment is torn down); drains in progress are left to shutdown."""
        for task in [self._loop, *self.changes.values()]:
            if task is not None:
                task.cancel()


def status_lines(status: AutoscalerStatus) -> list[str]:
    """`raypd status` lines: one per role, then the last scale events."""
    lines = ["autoscaler:"]
    for role, st in status.roles.items():
        sig = st.signals or PoolSignals(engines=0)
        load = (f"queued {sig.queued_prompt_tokens:.0f} prompt tok" if role == "prefill"
                else f"outstanding {sig.outstanding_tokens:.0f} tok, kv {sig.kv_usage:.0%}")
        lines.append(f"  {role:<7} {len(st.serving)} serving (min {st.min}, max {st.max})"
                     + (f", starting {st.starting}" if st.starting else "")
                     + (f", draining {st.draining}" if st.draining else "")
                     + f"; {load}; last: {st.last_decision}")
    for ev in list(status.history)[-5:]:
        lines.append(f"  {ev.direction:<4} {ev.role:<7} {ev.engine:<30} {ev.reason:<22} {ev.outcome}")
    return lines
