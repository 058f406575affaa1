"""The router's typed seams: the front's `RequestRouter` (the real Router fits it), the stream it returns,
the pool-status source injected at construction, and the one place a placer is chosen (no Ray)."""

from __future__ import annotations

import asyncio
import inspect
import typing

import pytest

from actors.protocol.request import EngineRequest, SamplingSpec, TokenChunk
from actors.routes import RouteTable
from serving.config import RouterConfig
from serving.front.routes import FrontState, open_stream
from serving.placement_config import PlacementConfig
from serving.routing.placers import DisaggregatePlacer, EngineEstimates, SloPlacer, placer_for
from serving.routing.planner import planner_for
from serving.routing.policy import ScoreSettings
from serving.routing.protocols import PoolStatusSource, RequestRouter, TokenStream
from serving.routing.router import Router
from serving.routing.stream import RoutedStream
from typed_fakes import engine_stats

ITERATION = ("__aiter__", "__anext__")


def methods(protocol: type) -> dict[str, typing.Callable]:
    return {n: f for n, f in vars(protocol).items() if inspect.isfunction(f) and (not n.startswith("_") or n in ITERATION)}


def assert_fits(impl: type, protocol: type) -> None:
    """Every method of `protocol` is on `impl`, sync or async alike, called the same way (what `impl`
    adds has defaults), returning what the protocol promises (a protocol: a class that fits it)."""
    for name, proto in methods(protocol).items():
        real = getattr(impl, name, None)
        assert real is not None, f"{impl.__name__} lacks {name}"
        assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(proto), name
        wanted = list(inspect.signature(proto).parameters.values())
        given = list(inspect.signature(real).parameters.values())
        assert [(p.name, p.kind) for p in given[:len(wanted)]] == [(p.name, p.kind) for p in wanted], name
        assert all(p.default is not inspect.Parameter.empty for p in given[len(wanted):]), name
        promised = typing.get_type_hints(proto)["return"]
        returned = typing.get_type_hints(real)["return"]
        if promised is protocol or returned is impl:  # `__aiter__` returns the stream itself
            continue
        if getattr(promised, "_is_protocol", False):
            assert_fits(returned, promised)
        elif typing.get_origin(promised) is not None:  # Mapping[str, X] promised, dict[str, X] given
            assert issubclass(typing.get_origin(returned), typing.get_origin(promised)), name
            assert typing.get_args(returned) == typing.get_args(promised), name
        else:
            assert issubclass(returned, promised), name


def test_the_front_holds_a_request_router_and_the_router_fits_it():
    hints = typing.get_type_hints(FrontState)
    assert hints["router"] is RequestRouter
    assert set(methods(RequestRouter)) == {"open", "readiness", "refresh_engine_stats", "snapshot"}
    assert_fits(Router, RequestRouter)
    # following the request from the front leads into the router: open_stream takes and returns typed seams
    opened = typing.get_type_hints(open_stream)
    assert opened["engine_request"] is EngineRequest and opened["return"] is TokenStream
    assert typing.get_type_hints(Router.open)["return"] is RoutedStream


class OneDecode:
    engine_id = "d0"

    async def prefill(self, req):
        raise AssertionError("no prefill engine here")

    async def generate(self, req):
        yield TokenChunk(req.request_id, (1,), " a", finished=True, finish_reason="length", num_prompt_tokens=2)

    async def abort(self, request_id):
        pass

    async def stats(self):
        return engine_stats("d0")


class Directory:
    async def routes(self):
        return RouteTable({"d0": ()}, (), {"d0": 1})

    async def admit_probe(self, decode_id, prefill_id):
        return False

    def prefill_failed(self, decode_id, prefill_id, reason):
        pass


class PoolStatus:
    def __init__(self, answer=None, error=None):
        self.answer, self.error, self.asked = answer, error, 0

    async def status(self):
        self.asked += 1
        if self.error is not None:
            raise self.error
        return self.answer


def router(pool_status: PoolStatusSource | None = None) -> Router:
    return Router({}, {"d0": OneDecode()}, Directory(), RouterConfig(placement="disaggregate"),
                  pool_status=pool_status)


def test_the_stream_the_router_opens_has_what_the_front_reads():
    async def go():
        r = router()
        stream = await r.open(EngineRequest("r1", SamplingSpec(max_tokens=1), prompt_token_ids=(5, 6)))
        chunks = [c async for c in stream]
        stream.close()
        await r.drain()
        return stream, chunks

    stream, chunks = asyncio.run(go())
    assert_fits(RoutedStream, TokenStream)
    for name in typing.get_type_hints(TokenStream):
        assert hasattr(stream, name), name
    assert stream.route.path == "fallback"  # no prefill engine: the decode engine prefilled itself
    assert stream.num_prompt_tokens == 2 and stream.num_generated == 1 and [c.text for c in chunks] == [" a"]


def test_the_pool_status_source_is_injected_and_asked_with_the_engine_stats():
    source = PoolStatus(answer={"deployment": "x"})
    r = router(source)
    asyncio.run(r.refresh_engine_stats())
    assert source.asked == 1 and r.pool_status == {"deployment": "x"} and r.snapshot().pools == {"deployment": "x"}
    broken = router(PoolStatus(error=RuntimeError("launcher gone")))
    broken.pool_status = "stale"
    asyncio.run(broken.refresh_engine_stats())
    assert broken.pool_status is None  # shown as unavailable; routing goes on
    none = router()
    asyncio.run(none.refresh_engine_stats())
    assert none.pool_status_source is None and none.snapshot().pools is None


def test_the_placer_factory_picks_the_slo_model_or_always_disaggregate():
    estimates = EngineEstimates(PlacementConfig())
    slo = placer_for("slo", ScoreSettings(), estimates, True)
    disaggregate = placer_for("disaggregate", ScoreSettings(), estimates, False)
    assert isinstance(slo, SloPlacer) and slo.estimates is estimates and slo.fallback_local
    assert isinstance(disaggregate, DisaggregatePlacer) and not disaggregate.fallback_local
    with pytest.raises(ValueError, match="unknown router.placement"):
        placer_for("random", ScoreSettings(), estimates, True)
    # the planner holds the placer its config names (placement defaults to slo)
    assert isinstance(planner_for(RouterConfig()).placer, SloPlacer)
    assert isinstance(planner_for(RouterConfig(placement="disaggregate")).placer, DisaggregatePlacer)
