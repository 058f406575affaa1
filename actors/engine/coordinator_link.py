"""How an engine actor stays registered with the coordinator (`EngineActor`'s coordinator link).

`_register` publishes this incarnation's handshakes (a new generation); one pending
`watch_registration` call at the coordinator returns when the coordinator evicts the
registration and fails when the coordinator dies: either way the engine registers again,
after `_await_coordinator` found it back (restarted by Ray, or recreated by name). Nothing
is polled while all is well. KV cache events and the engine's rates go out through it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from actors.engine.config import EngineConfig
from actors.engine.rates_publisher import RatesPublisher
from actors.engine.startup import StartupLog
from actors.protocol.backend import Backend
from actors.protocol.registration import EngineInfo
from actors.ray_names import NAMESPACE

logger = logging.getLogger("raypd.engine")


class CoordinatorLink:
    """Mixed into `EngineActor`: the state below, and `_check_alive`, are its own (set in its `__init__`)."""

    engine_id: str
    cfg: EngineConfig
    backend: Backend
    coordinator_name: str | None
    closed: bool
    rates_publisher: RatesPublisher | None
    startup: StartupLog
    _coordinator: Any
    _generation: int | None
    _handshakes: list[bytes]
    _register_lock: asyncio.Lock

    async def _register(self, evicted_generation: int | None = None) -> Any:
        """Register this incarnation's handshakes. From the watch loop (`evicted_generation`:
        the coordinator dropped that registration) it registers again unless someone already
        did; from a new incarnation of the backend it registers unless nothing changed."""
        if self.backend.dead_reason() is not None:  # e.g. a rank that Ray did not restart
            self._check_alive(RuntimeError("found at registration"))
            return None
        async with self._register_lock:
            if evicted_generation is not None and self._generation != evicted_generation:
                return None  # registered meanwhile
            handshakes = await self.backend.handshakes()
            if evicted_generation is None and self._generation is not None and handshakes == self._handshakes:
                return None  # already registered as it is
            reg = await self._coordinator.register_engine.remote(
                self.engine_id, self.cfg.role, handshakes,
                [ray.get_runtime_context().current_actor] + self.backend.liveness_handles(),
                EngineInfo(self.cfg.backend, self.cfg.model, os.getpid(),
                           ray.get_runtime_context().get_node_id(), self.startup.start_s(),
                           ray.get_runtime_context().get_actor_id() or ""),
            )
            self._generation, self._handshakes = reg.generation, handshakes
            if self.rates_publisher is not None:
                self.rates_publisher.reset()  # the new registration has none of our rates yet
            return reg

    def _relay_kv_events(self, batch: Any) -> Any:
        return self._coordinator.kv_events.remote(self.engine_id, batch)

    def _send_rates(self, rates: Any) -> Any:
        return self._coordinator.report_rates.remote(self.engine_id, self._generation, rates)

    async def _watch_coordinator(self) -> None:
        """One pending call at the coordinator; re-register when it returns or fails."""
        while not self.closed:
            generation = self._generation
            try:
                reason = await self._coordinator.watch_registration.options(max_task_retries=0).remote(
                    self.engine_id, generation)
            except ray.exceptions.RayError as exc:
                reason = f"coordinator unreachable ({type(exc).__name__})"
                await self._await_coordinator()
            if self.closed:
                return
            if self._generation == generation:  # not already replaced by a registration of ours
                logger.warning("%s: registration %s ended (%s); registering again", self.engine_id,
                               generation, reason)
                try:
                    await self._register(evicted_generation=generation)
                except ray.exceptions.RayError as exc:
                    logger.warning("%s: registering failed: %s", self.engine_id, exc)
                    await self._await_coordinator()
                    await asyncio.sleep(1.0)  # refused (e.g. a fenced incarnation): no tight loop

    async def _await_coordinator(self) -> None:
        """Until the coordinator answers again (restarted by Ray, or recreated by name)."""
        delay = 0.2
        while not self.closed:
            try:
                handle = ray.get_actor(self.coordinator_name, namespace=NAMESPACE)
                await asyncio.wait_for(handle.ping.remote(), 10.0)
                self._coordinator = handle
                self.backend.coordinator_changed(handle)
                return
            except (ValueError, asyncio.TimeoutError, ray.exceptions.RayError):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
