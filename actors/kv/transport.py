"""Per-rank KV transport: peers, descriptor lists, READs per request, completion, notices.

`TransportBase` keeps the bookkeeping; `NixlTransport` (`actors.kv.nixl.nixl_transport`) moves
bytes with NIXL (UCX), the unit tests' `FakeTransport` with memmove inside one process (with fault
switches for the layers above), so tests of one exercise the other's logic too. Invariants:
prepared lists are cached and released with their peer; a request is DONE when all its READs are
and FAILED as soon as one errors or it outlives `read_timeout_s` (a dead peer never leaves a request
waiting forever); every handle is released once; nothing here starts a thread or spins (NIXL's
progress thread serves peers' READs). The life cycle of one request's pull: `TransportBase`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from actors.kv.plan.descriptors import DescTable
from actors.kv.transfer_errors import HandshakeError, KVTransferError, TransferSetupError, TransportClosedError
from actors.kv.handshake import RankHandshake
from actors.kv.plan.layout import CacheGeometry

logger = logging.getLogger("raypd.transport")

PeerKey = tuple[str, int, int]  # (engine id, pp rank, tp rank)


@dataclass
class PollResult:
    done: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # req id -> reason


@dataclass
class _Pending:
    handles: list[tuple[PeerKey, Any]]
    started: float
    failed: str | None = None
    nbytes: int = 0  # posted so far: the read deadline grows with them


@dataclass
class TransportStats:
    reads_posted: int = 0
    descriptors_posted: int = 0
    spans_posted: int = 0  # extents once NIXL merged descriptors adjacent in both caches
    bytes_posted: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    notifs_sent: int = 0
    handshakes: int = 0
    lists_prepared: int = 0


class TransportBase:
    """Request bookkeeping shared by the real and the fake transport.

    Life cycle of one request's pull on a decode rank:

      add_peer            once per remote rank (handshake): connect to its agent;
      local_list /        once per descriptor table: prepared lists are cached
      remote_list         (local ones per table, remote ones per (peer, table)) and
                          released with their peer; KV lists are of the cache's
                          memory kind, lease-board lists of DRAM (`register_extra`
                          adds DRAM this rank READs into or is read from);
      start_read          post one READ by descriptor index; `notif` reaches the
                          peer when the data has moved;
      poll                non-blocking; a request is DONE when all its READs are,
                          FAILED as soon as one READ errors, raises, or the request
                          outlives `read_timeout_s` (a dead peer must never leave a
                          request waiting forever); every handle is released once.

    `NixlTransport` (`actors.kv.nixl.nixl_transport`) moves bytes with NIXL (UCX); the unit tests' `FakeTransport`
    (tests/unit/fake_transport.py) moves them with memmove inside one process, with
    fault switches for the layers above. Both share the bookkeeping in `TransportBase`,
    so tests of one exercise the other's logic too. Nothing here starts a thread or spins: NIXL's UCX
    progress thread (asleep on the UCX worker's fd, `actors.kv.nixl.nixl_binding`)
    serves peers' READs and collects notifications; `poll()` reads states.
    """

    def __init__(self, name: str, geometry: CacheGeometry, read_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, min_link_mbps: float = 0.0):
        if read_timeout_s <= 0:
            raise TransferSetupError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.name = name
        self.geometry = geometry
        self.read_timeout_s = read_timeout_s
        # the slowest link a READ may cross without failing: its bytes at that rate extend the deadline
        self._seconds_per_byte = 8.0 / (min_link_mbps * 1e6) if min_link_mbps > 0 else 0.0
        self._clock = clock
        self._peers: dict[PeerKey, RankHandshake] = {}
        self._local: dict[tuple[DescTable, str | None], Any] = {}
        self._remote: dict[tuple[PeerKey, DescTable, str | None], Any] = {}
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self.stats = TransportStats()

    # ------------------------------------------------------- backend hooks
    def _connect(self, hs: RankHandshake) -> None: raise NotImplementedError
    def _disconnect(self, hs: RankHandshake) -> None: raise NotImplementedError
    def _prepare(self, hs: RankHandshake | None, table: DescTable, mem: str | None) -> Any:
        raise NotImplementedError
    def _register(self, regions: list[tuple[int, int]]) -> None: raise NotImplementedError
    def _post(self, hs: RankHandshake, local: Any, li: np.ndarray, remote: Any, ri: np.ndarray,
              notif: bytes) -> Any: raise NotImplementedError
    def _state(self, handle: Any) -> str: raise NotImplementedError
    def _release(self, handle: Any) -> None: raise NotImplementedError
    def _send(self, hs: RankHandshake, msg: bytes) -> None: raise NotImplementedError
    def _recv(self) -> list[bytes]: raise NotImplementedError
    def _close(self) -> None: raise NotImplementedError
    def metadata(self) -> bytes: raise NotImplementedError

    # -------------------------------------------------------------- peers
    def _require_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"transport {self.name!r} is shut down")

    def add_peer(self, hs: RankHandshake) -> PeerKey:
        """Connect to a remote rank; a new agent under a known key replaces the old one."""
        self._require_open()
        known = self._peers.get(hs.key)
        if known is not None and known.agent_name == hs.agent_name:
            return hs.key
        if known is not None:
            self._drop_peer(hs.key)
        self._connect(hs)
        self._peers[hs.key] = hs
        self.stats.handshakes += 1
        return hs.key

    def has_peer(self, key: PeerKey) -> bool:
        return key in self._peers

    def peer(self, key: PeerKey) -> RankHandshake:
        try:
            return self._peers[key]
        except KeyError:
            raise HandshakeError("peer", f"no handshake with {key}") from None

    def peers(self) -> list[PeerKey]:
        return sorted(self._peers)

    def remove_engine(self, engine_id: str) -> int:
        """Drop every rank of a remote engine; its in-flight reads fail."""
        self._require_open()
        keys = [k for k in self._peers if k[0] == engine_id]
        for key in keys:
            self._drop_peer(key)
        return len(keys)

    def _drop_peer(self, key: PeerKey) -> None:
        for pending in self._pending.values():
            if pending.failed is None and any(k == key for k, _ in pending.handles):
                pending.failed = f"peer {key} was removed"
        for list_key in [k for k in self._remote if k[0] == key]:
            del self._remote[list_key]  # released with the peer's agent
        hs = self._peers.pop(key)
        try:
            self._disconnect(hs)
        except KVTransferError as exc:  # a dead peer may refuse a clean goodbye
            logger.warning("disconnecting %s: %s", key, exc)

    # ----------------------------------------------------- descriptor lists
    def register_extra(self, regions: list[tuple[int, int]]) -> None:
        """Register DRAM besides the KV cache (lease board, landing rows); before `metadata()`
        when peers must read it."""
        self._require_open()
        self._register(regions)

    def local_list(self, table: DescTable, mem: str | None = None) -> Any:
        """This rank's descriptors cut by `table` (KV memory, or `mem`), prepared once and cached."""
        self._require_open()
        handle = self._local.get((table, mem))
        if handle is None:
            handle = self._local[(table, mem)] = self._prepare(None, table, mem)
            self.stats.lists_prepared += 1
        return handle

    def remote_list(self, key: PeerKey, table: DescTable, mem: str | None = None) -> Any:
        """A peer's descriptors cut by `table`, prepared once per peer and cached."""
        self._require_open()
        handle = self._remote.get((key, table, mem))
        if handle is None:
            handle = self._remote[(key, table, mem)] = self._prepare(self.peer(key), table, mem)
            self.stats.lists_prepared += 1
        return handle

    # -------------------------------------------------------------- reads
    def start_read(self, req_id: str, key: PeerKey, local: Any, li: np.ndarray, remote: Any,
                   ri: np.ndarray, notif: bytes, nbytes: int, spans: int | None = None) -> None:
        """Post one READ of descriptors `ri` of a peer's list into `li` of ours (`spans`: the
        extents they merge into, for the stats)."""
        self._require_open()
        hs = self.peer(key)
        pending = self._pending.setdefault(req_id, _Pending([], self._clock()))
        try:
            handle = self._post(hs, local, li, remote, ri, notif)
        except KVTransferError as exc:
            pending.failed = pending.failed or f"read setup from {key} failed: {exc}"
            raise
        pending.handles.append((key, handle))
        pending.nbytes += nbytes
        self.stats.reads_posted += 1
        self.stats.descriptors_posted += int(li.size)
        self.stats.spans_posted += int(li.size) if spans is None else int(spans)
        self.stats.bytes_posted += nbytes

    def read_deadline_s(self, nbytes: int) -> float:
        """How long a request's READs of `nbytes` may take: `read_timeout_s` plus the bytes at the
        slowest link allowed, so a slow link is not mistaken for a dead peer."""
        return self.read_timeout_s + nbytes * self._seconds_per_byte

    def fail_request(self, req_id: str, reason: str) -> None:
        """Mark a request failed (e.g. a later read of it could not be set up)."""
        pending = self._pending.setdefault(req_id, _Pending([], self._clock()))
        pending.failed = pending.failed or reason

    def poll(self) -> PollResult:
        """Advance transfers; report requests that finished or failed since the last poll."""
        self._require_open()
        result = PollResult()
        now = self._clock()
        for req_id, pending in list(self._pending.items()):
            states = []
            if pending.failed is None:
                for key, handle in pending.handles:
                    try:
                        state = self._state(handle)
                    except Exception as exc:  # a backend error is a failed read, never a crash
                        state, pending.failed = "ERR", f"polling read from {key} raised: {exc}"
                    if state == "ERR" and pending.failed is None:
                        pending.failed = f"read from {key} failed"
                    states.append(state)
            limit = self.read_deadline_s(pending.nbytes)
            if pending.failed is None and now - pending.started > limit:
                pending.failed = f"reads not done after {limit:.1f}s"
            if pending.failed is not None:
                result.failed[req_id] = pending.failed
            elif states and all(s == "DONE" for s in states):
                result.done.add(req_id)
            else:
                continue
            self._finish(req_id)
        self.stats.requests_done += len(result.done)
        self.stats.requests_failed += len(result.failed)
        return result

    def cancel(self, req_id: str) -> bool:
        """Forget a request (abort); its handles are released."""
        if req_id not in self._pending:
            return False
        self._finish(req_id)
        return True

    def _finish(self, req_id: str) -> None:
        for _, handle in self._pending.pop(req_id).handles:
            try:
                self._release(handle)
            except Exception as exc:
                logger.warning("releasing a read of %s: %s", req_id, exc)

    def in_flight(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------ notifications
    def send_notif(self, key: PeerKey, msg: bytes) -> None:
        self._require_open()
        self._send(self.peer(key), msg)
        self.stats.notifs_sent += 1

    def get_notifs(self) -> list[bytes]:
        self._require_open()
        return self._recv()

    # ----------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release every handle, list, peer and registration exactly once; idempotent."""
        if self._closed:
            return
        for req_id in list(self._pending):
            self._finish(req_id)
        for key in list(self._peers):
            self._drop_peer(key)
        self._local.clear()
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed
