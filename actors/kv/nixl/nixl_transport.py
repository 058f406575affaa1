"""`NixlTransport`: `TransportBase` over one NIXL agent (UCX) per rank, this rank's KV regions registered.

DRAM caches are backed by 2 MiB pages first (`hugepages`): CMA pins the source
pages of every descriptor. nixl itself is imported only when a transport is built.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import numpy as np

from actors.kv.transfer_errors import HandshakeError, TransferSetupError
from actors.kv.handshake import RankHandshake
from actors.kv.plan.layout import CacheGeometry
from actors.kv.nixl.hugepages import back_with_huge_pages
from actors.kv.plan.descriptors import DescTable
from actors.kv.transport import TransportBase

logger = logging.getLogger("raypd.transport")


class NixlTransport(TransportBase):
    """One NIXL agent (UCX) per rank, with this rank's KV regions registered."""

    def __init__(self, name: str, geometry: CacheGeometry, read_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, mem: str = "DRAM", min_link_mbps: float = 0.0):
        super().__init__(name, geometry, read_timeout_s, clock, min_link_mbps)
        from actors.kv.nixl.nixl_agent import NixlAgent  # nixl is imported only for real transports

        self.mem = mem
        # CMA pins the source pages of every descriptor: 2 MiB pages make that cheap
        self.huge_page_bytes = back_with_huge_pages(geometry.regions()) if mem == "DRAM" else 0
        self._agent = NixlAgent(name)
        try:
            self._agent.register(geometry.regions(), mem=mem)
        except Exception:
            self._agent.shutdown()
            raise

    def metadata(self) -> bytes:
        return self._agent.metadata()

    def _connect(self, hs: RankHandshake) -> None:
        name = self._agent.add_remote(hs.agent_metadata)
        if name != hs.agent_name:
            self._agent.remove_remote(name)
            raise HandshakeError("agent_name", f"metadata is for {name!r}, payload says {hs.agent_name!r}")
        try:
            # Start UCX wire-up now (the progress threads of both sides complete it), so the
            # first READ and a notice to a rank we never read from do not wait for it.
            self._agent.make_connection(name)
        except TransferSetupError as exc:
            logger.info("eager connection to %s failed (the first READ retries): %s", name, exc)

    def _disconnect(self, hs: RankHandshake) -> None:
        self._agent.remove_remote(hs.agent_name)  # also releases its prepared lists

    def _prepare(self, hs: RankHandshake | None, table: DescTable, mem: str | None) -> Any:
        if hs is None:
            return self._agent.prepare_local(table.rows(), mem or self.mem)
        return self._agent.prepare_remote(hs.agent_name, table.rows(), mem or self.mem)

    def _register(self, regions: list[tuple[int, int]]) -> None:
        self._agent.register(regions, mem="DRAM")

    def _post(self, hs: RankHandshake, local: Any, li: np.ndarray, remote: Any, ri: np.ndarray,
              notif: bytes) -> Any:
        return self._agent.read(local, li, remote, ri, notif)

    def _state(self, handle: Any) -> str:
        return self._agent.check(handle)

    def _release(self, handle: Any) -> None:
        self._agent.release(handle)

    def _send(self, hs: RankHandshake, msg: bytes) -> None:
        self._agent.send_notif(hs.agent_name, msg)

    def _recv(self) -> list[bytes]:
        return [m for msgs in self._agent.get_notifs().values() for m in msgs]

    def _close(self) -> None:
        self._agent.shutdown()

    @property
    def registered_regions(self) -> int:
        return 0 if self._agent.closed else len(self._agent.registrations)
