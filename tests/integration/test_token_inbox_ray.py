"""The same-node token hop (serving/cluster/token_inbox.py, actors/engine/token_outbox.py) on real Ray
actors and real ZMQ sockets: an engine-like actor sends its chunks with the real `TokenOutbox`, the
consumer reads them with the real `RayEngineClient`. The vLLM engine's own use of it through the Serve
front: tests/integration/test_default_front.py."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

from actors.protocol.request import EngineRequestError, TokenChunk


@ray.remote(num_cpus=0)
class Steps:
    """Yields `n` one-token chunks (the last finished); `hold` waits after the first until released."""

    def __init__(self, node_id: str | None = None):
        from actors.engine.token_outbox import TokenOutbox

        self.outbox = TokenOutbox(node_id or ray.get_runtime_context().get_node_id())
        self.go = asyncio.Event()
        self.ended_by: str | None = None
        self.ray_items = 0

    async def _chunks(self, n: int, hold: bool, fail: str | None):
        try:
            for i in range(n):
                if fail == "reject":
                    raise EngineRequestError("prompt too long")
                if fail == "die" and i == 1:
                    os._exit(1)
                yield TokenChunk("r", (i,), f" t{i}", finished=i == n - 1, finish_reason="length" if i == n - 1 else None)
                if hold and i == 0:
                    await self.go.wait()
            self.ended_by = "end"
        except (asyncio.CancelledError, GeneratorExit):
            self.ended_by = "abort"  # the EngineActor frees the request's blocks here
            raise

    async def generate_to(self, req, route):
        n, hold, fail = req
        return await self.outbox.send_all(route, self._chunks(n, hold, fail))

    async def generate(self, req):
        self.ray_items += 1
        async for chunk in self._chunks(*req):
            yield chunk

    def release(self) -> None:
        self.go.set()

    def state(self) -> tuple[str | None, int]:
        return self.ended_by, self.ray_items


def _client(actor):
    from serving.cluster.clients import RayEngineClient

    return RayEngineClient("e", actor)


def test_a_stream_comes_whole_and_in_order_through_the_inbox(ray_cluster):
    from serving.cluster.token_inbox import InboxStream

    actor = Steps.remote()

    async def read():
        stream = _client(actor).generate((16, False, None))
        return type(stream), [c async for c in stream]

    kind, chunks = asyncio.run(read())
    assert (kind, sum((c.token_ids for c in chunks), ()), chunks[-1].finish_reason,
            ray.get(actor.state.remote())) == (InboxStream, tuple(range(16)), "length", ("end", 0))


def test_closing_a_stream_before_its_end_cancels_the_engine_call(ray_cluster):
    actor = Steps.remote()

    async def read_one():
        stream = _client(actor).generate((8, True, None))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(read_one())
    deadline = time.monotonic() + 30
    while ray.get(actor.state.remote())[0] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (first.token_ids, ray.get(actor.state.remote())) == ((0,), ("abort", 0))


def test_an_engine_on_another_node_is_read_by_ray_items(ray_cluster):
    actor = Steps.remote(node_id="f" * 56)  # its outbox believes it runs elsewhere: it refuses the inbox
    client = _client(actor)

    async def read_twice():
        return [[c async for c in client.generate((4, False, None))] for _ in range(2)]

    first, second = asyncio.run(read_twice())
    assert ([sum((c.token_ids for c in s), ()) for s in (first, second)], client.inbox_ok,
            ray.get(actor.state.remote())) == ([(0, 1, 2, 3)] * 2, False, ("end", 2))


def test_an_engine_refusing_the_request_is_a_client_error(ray_cluster):
    from serving.routing.router import RequestRejected

    actor = Steps.remote()

    async def read():
        return [c async for c in _client(actor).generate((4, False, "reject"))]

    with pytest.raises(RequestRejected, match="prompt too long"):
        asyncio.run(read())


def test_an_engine_that_dies_mid_stream_is_unavailable_and_dead(ray_cluster):
    from serving.routing.router import EngineUnavailable

    actor = Steps.options(max_restarts=0).remote()

    async def read():
        got = []
        try:
            async for c in _client(actor).generate((8, True, "die")):  # dies once released after token 0
                got.append(c)
                actor.release.remote()  # not awaited: the actor may die before it answers
        except EngineUnavailable as exc:
            return got, exc
        return got, None

    got, exc = asyncio.run(read())
    assert ([c.token_ids for c in got], type(exc), exc.died) == ([(0,)], EngineUnavailable, True)
