"""A thin, typed wrapper around one NIXL agent (UCX backend) for KV-block READs.

`NixlAgent` owns one NIXL agent and everything created through it (registrations, remote agents,
prepared descriptor lists, transfer handles: `nixl_handles`) and releases each exactly once on
`shutdown()`. Invariants:
* caller mistakes are typed errors (`nixl_checks` validates before NIXL sees anything); a transfer
  that fails *after* it was posted (dead peer) is ``"ERR"`` from `check()`, never an exception;
* NIXL's UCX progress thread (`nixl_binding`) serves peers' READs and collects notifications while
  the owner is busy; `check()` drives progress for our own READs;
* one owner thread uses the agent (no lock here); UCX's "peer" error mode makes a dead peer a
  failed transfer, not a hang (docs/nixl_notes.md).
`nixl` is imported lazily, so `actors.kv` imports where nixl is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from actors.kv.transfer_errors import HandshakeError, KVTransferError, TransferSetupError, TransportClosedError
from actors.kv.nixl.nixl_checks import (
    Range,
    as_indices,
    as_notif,
    as_range_array,
    as_rows,
    bounds_or_setup_error,
    check_inside,
    check_mem,
    err,
)
from actors.kv.nixl.nixl_binding import load_nixl_api, new_agent
from actors.kv.nixl.nixl_handles import LOCAL, PreparedDescs, Registration, Transfer, XferState

__all__ = ["NixlAgent", "PreparedDescs", "Registration", "Transfer", "XferState"]

logger = logging.getLogger(__name__)


class NixlAgent:
    """One NIXL agent with one backend (UCX by default) and everything it owns.

    After `shutdown()` every method except `shutdown()` and the read-only
    properties raises `TransportClosedError`.
    """

    def __init__(self, name: str, backend: str = "UCX") -> None:
        if not isinstance(name, str) or not name:
            raise TransferSetupError(f"agent name must be a non-empty str, got {name!r}")
        if not isinstance(backend, str) or not backend:
            raise TransferSetupError(f"backend must be a non-empty str, got {backend!r}")
        api = load_nixl_api()
        self._bind = api.nixlBind
        self._prepped_handle, self._xfer_handle = api.nixl_prepped_dlist_handle, api.nixl_xfer_handle
        self._name = name
        self._backend = backend
        self._closed = False
        self._registrations: list[Registration] = []
        self._remotes: set[str] = set()
        self._prepared: list[PreparedDescs] = []
        self._transfers: set[Transfer] = set()
        self._nixl: Any = new_agent(name, backend)  # nixlBind.nixlAgent

    # ------------------------------------------------------------------ props
    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(self._registrations)

    def _require_open(self) -> Any:
        if self._closed:
            raise TransportClosedError(f"NIXL agent {self._name!r} is shut down")
        return self._nixl

    # ------------------------------------------------------------ registration
    def register(self, regions: Sequence[Range], mem: str = "DRAM", dev_id: int = 0) -> Registration:
        """Register memory ranges ``(addr, nbytes)`` (the caller keeps the memory alive).

        The registration is part of `metadata()` taken *after* this call.
        """
        nixl = self._require_open()
        arr = as_range_array(regions, "register")
        try:
            descs = self._bind.nixlRegDList(self._segment(check_mem(mem)),
                                            [(int(a), int(n), dev_id, "") for a, n in arr])
            nixl.registerMem(descs, [])
        except KVTransferError:
            raise
        except Exception as exc:
            raise TransferSetupError(f"memory registration failed: {err(exc)}") from exc
        reg = Registration(tuple((int(a), int(n)) for a, n in arr), mem, dev_id, descs, self)
        self._registrations.append(reg)
        return reg

    def _deregister(self, nixl: Any, reg: Registration) -> None:
        reg.released = True
        self._registrations.remove(reg)
        try:
            nixl.deregisterMem(reg._descs, [])
        except Exception as exc:
            raise TransferSetupError(f"memory deregistration failed: {err(exc)}") from exc
        finally:
            reg._descs = None

    # ----------------------------------------------------------- peers
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + current registrations)."""
        nixl = self._require_open()
        try:
            return bytes(nixl.getLocalMD())
        except Exception as exc:
            raise TransferSetupError(f"cannot export agent metadata: {err(exc)}") from exc

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's `metadata()`; returns the peer's agent name (reloading updates it)."""
        nixl = self._require_open()
        if isinstance(metadata, (bytearray, memoryview)):
            metadata = bytes(metadata)
        if not isinstance(metadata, bytes) or not metadata:
            raise HandshakeError("metadata", "must be non-empty bytes")
        try:
            raw = nixl.loadRemoteMD(metadata)
        except Exception as exc:
            raise HandshakeError("metadata", f"NIXL rejected it: {err(exc)}") from exc
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if name == self._name:
            raise HandshakeError("metadata", "this is the local agent's own metadata")
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> bool:
        """Forget a peer: release its transfers and prepared lists, then drop it.

        Returns False if the peer was not known. Running transfers are cancelled.
        """
        nixl = self._require_open()
        if name not in self._remotes:
            return False
        failures: list[str] = []
        for t in [t for t in self._transfers if t.remote_agent == name]:
            failures += self._release_transfer(t, force=True)
        for p in [p for p in self._prepared if p.agent == name]:
            failures += self._release_prepared(p)
        self._remotes.discard(name)
        failures += self._invalidate_remote(nixl, name)
        if failures:
            logger.warning("remove_remote(%s): %s", name, "; ".join(failures))
        return True

    def make_connection(self, name: str) -> None:
        """Start connecting to a loaded peer now instead of on the first READ."""
        nixl = self._require_open()
        self._require_remote(name)
        try:
            nixl.makeConnection(name, [])
        except Exception as exc:
            raise TransferSetupError(f"cannot connect to {name!r}: {err(exc)}") from exc

    def _require_remote(self, name: str) -> None:
        if name != self._name and name not in self._remotes:
            raise TransferSetupError(f"unknown remote agent {name!r}; call add_remote first")

    # ---------------------------------------------------------- descriptors
    def prepare_local(self, rows: np.ndarray, mem: str = "DRAM") -> PreparedDescs:
        """Prepare strided rows (address, nbytes, stride, count) of our own memory, once.

        Every row must lie inside one of this agent's registrations of `mem`.
        """
        self._require_open()
        rows = as_rows(rows, "prepare_local")
        regions = [r for reg in self._registrations if reg.mem == check_mem(mem) for r in reg.regions]
        check_inside(rows, regions, "prepare_local")
        return self._prepare(LOCAL, rows, mem)

    def prepare_remote(self, agent_name: str, rows: np.ndarray, mem: str = "DRAM") -> PreparedDescs:
        """Prepare strided rows of a loaded peer's memory once (NIXL checks them against
        the registrations in the peer's metadata). ``agent_name == self.name`` is loopback."""
        self._require_open()
        self._require_remote(agent_name)
        return self._prepare(agent_name, as_rows(rows, "prepare_remote"), check_mem(mem))

    def _prepare(self, agent: str, rows: np.ndarray, mem: str) -> PreparedDescs:
        dev = 0
        if agent == LOCAL:
            dev = next((reg.dev_id for reg in self._registrations if reg.mem == mem), 0)
        strided = np.empty((rows.shape[0], 5), dtype=np.uint64)
        strided[:, :2] = rows[:, :2]
        strided[:, 2] = dev
        strided[:, 3:] = rows[:, 2:]
        where = "local memory" if agent == LOCAL else f"memory of {agent!r}"
        try:
            raw = self._nixl.prepXferDlist(agent or self._bind.NIXL_INIT_AGENT, self._segment(mem), strided, [])
            handle = self._prepped_handle(self._nixl, raw)
        except Exception as exc:
            raise bounds_or_setup_error(exc, f"descriptors not prepared for {where}") from exc
        prepared = PreparedDescs(agent, int(rows[:, 3].sum()), mem, handle, self)
        self._prepared.append(prepared)
        return prepared

    # --------------------------------------------------------------- transfers
    def read(self, local: PreparedDescs, local_indices: Sequence[int] | np.ndarray,
             remote: PreparedDescs, remote_indices: Sequence[int] | np.ndarray, notif: bytes = b"") -> Transfer:
        """Post a READ of ``remote[remote_indices[k]]`` into ``local[local_indices[k]]``.

        ``notif`` (if non-empty) reaches the remote agent once the data has been
        read. NIXL merges neighbouring descriptors itself. Caller mistakes raise
        (`BlockRangeError`, `TransferSetupError`); a peer that is already dead is
        *not* an exception: the returned transfer is in state ERR.
        """
        nixl = self._require_open()
        for prepared in (local, remote):
            self._check_owner(prepared)
            if prepared.released:
                raise TransferSetupError("read: a prepared descriptor list was released")
        if not local.is_local or remote.is_local:
            raise TransferSetupError("read: pass a prepare_local list, then a prepare_remote list")
        self._require_remote(remote.agent)
        notif = as_notif(notif)
        li = as_indices(local_indices, len(local), "read local_indices")
        ri = as_indices(remote_indices, len(remote), "read remote_indices")
        if li.size != ri.size:
            raise TransferSetupError(f"read: {li.size} local indices vs {ri.size} remote indices")
        try:  # NIXL refuses pairs whose lengths differ (InvalidParam)
            raw = nixl.makeXferReq(self._bind.NIXL_READ, local._handle._handle, li, remote._handle._handle, ri,
                                   notif, [], False)
            handle = self._xfer_handle(nixl, raw)
        except Exception as exc:
            raise TransferSetupError(f"cannot build READ from {remote.agent!r}: {err(exc)}") from exc
        error: BaseException | None = None
        try:
            state = self._xfer_state(nixl.postXferReq(handle._handle, b""))  # notif set above
        except Exception as exc:
            if type(exc).__name__ != "nixlRemoteDisconnectError":
                self._release_quietly(handle)
                raise TransferSetupError(f"cannot post READ from {remote.agent!r}: {err(exc)}") from exc
            state, error = "ERR", exc  # the peer is gone: a failed transfer, like a later ERR
        transfer = Transfer(remote.agent, int(li.size), notif, handle, self)
        transfer._state = state
        if state == "ERR":
            transfer.error = error or TransferSetupError("NIXL returned ERR when posting")
        self._transfers.add(transfer)
        return transfer

    def check(self, transfer: Transfer) -> XferState:
        """Non-blocking state: ``"DONE"``, ``"PROC"`` or ``"ERR"`` (final ones stick).

        Drives UCX progress. A transfer that failed after posting is ``"ERR"``
        with the cause in ``transfer.error``; this method does not raise for it.
        """
        nixl = self._require_open()
        self._check_owner(transfer)
        if transfer.released:
            raise TransferSetupError("check: transfer handle was released")
        if transfer._state != "PROC":
            return transfer._state
        try:
            state = self._xfer_state(nixl.getXferStatus(transfer._handle._handle))
        except Exception as exc:
            transfer.error, state = exc, "ERR"
        if state == "ERR" and transfer.error is None:
            transfer.error = TransferSetupError("NIXL reported ERR")
        transfer._state = state
        return state

    def release(self, transfer: Transfer) -> None:
        """Free a transfer handle (no-op if released); a running one is cancelled by NIXL."""
        self._require_open()
        self._check_owner(transfer)
        failures = self._release_transfer(transfer)
        if failures:
            raise TransferSetupError("; ".join(failures))

    def _check_owner(self, obj: Transfer | PreparedDescs) -> None:
        if not isinstance(obj, (Transfer, PreparedDescs)):
            raise TransferSetupError(f"expected a Transfer or PreparedDescs, got {type(obj).__name__}")
        if obj._owner is not self:
            raise TransferSetupError(f"{type(obj).__name__} belongs to another agent")

    # ----------------------------------------------------------- notifications
    def send_notif(self, remote_agent: str, msg: bytes) -> None:
        """Send a standalone notification (not tied to a transfer) to a loaded peer."""
        nixl = self._require_open()
        self._require_remote(remote_agent)
        msg = as_notif(msg)
        try:
            nixl.genNotif(remote_agent, msg, [])
        except Exception as exc:
            raise TransferSetupError(f"cannot notify {remote_agent!r}: {err(exc)}") from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications since the last call, keyed by sender agent name.

        The progress thread collected them; this call only takes them over.
        """
        nixl = self._require_open()
        try:
            raw = nixl.getNotifs({}, [])
        except Exception as exc:
            raise TransferSetupError(f"cannot fetch notifications: {err(exc)}") from exc
        return {(k.decode() if isinstance(k, bytes) else str(k)): [bytes(m) for m in msgs]
                for k, msgs in raw.items()}

    # ----------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release transfers, prepared lists, remotes and registrations once; idempotent.

        Failures are logged, not raised, so shutdown always completes.
        """
        if self._closed:
            return
        self._closed = True
        nixl = self._nixl
        failures: list[str] = []
        for t in list(self._transfers):
            failures += self._release_transfer(t, force=True)
        for p in list(self._prepared):
            failures += self._release_prepared(p)
        for name in sorted(self._remotes):
            failures += self._invalidate_remote(nixl, name)
        self._remotes.clear()
        for reg in list(self._registrations):
            try:
                self._deregister(nixl, reg)
            except KVTransferError as exc:
                failures.append(str(exc))
        self._nixl = None  # last reference: the C++ agent (UCX worker/context) goes away
        if failures:
            logger.warning("NIXL agent %s shutdown: %s", self._name, "; ".join(failures))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"NixlAgent({self._name!r}, backend={self._backend}, {state}, "
                f"remotes={len(self._remotes)}, transfers={len(self._transfers)})")

    # ------------------------------------------------------------ internals
    def _release_transfer(self, t: Transfer, force: bool = False) -> list[str]:
        failures = t.free(force)
        if t.released:
            self._transfers.discard(t)
        return failures

    def _release_prepared(self, p: PreparedDescs) -> list[str]:
        if p in self._prepared:
            self._prepared.remove(p)
        return p.free()

    @staticmethod
    def _invalidate_remote(nixl: Any, name: str) -> list[str]:
        try:
            status = nixl.invalidateRemoteMD(name)  # returns a status instead of raising
        except Exception as exc:
            return [f"removing remote {name!r} failed: {err(exc)}"]
        return [] if int(status) == 0 else [f"removing remote {name!r} returned {status}"]

    def _segment(self, mem: str) -> Any:
        return self._bind.DRAM_SEG if mem == "DRAM" else self._bind.VRAM_SEG

    def _xfer_state(self, status: Any) -> XferState:
        if status == self._bind.NIXL_SUCCESS:
            return "DONE"
        return "PROC" if status == self._bind.NIXL_IN_PROG else "ERR"

    @staticmethod
    def _release_quietly(handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # the C++ agent frees it at destruction
            logger.warning("releasing a failed transfer handle: %s", err(exc))
