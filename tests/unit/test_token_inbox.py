"""The ingress's token inbox without Ray: a real ZMQ ipc socket, frames pushed by the test as an engine's
`TokenOutbox` would, the engine call stood in for by an asyncio future."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import zmq
import zmq.asyncio

from actors.protocol.request import TokenChunk
from serving.cluster import token_inbox
from serving.cluster.token_inbox import InboxStream, TokenInbox


class Failed(Exception):
    pass


def _chunk(i: int, last: bool = False) -> TokenChunk:
    return TokenChunk("r", (i,), f" t{i}", finished=last, finish_reason="length" if last else None)


PUSH: list[zmq.asyncio.Socket] = []


@pytest.fixture(autouse=True)
def _close_push():
    yield
    while PUSH:
        PUSH.pop().close(linger=0)


async def _setup():
    inbox = TokenInbox("node-a")
    push = zmq.asyncio.Context.instance().socket(zmq.PUSH)
    PUSH.append(push)
    push.connect(inbox.endpoint)
    route, mailbox = inbox.open()
    call = asyncio.get_running_loop().create_future()
    stream = InboxStream(inbox, route, mailbox, call, lambda exc: Failed(str(exc)), lambda: None)
    return inbox, push, route, call, stream


async def _send(push, key: bytes, *chunks: TokenChunk) -> None:
    for c in chunks:
        await push.send_multipart((key, pickle.dumps(c)))


def test_chunks_already_arrived_are_taken_as_one():
    async def run():
        inbox, push, route, call, stream = await _setup()
        await _send(push, route.key, _chunk(0), _chunk(1), _chunk(2, last=True))
        while len(inbox._mailboxes[route.key].items) < 3:  # all three in before the first take
            await asyncio.sleep(0.01)
        return [c async for c in stream]

    chunks = asyncio.run(run())
    assert [(c.token_ids, c.finished) for c in chunks] == [((0, 1, 2), True)]


def test_a_frame_under_a_key_the_inbox_never_gave_is_dropped_unread():
    async def run():
        inbox, push, route, call, stream = await _setup()
        await push.send_multipart((b"x" * 16, b"not a pickle: never unpickled"))
        await _send(push, route.key, _chunk(0, last=True))
        return [c async for c in stream]

    chunks = asyncio.run(run())
    assert [c.token_ids for c in chunks] == [(0,)]


def test_a_call_that_returned_without_the_last_chunk_fails_the_stream(monkeypatch):
    monkeypatch.setattr(token_inbox, "LAST_CHUNK_WAIT_S", 0.2)

    async def run():
        inbox, push, route, call, stream = await _setup()
        await _send(push, route.key, _chunk(0))
        first = await stream.__anext__()
        call.set_result(2)  # it says 2 chunks were sent; the second never comes
        with pytest.raises(Failed, match="without its last chunk"):
            await stream.__anext__()
        return first, route.key in inbox._mailboxes

    first, still_open = asyncio.run(run())
    assert (first.token_ids, still_open) == ((0,), False)


def test_a_failed_call_fails_the_stream_and_closes_its_mailbox():
    async def run():
        inbox, push, route, call, stream = await _setup()
        call.set_exception(RuntimeError("engine died"))
        with pytest.raises(Failed, match="engine died"):
            await stream.__anext__()
        return route.key in inbox._mailboxes

    assert asyncio.run(run()) is False


def test_outside_an_event_loop_there_is_no_inbox_and_streams_go_by_ray_items(monkeypatch):
    # A connected Ray worker calling without a running loop: the inbox's reader needs a loop.
    monkeypatch.setattr(token_inbox.ray, "is_initialized", lambda: True)
    assert TokenInbox.here() is None


def test_a_burst_longer_than_one_drain_arrives_whole_and_in_order(monkeypatch):
    monkeypatch.setattr(token_inbox, "DRAIN_BATCH", 4)  # ten frames: three reader callbacks

    async def run():
        inbox, push, route, call, stream = await _setup()
        await _send(push, route.key, *(_chunk(i) for i in range(9)), _chunk(9, last=True))
        return [c async for c in stream]

    chunks = asyncio.run(run())
    assert [t for c in chunks for t in c.token_ids] == list(range(10))


def test_the_loop_ending_closes_the_inbox_socket_and_its_directory():
    async def run():
        inbox = TokenInbox("node-a")
        await asyncio.sleep(0)  # the reader holds the socket
        return inbox

    inbox = asyncio.run(run())
    assert (inbox._sock.closed, os.path.exists(inbox._dir)) == (True, False)
