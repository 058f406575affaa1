"""An engine's chunks to a same-node consumer's inbox, as frames over ZMQ (ipc), not as Ray items.

A frame costs a fraction of a Ray streaming item's CPU per token (docs/benchmarks.md). The Ray call
that asked for the stream (`EngineActor.generate_to`) stays its control: the engine's errors, the
consumer's cancellation (the abort that frees the request's blocks) and the end of the stream
travel as before; only the chunks take the socket. One PUSH socket per consumer inbox carries all
its streams in order.

A consumer on another node is refused before anything runs (`InboxUnreachable`): it reads that engine
by Ray items. A consumer that takes no frame for `SEND_TIMEOUT_S` (its process gone) ends the stream:
the request is aborted, as when a Ray stream's consumer goes away.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from actors.protocol.request import InboxRoute, InboxUnreachable, TokenChunk

SEND_TIMEOUT_S = 10.0


class TokenOutbox:
    """One engine's PUSH sockets, one per consumer inbox it has sent to."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._sockets: dict[str, zmq.asyncio.Socket] = {}

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = zmq_context().socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live consumer: a gone one blocks the send
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock

    async def send_all(self, route: InboxRoute, chunks: AsyncIterator[TokenChunk]) -> int:
        """Every chunk of `chunks` to the inbox at `route`; the number sent. The chunk source is
        closed on any way out (its consumer's abort path runs: blocks freed)."""
        try:
            if route.node_id != self.node_id:
                raise InboxUnreachable(f"inbox on node {route.node_id[:12]}, engine on {self.node_id[:12]}")
            sock, sent = self._socket(route.endpoint), 0
            async for chunk in chunks:
                frame = (route.key, pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL))
                try:  # zmq's own send timeout: asyncio.wait_for (3.11) can swallow the call's cancellation
                    await sock.send_multipart(frame, copy=False)
                except zmq.Again:
                    raise TimeoutError(f"the consumer's inbox took no chunk in {SEND_TIMEOUT_S:g} s") from None
                sent += 1
            return sent
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()


_CONTEXT: zmq.asyncio.Context | None = None


def zmq_context() -> zmq.asyncio.Context:
    """One ZMQ context per process (engines' outboxes, the ingress's inboxes), never collected (a collected context with an open socket blocks
    in its finalizer)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = zmq.asyncio.Context()
    return _CONTEXT
