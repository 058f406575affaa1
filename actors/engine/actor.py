"""EngineActor: one prefill, decode or colocated engine as a Ray actor.

It runs a backend (vLLM, or the synthetic engine), stays registered with the coordinator
(`actors.engine.coordinator_link`) and serves requests: `prefill`, `generate` (or `generate_to` a
same-node inbox) and `abort`. Invariants: one incarnation per process, and a crashed actor that Ray
restarts starts itself and rejoins with fresh agents and handshakes; a transfer failure is answered
per `transfer.failure_policy` (`recompute` prefills locally, `fail` ends the stream with
finish_reason "error"); a decode request aborted before its verdict closes its ledger handoff
without moving a breaker. The life cycles of a request and of the actor: `EngineActor`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

import ray

from actors.engine.backends import make_backend
from actors.engine.config import EngineConfig
from actors.engine.coordinator_link import CoordinatorLink
from actors.engine.core_probe import PONG, core_answer
from actors.engine.ledger_reporter import LedgerReporter
from actors.engine.vllm.kv_events import relay_for
from actors.engine.vllm.trace import timer_for
from actors.engine.load import EngineLoad, LoadMeter
from actors.engine.rates_publisher import RatesPublisher
from actors.engine.token_outbox import TokenOutbox
from actors.protocol.backend import Backend
from actors.protocol.registration import EngineStart
from actors.protocol.request import (EngineRequest, EngineRequestError, InboxRoute, ModelInfo, PrefillResult, Stamps,
                                     TokenChunk)
from actors.protocol.stats import EngineStats
from actors.actor_restart import reconstructed
from actors.ray_names import NAMESPACE
from actors.engine.startup import HANDSHAKE_PUBLISHED, KV_REGISTERED, LOADING, PLACED, READY, StartPhase, StartupLog
from actors.transfer_params import TransferParams, TransferParamsError

logger = logging.getLogger("raypd.engine")
SHUTDOWN_STEP_S = 5.0  # each step of shutdown() before vLLM's own


class EngineActor(CoordinatorLink):
    """Life cycle of a request through an engine pair:

      prefill engine  prefill(req)   the prompt is run with max_tokens=1 and
                                     do_remote_decode; its blocks stay held under a
                                     lease; the first token and the transfer params
                                     come back;
      decode engine   generate(req)  with those params the decode ranks pull the
                                     KV (read plans, NIXL READs), then tokens are
                                     streamed back as deltas; without params the
                                     engine prefills locally (colocated path, or a
                                     migrated stream: prompt + tokens already sent);
                      generate_to    the same chunks sent to a same-node ingress's
                                     inbox (token_outbox.py), not as Ray items;
      either          abort(req_id)  releases the request's blocks and leases; a
                                     decode request aborted before its verdict
                                     closes its ledger handoff (no breaker moves).

    A transfer failure is answered per `transfer.failure_policy`: `recompute`
    prefills the prompt locally (the client sees a normal answer), `fail` ends the
    stream with finish_reason "error" and the reason.

    Life cycle of the actor itself (one incarnation per process):

      start      build the backend, register with the coordinator (a new
                 generation), keep one `watch_registration` call pending there: it
                 returns when the coordinator evicts this incarnation and fails
                 when the coordinator dies; either way the engine registers again
                 (nothing is polled while all is well);
      restart    Ray restarts a crashed actor (`max_restarts`); the new process sees
                 `was_current_actor_reconstructed` and starts itself, so the engine
                 rejoins with no command from anyone (fresh agents, fresh handshakes);
      watch      never returns: the coordinator's pending call fails when this
                 process dies, which is how it learns of the death at once;
      shutdown   unregister, stop the backend.
    """

    async def __init__(self, config: dict, coordinator_name: str | None = None):
        self.cfg = EngineConfig.model_validate(config)
        self.engine_id = self.cfg.engine_id or f"{self.cfg.role}-{uuid.uuid4().hex[:6]}"
        self.coordinator_name = coordinator_name
        self.backend = make_backend(self.cfg, self.engine_id)
        self._coordinator: Any = None
        self._generation: int | None = None
        self._handshakes: list[bytes] = []
        self._register_lock = asyncio.Lock()
        self._kv_relay: Any = None  # actors.engine.vllm.kv_events.KVEventsRelay: KV cache events -> coordinator
        self._timer: Any = None  # actors.engine.vllm.trace.RequestTimer: vLLM's queued/compute split per request
        # handoffs opened/aborted here and the backend's transfer outcomes, coalesced into report_batch calls
        self.ledger: LedgerReporter | None = None
        self.meter = LoadMeter(rates=self.cfg.rates)  # queues, latencies and the one rate model
        self.rates_publisher: RatesPublisher | None = None  # that model to the coordinator, for every router
        self._start_lock = asyncio.Lock()
        self._start_info: EngineStart | None = None
        self._watcher: asyncio.Task | None = None
        self._running: dict[str, float] = {}
        self._outbox: TokenOutbox | None = None  # chunks to same-node ingress inboxes (generate_to)
        self.inbox_streams = 0
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "aborted": 0, "recomputed": 0}
        self.started = False
        self.closed = False
        self.startup = StartupLog(self.engine_id)
        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
            self.startup.reached(PLACED, f"node {node[:8]} ({ray.util.get_node_ip_address()})")
        self.restarted = reconstructed()
        if self.restarted:
            # A restarted incarnation rejoins by itself; callers of start() get the same answer.
            logger.warning("%s: restarted by Ray, starting a new incarnation", self.engine_id)
            asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        delay = 0.5
        while not self.closed and not self.started:
            try:
                await self.start()
            except Exception as exc:  # noqa: BLE001 - e.g. the coordinator restarting too: try again
                logger.warning("%s: starting the new incarnation failed (%s); retrying", self.engine_id, exc)
                await self.backend.shutdown()
                self.backend = make_backend(self.cfg, self.engine_id)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def start(self) -> EngineStart:
        """Build the backend and register with the coordinator (if any).

        Idempotent: several ingress replicas share one engine and each calls
        start(); the first builds the backend, later calls get its answer.
        """
        async with self._start_lock:
            if self._start_info is None:
                self._start_info = await self._start()
            return self._start_info

    async def _start(self) -> EngineStart:
        if self.coordinator_name is not None:
            self._coordinator = ray.get_actor(self.coordinator_name, namespace=NAMESPACE)
            self.ledger = LedgerReporter(self.engine_id, lambda: self._coordinator)
        pairs: dict = {}
        self.startup.reached(LOADING, self.cfg.model if self.cfg.backend == "vllm" else "synthetic")
        try:
            await self.backend.start(self._coordinator, on_new_incarnation=self._register, ledger=self.ledger)
            self._timer = timer_for(self.backend)
            self.meter.budget_tokens = getattr(self.effective_config(), "max_num_batched_tokens", None)
            if self.cfg.backend == "vllm":
                from actors.engine.vllm.compute_priority import lower_compute_priority

                await asyncio.to_thread(lower_compute_priority, self.cfg.cpu.compute_nice)
            self.startup.reached(KV_REGISTERED)
            if self._coordinator is not None:
                self._kv_relay = relay_for(self.backend, self.engine_id, self._relay_kv_events)
                reg = await self._register()
                pairs = reg.pairs if reg is not None else {}
                self.startup.reached(HANDSHAKE_PUBLISHED)
                self._watcher = asyncio.get_running_loop().create_task(self._watch_coordinator())
                r = self.cfg.rates
                self.rates_publisher = RatesPublisher(self.engine_id, self.meter.rates, self._send_rates,
                                                      r.publish_interval_s, r.republish_s)
                self.rates_publisher.start()
        except Exception as exc:
            self.startup.failed(exc)
            raise
        self.started = True
        self.startup.reached(READY)
        return EngineStart(self.engine_id, self.cfg.role, pairs, self.restarted)

    async def start_phases(self) -> list[StartPhase]:
        """Start-up phases reached so far (polled by the launcher while start() runs)."""
        return self.startup.phases()

    def effective_config(self) -> Any:
        """The vLLM engine's own config values (actors.engine.vllm.args.EffectiveEngineConfig); None otherwise."""
        return getattr(self.backend, "effective_config", None)

    # ------------------------------------------------------------- requests
    def _check_role(self, *allowed: str) -> None:
        if self.cfg.role not in allowed:
            raise EngineRequestError(f"engine {self.engine_id} is a {self.cfg.role} engine")
        if not self.started:  # a restarted incarnation still starting: fail fast, the router goes elsewhere
            raise RuntimeError(f"engine {self.engine_id} is starting")

    def _check_alive(self, exc: BaseException) -> None:
        """The backend cannot serve anymore (vLLM's engine core died): let Ray restart us."""
        reason = self.backend.dead_reason()
        if reason is not None and not self.closed:
            logger.error("%s: %s (%s); exiting so that Ray restarts the engine", self.engine_id, reason, exc)
            asyncio.get_running_loop().call_later(0.2, os._exit, 1)

    @ray.method(max_task_retries=0)
    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Run the prompt for remote decode: the first token and the transfer params."""
        entered = Stamps.now(Stamps.ENGINE_IN)
        self._check_role("prefill", "both")
        self.counters["requests"] += 1
        started, out = self.meter.prefill_started(req), None
        try:
            out = await self.backend.prefill(req)
            return out.replace(stamps=out.stamps + self._engine_stamps(entered, req.request_id))
        except EngineRequestError:
            raise
        except Exception as exc:
            self._check_alive(exc)
            raise
        finally:  # a prefill that produced its token teaches the rate model
            self.meter.prefill_done(started, out.num_cached_tokens if out is not None else None, ok=out is not None)

    def _engine_stamps(self, entered: tuple[str, float], request_id: str) -> tuple[tuple[str, float], ...]:
        """This engine's hops of a request's first token: entry, vLLM's queue and compute, exit."""
        inside = self._timer.take(request_id) if self._timer is not None else ()
        return (entered, *inside, Stamps.now(Stamps.ENGINE_OUT))

    @ray.method(max_task_retries=0)
    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Stream token deltas; the last chunk has `finished` and `finish_reason`."""
        entered: tuple[str, float] | None = Stamps.now(Stamps.ENGINE_IN)
        self._check_role("decode", "both")
        req_id = req.request_id
        params = None
        if req.kv_transfer_params is not None:
            try:
                params = TransferParams.parse(req.kv_transfer_params)
            except TransferParamsError as exc:
                raise EngineRequestError(str(exc)) from None
        self.counters["requests"] += 1
        self._running[req_id] = time.monotonic()
        track = self.meter.decode_started(req, local_prefill=params is None)  # no KV to pull: prefilled here
        handoff = self.ledger is not None and params is not None
        if handoff:
            # the ledger watches this handoff until the transfer outcome is reported (coalesced, not awaited)
            self.ledger.opened(req_id, params.remote_engine_id)
        try:
            async for chunk in self.backend.generate(req, params):
                track.observe(chunk)
                if chunk.recomputed:
                    self.counters["recomputed"] += 1
                if chunk.failed:
                    self.counters["errors"] += 1
                if entered is not None and (chunk.token_ids or chunk.finished):
                    chunk = chunk.replace(stamps=(entered, Stamps.now(Stamps.ENGINE_OUT)))
                    entered = None
                yield chunk
            self.counters["finished"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            # the consumer went away (client disconnect): free the request's blocks, and close
            # its handoff if no verdict came yet (an abort is no transfer failure)
            self.counters["aborted"] += 1
            if handoff:
                self.ledger.aborted(req_id)
            await self.backend.abort(req_id)
            raise
        except EngineRequestError:
            raise
        except Exception as exc:
            self._check_alive(exc)
            raise
        finally:
            track.done()
            self._running.pop(req_id, None)

    @ray.method(max_task_retries=0)
    async def generate_to(self, req: EngineRequest, route: InboxRoute) -> int:
        """`generate`'s chunks sent to a same-node consumer's inbox (actors/engine/token_outbox.py);
        this call stays the stream's control: its errors, its cancellation, its end (chunks sent)."""
        if self._outbox is None:
            self._outbox = TokenOutbox(ray.get_runtime_context().get_node_id())
        self.inbox_streams += route.node_id == self._outbox.node_id
        return await self._outbox.send_all(route, self.generate(req))

    async def abort(self, req_id: str) -> None:
        self.counters["aborted"] += 1
        await self.backend.abort(req_id)

    async def stats(self) -> EngineStats:
        return EngineStats(
            engine_id=self.engine_id, role=self.cfg.role, pid=os.getpid(), generation=self._generation,
            restarted=self.restarted, running=len(self._running), **self.counters,
            backend=await self.backend.stats(), load=self.meter.snapshot(),
            kv_events=self._kv_relay.snapshot() if self._kv_relay is not None else None,
            inbox_streams=self.inbox_streams,
        )

    async def load(self) -> EngineLoad:
        """Queues, latencies, KV usage and leases, for the autoscaler."""
        return EngineLoad.of(self.engine_id, self.cfg.role, len(self._running), await self.backend.stats(),
                             self.meter.snapshot())

    async def check_health(self) -> bool:
        return self.started and self.backend.dead_reason() is None

    def model_info(self) -> ModelInfo:
        """What the HTTP front needs about the served model (tokenizer, limits, sampling defaults)."""
        if not self.started:
            raise RuntimeError(f"engine {self.engine_id} has not started")
        return self.backend.model_info()

    @ray.method(max_task_retries=0)  # a probe judges the incarnation it was sent to, not the next one
    async def ping(self) -> str:
        """The coordinator's liveness probe (`actors.control.liveness`): "pong" once this actor's loop
        and the engine core behind it answer, or the core stepped meanwhile (`core_probe`), else
        what is stuck; a frozen actor cannot answer (the caller's timeout decides); a dead backend
        exits the actor."""
        if self.started and self.backend.dead_reason() is not None:
            self._check_alive(RuntimeError("found at a ping"))
        return await core_answer(self.backend, self.engine_id) if self.started else PONG

    @ray.method(max_task_retries=0)
    async def watch(self) -> None:
        """Never returns: a caller's pending call fails when this process dies."""
        await asyncio.Event().wait()

    def pid(self) -> int:
        return os.getpid()

    async def placement(self) -> dict:
        """Where this engine and its rank actors run (node ids), for placement checks."""
        ranks = self.backend.liveness_handles()
        rank_nodes = await asyncio.gather(*(r.node_id.remote() for r in ranks)) if ranks else []
        return {"node_id": ray.get_runtime_context().get_node_id(), "rank_nodes": list(rank_nodes)}

    async def _unregister(self) -> None:
        try:
            await self._coordinator.unregister_engine.remote(self.engine_id, "shutdown", self._generation)
        except ray.exceptions.RayError:
            pass  # the coordinator is away: its watch on this actor ends with it

    async def _shutdown_step(self, step: str, work: Any) -> None:
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task}, timeout=SHUTDOWN_STEP_S)
        if not done:
            task.cancel()  # not awaited: a step that ignores its cancellation must not hold the shutdown
            logger.warning("%s: shutdown: %s did not end within %.0f s; going on", self.engine_id, step,
                           SHUTDOWN_STEP_S)
            return
        task.result()

    def drop_engine(self, engine_id: str) -> None:
        """Coordinator notice: a remote engine incarnation is gone; drop its agents."""
        asyncio.get_running_loop().create_task(self.backend.drop_engine(engine_id))

    async def shutdown(self) -> None:
        """Stops the relays, says goodbye to the coordinator, then stops vLLM. Each step before vLLM's
        gets `SHUTDOWN_STEP_S` (an overrun is logged and left behind): the caller's wait is bounded."""
        self.closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._kv_relay is not None:
            await self._shutdown_step("the KV events relay", self._kv_relay.stop())
        if self.rates_publisher is not None:
            await self._shutdown_step("the rates publisher", self.rates_publisher.stop())
        if self.ledger is not None:
            await self.ledger.flush(timeout_s=SHUTDOWN_STEP_S)
        if self._coordinator is not None:
            await self._shutdown_step("unregistering at the coordinator", self._unregister())
        await self.backend.shutdown()
        if self._outbox is not None:
            self._outbox.close()

