"""The ingress's side of the same-node token hop: one inbox per event loop, one stream per engine call.

Engines on the ingress's node send a stream's chunks as frames to this process's PULL socket
(`actors.engine.token_outbox`), one mailbox per stream; the Ray call that asked for the stream stays
its control. Invariants: a frame under a key the inbox did not hand out is dropped unread; a failed
call raises as a Ray stream's error would; closing before the last chunk cancels the call (the
engine aborts the request and frees its blocks); every way out closes the mailbox. The socket is ipc
in a directory only this user can enter; `RAYPD_TOKEN_INBOX=0` turns the inbox off. The life of a
stream read through it: `TokenInbox`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import pickle
import secrets
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
import zmq

from actors.engine.token_outbox import zmq_context
from actors.protocol.request import InboxRoute, InboxUnreachable, TokenChunk

logger = logging.getLogger("raypd.router")

LAST_CHUNK_WAIT_S = 5.0
DRAIN_BATCH = 256  # frames per reader callback, so one busy inbox cannot hold the loop
ENABLED = os.environ.get("RAYPD_TOKEN_INBOX", "1") != "0"


class _CallEnded:
    """Posted to a mailbox when the engine call ended (its outcome is on the future)."""

    def __init__(self, call: asyncio.Future):
        self.call = call


class Mailbox:
    """One stream's chunks in arrival order; one reader."""

    def __init__(self) -> None:
        self.items: deque[TokenChunk | _CallEnded] = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: TokenChunk | _CallEnded) -> None:
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> TokenChunk | _CallEnded:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()


class TokenInbox:
    """This event loop's PULL socket and the mailboxes of the streams it reads.

    Life of a stream read through the inbox:
      1. `RayEngineClient.generate` opens a mailbox under a fresh random key (`TokenInbox.open`) and
         calls the engine's `generate_to(req, InboxRoute)` at once (the call starts now).
      2. The engine sends each chunk as a frame [key, pickled TokenChunk] to this process's PULL
         socket (`actors/engine/token_outbox.py`); the inbox's reader puts it in the key's mailbox.
         A frame under a key the inbox did not hand out is dropped unread.
      3. `InboxStream.__anext__` takes the next chunk, with every chunk already in the mailbox merged
         in (as `merge_ready` does for Ray items), until the finished one.
      4. The call's end is posted to the mailbox too. A failed call raises there, translated like a Ray
         stream's error (engine died, request rejected); an engine on another node refuses before it
         starts and the stream is read by Ray items instead (the client remembers). A call that
         returned without its finished chunk in `LAST_CHUNK_WAIT_S` fails the stream.
      5. Closing before the finished chunk cancels the call: the engine aborts the request and frees
         its blocks. Every way out closes the mailbox.

    The socket is ipc in a directory only this user can enter (the same trust as Ray's session
    directory); frames are pickled by raypd's engines. `RAYPD_TOKEN_INBOX=0` turns the inbox off (every
    stream by Ray items).
    """

    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TokenInbox]" = weakref.WeakKeyDictionary()

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._dir = tempfile.mkdtemp(prefix="raypd-inbox-")  # mode 0700
        atexit.register(shutil.rmtree, self._dir, True)
        self.endpoint = f"ipc://{self._dir}/tokens"
        # A plain socket read by `loop.add_reader`: zmq.asyncio's per-frame futures and poller cost
        # about twice as much CPU per frame as draining everything ready in one callback.
        self._sock = zmq.Socket(zmq_context(), zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._mailboxes: dict[bytes, Mailbox] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    def here(cls) -> "TokenInbox | None":
        """The running loop's inbox (made on first use); None when off, outside a Ray worker or
        outside an event loop (the inbox's reader is a task of the loop)."""
        if not ENABLED or not ray.is_initialized():
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        inbox = cls._by_loop.get(loop)
        if inbox is None:
            try:
                inbox = cls._by_loop[loop] = cls(ray.get_runtime_context().get_node_id())
            except (OSError, zmq.ZMQError) as exc:
                logger.warning("no token inbox here (%s): streams go by Ray items", exc)
                return None
        return inbox

    def open(self) -> tuple[InboxRoute, Mailbox]:
        key = secrets.token_bytes(16)
        mailbox = self._mailboxes[key] = Mailbox()
        return InboxRoute(self.node_id, self.endpoint, key), mailbox

    def close(self, key: bytes) -> None:
        self._mailboxes.pop(key, None)

    async def _read(self) -> None:
        """Holds the socket's reader for the loop's life: the loop ending cancels it, and the socket goes."""
        loop = asyncio.get_running_loop()
        fd = self._sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        try:
            self._drain()  # frames that came before the reader
            await loop.create_future()
        finally:
            loop.remove_reader(fd)
            self._sock.close(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _drain(self) -> None:
        """Every frame ready now, at most `DRAIN_BATCH` per callback (the rest in the next one). ZMQ's
        FD is edge-triggered: it signals again only after a read has found the socket empty."""
        sock = self._sock
        for _ in range(DRAIN_BATCH):
            try:
                key, payload = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed under us: the loop is ending
                return
            mailbox = self._mailboxes.get(key)
            if mailbox is None:  # a closed stream's late frames, or none of ours: dropped unread
                continue
            try:
                mailbox.put(pickle.loads(payload))
            except Exception:  # noqa: BLE001 - one bad frame must not stop every stream
                logger.exception("token inbox: a frame could not be read")
        asyncio.get_running_loop().call_soon(self._drain)


class InboxStream:
    """The chunks of one `generate_to` call, read from the inbox (see the module's life cycle)."""

    def __init__(self, inbox: TokenInbox, route: InboxRoute, mailbox: Mailbox, call: Any,
                 fail: Callable[[BaseException], Exception], by_ray_items: Callable[[], Any]):
        self._inbox, self._route, self._mailbox, self._ref = inbox, route, mailbox, call
        self._fail, self._by_ray_items = fail, by_ray_items
        self._fallback: Any = None  # the Ray-items stream, when the engine is on another node
        self._received = False  # a chunk came: the stream is never started again elsewhere
        self._returned = False  # the call returned: what it sent is still on its way, for a bounded time
        self._finished = False
        self._call = asyncio.ensure_future(call)
        self._call.add_done_callback(self._ended)

    def _ended(self, call: asyncio.Future) -> None:
        if not call.cancelled():
            call.exception()  # retrieved: a stream that got its finished chunk never looks
        self._mailbox.put(_CallEnded(call))

    def __aiter__(self) -> "InboxStream":
        return self

    async def __anext__(self) -> TokenChunk:
        if self._fallback is not None:
            return await self._fallback.__anext__()
        if self._finished:
            raise StopAsyncIteration
        try:
            chunk = await self._next()
        except BaseException:
            self._close()
            raise
        if self._fallback is not None:
            return chunk
        items = self._mailbox.items
        while not chunk.finished and items and isinstance(items[0], TokenChunk):
            chunk = chunk.merge(items.popleft())  # and whatever else arrived (one SSE event)
        if chunk.finished:
            self._finished = True
            self._inbox.close(self._route.key)
        return chunk

    async def _next(self) -> TokenChunk:
        while True:
            if self._returned:
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                    async with asyncio.timeout(LAST_CHUNK_WAIT_S):
                        item = await self._mailbox.get()
                except TimeoutError:
                    raise self._fail(RuntimeError(
                        f"the engine's stream ended without its last chunk ({self._call.result()} sent)")) from None
            else:
                item = await self._mailbox.get()
            if isinstance(item, TokenChunk):
                self._received = True
                return item
            call = item.call
            if call.cancelled():
                raise self._fail(RuntimeError("the engine call was cancelled"))
            exc = call.exception()
            if exc is None:
                self._returned = True
                continue
            if _refused(exc) and not self._received:  # an engine on another node: nothing ran there
                self._inbox.close(self._route.key)
                self._fallback = self._by_ray_items()
                return await self._fallback.__anext__()
            raise self._fail(exc) from None

    def _close(self) -> None:
        if not self._finished:
            self._finished = True
            if not self._call.done():
                try:
                    ray.cancel(self._ref, recursive=False)  # the engine aborts the request
                except Exception:  # noqa: BLE001 - already done or actor gone
                    pass
        self._inbox.close(self._route.key)

    async def aclose(self) -> None:
        if self._fallback is not None:
            await self._fallback.aclose()
        self._close()


def _refused(exc: BaseException) -> bool:
    """The engine refused the inbox (on another node): nothing ran."""
    cause = getattr(exc, "cause", None)
    return isinstance(exc, InboxUnreachable) or isinstance(cause, InboxUnreachable)
