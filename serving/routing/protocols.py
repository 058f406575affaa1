"""The router's seams, typed: what its callers ask of it, and what it asks of the deployment.

  `RequestRouter`     what the HTTP front asks of a router (`serving.routing.router.Router`
                      implements it; the front's unit tests pass a fake): open a request's
                      stream, readiness, engine stats, a snapshot for the metrics;
  `TokenStream`       the stream `RequestRouter.open` returns, as the front reads it
                      (`serving.routing.stream.RoutedStream` is the real one);
  `PoolStatusSource`  where a router reads the engine pools' status it shows with the
                      engine stats (the autoscaler: `serving.cluster.clients.AutoscalerClient`).

The front depends on these and never on the router's module, so its dependency stops here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from actors.protocol.request import EngineRequest, TokenChunk
from serving.routing.pool import EngineStatus
from serving.routing.status import Readiness, RouterSnapshot
from serving.routing.stream import Route


class TokenStream(Protocol):
    """A routed request's token chunks: iterate them, close the stream when done (aborts it if unfinished)."""

    route: Route  # how it is served (its `path`: pd | local | fallback | migrated labels the metrics)
    first_stamps: tuple[tuple[str, float], ...]  # the first token's hops (`actors.protocol.request.Stamps`)
    num_prompt_tokens: int
    num_generated: int
    num_cached_tokens: int | None  # prompt tokens found in a prefix cache (vLLM reports them; else None)

    def __aiter__(self) -> TokenStream: ...

    async def __anext__(self) -> TokenChunk: ...

    def close(self) -> None:
        """Synchronous, so safe in a cancelled task: the aborts it issues run in the background."""
        ...


class RequestRouter(Protocol):
    """What the front asks of its router (`serving.routing.router.Router`)."""

    async def open(self, req: EngineRequest) -> TokenStream:
        """Route `req`; its stream once the first chunk is known. Raises a
        `serving.routing.route_errors.RoutingError` when no engine can serve it (nothing left running)."""
        ...

    async def readiness(self) -> Readiness:
        """Whether a request can be placed now (`/health`)."""
        ...

    async def refresh_engine_stats(self) -> Mapping[str, EngineStatus]:
        """Ask every engine for its stats (`/metrics` renders them from `snapshot()`)."""
        ...

    def snapshot(self) -> RouterSnapshot:
        """Routing state for the metrics and `raypd status`."""
        ...


class PoolStatusSource(Protocol):
    """The engine pools' status a router shows beside the engine stats (`RouterSnapshot.pools`)."""

    async def status(self) -> object:
        """The status now (the autoscaler's `AutoscalerStatus`); the router only passes it on."""
        ...
