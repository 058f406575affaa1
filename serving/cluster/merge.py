"""Taking an engine's stream one chunk per wake-up: the items that already arrived, merged.

An engine yields one `TokenChunk` per vLLM output (at most one per engine step
per request: vLLM's output collector merges steps for a consumer that fell
behind), and Ray delivers each as one item of a streaming generator. When this
side falls behind (its event loop busy with other streams), several items wait;
`merge_ready` folds every item that is already here into the chunk just taken
(`TokenChunk.merge`), so the front writes one SSE event for all of them instead
of a burst of events microseconds apart. It never waits for an item.
"""

from __future__ import annotations

from typing import Any

from actors.protocol.request import TokenChunk


def arrived(gen: Any) -> bool:
    """Whether the next item of `gen` is already in this process's memory store.

    `ObjectRefGenerator.next_ready()` answers the same but, whenever the item is not there
    (the common case: the consumer keeps up), also calls `ray.wait(timeout=0)`, which costs
    more than the rest of a token's way through the ingress (py-spy under load). Small items
    (a TokenChunk is inlined in Ray's reply) are in the memory store as soon as they arrive,
    so the store's own peek is the whole answer; `next_ready()` is the fallback."""
    try:
        return bool(gen.worker.core_worker.peek_object_ref_stream(gen._generator_ref)[1])
    except Exception:  # noqa: BLE001 - not Ray's generator (tests), another Ray version, a stream at its end
        return bool(gen.next_ready())


async def merge_ready(gen: Any, chunk: TokenChunk) -> tuple[TokenChunk, BaseException | None]:
    """`chunk` with the items of `gen` (a Ray `ObjectRefGenerator`) that are ready now merged in.

    An item that fails ends the merge: its exception is returned, to be raised once the
    merged chunk (what arrived before the failure) has been handed on."""
    while not chunk.finished and arrived(gen):
        try:
            ref = await gen.__anext__()
            chunk = chunk.merge(await ref)
        except StopAsyncIteration:
            break
        except Exception as exc:  # noqa: BLE001 - raised by the caller after this chunk
            return chunk, exc
    return chunk, None
