"""Ray actor handles behind the router's small interfaces (`EngineClient`, `Directory`).

The only place where Ray errors are translated: an `EngineRequestError` raised
by an engine (bad prompt, out-of-vocabulary ids, too long) becomes
`RequestRejected` (HTTP 400); anything else Ray raises (actor died, task
failed) becomes `EngineUnavailable`, with `died` set when the actor is gone.

Handles are resolved by name: Ray restarts a crashed engine behind the same
handle, but an engine that was recreated (its restarts used up, then launched
again) is a new actor under the same name, found again after a death.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from serving.cluster.autoscaler import AutoscalerStatus
from serving.cluster.engines import Deployment
from serving.cluster.launcher import find_launcher
from serving.cluster.names import COORDINATOR_NAME, NAMESPACE, actor_name_of
from actors.routes import RouteDelta, RouteTable
from actors.prefix_wire import IndexCursor, IndexUpdate
from actors.protocol.request import EngineRequest, EngineRequestError, PrefillResult, TokenChunk
from serving.cluster.merge import merge_ready
from serving.cluster.token_inbox import InboxStream, TokenInbox
from serving.config import DeploymentConfig
from serving.routing.prefix_view import PrefixCacheView
from serving.routing.planner import planner_for
from serving.routing.router import EngineUnavailable, RequestRejected, Router

logger = logging.getLogger("raypd.router")

ABORT_TIMEOUT_S = 10.0


def translate(exc: BaseException) -> Exception:
    """A Ray error as the router's exception."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, EngineRequestError):
        return RequestRejected(str(exc))
    if isinstance(cause, EngineRequestError):
        return RequestRejected(str(cause))
    died = isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))
    if isinstance(exc, ray.exceptions.RayTaskError) and cause is not None:
        return EngineUnavailable(f"{type(cause).__name__}: {cause}", died=died)
    return EngineUnavailable(f"{type(exc).__name__}: {exc}", died=died)


class NamedActor:
    """An actor handle that is looked up again by name after its actor died for good."""

    def __init__(self, name: str | None, handle: Any):
        self.name, self._handle, self._stale = name, handle, False

    @property
    def handle(self) -> Any:
        if self._stale and self.name is not None:
            try:
                self._handle = ray.get_actor(self.name, namespace=NAMESPACE)
                self._stale = False
            except ValueError:
                pass  # not there (yet): keep the old handle, calls fail fast
        return self._handle

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, ray.exceptions.ActorDiedError):
            self._stale = True


class EngineStream:
    """The chunks of one started `generate` call; closing it before its end cancels the call (the
    actor's generator sees CancelledError and frees the request), iterated or not."""

    def __init__(self, client: "RayEngineClient", gen: Any, error: Exception | None = None):
        self._client, self._gen, self._error = client, gen, error
        self._chunks: AsyncIterator[TokenChunk] | None = None
        self._finished = False

    def __aiter__(self) -> "EngineStream":
        return self

    async def __anext__(self) -> TokenChunk:
        if self._error is not None:
            error, self._error, self._finished = self._error, None, True
            raise error
        if self._chunks is None:
            self._chunks = self._iterate()
        return await self._chunks.__anext__()

    async def _iterate(self) -> AsyncIterator[TokenChunk]:
        gen, fail = self._gen, self._client._error
        try:
            async for ref in gen:
                try:
                    chunk, failure = await merge_ready(gen, await ref)  # and whatever else arrived
                except (ray.exceptions.RayError, EngineRequestError) as exc:
                    raise fail(exc) from None
                self._finished = chunk.finished
                yield chunk
                if failure is not None:
                    raise fail(failure) if isinstance(failure, (ray.exceptions.RayError, EngineRequestError)) \
                        else failure
        except ray.exceptions.RayError as exc:
            raise fail(exc) from None
        finally:
            self._cancel()

    def _cancel(self) -> None:
        if not self._finished and self._gen is not None:
            self._finished = True
            try:
                ray.cancel(self._gen, recursive=False)
            except Exception:  # noqa: BLE001 - already done or actor gone
                pass

    async def aclose(self) -> None:
        if self._chunks is not None:
            await self._chunks.aclose()  # its finally cancels
        self._cancel()


class RayEngineClient:
    """One EngineActor handle."""

    def __init__(self, engine_id: str, handle: Any, actor_name: str | None = None):
        self.engine_id = engine_id
        self.actor = NamedActor(actor_name, handle)
        self.inbox_ok = True  # until the engine says it is on another node

    @property
    def handle(self) -> Any:
        return self.actor.handle

    def _error(self, exc: BaseException) -> Exception:
        self.actor.failed(exc)
        return translate(exc)

    async def prefill(self, req: EngineRequest) -> PrefillResult:
        try:
            return await self.handle.prefill.remote(req)
        except (ray.exceptions.RayError, EngineRequestError) as exc:
            raise self._error(exc) from None

    def generate(self, req: EngineRequest) -> "EngineStream | InboxStream":
        """The engine's chunks of `req`; the call starts now, not at the first `__anext__` (a P/D
        continuation's pull overlaps the first token's way to the client). An engine on this
        node sends them to this process's token inbox (serving/cluster/token_inbox.py), any
        other by Ray items."""
        handle = self.handle
        inbox = TokenInbox.here() if self.inbox_ok and hasattr(handle, "generate_to") else None
        if inbox is not None:
            route, mailbox = inbox.open()
            try:
                call = handle.generate_to.remote(req, route)
            except ray.exceptions.RayError as exc:
                inbox.close(route.key)
                return EngineStream(self, None, self._error(exc))
            return InboxStream(inbox, route, mailbox, call, self._error, lambda: self._elsewhere(req))
        return self._by_ray_items(req)

    def _elsewhere(self, req: EngineRequest) -> EngineStream:
        """The engine refused this process's inbox (another node): this and later streams by Ray items."""
        self.inbox_ok = False
        return self._by_ray_items(req)

    def _by_ray_items(self, req: EngineRequest) -> EngineStream:
        try:
            return EngineStream(self, self.handle.generate.options(num_returns="streaming").remote(req))
        except ray.exceptions.RayError as exc:
            return EngineStream(self, None, self._error(exc))

    async def abort(self, request_id: str) -> None:
        try:  # bounded: a hung engine never answers, and nothing waits for an abort's answer
            await asyncio.wait_for(self.handle.abort.remote(request_id), ABORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.info("abort of %s on %s: no answer in %.0f s", request_id, self.engine_id, ABORT_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            self.actor.failed(exc)
            logger.info("abort of %s on %s failed: %s", request_id, self.engine_id, exc)

    async def stats(self) -> dict:
        try:
            return await self.handle.stats.remote()
        except ray.exceptions.RayError as exc:
            raise self._error(exc) from None

    async def check_health(self, timeout_s: float = 10.0) -> bool:
        return bool(await asyncio.wait_for(self.handle.check_health.remote(), timeout_s))


class RayDirectory:
    """The coordinator as the router's directory (routes, probes, prefill failures).

    Routes are polled with the copy's (epoch, version): the coordinator answers a current copy
    with nothing (the same table object is returned again: the view adopts nothing), breaker
    moves with a `RouteDelta` applied here, anything else with the whole table."""

    def __init__(self, coordinator: Any, timeout_s: float = 5.0, name: str | None = COORDINATOR_NAME):
        self.coordinator = NamedActor(name, coordinator)
        self.timeout_s = timeout_s
        self.table: RouteTable | None = None

    async def routes(self) -> RouteTable:
        fresh = await self._poll(self.table)
        if isinstance(fresh, RouteDelta):  # only breakers moved: applied to our copy (O(changes))
            fresh = fresh.apply(self.table) if fresh.base == self.table.version else await self._poll(None)
        if fresh is not None:
            self.table = fresh
        return self.table

    async def _poll(self, table: RouteTable | None) -> RouteTable | RouteDelta | None:
        seen = (table.epoch, table.version) if table is not None else (None, 0)
        try:
            return await asyncio.wait_for(self.coordinator.handle.routes_if_changed.remote(*seen), self.timeout_s)
        except ray.exceptions.RayError as exc:
            self.coordinator.failed(exc)
            raise

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        return await asyncio.wait_for(self.coordinator.handle.admit_probe.remote(decode_id, prefill_id),
                                      self.timeout_s)

    def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        self.coordinator.handle.prefill_failed.remote(decode_id, prefill_id, reason)

    def engine_hung(self, engine_id: str, generation: int | None, reason: str) -> None:
        """An engine missed a deadline: the coordinator probes it, evicts and restarts it (fire and forget)."""
        self.coordinator.handle.engine_hung.remote(engine_id, generation, reason)


def resolve_engine() -> Callable[[str], RayEngineClient | None]:
    """Looks up the engines the directory names by actor name (engines started after the router
    was built: scaled up by the autoscaler); None when no such actor exists."""
    def resolve(engine_id: str) -> RayEngineClient | None:
        name = actor_name_of(engine_id)
        try:
            return RayEngineClient(engine_id, ray.get_actor(name, namespace=NAMESPACE), name)
        except ValueError:
            return None

    return resolve


class AutoscalerClient:
    """The launcher's autoscaler as the router's `PoolStatusSource` (its status shown with the engine stats)."""

    def __init__(self, handle: Any):
        self.handle = handle  # the launcher actor: its status() is the autoscaler's

    async def status(self) -> AutoscalerStatus:
        return await self.handle.status.remote()


def prefix_index_view(directory: RayDirectory, refresh_s: float) -> PrefixCacheView:
    """The router's copy of the coordinator's prefix index (follows the coordinator across restarts)."""

    async def fetch(cursor: IndexCursor | None) -> IndexUpdate:
        return await asyncio.wait_for(directory.coordinator.handle.prefix_index_updates.remote(cursor),
                                      directory.timeout_s)

    return PrefixCacheView(fetch, refresh_s)


def pool_status_source(cfg: DeploymentConfig) -> AutoscalerClient | None:
    """The autoscaler's status, when the deployment runs one (in its launcher) and the launcher is found."""
    handle = find_launcher(cfg.name) if cfg.autoscaler.enabled else None
    return AutoscalerClient(handle) if handle is not None else None


def build_router(cfg: DeploymentConfig, deployment: Deployment) -> Router:
    """A Router over a launched deployment (`serving.cluster.launcher.attach` / `launch`)."""
    directory = RayDirectory(deployment.coordinator)
    return Router(
        prefills={eid: RayEngineClient(eid, h, actor_name_of(eid)) for eid, h in deployment.prefills.items()},
        decodes={eid: RayEngineClient(eid, h, actor_name_of(eid)) for eid, h in deployment.decodes.items()},
        directory=directory,
        config=cfg.router_config(),
        resolve_engine=resolve_engine(),
        planner=planner_for(cfg.router, prefix_index_view(directory, cfg.router.index_refresh_s),
                            {r: b for r in ("prefill", "decode", "both") if (b := cfg.chunk_budget(r))}),
        pool_status=pool_status_source(cfg),
    )
