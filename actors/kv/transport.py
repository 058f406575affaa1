"""Per-rank KV transport: peers, READs per request, completion, notifications.

Life cycle of one request's pull on a decode rank:

  start_read(req, peer, runs, notif)  -> runs are bounds-checked against the
        peer's registered regions (from its handshake) and ours, then posted
        as one READ per (request, peer); `notif` reaches the peer on success;
  poll()  -> non-blocking; a request is DONE when all its READs are, FAILED as
        soon as one READ errors, raises, or the request outlives `read_timeout_s`
        (a dead peer must never leave a request waiting forever);
  every handle is released once, whatever the outcome.

`NixlTransport` moves bytes with NIXL (UCX); `FakeTransport` moves them with
memmove inside one process and has fault switches for the layers above. Both
share the bookkeeping in `_TransportBase`, so tests of one exercise the other's
logic too. No thread is started: progress happens in `poll()`.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.kv.errors import (
    BlockRangeError,
    HandshakeError,
    KVTransferError,
    TransferSetupError,
    TransportClosedError,
)
from actors.kv.handshake import RankHandshake
from actors.kv.layout import CacheGeometry, Run, check_runs_inside

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


@dataclass
class TransportStats:
    reads_posted: int = 0
    descriptors_posted: int = 0
    bytes_posted: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    notifs_sent: int = 0
    handshakes: int = 0


class _TransportBase:
    """Request bookkeeping shared by the real and the fake transport."""

    def __init__(self, name: str, geometry: CacheGeometry, read_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if read_timeout_s <= 0:
            raise TransferSetupError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.name = name
        self.geometry = geometry
        self.read_timeout_s = read_timeout_s
        self._clock = clock
        self._peers: dict[PeerKey, RankHandshake] = {}
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self.stats = TransportStats()

    # ------------------------------------------------------- backend hooks
    def _connect(self, hs: RankHandshake) -> None: raise NotImplementedError
    def _disconnect(self, hs: RankHandshake) -> None: raise NotImplementedError
    def _post(self, hs: RankHandshake, runs: list[Run], notif: bytes) -> Any: raise NotImplementedError
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
        for req_id, pending in self._pending.items():
            if pending.failed is None and any(k == key for k, _ in pending.handles):
                pending.failed = f"peer {key} was removed"
        hs = self._peers.pop(key)
        try:
            self._disconnect(hs)
        except KVTransferError as exc:  # a dead peer may refuse a clean goodbye
            logger.warning("disconnecting %s: %s", key, exc)

    # -------------------------------------------------------------- reads
    def start_read(self, req_id: str, key: PeerKey, runs: list[Run], notif: bytes = b"") -> None:
        """Post one READ of `runs` (local addr, remote addr, nbytes) from a peer."""
        self._require_open()
        hs = self.peer(key)
        if not runs:
            raise TransferSetupError(f"request {req_id}: empty read from {key}")
        check_runs_inside(runs, self.geometry, hs.geometry)
        pending = self._pending.setdefault(req_id, _Pending([], self._clock()))
        try:
            handle = self._post(hs, runs, notif)
        except KVTransferError as exc:
            pending.failed = pending.failed or f"read setup from {key} failed: {exc}"
            raise
        pending.handles.append((key, handle))
        self.stats.reads_posted += 1
        self.stats.descriptors_posted += len(runs)
        self.stats.bytes_posted += sum(n for _, _, n in runs)

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
            if pending.failed is None and now - pending.started > self.read_timeout_s:
                pending.failed = f"reads not done after {self.read_timeout_s:.1f}s"
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

    def progress(self) -> None:
        """Drive the backend once (sends queued behind a connection set-up go out)."""
        if not self._closed:
            self._progress()

    def _progress(self) -> None:
        return None

    # ----------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release every handle, peer and registration exactly once; idempotent."""
        if self._closed:
            return
        for req_id in list(self._pending):
            self._finish(req_id)
        for key in list(self._peers):
            self._drop_peer(key)
        self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed


class NixlTransport(_TransportBase):
    """One NIXL agent (UCX) per rank, with this rank's KV regions registered."""

    def __init__(self, name: str, geometry: CacheGeometry, read_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, mem: str = "DRAM"):
        super().__init__(name, geometry, read_timeout_s, clock)
        from actors.kv.nixl_agent import NixlAgent  # nixl is imported only for real transports

        self.mem = mem
        self._agent = NixlAgent(name)
        try:
            self._agent.register(geometry.regions(), mem=mem)
        except Exception:
            self._agent.shutdown()
            raise
        self._names: dict[PeerKey, str] = {}

    def metadata(self) -> bytes:
        return self._agent.metadata()

    def _connect(self, hs: RankHandshake) -> None:
        name = self._agent.add_remote(hs.agent_metadata)
        if name != hs.agent_name:
            self._agent.remove_remote(name)
            raise HandshakeError("agent_name", f"metadata is for {name!r}, payload says {hs.agent_name!r}")
        try:
            # Start UCX wire-up now: it completes while we poll for our first READ, so a
            # later notification to a rank we never read from is not stuck behind it.
            self._agent.make_connection(name)
        except TransferSetupError as exc:
            logger.info("eager connection to %s failed (the first READ retries): %s", name, exc)

    def _disconnect(self, hs: RankHandshake) -> None:
        self._agent.remove_remote(hs.agent_name)

    def _post(self, hs: RankHandshake, runs: list[Run], notif: bytes) -> Any:
        local = [(l, n) for l, _, n in runs]
        remote = [(r, n) for _, r, n in runs]
        return self._agent.read_ranges(hs.agent_name, local, remote, notif, mem=self.mem)

    def _state(self, handle: Any) -> str:
        return self._agent.check(handle)

    def _release(self, handle: Any) -> None:
        self._agent.release(handle)

    def _send(self, hs: RankHandshake, msg: bytes) -> None:
        self._agent.send_notif(hs.agent_name, msg)

    def _recv(self) -> list[bytes]:
        return [m for msgs in self._agent.get_notifs().values() for m in msgs]

    def _progress(self) -> None:
        self._agent.progress()

    def _close(self) -> None:
        self._agent.shutdown()

    @property
    def registered_regions(self) -> int:
        return 0 if self._agent.closed else len(self._agent.registrations)


class FakeFabric:
    """The in-process 'network' of fake transports: metadata and notifications."""

    def __init__(self) -> None:
        self.agents: dict[str, "FakeTransport"] = {}
        self.mailboxes: dict[str, list[bytes]] = defaultdict(list)


@dataclass
class FaultSwitches:
    """Faults a FakeTransport injects; each applies to every later call."""

    handshake_fails: bool = False
    setup_fails: bool = False
    state_err: bool = False
    poll_raises: bool = False
    slow_polls: int = 0  # a READ reports PROC this many polls before DONE
    dead: bool = False  # behaves like a killed peer: reads from it error


class FakeTransport(_TransportBase):
    """Same interface as NixlTransport; copies with memmove inside one process."""

    def __init__(self, name: str, geometry: CacheGeometry, fabric: FakeFabric | None = None,
                 read_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(name, geometry, read_timeout_s, clock)
        self.fabric = fabric or FakeFabric()
        self.faults = FaultSwitches()
        self.fabric.agents[name] = self
        self.connected: set[str] = set()

    def metadata(self) -> bytes:
        return f"fake:{self.name}".encode()

    def _connect(self, hs: RankHandshake) -> None:
        if self.faults.handshake_fails:
            raise HandshakeError("agent_metadata", f"injected handshake failure with {hs.agent_name}")
        if hs.agent_metadata != f"fake:{hs.agent_name}".encode():
            raise HandshakeError("agent_metadata", "not a fake agent's metadata")
        self.connected.add(hs.agent_name)

    def _disconnect(self, hs: RankHandshake) -> None:
        self.connected.discard(hs.agent_name)

    def _post(self, hs: RankHandshake, runs: list[Run], notif: bytes) -> Any:
        if self.faults.setup_fails:
            raise TransferSetupError(f"injected setup failure for a read from {hs.agent_name}")
        return {"peer": hs.agent_name, "runs": runs, "notif": notif, "polls": 0, "state": "PROC"}

    def _state(self, handle: Any) -> str:
        if self.faults.poll_raises:
            raise RuntimeError("injected exception while polling")
        if handle["state"] != "PROC":
            return handle["state"]
        peer = self.fabric.agents.get(handle["peer"])
        if self.faults.state_err or peer is None or peer.faults.dead or peer.closed:
            handle["state"] = "ERR"
            return "ERR"
        handle["polls"] += 1
        if handle["polls"] <= self.faults.slow_polls:
            return "PROC"
        for local, remote, nbytes in handle["runs"]:
            ctypes.memmove(local, remote, nbytes)
        if handle["notif"]:
            self.fabric.mailboxes[handle["peer"]].append(handle["notif"])
        handle["state"] = "DONE"
        return "DONE"

    def _release(self, handle: Any) -> None:
        if handle.get("released"):
            raise TransferSetupError("handle released twice")
        handle["released"] = True

    def _send(self, hs: RankHandshake, msg: bytes) -> None:
        self.fabric.mailboxes[hs.agent_name].append(msg)

    def _recv(self) -> list[bytes]:
        msgs, self.fabric.mailboxes[self.name] = self.fabric.mailboxes[self.name], []
        return msgs

    def _close(self) -> None:
        self.fabric.agents.pop(self.name, None)


def validate_runs(runs: list[Run], local: CacheGeometry, remote: CacheGeometry) -> None:
    """Public alias so callers can check a plan before asking for a transport."""
    if not runs:
        raise BlockRangeError("a read needs at least one byte range")
    check_runs_inside(runs, local, remote)
