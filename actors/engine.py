"""EngineActor: one prefill, decode or colocated engine as a Ray actor.

Life cycle of a request through an engine pair:

  prefill engine  prefill(req)   the prompt is run with max_tokens=1 and
                                 do_remote_decode; its blocks stay held under a
                                 lease; the transfer params come back;
  decode engine   generate(req)  with those params the decode ranks pull the
                                 KV (read plans, NIXL READs), then tokens are
                                 streamed back as deltas; without params the
                                 engine prefills locally (colocated path);
  either          abort(req_id)  releases the request's blocks and leases.

A transfer failure is answered per `kv_load_failure_policy`: `recompute`
prefills the prompt locally (the client sees a normal answer), `fail` ends the
stream with finish_reason "error" and the reason. The backend (vLLM AsyncLLM or
the synthetic engine) does the work; this actor adds registration with the
coordinator, heartbeats, request bookkeeping and stats.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import ray

from actors.engine_config import EngineConfig
from actors.protocol import Backend, EngineRequest, EngineRequestError, ModelInfo, PrefillResult, TokenChunk
from actors.startup import HANDSHAKE_PUBLISHED, KV_REGISTERED, LOADING, PLACED, READY, StartPhase, StartupLog
from actors.transfer_params import TransferParams, TransferParamsError

logger = logging.getLogger("raypd.engine")


def make_backend(cfg: EngineConfig, engine_id: str) -> Backend:
    if cfg.backend == "synthetic":
        from actors.synthetic.backend import SyntheticBackend

        return SyntheticBackend(cfg, engine_id, token_latency_s=cfg.synthetic.token_latency_s)
    from actors.vllm_backend import VllmBackend

    return VllmBackend(cfg, engine_id)


class EngineActor:
    def __init__(self, config: dict, coordinator_name: str | None = None, heartbeat_s: float = 2.0):
        self.cfg = EngineConfig.model_validate(config)
        self.engine_id = self.cfg.engine_id or f"{self.cfg.role}-{uuid.uuid4().hex[:6]}"
        self.coordinator_name = coordinator_name
        self.heartbeat_s = heartbeat_s
        self.backend = make_backend(self.cfg, self.engine_id)
        self._coordinator: Any = None
        self._heartbeat: asyncio.Task | None = None
        self._running: dict[str, float] = {}
        self.counters = {"requests": 0, "finished": 0, "errors": 0, "aborted": 0, "recomputed": 0}
        self.started = False
        self._start_lock: asyncio.Lock | None = None
        self._start_info: dict | None = None
        self.startup = StartupLog(self.engine_id)
        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
            self.startup.reached(PLACED, f"node {node[:8]} ({ray.util.get_node_ip_address()})")

    async def start(self) -> dict:
        """Build the backend and register with the coordinator (if any).

        Idempotent: several ingress replicas share one engine and each calls
        start(); the first builds the backend, later calls get its answer.
        """
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._start_info is None:
                self._start_info = await self._start()
            return self._start_info

    async def _start(self) -> dict:
        if self.coordinator_name is not None:
            from actors.coordinator import NAMESPACE

            self._coordinator = ray.get_actor(self.coordinator_name, namespace=NAMESPACE)
        verdicts: dict = {}
        self.startup.reached(LOADING, self.cfg.model if self.cfg.backend == "vllm" else "synthetic")
        try:
            await self.backend.start(self._coordinator)
            self.startup.reached(KV_REGISTERED)
            if self._coordinator is not None:
                verdicts = await self._register()
                self.startup.reached(HANDSHAKE_PUBLISHED)
                self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        except Exception as exc:
            self.startup.failed(exc)
            raise
        self.started = True
        self.startup.reached(READY)
        return {"engine_id": self.engine_id, "role": self.cfg.role, "pairs": verdicts}

    async def start_phases(self) -> list[StartPhase]:
        """Start-up phases reached so far (polled by the launcher while start() runs)."""
        return self.startup.phases()

    def effective_config(self) -> Any:
        """The vLLM engine's own config values (actors.engine_args.EffectiveEngineConfig); None otherwise."""
        return getattr(self.backend, "effective_config", None)

    async def _register(self) -> dict:
        return await self._coordinator.register_engine.remote(
            self.engine_id, self.cfg.role, self.backend.handshakes(),
            [ray.get_runtime_context().current_actor] + self.backend.liveness_handles(),
            {"backend": self.cfg.backend, "model": self.cfg.model},
        )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                known = await self._coordinator.heartbeat.remote(self.engine_id)
                if not known:  # the coordinator restarted or dropped us: register again
                    logger.warning("%s: coordinator forgot us, re-registering", self.engine_id)
                    await self._register()
            except ray.exceptions.RayError as exc:
                logger.warning("%s: heartbeat failed: %s", self.engine_id, exc)
                await self._reconnect()

    async def _reconnect(self) -> None:
        from actors.coordinator import NAMESPACE

        try:
            self._coordinator = ray.get_actor(self.coordinator_name, namespace=NAMESPACE)
        except ValueError:
            return  # not back yet; try at the next beat

    # ------------------------------------------------------------- requests
    def _check_role(self, *allowed: str) -> None:
        if self.cfg.role not in allowed:
            raise EngineRequestError(f"engine {self.engine_id} is a {self.cfg.role} engine")

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """Run the prompt for remote decode: the first token and the transfer params."""
        self._check_role("prefill", "both")
        self.counters["requests"] += 1
        return await self.backend.prefill(req)

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]:
        """Stream token deltas; the last chunk has `finished` and `finish_reason`."""
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
        if self._coordinator is not None and params is not None:
            # the ledger watches this handoff until the transfer outcome is reported
            self._coordinator.open_handoff.remote(req_id, params.remote_engine_id, self.engine_id)
        try:
            async for chunk in self.backend.generate(req):
                if chunk.recomputed:
                    self.counters["recomputed"] += 1
                if chunk.failed:
                    self.counters["errors"] += 1
                yield chunk
            self.counters["finished"] += 1
        except (asyncio.CancelledError, GeneratorExit):
            # the consumer went away (client disconnect): free the request's blocks
            self.counters["aborted"] += 1
            await self.backend.abort(req_id)
            raise
        finally:
            self._running.pop(req_id, None)

    async def abort(self, req_id: str) -> None:
        self.counters["aborted"] += 1
        await self.backend.abort(req_id)

    async def stats(self) -> dict:
        return {
            "engine_id": self.engine_id, "role": self.cfg.role, "backend": self.cfg.backend,
            "running": len(self._running), **self.counters, **(await self.backend.stats()),
        }

    async def check_health(self) -> bool:
        return self.started

    def model_info(self) -> ModelInfo:
        """What the HTTP front needs about the served model (tokenizer, limits, sampling defaults)."""
        if not self.started:
            raise RuntimeError(f"engine {self.engine_id} has not started")
        return self.backend.model_info()

    def ping(self) -> str:
        return "pong"

    def pid(self) -> int:
        import os

        return os.getpid()

    async def placement(self) -> dict:
        """Where this engine and its rank actors run (node ids), for placement checks."""
        ranks = self.backend.liveness_handles()
        rank_nodes = await asyncio.gather(*(r.node_id.remote() for r in ranks)) if ranks else []
        return {"node_id": ray.get_runtime_context().get_node_id(), "rank_nodes": list(rank_nodes)}

    def drop_engine(self, engine_id: str) -> None:
        """Coordinator notice: a remote engine died; its agents are dropped lazily."""
        drop = getattr(self.backend, "drop_engine", None)
        if drop is not None:
            asyncio.get_running_loop().create_task(drop(engine_id))

    async def shutdown(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._coordinator is not None:
            try:
                await self._coordinator.unregister_engine.remote(self.engine_id, "shutdown")
            except ray.exceptions.RayError:
                pass
        await self.backend.shutdown()


def engine_actor_options(cfg: EngineConfig) -> dict:
    """Ray options for an engine: mostly waiting, so it reserves what the config says."""
    env = {}
    if cfg.cpu_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind
    if cfg.backend == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_space_gib)
    return {
        "num_cpus": cfg.num_cpus,
        "resources": dict(cfg.resources),
        "max_concurrency": 1000,
        "runtime_env": {"env_vars": env} if env else None,
    }
