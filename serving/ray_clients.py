"""Ray actor handles behind the router's small interfaces (`EngineClient`, `Directory`).

The only place where Ray errors are translated: an `EngineRequestError` raised
by an engine (bad prompt, too long) becomes `RequestRejected` (HTTP 400);
anything else Ray raises (actor died, task failed) becomes `EngineUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

from actors.protocol import EngineRequest, EngineRequestError, PrefillResult, TokenChunk
from serving.router import EngineUnavailable, RequestRejected, Router, RouterSettings

logger = logging.getLogger("raypd.router")


def translate(exc: BaseException) -> Exception:
    """A Ray error as the router's exception."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, EngineRequestError):
        return RequestRejected(str(exc))
    if isinstance(cause, EngineRequestError):
        return RequestRejected(str(cause))
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        return EngineUnavailable(f"{type(cause).__name__}: {cause}")
    return EngineUnavailable(f"{type(exc).__name__}: {exc}")


class RayEngineClient:
    """One EngineActor handle."""

    def __init__(self, engine_id: str, handle: Any):
        self.engine_id, self.handle = engine_id, handle

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        try:
            return await self.handle.prefill.remote(req)
        except (ray.exceptions.RayError, EngineRequestError) as exc:
            raise translate(exc) from None

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenChunk]:
        try:
            gen = self.handle.generate.options(num_returns="streaming").remote(req)
        except ray.exceptions.RayError as exc:
            raise translate(exc) from None
        finished = False
        try:
            async for ref in gen:
                try:
                    chunk = await ref
                except (ray.exceptions.RayError, EngineRequestError) as exc:
                    raise translate(exc) from None
                finished = chunk.finished
                yield chunk
        except ray.exceptions.RayError as exc:
            raise translate(exc) from None
        finally:
            if not finished:
                try:
                    ray.cancel(gen, recursive=False)  # the actor's generator sees CancelledError and frees the request
                except Exception:  # noqa: BLE001 - already done or actor gone
                    pass

    async def abort(self, request_id: str) -> None:
        try:
            await self.handle.abort.remote(request_id)
        except ray.exceptions.RayError as exc:
            logger.info("abort of %s on %s failed: %s", request_id, self.engine_id, exc)

    async def stats(self) -> dict:
        try:
            return await self.handle.stats.remote()
        except ray.exceptions.RayError as exc:
            raise translate(exc) from None

    async def check_health(self) -> bool:
        return bool(await self.handle.check_health.remote())


class RayDirectory:
    """The coordinator as the router's directory."""

    def __init__(self, coordinator: Any, timeout_s: float = 5.0):
        self.coordinator, self.timeout_s = coordinator, timeout_s

    async def routes(self) -> dict[str, list[str]]:
        engines = await asyncio.wait_for(self.coordinator.engines.remote(), self.timeout_s)
        decodes = [e["engine_id"] for e in engines if e["role"] in ("decode", "both")]
        compat = await asyncio.wait_for(
            asyncio.gather(*(self.coordinator.compatible_prefills.remote(d) for d in decodes)), self.timeout_s
        )
        return dict(zip(decodes, (list(c) for c in compat)))


def build_router(cfg: Any, deployment: Any) -> Router:
    """A Router over a launched deployment (`serving.launcher.Deployment`)."""
    return Router(
        prefills={eid: RayEngineClient(eid, h) for eid, h in deployment.prefills.items()},
        decodes={eid: RayEngineClient(eid, h) for eid, h in deployment.decodes.items()},
        directory=RayDirectory(deployment.coordinator),
        settings=RouterSettings.from_config(cfg),
    )
