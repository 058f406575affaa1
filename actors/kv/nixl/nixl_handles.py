"""Handles a `NixlAgent` gives out: registrations, prepared descriptor lists, transfers.

Each wraps one NIXL object, remembers the agent that owns it (a handle of
another agent is refused) and whether it was released; the agent releases
every handle it still holds exactly once on `shutdown()`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from actors.kv.nixl.nixl_checks import Range, err


XferState = Literal["DONE", "PROC", "ERR"]
"""Non-blocking state of a posted transfer."""

LOCAL = ""  # agent name of a prepared list that describes local memory


class Registration:
    """Memory regions registered with one `NixlAgent` (returned by `register`)."""

    __slots__ = ("regions", "mem", "dev_id", "_descs", "_owner", "released")

    def __init__(self, regions: tuple[Range, ...], mem: str, dev_id: int, descs: Any, owner: object) -> None:
        self.regions = regions
        self.mem = mem
        self.dev_id = dev_id
        self._descs = descs  # nixlRegDList, needed to deregister
        self._owner = owner
        self.released = False

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.regions)

    def __repr__(self) -> str:
        return (f"Registration(mem={self.mem}, regions={len(self.regions)}, "
                f"nbytes={self.nbytes}, released={self.released})")


class PreparedDescs:
    """A descriptor list prepared once with `prep_xfer_dlist` (strided rows, expanded by NIXL).

    ``agent`` is the remote agent the memory lives in, or ``""`` for a local
    list. A READ names descriptors by index in ``[0, len(self))``.
    """

    __slots__ = ("agent", "size", "mem", "_handle", "_owner", "released")

    def __init__(self, agent: str, size: int, mem: str, handle: Any, owner: object) -> None:
        self.agent = agent
        self.size = size
        self.mem = mem
        self._handle = handle  # nixl_prepped_dlist_handle
        self._owner = owner
        self.released = False

    @property
    def is_local(self) -> bool:
        return self.agent == LOCAL

    def __len__(self) -> int:
        return self.size

    def free(self) -> list[str]:
        """Release the NIXL list once; returns failures instead of raising (shutdown must finish)."""
        if self.released:
            return []
        self.released = True
        handle, self._handle = self._handle, None
        try:
            handle.release()
        except Exception as exc:
            return [f"release of {self!r} failed: {err(exc)}"]
        return []

    def __repr__(self) -> str:
        where = "local" if self.is_local else f"remote={self.agent!r}"
        return f"PreparedDescs({where}, n={self.size}, released={self.released})"


class Transfer:
    """One posted READ. Poll it with `NixlAgent.check`, free it with `NixlAgent.release`."""

    __slots__ = ("remote_agent", "num_descs", "notif", "posted_at", "error", "released",
                 "_state", "_handle", "_owner")

    def __init__(self, remote_agent: str, num_descs: int, notif: bytes, handle: Any, owner: object) -> None:
        self.remote_agent = remote_agent
        self.num_descs = num_descs
        self.notif = notif
        self.posted_at = time.monotonic()
        self.error: BaseException | None = None  # set when the state became ERR
        self.released = False
        self._state: XferState = "PROC"
        self._handle = handle  # nixl_xfer_handle
        self._owner = owner

    @property
    def state(self) -> XferState:
        """Last state seen by `check` (does not poll)."""
        return self._state

    def free(self, force: bool = False) -> list[str]:
        """Release the NIXL handle once (a running READ is cancelled). On failure the handle
        is kept for another try unless `force` (shutdown: the C++ agent frees it at exit)."""
        if self.released:
            return []
        try:
            self._handle.release()
        except Exception as exc:
            if not force:
                return [f"release of {self!r} failed: {err(exc)}"]
            failure = [f"release of {self!r} failed: {err(exc)}"]
        else:
            failure = []
        self.released = True
        self._handle = None  # NIXL handles reference the C++ agent; drop them
        return failure

    def __repr__(self) -> str:
        return (f"Transfer(remote={self.remote_agent!r}, descs={self.num_descs}, "
                f"state={self._state}, released={self.released})")
