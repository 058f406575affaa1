"""A Ray streaming generator taken by a slow consumer: the items that arrived meanwhile are one chunk."""

from __future__ import annotations

import asyncio

import ray

from actors.protocol import TokenChunk


def test_a_slow_consumer_gets_one_chunk_per_wake_up_from_a_real_ray_stream(ray_cluster):
    """An engine-like actor yields 8 one-token chunks fast; a consumer that sleeps before taking
    the rest finds them all arrived and takes them as one chunk (Ray streaming generator)."""
    from serving.cluster.clients import RayEngineClient

    @ray.remote(num_cpus=0)
    class Steps:
        async def generate(self, req):
            for i in range(8):
                yield TokenChunk("r", (i,), f" t{i}", finished=i == 7, finish_reason="length" if i == 7 else None)

    client = RayEngineClient("e", Steps.remote())

    async def consume():
        got = []
        gen = client.generate(None)
        got.append(await gen.__anext__())
        await asyncio.sleep(1.0)  # the consumer falls behind: the other 7 arrive meanwhile
        async for chunk in gen:
            got.append(chunk)
        return got

    got = asyncio.run(consume())
    # whatever the first take found, the rest had all arrived by the second: two chunks in all
    assert len(got) == 2 and sum((c.token_ids for c in got), ()) == tuple(range(8))
    assert "".join(c.text for c in got) == "".join(f" t{i}" for i in range(8))
    assert got[-1].finished and got[-1].finish_reason == "length"
