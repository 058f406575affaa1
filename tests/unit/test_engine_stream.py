"""The router's Ray engine client starts a stream's call at once (a P/D continuation's pull overlaps the
first token's way to the client), and closing a stream nobody iterated still cancels the call."""

import asyncio

import ray

from actors.protocol.request import EngineRequest, SamplingSpec
from serving.cluster import clients
from serving.cluster.clients import RayEngineClient


class FakeMethod:
    def __init__(self, calls):
        self.calls = calls

    def options(self, **_):
        return self

    def remote(self, req):
        self.calls.append(req.request_id)
        return f"generator-of-{req.request_id}"


class FakeHandle:
    def __init__(self):
        self.calls = []
        self.generate = FakeMethod(self.calls)


def test_the_call_starts_when_generate_is_called_not_at_the_first_chunk():
    handle = FakeHandle()
    RayEngineClient("d", handle).generate(EngineRequest("r1", SamplingSpec(), prompt_token_ids=(1, 2)))
    assert handle.calls == ["r1"]


def test_closing_a_stream_nobody_iterated_cancels_its_call(monkeypatch):
    cancelled = []
    monkeypatch.setattr(clients.ray, "cancel", lambda gen, recursive=False: cancelled.append(gen))
    stream = RayEngineClient("d", FakeHandle()).generate(EngineRequest("r2", SamplingSpec(), prompt_token_ids=(1,)))
    asyncio.run(stream.aclose())
    assert cancelled == ["generator-of-r2"]


def test_a_call_ray_refuses_fails_at_the_first_chunk_as_the_engine_being_unavailable():
    class Refusing(FakeHandle):
        def __init__(self):
            super().__init__()
            self.generate.remote = self._refuse

        @staticmethod
        def _refuse(req):
            raise ray.exceptions.RayError("actor handle is gone")

    stream = RayEngineClient("d", Refusing()).generate(EngineRequest("r3", SamplingSpec(), prompt_token_ids=(1,)))

    async def first():
        try:
            await stream.__anext__()
        except clients.EngineUnavailable as exc:
            return str(exc)

    assert "actor handle is gone" in asyncio.run(first())


def test_a_connected_ray_worker_without_a_loop_still_starts_the_call_by_ray_items(monkeypatch):
    # CI runs this after Ray tests left ray initialized: the outcome must not depend on that.
    monkeypatch.setattr(clients.ray, "is_initialized", lambda: True)
    handle = FakeHandle()
    RayEngineClient("d", handle).generate(EngineRequest("r4", SamplingSpec(), prompt_token_ids=(1,)))
    assert handle.calls == ["r4"]
