"""A thin, typed wrapper around one NIXL agent (UCX backend) for KV-block READs.

What it does
------------
`NixlAgent` owns exactly one `nixl_agent` and everything created through it:
memory registrations, remote agents loaded from their metadata, prepared
descriptor lists and transfer handles. It offers the handful of operations the
KV transport needs -- register KV memory, exchange agent metadata, prepare
descriptor lists once per (remote agent, rank), post READs with a notification
for the block owner, poll them without blocking, exchange standalone
notifications -- and releases every NIXL object exactly once on `shutdown()`.

Why a wrapper
-------------
The raw `nixl._api` surface is loose in ways that hurt a serving system:

* it reports problems through a mix of return strings ("ERR"), raised
  `nixl._bindings.nixl*Error` exceptions, `None` returns with only a log line
  (e.g. `get_xfer_descs` on bad input) and silently skipped backends (a missing
  plugin is only a warning in `nixl_agent.__init__`). Here, every caller
  mistake is a typed error from `actors.kv.errors` (bounds problems are
  `BlockRangeError`, failed preparation/posting `TransferSetupError`, bad peer
  metadata `HandshakeError`, use after `shutdown()` `TransportClosedError`), and
  a transfer that fails *after* it was posted (dead peer) is reported by
  `check()` as ``"ERR"``, never as an exception;
* `nixl_agent_config` enables a progress thread by default and the wrapper
  hard-codes its poll delay to 0, so that thread spins a full core forever
  (measured: 5.0 s CPU per 5 s idle). We disable it: progress is driven by the
  caller's `check()` / `progress()` / `get_notifs()` calls, and an idle agent
  costs no CPU. Note that a READ only reliably reaches DONE when the *target*
  agent progresses too (connection wire-up, notification delivery and the
  final flush travel over UCX's TCP loopback lane), so an agent whose memory
  is read must call `progress()` regularly (its engine loop or a ~1 ms
  background thread, ~3% of a core);
* the Python binding releases the GIL inside most calls, while the agent is
  created with `NIXL_THREAD_SYNC_NONE` and a single-threaded UCX worker when
  there is neither a listener nor a progress thread; concurrent calls from two
  Python threads would race inside UCX. Every method here takes one re-entrant
  lock, so the object may be shared between threads (calls are serialized);
* local descriptors are bounds-checked against our own registrations before
  NIXL sees them, and descriptor lengths of the two sides are matched before a
  READ is built, so a bad block id is a clear error instead of a NIXL log line.

UCX's default error-handling mode ("peer") is kept on purpose: it is what makes
a dead peer surface as a failed transfer instead of a hang.

Facts measured with this wrapper on the 2-core CPU-only dev box are in
`actors/kv/NIXL_NOTES.md`.

No Ray, no vLLM: this module depends on numpy, nixl and (optionally) torch.
`nixl` is imported lazily, when the first `NixlAgent` is created, so importing
`actors.kv` stays cheap and works where nixl is not installed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np

from actors.kv.errors import (
    BlockRangeError,
    HandshakeError,
    KVTransferError,
    TransferSetupError,
    TransportClosedError,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "MEM_TYPES",
    "NixlAgent",
    "PreparedDescs",
    "Range",
    "Registration",
    "Transfer",
    "XferState",
    "merge_contiguous",
]

logger = logging.getLogger(__name__)

XferState = Literal["DONE", "PROC", "ERR"]
"""Non-blocking state of a posted transfer."""

Range = tuple[int, int]
"""A memory range as ``(address, nbytes)``."""

MEM_TYPES: tuple[str, ...] = ("DRAM", "VRAM")
"""Memory kinds this wrapper accepts (the ones the UCX backend supports)."""

RegionLike = Union[Range, "torch.Tensor"]

_LOCAL = ""  # agent name of a prepared list that describes local memory


def _load_nixl_api() -> Any:
    """Import `nixl._api` on first use (it probes CUDA and loads plugins)."""
    try:
        import nixl  # noqa: F401  (selects nixl_cu12 / nixl_cu13 / nixl_rocm)
        from nixl import _api
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TransferSetupError(f"nixl is not importable: {exc}") from exc
    return _api


# --------------------------------------------------------------------------- #
# Handles
# --------------------------------------------------------------------------- #


class Registration:
    """Memory regions registered with one `NixlAgent` (returned by `register`)."""

    __slots__ = ("regions", "mem", "dev_id", "_descs", "_keepalive", "_owner", "released")

    def __init__(
        self,
        regions: tuple[Range, ...],
        mem: str,
        dev_id: int,
        descs: Any,
        keepalive: tuple[Any, ...],
        owner: NixlAgent,
    ) -> None:
        self.regions = regions
        self.mem = mem
        self.dev_id = dev_id
        self._descs = descs  # nixlRegDList, needed to deregister
        self._keepalive = keepalive  # tensors whose storage must outlive the registration
        self._owner = owner
        self.released = False

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.regions)

    def __repr__(self) -> str:
        return (
            f"Registration(mem={self.mem}, regions={len(self.regions)}, "
            f"nbytes={self.nbytes}, released={self.released})"
        )


class PreparedDescs:
    """A descriptor list prepared once with `prep_xfer_dlist`.

    ``agent`` is the remote agent the ranges live in, or ``""`` for a local
    list. Index ``i`` of a READ refers to ``ranges[i]``.
    """

    __slots__ = ("agent", "ranges", "mem", "lengths", "_handle", "_owner", "released")

    def __init__(
        self,
        agent: str,
        ranges: tuple[Range, ...],
        mem: str,
        lengths: np.ndarray,
        handle: Any,
        owner: NixlAgent,
    ) -> None:
        self.agent = agent
        self.ranges = ranges
        self.mem = mem
        self.lengths = lengths  # int64 array, lengths[i] == ranges[i][1]
        self._handle = handle  # nixl_prepped_dlist_handle
        self._owner = owner
        self.released = False

    @property
    def is_local(self) -> bool:
        return self.agent == _LOCAL

    def __len__(self) -> int:
        return len(self.ranges)

    def __repr__(self) -> str:
        where = "local" if self.is_local else f"remote={self.agent!r}"
        return f"PreparedDescs({where}, n={len(self.ranges)}, released={self.released})"


class Transfer:
    """One posted READ. Poll it with `NixlAgent.check`, free it with `release`."""

    __slots__ = (
        "remote_agent",
        "nbytes",
        "num_descs",
        "notif",
        "posted_at",
        "error",
        "released",
        "_state",
        "_handle",
        "_owner",
    )

    def __init__(
        self,
        remote_agent: str,
        nbytes: int,
        num_descs: int,
        notif: bytes,
        handle: Any,
        owner: NixlAgent,
    ) -> None:
        self.remote_agent = remote_agent
        self.nbytes = nbytes
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

    def __repr__(self) -> str:
        return (
            f"Transfer(remote={self.remote_agent!r}, nbytes={self.nbytes}, "
            f"state={self._state}, released={self.released})"
        )


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def merge_contiguous(
    local_ranges: Sequence[Range], remote_ranges: Sequence[Range]
) -> tuple[list[Range], list[Range]]:
    """Merge neighbouring (local, remote) pairs that are contiguous on both sides.

    ``[(a, n), (a+n, m)]`` / ``[(b, n), (b+n, m)]`` becomes ``[(a, n+m)]`` /
    ``[(b, n+m)]``. Order is preserved; pairs are only merged with their
    predecessor. Lengths of each pair must already match.
    """
    if len(local_ranges) != len(remote_ranges):
        raise TransferSetupError(
            f"{len(local_ranges)} local ranges vs {len(remote_ranges)} remote ranges"
        )
    out_l: list[Range] = []
    out_r: list[Range] = []
    for (la, ln), (ra, rn) in zip(local_ranges, remote_ranges):
        if ln != rn:
            raise TransferSetupError(f"range length mismatch: local {ln} vs remote {rn}")
        if out_l:
            pla, pln = out_l[-1]
            pra, prn = out_r[-1]
            if pla + pln == la and pra + prn == ra:
                out_l[-1] = (pla, pln + ln)
                out_r[-1] = (pra, prn + rn)
                continue
        out_l.append((int(la), int(ln)))
        out_r.append((int(ra), int(rn)))
    return out_l, out_r


def _as_range_array(ranges: Iterable[Range] | np.ndarray, what: str) -> np.ndarray:
    """Validate ``(addr, nbytes)`` pairs and return them as an ``(N, 2)`` int64 array."""
    if isinstance(ranges, np.ndarray):
        arr = ranges
    else:
        ranges = list(ranges)
        if not ranges:
            raise BlockRangeError(f"{what}: no ranges given")
        for r in ranges:
            if not isinstance(r, (tuple, list)) or len(r) != 2:
                raise BlockRangeError(f"{what}: expected (addr, nbytes) pairs, got {r!r}")
            if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in r):
                raise BlockRangeError(f"{what}: (addr, nbytes) must be integers, got {r!r}")
        try:
            arr = np.asarray(ranges, dtype=np.int64)
        except OverflowError as exc:
            raise BlockRangeError(f"{what}: address or length out of range: {exc}") from exc
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.shape[0] == 0:
        raise BlockRangeError(f"{what}: expected a non-empty (N, 2) array of (addr, nbytes)")
    if not np.issubdtype(arr.dtype, np.integer):
        raise BlockRangeError(f"{what}: ranges must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if (arr[:, 1] <= 0).any():
        i = int(np.argmax(arr[:, 1] <= 0))
        raise BlockRangeError(f"{what}: range {i} has non-positive length {int(arr[i, 1])}")
    if (arr[:, 0] <= 0).any():
        i = int(np.argmax(arr[:, 0] <= 0))
        raise BlockRangeError(f"{what}: range {i} has invalid address {int(arr[i, 0])}")
    return arr


def _as_indices(indices: Sequence[int] | np.ndarray, size: int, what: str) -> np.ndarray:
    try:
        idx = np.asarray(indices)
    except (TypeError, ValueError) as exc:
        raise BlockRangeError(f"{what}: not a sequence of integers: {exc}") from exc
    if idx.ndim != 1 or idx.size == 0:
        raise BlockRangeError(f"{what}: expected a non-empty 1-D sequence of indices")
    if not np.issubdtype(idx.dtype, np.integer):
        raise BlockRangeError(f"{what}: indices must be integers, got dtype {idx.dtype}")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        bad = lo if lo < 0 else hi
        raise BlockRangeError(f"{what}: index {bad} outside the prepared list of {size}")
    return idx.astype(np.int32)


def _as_notif(msg: bytes | bytearray | memoryview, what: str = "notification") -> bytes:
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    if not isinstance(msg, bytes):
        raise TransferSetupError(f"{what} must be bytes, got {type(msg).__name__}")
    return msg


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- #
# The agent
# --------------------------------------------------------------------------- #


class NixlAgent:
    """One NIXL agent with one backend (UCX by default) and everything it owns.

    Args:
        name: unique agent name; peers see notifications keyed by it.
        backend: NIXL backend plugin to instantiate (``"UCX"``).
        progress_thread: start NIXL's backend progress thread. Off by default:
            with nixl 1.5.1 the Python wrapper fixes its poll delay at 0, so
            the thread busy-spins a core even when idle. Without it, progress
            happens inside `check()`, `progress()` and `get_notifs()`.
        backend_params: extra backend init parameters (strings). Leave
            ``ucx_error_handling_mode`` at its default ("peer").

    All methods are serialized by one re-entrant lock. After `shutdown()`
    every method except `shutdown()` and the read-only properties raises
    `TransportClosedError`.
    """

    def __init__(
        self,
        name: str,
        backend: str = "UCX",
        *,
        progress_thread: bool = False,
        backend_params: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TransferSetupError(f"agent name must be a non-empty str, got {name!r}")
        if not isinstance(backend, str) or not backend:
            raise TransferSetupError(f"backend must be a non-empty str, got {backend!r}")
        params = dict(backend_params or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise TransferSetupError("backend_params must map str to str")

        api = _load_nixl_api()
        self._lock = threading.RLock()
        self._name = name
        self._backend = backend
        self._closed = False
        self._registrations: list[Registration] = []
        self._remotes: set[str] = set()
        self._prepared: list[PreparedDescs] = []
        self._transfers: list[Transfer] = []
        self._notif_buf: dict[str, list[bytes]] = {}

        # The backend is created explicitly (backends=[] in the config) because
        # nixl_agent only logs a warning when a requested plugin is missing.
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=[],
        )
        try:
            agent = api.nixl_agent(name, config)
        except Exception as exc:
            raise TransferSetupError(f"cannot create NIXL agent {name!r}: {_err(exc)}") from exc
        plugins = list(agent.get_plugin_list())
        if backend not in plugins:
            raise TransferSetupError(
                f"NIXL backend plugin {backend!r} not available (have {sorted(plugins)})"
            )
        try:
            agent.create_backend(backend, params)
        except Exception as exc:
            raise TransferSetupError(f"cannot create NIXL backend {backend!r}: {_err(exc)}") from exc
        self._nixl: Any = agent

    # ------------------------------------------------------------------ props
    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def remote_agents(self) -> frozenset[str]:
        """Names of the remote agents currently loaded."""
        with self._lock:
            return frozenset(self._remotes)

    @property
    def registrations(self) -> tuple[Registration, ...]:
        with self._lock:
            return tuple(self._registrations)

    @property
    def open_transfers(self) -> int:
        """Transfer handles posted and not yet released."""
        with self._lock:
            return len(self._transfers)

    def _require_open(self) -> Any:
        if self._closed:
            raise TransportClosedError(f"NIXL agent {self._name!r} is shut down")
        return self._nixl

    # ------------------------------------------------------------ registration
    def register(
        self, regions: Sequence[RegionLike] | "torch.Tensor", mem: str = "DRAM"
    ) -> Registration:
        """Register memory regions ``(addr, nbytes)`` and/or contiguous tensors.

        Tensors are kept alive by the returned `Registration` until it is
        deregistered. A CPU tensor is DRAM, a CUDA tensor VRAM; mixing with a
        different ``mem`` is an error. The registration is included in
        `metadata()` taken *after* this call.
        """
        with self._lock:
            nixl = self._require_open()
            if mem not in MEM_TYPES:
                raise TransferSetupError(f"mem must be one of {MEM_TYPES}, got {mem!r}")
            items = [regions] if _is_tensor(regions) else list(regions)
            if not items:
                raise BlockRangeError("register: no regions given")
            ranges: list[Range] = []
            keepalive: list[Any] = []
            dev_id = 0
            for item in items:
                if _is_tensor(item):
                    addr, nbytes, t_mem, t_dev = _tensor_region(item)
                    if t_mem != mem:
                        raise TransferSetupError(
                            f"register: tensor on {item.device} is {t_mem}, not {mem}"
                        )
                    dev_id = t_dev
                    keepalive.append(item)
                    ranges.append((addr, nbytes))
                else:
                    ranges.append(item)  # validated below
            arr = _as_range_array(ranges, "register")
            reg_rows = [(int(a), int(n), dev_id, "") for a, n in arr]
            try:
                descs = nixl.register_memory(reg_rows, mem)
            except Exception as exc:
                raise TransferSetupError(f"memory registration failed: {_err(exc)}") from exc
            reg = Registration(
                tuple((int(a), int(n)) for a, n in arr), mem, dev_id, descs, tuple(keepalive), self
            )
            self._registrations.append(reg)
            return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister one registration (no-op if already deregistered)."""
        with self._lock:
            nixl = self._require_open()
            if reg._owner is not self:
                raise TransferSetupError("registration belongs to another agent")
            if reg.released:
                return
            self._deregister(nixl, reg)

    def deregister_all(self) -> None:
        with self._lock:
            nixl = self._require_open()
            for reg in list(self._registrations):
                self._deregister(nixl, reg)

    def _deregister(self, nixl: Any, reg: Registration) -> None:
        reg.released = True
        self._registrations.remove(reg)
        try:
            nixl.deregister_memory(reg._descs)
        except Exception as exc:
            raise TransferSetupError(f"memory deregistration failed: {_err(exc)}") from exc
        finally:
            reg._keepalive = ()
            reg._descs = None

    # --------------------------------------------------------------- metadata
    def metadata(self) -> bytes:
        """This agent's metadata (connection info + current registrations)."""
        with self._lock:
            nixl = self._require_open()
            try:
                return bytes(nixl.get_agent_metadata())
            except Exception as exc:
                raise TransferSetupError(f"cannot export agent metadata: {_err(exc)}") from exc

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's `metadata()`; returns the peer's agent name.

        Loading metadata of an already known peer again updates it (e.g. after
        the peer registered more memory).
        """
        with self._lock:
            nixl = self._require_open()
            if isinstance(metadata, (bytearray, memoryview)):
                metadata = bytes(metadata)
            if not isinstance(metadata, bytes) or not metadata:
                raise HandshakeError("metadata", "must be non-empty bytes")
            try:
                raw = nixl.add_remote_agent(metadata)
            except Exception as exc:
                raise HandshakeError("metadata", f"NIXL rejected it: {_err(exc)}") from exc
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if name == self._name:
                raise HandshakeError("metadata", "this is the local agent's own metadata")
            self._remotes.add(name)
            return name

    def remove_remote(self, name: str) -> bool:
        """Forget a peer: release its transfers and prepared lists, then drop it.

        Returns False if the peer was not known. Transfers to the peer that
        were still running are cancelled by NIXL when released.
        """
        with self._lock:
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
        """Connect to a loaded peer now instead of on the first READ (optional)."""
        with self._lock:
            nixl = self._require_open()
            self._require_remote(name)
            try:
                nixl.make_connection(name)
            except Exception as exc:
                raise TransferSetupError(f"cannot connect to {name!r}: {_err(exc)}") from exc

    def _require_remote(self, name: str) -> None:
        if name not in self._remotes:
            raise TransferSetupError(f"unknown remote agent {name!r}; call add_remote first")

    # ---------------------------------------------------------- descriptors
    def prepare_local(
        self, ranges: Sequence[Range] | np.ndarray, mem: str = "DRAM"
    ) -> PreparedDescs:
        """Prepare local ranges once; index them later in `read`.

        Every range must lie inside one of this agent's registrations.
        """
        with self._lock:
            nixl = self._require_open()
            arr = _as_range_array(ranges, "prepare_local")
            self._check_local_bounds(arr, mem, "prepare_local")
            return self._prepare(nixl, _LOCAL, arr, mem)

    def prepare_remote(
        self, agent_name: str, ranges: Sequence[Range] | np.ndarray, mem: str = "DRAM"
    ) -> PreparedDescs:
        """Prepare ranges of a loaded remote agent once (per remote, per rank).

        The remote ranges must lie inside memory the peer had registered when
        it exported the metadata given to `add_remote`; NIXL checks this.
        ``agent_name == self.name`` prepares a loopback list.
        """
        with self._lock:
            nixl = self._require_open()
            if agent_name != self._name:
                self._require_remote(agent_name)
            arr = _as_range_array(ranges, "prepare_remote")
            return self._prepare(nixl, agent_name, arr, mem)

    def _prepare(self, nixl: Any, agent: str, arr: np.ndarray, mem: str) -> PreparedDescs:
        if mem not in MEM_TYPES:
            raise TransferSetupError(f"mem must be one of {MEM_TYPES}, got {mem!r}")
        dev = 0
        if agent == _LOCAL:
            dev = self._local_dev_id(mem)
        descs = np.empty((arr.shape[0], 3), dtype=np.uint64)
        descs[:, :2] = arr
        descs[:, 2] = dev
        try:
            handle = nixl.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", descs, mem)
        except Exception as exc:
            where = "local memory" if agent == _LOCAL else f"memory of {agent!r}"
            kind = type(exc).__name__
            if kind in ("nixlNotFoundError", "nixlInvalidParamError", "nixlMismatchError"):
                raise BlockRangeError(
                    f"descriptors are not inside registered {where}: {_err(exc)}"
                ) from exc
            raise TransferSetupError(f"cannot prepare descriptors for {where}: {_err(exc)}") from exc
        ranges = tuple((int(a), int(n)) for a, n in arr)
        prepared = PreparedDescs(agent, ranges, mem, arr[:, 1].copy(), handle, self)
        self._prepared.append(prepared)
        return prepared

    def release_prepared(self, prepared: PreparedDescs) -> None:
        """Release a prepared list (no-op if already released)."""
        with self._lock:
            self._require_open()
            self._check_owner(prepared)
            failures = self._release_prepared(prepared)
            if failures:
                raise TransferSetupError("; ".join(failures))

    def _check_local_bounds(self, arr: np.ndarray, mem: str, what: str) -> None:
        regs = [r for reg in self._registrations if reg.mem == mem for r in reg.regions]
        if not regs:
            raise BlockRangeError(f"{what}: no {mem} memory is registered")
        starts = np.array([a for a, _ in regs], dtype=np.int64)
        ends = np.array([a + n for a, n in regs], dtype=np.int64)
        order = np.argsort(starts)
        starts, ends = starts[order], ends[order]
        # Vectorized fast path: the region starting last at or before each
        # range must contain it. Ranges that fail it are re-checked against
        # every region (overlapping registrations).
        pos = np.searchsorted(starts, arr[:, 0], side="right") - 1
        ok = pos >= 0
        cand_end = np.where(ok, ends[np.clip(pos, 0, None)], 0)
        ok &= arr[:, 0] + arr[:, 1] <= cand_end
        for i in np.flatnonzero(~ok):
            a, n = int(arr[i, 0]), int(arr[i, 1])
            if not any(s <= a and a + n <= s + ln for s, ln in regs):
                raise BlockRangeError(
                    f"{what}: range {i} [{a:#x}, +{n}) is outside every registered {mem} region"
                )

    def _local_dev_id(self, mem: str) -> int:
        for reg in self._registrations:
            if reg.mem == mem:
                return reg.dev_id
        return 0

    # --------------------------------------------------------------- transfers
    def read(
        self,
        local: PreparedDescs,
        local_indices: Sequence[int] | np.ndarray,
        remote: PreparedDescs,
        remote_indices: Sequence[int] | np.ndarray,
        notif: bytes = b"",
    ) -> Transfer:
        """Post a READ of ``remote[remote_indices[k]]`` into ``local[local_indices[k]]``.

        ``notif`` (if non-empty) is delivered to the remote agent once the data
        has been read. Contiguous neighbouring descriptors are merged by NIXL.
        Returns a `Transfer` to poll with `check`. Caller mistakes raise
        (`BlockRangeError`, `TransferSetupError`); a peer that is already
        dead is *not* an exception: the returned transfer is in state ERR.
        """
        with self._lock:
            nixl = self._require_open()
            self._check_owner(local)
            self._check_owner(remote)
            if local.released or remote.released:
                raise TransferSetupError("read: a prepared descriptor list was released")
            if not local.is_local:
                raise TransferSetupError("read: `local` must come from prepare_local")
            if remote.is_local:
                raise TransferSetupError("read: `remote` must come from prepare_remote")
            if remote.agent != self._name:
                self._require_remote(remote.agent)
            notif = _as_notif(notif)
            li = _as_indices(local_indices, len(local), "read local_indices")
            ri = _as_indices(remote_indices, len(remote), "read remote_indices")
            if li.size != ri.size:
                raise TransferSetupError(
                    f"read: {li.size} local indices vs {ri.size} remote indices"
                )
            llen, rlen = local.lengths[li], remote.lengths[ri]
            if not np.array_equal(llen, rlen):
                k = int(np.argmax(llen != rlen))
                raise TransferSetupError(
                    f"read: pair {k} has local length {int(llen[k])} vs remote {int(rlen[k])}"
                )
            try:
                handle = nixl.make_prepped_xfer(
                    "READ", local._handle, li, remote._handle, ri, notif
                )
            except Exception as exc:
                raise TransferSetupError(
                    f"cannot build READ from {remote.agent!r}: {_err(exc)}"
                ) from exc
            return self._post(nixl, handle, remote.agent, int(llen.sum()), int(li.size), notif)

    def read_ranges(
        self,
        remote_agent: str,
        local_ranges: Sequence[Range] | np.ndarray,
        remote_ranges: Sequence[Range] | np.ndarray,
        notif: bytes = b"",
        mem: str = "DRAM",
        remote_mem: str | None = None,
    ) -> Transfer:
        """Post a READ from raw ranges without preparing lists (`initialize_xfer`).

        Simpler than `read`, but NIXL re-validates and re-resolves both lists
        on every call; prefer `read` for repeated reads from the same peer.
        """
        with self._lock:
            nixl = self._require_open()
            if remote_agent != self._name:
                self._require_remote(remote_agent)
            notif = _as_notif(notif)
            remote_mem = mem if remote_mem is None else remote_mem
            if mem not in MEM_TYPES or remote_mem not in MEM_TYPES:
                raise TransferSetupError(f"mem must be one of {MEM_TYPES}")
            la = _as_range_array(local_ranges, "read_ranges local")
            ra = _as_range_array(remote_ranges, "read_ranges remote")
            if la.shape[0] != ra.shape[0]:
                raise TransferSetupError(
                    f"read_ranges: {la.shape[0]} local ranges vs {ra.shape[0]} remote ranges"
                )
            if not np.array_equal(la[:, 1], ra[:, 1]):
                k = int(np.argmax(la[:, 1] != ra[:, 1]))
                raise TransferSetupError(
                    f"read_ranges: pair {k} has local length {int(la[k, 1])} "
                    f"vs remote {int(ra[k, 1])}"
                )
            self._check_local_bounds(la, mem, "read_ranges local")
            ldesc = np.empty((la.shape[0], 3), dtype=np.uint64)
            ldesc[:, :2] = la
            ldesc[:, 2] = self._local_dev_id(mem)
            rdesc = np.zeros((ra.shape[0], 3), dtype=np.uint64)
            rdesc[:, :2] = ra
            try:
                handle = nixl.initialize_xfer(
                    "READ",
                    nixl.get_xfer_descs(ldesc, mem),
                    nixl.get_xfer_descs(rdesc, remote_mem),
                    remote_agent,
                    notif,
                )
            except Exception as exc:
                kind = type(exc).__name__
                if kind in ("nixlNotFoundError", "nixlInvalidParamError", "nixlMismatchError"):
                    raise BlockRangeError(
                        f"read_ranges: descriptors rejected for {remote_agent!r}: {_err(exc)}"
                    ) from exc
                raise TransferSetupError(
                    f"cannot build READ from {remote_agent!r}: {_err(exc)}"
                ) from exc
            return self._post(
                nixl, handle, remote_agent, int(la[:, 1].sum()), int(la.shape[0]), notif
            )

    def _post(
        self, nixl: Any, handle: Any, remote: str, nbytes: int, ndescs: int, notif: bytes
    ) -> Transfer:
        error: BaseException | None = None
        try:
            state = nixl.transfer(handle)
        except Exception as exc:
            if type(exc).__name__ != "nixlRemoteDisconnectError":
                self._release_quietly(handle)
                raise TransferSetupError(f"cannot post READ from {remote!r}: {_err(exc)}") from exc
            # The peer is gone (seen at post time): report it like a failure
            # detected later, as a transfer in state ERR.
            state, error = "ERR", exc
        transfer = Transfer(remote, nbytes, ndescs, notif, handle, self)
        transfer._state = state
        if state == "ERR":
            transfer.error = error or TransferSetupError("NIXL returned ERR when posting")
        self._transfers.append(transfer)
        return transfer

    def check(self, transfer: Transfer) -> XferState:
        """Non-blocking state of a transfer: ``"DONE"``, ``"PROC"`` or ``"ERR"``.

        Also drives UCX progress. A transfer that failed after posting (e.g.
        the peer died) is ``"ERR"`` with the cause in ``transfer.error``; this
        method does not raise for it. DONE and ERR are final.
        """
        with self._lock:
            nixl = self._require_open()
            self._check_owner(transfer)
            if transfer.released:
                raise TransferSetupError("check: transfer handle was released")
            if transfer._state != "PROC":
                return transfer._state
            try:
                state = nixl.check_xfer_state(transfer._handle)
            except Exception as exc:
                transfer.error = exc
                state = "ERR"
            if state == "ERR" and transfer.error is None:
                transfer.error = TransferSetupError("NIXL reported ERR")
            transfer._state = state
            return state

    def wait(
        self, transfer: Transfer, timeout: float, poll_interval: float = 0.0002
    ) -> XferState:
        """Poll `check` until DONE/ERR or ``timeout`` seconds; returns the last state.

        The lock is released between polls, so other threads can use the agent.
        """
        deadline = time.monotonic() + timeout
        while True:
            state = self.check(transfer)
            if state != "PROC" or time.monotonic() >= deadline:
                return state
            if poll_interval > 0:
                time.sleep(poll_interval)

    def release(self, transfer: Transfer) -> None:
        """Free a transfer handle (no-op if already released).

        Releasing a transfer that is still running asks NIXL to cancel it; if
        NIXL refuses, `TransferSetupError` is raised and the handle is kept
        for another attempt (at the latest in `shutdown`).
        """
        with self._lock:
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
        with self._lock:
            nixl = self._require_open()
            if remote_agent != self._name:
                self._require_remote(remote_agent)
            msg = _as_notif(msg)
            try:
                nixl.send_notif(remote_agent, msg)
            except Exception as exc:
                raise TransferSetupError(
                    f"cannot notify {remote_agent!r}: {_err(exc)}"
                ) from exc

    def progress(self) -> int:
        """Drive UCX progress once; buffer new notifications for `get_notifs`.

        Returns how many notifications arrived. A READ only completes when the
        *target* agent progresses too (see NIXL_NOTES.md), so an agent that
        owns memory others read must call this (or `get_notifs`) regularly,
        e.g. from its engine loop or a low-rate background thread.
        """
        with self._lock:
            nixl = self._require_open()
            try:
                raw = nixl.get_new_notifs()
            except Exception as exc:
                raise TransferSetupError(f"cannot fetch notifications: {_err(exc)}") from exc
            count = 0
            for k, msgs in raw.items():
                key = k.decode() if isinstance(k, bytes) else str(k)
                self._notif_buf.setdefault(key, []).extend(bytes(m) for m in msgs)
                count += len(msgs)
            return count

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, keyed by sender agent name.

        Drives UCX progress. Senders need not be loaded with `add_remote`.
        Messages from one sender keep their arrival order.
        """
        with self._lock:
            self.progress()
            out, self._notif_buf = self._notif_buf, {}
            return out

    # ----------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Release everything exactly once, then destroy the NIXL agent. Idempotent.

        Order: transfer handles, prepared lists, remote agents, registrations.
        Failures are logged, not raised, so shutdown always completes.
        """
        with self._lock:
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

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"NixlAgent({self._name!r}, backend={self._backend}, {state}, "
            f"remotes={len(self._remotes)}, transfers={len(self._transfers)})"
        )

    # ------------------------------------------------------------ internals
    def _release_transfer(self, t: Transfer, force: bool = False) -> list[str]:
        if t.released:
            return []
        try:
            t._handle.release()
        except Exception as exc:
            if not force:
                return [f"release of {t!r} failed: {_err(exc)}"]
            # At shutdown the C++ agent's destructor frees what is left.
            failure = [f"release of {t!r} failed: {_err(exc)}"]
        else:
            failure = []
        t.released = True
        t._handle = None  # NIXL handles reference the C++ agent; drop them
        self._transfers.remove(t)
        return failure

    def _release_prepared(self, p: PreparedDescs) -> list[str]:
        if p.released:
            return []
        p.released = True
        self._prepared.remove(p)
        handle, p._handle = p._handle, None
        try:
            handle.release()
        except Exception as exc:
            return [f"release of {p!r} failed: {_err(exc)}"]
        return []

    @staticmethod
    def _invalidate_remote(nixl: Any, name: str) -> list[str]:
        try:
            # invalidateRemoteMD returns a status instead of raising.
            status = nixl.agent.invalidateRemoteMD(name)
        except Exception as exc:
            return [f"removing remote {name!r} failed: {_err(exc)}"]
        if int(status) != 0:
            return [f"removing remote {name!r} returned {status}"]
        return []

    @staticmethod
    def _release_quietly(handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # the C++ agent frees it at destruction
            logger.warning("releasing a failed transfer handle: %s", _err(exc))


def _is_tensor(obj: object) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_region(t: "torch.Tensor") -> tuple[int, int, str, int]:
    if not t.is_contiguous():
        raise BlockRangeError("register: tensors must be contiguous")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        raise BlockRangeError("register: tensor is empty")
    if t.device.type == "cpu":
        return t.data_ptr(), nbytes, "DRAM", 0
    if t.device.type == "cuda":
        return t.data_ptr(), nbytes, "VRAM", int(t.device.index or 0)
    raise TransferSetupError(f"register: unsupported tensor device {t.device}")
