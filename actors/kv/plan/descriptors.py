"""Descriptor lists prepared once per peer, and the per-request index math.

Both sides of a READ are described once, at handshake, as a `DescTable`: every block cut into
equal units and every unit into the same byte runs (`UnitCut`; `read_cuts` cuts a read's two
tables). Invariants: whether every descriptor lies inside its region is proven once, when the table
is built; a request then only needs its block ids checked (`checked_block_ids`, one vectorised
min/max) and its descriptor indices computed (numpy broadcasting). The numbering and how NIXL is
handed a table: `DescTable`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from actors.kv.transfer_errors import BlockRangeError, LayoutError
from actors.kv.plan.layout import BlockLayout, CacheGeometry
from actors.kv.plan.read_plan import ReadSpec

Run = tuple[int, int]  # (offset inside a unit, nbytes)


@dataclass(frozen=True)
class UnitCut:
    """How a block is cut into descriptors: `units` units `unit_stride` apart, each `runs`."""

    units: int
    unit_stride: int
    runs: tuple[Run, ...]

    @property
    def run_lengths(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.runs)

    @property
    def tiles(self) -> bool:
        """One run covering the whole unit: unit k+1 starts where unit k ends."""
        return len(self.runs) == 1 and self.runs[0] == (0, self.unit_stride)

    @property
    def bytes_per_unit(self) -> int:
        return sum(self.run_lengths)


@dataclass(frozen=True)
class DescTable:
    """Every descriptor of a set of regions cut by `cut`; bounds are proven at construction.

    A rank's KV cache is a list of regions (one per layer and plane), each
    `num_blocks` blocks of `block_bytes`. A READ from one source rank moves the
    same byte runs out of every block it touches, so both sides are described
    once, at handshake, as a `DescTable`: every block is cut into `units` equal
    units (sub-blocks of a smaller remote block, or token slots for token-sharded
    reads) and every unit into the same `runs` (offset, nbytes). Descriptor
    `((region * K + k) * num_blocks + block) * units + unit` is run k of that unit.

    A table is handed to NIXL as strided rows (address, length, stride, count),
    one row per (region, run) when the units tile the block, so preparing even a
    large cache costs microseconds. Whether every descriptor lies inside its
    region is proven once, here, when the table is built (`DescTable.__post_init__`);
    a request then only needs its block ids checked (`checked_block_ids`, one
    vectorised min/max) and its descriptor indices computed (numpy broadcasting).
    """

    bases: tuple[int, ...]  # region start addresses, in region index order
    num_blocks: int
    block_bytes: int
    cut: UnitCut

    def __post_init__(self) -> None:
        c = self.cut
        if not self.bases or self.num_blocks < 1 or self.block_bytes < 1:
            raise LayoutError("a descriptor table needs regions, blocks and a block length")
        if c.units < 1 or c.unit_stride < 1 or not c.runs:
            raise LayoutError(f"bad unit cut {c}")
        for offset, nbytes in c.runs:
            end = (c.units - 1) * c.unit_stride + offset + nbytes
            if offset < 0 or nbytes < 1 or end > self.block_bytes:
                raise BlockRangeError(
                    f"run ({offset}, {nbytes}) of {c.units} units {c.unit_stride} B apart "
                    f"leaves the {self.block_bytes} B block"
                )
        if min(self.bases) < 1:
            raise BlockRangeError("region addresses must be positive")

    @property
    def runs_per_unit(self) -> int:
        return len(self.cut.runs)

    def __len__(self) -> int:
        return len(self.bases) * self.runs_per_unit * self.num_blocks * self.cut.units

    @property
    def tiles_block(self) -> bool:
        """Units fill the block exactly, so one strided row covers a whole region."""
        return self.cut.units * self.cut.unit_stride == self.block_bytes

    def rows(self) -> np.ndarray:
        """(address, nbytes, stride, count) rows, in descriptor index order."""
        c, nb = self.cut, self.num_blocks
        bases = np.asarray(self.bases, dtype=np.uint64)[:, None]
        offsets = np.asarray([o for o, _ in c.runs], dtype=np.uint64)[None, :]
        lengths = np.asarray(c.run_lengths, dtype=np.uint64)
        if self.tiles_block:
            starts = (bases + offsets).ravel()  # [region, run]
            out = np.empty((starts.size, 4), dtype=np.uint64)
            out[:, 0] = starts
            out[:, 1] = np.tile(lengths, len(self.bases))
            out[:, 2] = c.unit_stride
            out[:, 3] = nb * c.units
            return out
        blocks = np.arange(nb, dtype=np.uint64)[None, None, :] * np.uint64(self.block_bytes)
        starts = (bases[:, :, None] + offsets[:, :, None] + blocks).ravel()  # [region, run, block]
        out = np.empty((starts.size, 4), dtype=np.uint64)
        out[:, 0] = starts
        out[:, 1] = np.tile(np.repeat(lengths, nb), len(self.bases))
        out[:, 2] = c.unit_stride
        out[:, 3] = c.units
        return out

    def addresses(self) -> tuple[np.ndarray, np.ndarray]:
        """Every descriptor expanded (address, nbytes): for the in-process fake transport."""
        rows = self.rows()
        per_row = np.arange(int(rows[0, 3]), dtype=np.uint64)
        addrs = (rows[:, 0:1] + rows[:, 2:3] * per_row[None, :]).ravel()
        return addrs, np.repeat(rows[:, 1], int(rows[0, 3]))

    def region_run_base(self, regions: np.ndarray) -> np.ndarray:
        """First descriptor index of block 0, unit 0 for each (region, run): shape [R, K, 1]."""
        k = np.arange(self.runs_per_unit, dtype=np.int64)[None, :]
        first = (regions.astype(np.int64)[:, None] * self.runs_per_unit + k) * self.num_blocks
        return (first * self.cut.units)[:, :, None]


def index_dtype(table_len: int) -> type:
    return np.int32 if table_len < 2**31 else np.int64


def checked_block_ids(side: str, block_ids: Sequence[int] | np.ndarray, num_blocks: int) -> np.ndarray:
    """Block ids as an int64 array, all in [0, num_blocks): one vectorised check per request."""
    try:
        ids = np.asarray(block_ids)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BlockRangeError(f"{side} block ids are not integers: {exc}") from None
    if ids.size == 0:
        return ids.astype(np.int64).reshape(0)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise BlockRangeError(f"{side} block ids must be a flat list of integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        raise BlockRangeError(f"{side} block id {lo if lo < 0 else hi} outside [0, {num_blocks})")
    return ids.astype(np.int64, copy=False)


# ------------------------------------------------------------ byte runs of a block


def strides_of(axes: Sequence[str], dims: dict[str, int], itemsize: int) -> dict[str, int]:
    """Byte stride of each axis of a dense block whose axes are `axes`, outermost first."""
    strides, acc = {}, itemsize
    for axis in reversed(axes):
        strides[axis] = acc
        acc *= dims[axis]
    return strides


def _prefix_offsets(axes: Sequence[str], dims: dict[str, int], strides: dict[str, int], stop: str) -> list[int]:
    """Byte offsets of every index combination of the axes before `stop`."""
    offsets = [0]
    for axis in axes[: axes.index(stop)]:
        offsets = [o + i * strides[axis] for o in offsets for i in range(dims[axis])]
    return offsets


def _coalesce(pairs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (dst, src, n) runs adjacent on both sides (a full head range is one run)."""
    out: list[list[int]] = []
    for d, s, n in pairs:
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1][2] += n
        else:
            out.append([d, s, n])
    return [(d, s, n) for d, s, n in out]


def head_slice_runs(
    layout: BlockLayout, src_dims: dict[str, int], dst_dims: dict[str, int],
    src_heads: tuple[int, int], dst_heads: tuple[int, int], itemsize: int,
) -> list[tuple[int, int, int]]:
    """(dst offset, src offset, nbytes) moving a head slice between two blocks of one layout."""
    if src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]:
        raise LayoutError(f"head slices differ in size: {src_heads} vs {dst_heads}")
    if "H" not in layout.axes:
        return [(0, 0, math.prod(src_dims[a] for a in layout.axes) * itemsize)]
    s_str, d_str = strides_of(layout.axes, src_dims, itemsize), strides_of(layout.axes, dst_dims, itemsize)
    count = src_heads[1] - src_heads[0]
    s_pre = _prefix_offsets(layout.axes, src_dims, s_str, "H")
    d_pre = _prefix_offsets(layout.axes, dst_dims, d_str, "H")
    return _coalesce([
        (d + dst_heads[0] * d_str["H"], s + src_heads[0] * s_str["H"], count * s_str["H"])
        for d, s in zip(d_pre, s_pre)
    ])


def token_cut(layout: BlockLayout, dims: dict[str, int], itemsize: int) -> UnitCut:
    """One unit per token slot of a block; its runs are the slot's rows (one per outer index)."""
    strides = strides_of(layout.axes, dims, itemsize)
    runs = tuple((o, strides["N"]) for o in _prefix_offsets(layout.axes, dims, strides, "N"))
    return UnitCut(units=dims["N"], unit_stride=strides["N"], runs=runs)


# ------------------------------------------------------------ one read's two tables


def read_cuts(spec: ReadSpec, local: CacheGeometry, remote: CacheGeometry) -> tuple[UnitCut, UnitCut]:
    """How each side's blocks are cut into descriptors for this read."""
    if spec.token_shard is not None:
        l_cut = token_cut(local.layout, local.block_dims(), local.dtype_size)
        r_cut = token_cut(remote.layout, remote.block_dims(), remote.dtype_size)
        if l_cut.run_lengths != r_cut.run_lengths:
            raise LayoutError(f"token rows differ between layouts {local.layout.name} and {remote.layout.name}")
        return l_cut, r_cut
    # Local block j receives remote blocks [j*ratio, (j+1)*ratio) back to back, in the
    # remote axis order with the local head count (`to_local_layout` permutes later).
    src_dims = remote.block_dims()
    dst_dims = remote.block_dims(num_heads=local.num_heads)
    sub_block = local.block_bytes // spec.block_size_ratio
    runs = head_slice_runs(remote.layout, src_dims, dst_dims, spec.remote_heads, spec.local_heads,
                           remote.dtype_size)
    l_cut = UnitCut(spec.block_size_ratio, sub_block, tuple((d, n) for d, _, n in runs))
    r_cut = UnitCut(1, remote.block_bytes, tuple((s, n) for _, s, n in runs))
    return l_cut, r_cut


def table_of(geometry: CacheGeometry, cut: UnitCut) -> DescTable:
    """Every block of `geometry`'s regions, cut by `cut`."""
    return DescTable(tuple(b for planes in geometry.bases for b in planes), geometry.num_blocks,
                     geometry.block_bytes, cut)
