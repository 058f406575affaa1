"""A Ray streaming generator taken by a slow consumer: the items that arrived meanwhile are one chunk."""

from __future__ import annotations

import asyncio

import ray

from actors.protocol.request import TokenChunk


def test_a_slow_consumer_gets_one_chunk_per_wake_up_from_a_real_ray_stream(ray_cluster):
    """An engine-like actor yields one token, then (once let go) 7 more fast; a consumer that falls
    behind until the generator task has ended finds them all arrived and takes them as one chunk (Ray
    streaming generator). The order is forced by the task's end, not by a sleep."""
    from serving.cluster.clients import RayEngineClient

    @ray.remote(num_cpus=0)
    class Steps:
        def __init__(self):
            self.go = asyncio.Event()

        async def release(self):
            self.go.set()

        async def generate(self, req):
            yield TokenChunk("r", (0,), " t0")
            await self.go.wait()  # the first take sees one token, whatever the start-up timing
            for i in range(1, 8):
                yield TokenChunk("r", (i,), f" t{i}", finished=i == 7, finish_reason="length" if i == 7 else None)

    actor = Steps.remote()
    client = RayEngineClient("e", actor)

    async def consume():
        got = []
        gen = client.generate(None)
        got.append(await gen.__anext__())
        await actor.release.remote()
        # the consumer falls behind until the actor's generator has ended: every item was reported
        # to this process (Ray reports a streaming task's items before its end)
        await gen._gen.completed()
        async for chunk in gen:
            got.append(chunk)
        return got

    got = asyncio.run(consume())
    # the first take found one token, the rest had all arrived by the second: two chunks in all
    assert len(got) == 2 and sum((c.token_ids for c in got), ()) == tuple(range(8))
    assert "".join(c.text for c in got) == "".join(f" t{i}" for i in range(8))
    assert got[-1].finished and got[-1].finish_reason == "length"
