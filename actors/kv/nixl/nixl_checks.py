"""Input validation for `NixlAgent`: every caller mistake becomes a typed error.

NIXL's binding reports problems through raised `nixl._bindings.nixl*Error`
exceptions or returned status codes, some only with a log line. These helpers check arguments before NIXL sees
them (memory ranges, strided descriptor rows, descriptor indices,
notifications) and map NIXL's own exceptions to `actors.kv.transfer_errors` types.
All checks are vectorised with numpy: they run on every READ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from actors.kv.transfer_errors import BlockRangeError, TransferSetupError

Range = tuple[int, int]
"""A memory range as ``(address, nbytes)``."""

MEM_TYPES: tuple[str, ...] = ("DRAM", "VRAM")
"""Memory kinds the agent accepts (the ones the UCX backend supports)."""

# NIXL exceptions meaning "these descriptors are not inside registered memory".
_OUT_OF_BOUNDS = ("nixlNotFoundError", "nixlInvalidParamError", "nixlMismatchError")


def err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def bounds_or_setup_error(exc: BaseException, message: str) -> Exception:
    """The typed error for a NIXL failure while preparing or building a transfer."""
    if type(exc).__name__ in _OUT_OF_BOUNDS:
        return BlockRangeError(f"{message}: {err(exc)}")
    return TransferSetupError(f"{message}: {err(exc)}")


def check_mem(mem: str) -> str:
    if mem not in MEM_TYPES:
        raise TransferSetupError(f"mem must be one of {MEM_TYPES}, got {mem!r}")
    return mem


def as_range_array(ranges: Iterable[Range], what: str) -> np.ndarray:
    """Validate ``(addr, nbytes)`` pairs and return them as an ``(N, 2)`` int64 array."""
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
    if (arr[:, 1] <= 0).any():
        i = int(np.argmax(arr[:, 1] <= 0))
        raise BlockRangeError(f"{what}: range {i} has non-positive length {int(arr[i, 1])}")
    if (arr[:, 0] <= 0).any():
        i = int(np.argmax(arr[:, 0] <= 0))
        raise BlockRangeError(f"{what}: range {i} has invalid address {int(arr[i, 0])}")
    return arr


def as_rows(rows: np.ndarray, what: str) -> np.ndarray:
    """Validate strided descriptor rows (address, nbytes, stride, count) -> uint64 (N, 4)."""
    if not isinstance(rows, np.ndarray) or rows.ndim != 2 or rows.shape[1] != 4 or rows.shape[0] == 0:
        raise BlockRangeError(f"{what}: expected a non-empty (N, 4) array of (addr, nbytes, stride, count)")
    if rows.dtype.kind not in "iu":
        raise BlockRangeError(f"{what}: rows must be integers, got dtype {rows.dtype}")
    if rows.dtype.kind == "i" and (rows < 0).any():
        raise BlockRangeError(f"{what}: negative address, length, stride or count")
    rows = rows.astype(np.uint64, copy=False)
    for col, name in ((0, "address"), (1, "length"), (3, "count")):
        if (rows[:, col] == 0).any():
            i = int(np.argmax(rows[:, col] == 0))
            raise BlockRangeError(f"{what}: row {i} has a zero {name}")
    return rows


def row_spans(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first byte, end byte) of every strided row, as int64 (object-free: sizes fit)."""
    start = rows[:, 0].astype(np.int64)
    end = start + (rows[:, 3].astype(np.int64) - 1) * rows[:, 2].astype(np.int64) + rows[:, 1].astype(np.int64)
    return start, end


def check_inside(rows: np.ndarray, regions: Sequence[Range], what: str) -> None:
    """Every row's span must lie inside one of `regions` (vectorised; overlaps re-checked)."""
    if not regions:
        raise BlockRangeError(f"{what}: no memory of this kind is registered")
    starts = np.array([a for a, _ in regions], dtype=np.int64)
    ends = np.array([a + n for a, n in regions], dtype=np.int64)
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    lo, hi = row_spans(rows)
    pos = np.searchsorted(starts, lo, side="right") - 1
    ok = pos >= 0
    ok &= hi <= np.where(ok, ends[np.clip(pos, 0, None)], 0)
    for i in np.flatnonzero(~ok):  # overlapping registrations: try every region
        a, b = int(lo[i]), int(hi[i])
        if not any(s <= a and b <= s + n for s, n in regions):
            raise BlockRangeError(f"{what}: row {i} [{a:#x}, {b:#x}) is outside every registered region")


def as_indices(indices: Sequence[int] | np.ndarray, size: int, what: str) -> np.ndarray:
    """Descriptor indices as a 1-D integer array inside [0, size) (one min/max check)."""
    try:
        idx = np.asarray(indices)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BlockRangeError(f"{what}: not a sequence of integers: {exc}") from exc
    if idx.ndim != 1 or idx.size == 0:
        raise BlockRangeError(f"{what}: expected a non-empty 1-D sequence of indices")
    if idx.dtype.kind not in "iu":
        raise BlockRangeError(f"{what}: indices must be integers, got dtype {idx.dtype}")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        raise BlockRangeError(f"{what}: index {lo if lo < 0 else hi} outside the prepared list of {size}")
    return idx


def as_notif(msg: bytes | bytearray | memoryview, what: str = "notification") -> bytes:
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    if not isinstance(msg, bytes):
        raise TransferSetupError(f"{what} must be bytes, got {type(msg).__name__}")
    return msg
