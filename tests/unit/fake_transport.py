"""The in-process stand-in for `NixlTransport`: memmove instead of NIXL, plus fault switches.

Unit tests drive ranks over it in one process (no Ray, no UCX); a test fake, so it lives
with the tests, not in the product's `actors.kv`. It implements the same backend hooks as
the real transport and shares its bookkeeping (`TransportBase`), so what the fake proves
about requests, peers and lists holds for the real path; bytes move on the first poll
after the post.
"""

from __future__ import annotations

import ctypes
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from actors.kv.plan.descriptors import DescTable
from actors.kv.transfer_errors import HandshakeError, TransferSetupError
from actors.kv.handshake import RankHandshake
from actors.kv.plan.layout import CacheGeometry
from actors.kv.transport import TransportBase


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


@dataclass
class _FakeList:
    agent: str
    addrs: np.ndarray
    lengths: np.ndarray


@dataclass
class _FakeRead:
    peer: str
    pairs: list[tuple[int, int, int]]  # (local address, remote address, nbytes)
    notif: bytes
    polls: int = 0
    state: str = "PROC"
    released: bool = False


class FakeTransport(TransportBase):
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

    def _register(self, regions: list[tuple[int, int]]) -> None:
        pass  # memmove reaches any memory of the process

    def _prepare(self, hs: RankHandshake | None, table: DescTable, mem: str | None) -> Any:
        addrs, lengths = table.addresses()
        return _FakeList(hs.agent_name if hs else "", addrs, lengths)

    def _post(self, hs: RankHandshake, local: Any, li: np.ndarray, remote: Any, ri: np.ndarray,
              notif: bytes) -> Any:
        if self.faults.setup_fails:
            raise TransferSetupError(f"injected setup failure for a read from {hs.agent_name}")
        if remote.agent != hs.agent_name or local.agent:
            raise TransferSetupError("descriptor lists do not match the peer")
        if li.size != ri.size or not np.array_equal(local.lengths[li], remote.lengths[ri]):
            raise TransferSetupError("local and remote descriptors differ in count or length")
        pairs = list(zip(local.addrs[li].tolist(), remote.addrs[ri].tolist(), local.lengths[li].tolist()))
        return _FakeRead(hs.agent_name, pairs, notif)

    def _state(self, handle: Any) -> str:
        if self.faults.poll_raises:
            raise RuntimeError("injected exception while polling")
        if handle.state != "PROC":
            return handle.state
        peer = self.fabric.agents.get(handle.peer)
        if self.faults.state_err or peer is None or peer.faults.dead or peer.closed:
            handle.state = "ERR"
            return "ERR"
        handle.polls += 1
        if handle.polls <= self.faults.slow_polls:
            return "PROC"
        for local, remote, nbytes in handle.pairs:
            ctypes.memmove(local, remote, nbytes)
        if handle.notif:
            self.fabric.mailboxes[handle.peer].append(handle.notif)
        handle.state = "DONE"
        return "DONE"

    def _release(self, handle: Any) -> None:
        if handle.released:
            raise TransferSetupError("handle released twice")
        handle.released = True

    def _send(self, hs: RankHandshake, msg: bytes) -> None:
        self.fabric.mailboxes[hs.agent_name].append(msg)

    def _recv(self) -> list[bytes]:
        msgs, self.fabric.mailboxes[self.name] = self.fabric.mailboxes[self.name], []
        return msgs

    def _close(self) -> None:
        self.fabric.agents.pop(self.name, None)
