"""KV cache geometry, block byte ranges and the transforms applied on receive.

A rank's cache is `num_layers` layers of `planes` regions each. A region is
`num_blocks` contiguous blocks; a block is a dense array whose axes, in memory
order, are named by a `BlockLayout`:

  H  kv heads held by the rank      N  token slots (block size)
  D  head size                      KV K and V, when both live in one block

Examples: GPU flash-attention HND = planes=2 (K, V), axes (H, N, D); NHD =
(N, H, D); vLLM's CPU backend = planes=1, axes (H, KV, N, D); MLA = planes=1,
axes (N, D) with one latent head (H=1, implicit).

A READ copies the remote bytes of a head slice into the local block in the
*remote* axis order (with the local head count): for a smaller remote block
the local block receives `ratio` remote blocks back to back. `to_local_layout`
then permutes the received blocks in place into the local order. Token-sharded
(DCP) reads instead move single token rows straight to their final place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from actors.kv.errors import BlockRangeError, LayoutError
from actors.kv.topology import ReadSpec

AXIS_NAMES = frozenset({"KV", "H", "N", "D"})


@dataclass(frozen=True)
class BlockLayout:
    """Memory order of one block's axes, outermost first."""

    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.axes)) != len(self.axes) or not set(self.axes) <= AXIS_NAMES:
            raise LayoutError(f"block axes {self.axes} must be distinct names from {sorted(AXIS_NAMES)}")
        if "N" not in self.axes or "D" not in self.axes:
            raise LayoutError(f"block axes {self.axes} need at least N and D")

    @property
    def name(self) -> str:
        return "".join(a if a != "KV" else "C" for a in self.axes)

    @classmethod
    def parse(cls, name: str) -> "BlockLayout":
        """'HND', 'NHD', 'HCND' (C = K/V pair inside the block), 'ND' (MLA)."""
        axes = tuple("KV" if c == "C" else c for c in name.upper())
        return cls(axes)


HND = BlockLayout(("H", "N", "D"))
NHD = BlockLayout(("N", "H", "D"))
CPU_HKND = BlockLayout(("H", "KV", "N", "D"))  # vLLM's CPU attention backend
MLA_ND = BlockLayout(("N", "D"))


@dataclass(frozen=True)
class CacheGeometry:
    """Where a rank's KV blocks live; sent to peers in the handshake."""

    layout: BlockLayout
    num_layers: int
    first_layer: int  # global index of local layer 0 (pipeline parallelism)
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype_size: int
    bases: tuple[tuple[int, ...], ...]  # [layer][plane] -> address of block 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size", "dtype_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"cache {name} must be >= 1, got {getattr(self, name)}")
        if "H" not in self.layout.axes and self.num_heads != 1:
            raise LayoutError(f"layout {self.layout.name} has no head axis but num_heads={self.num_heads}")
        if len(self.bases) != self.num_layers or len({len(p) for p in self.bases}) != 1:
            raise LayoutError(
                f"cache bases must list the same number of planes for each of {self.num_layers} layers"
            )

    @property
    def planes(self) -> int:
        return len(self.bases[0])

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def block_dims(self, num_heads: int | None = None, block_size: int | None = None) -> dict[str, int]:
        return {
            "KV": 2,
            "H": self.num_heads if num_heads is None else num_heads,
            "N": self.block_size if block_size is None else block_size,
            "D": self.head_size,
        }

    @property
    def block_bytes(self) -> int:
        dims = self.block_dims()
        return math.prod(dims[a] for a in self.layout.axes) * self.dtype_size

    @property
    def region_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def regions(self) -> list[tuple[int, int]]:
        """(address, nbytes) of every registered region."""
        return [(base, self.region_bytes) for planes in self.bases for base in planes]

    def block_address(self, layer: int, plane: int, block_id: int) -> int:
        """Address of one block; `layer` is global, bounds-checked."""
        if layer not in self.layers:
            raise BlockRangeError(f"layer {layer} outside this rank's layers {self.layers}")
        if not 0 <= block_id < self.num_blocks:
            raise BlockRangeError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.bases[layer - self.first_layer][plane] + block_id * self.block_bytes

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.name,
            "num_layers": self.num_layers,
            "first_layer": self.first_layer,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_heads": self.num_heads,
            "head_size": self.head_size,
            "dtype_size": self.dtype_size,
            "bases": [list(p) for p in self.bases],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "CacheGeometry":
        fields = dict(data)
        fields["layout"] = BlockLayout.parse(fields["layout"])
        fields["bases"] = tuple(tuple(int(a) for a in p) for p in fields["bases"])
        return cls(**fields)

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[Sequence[torch.Tensor]], layout: BlockLayout, block_size: int,
        num_heads: int, head_size: int, first_layer: int = 0,
    ) -> "CacheGeometry":
        """Describe per-layer, per-plane tensors shaped [num_blocks, *block dims]."""
        if not tensors or not tensors[0]:
            raise LayoutError("no KV cache tensors given")
        ref = tensors[0][0]
        geometry = cls(
            layout=layout, num_layers=len(tensors), first_layer=first_layer,
            num_blocks=ref.shape[0], block_size=block_size, num_heads=num_heads,
            head_size=head_size, dtype_size=ref.element_size(),
            bases=tuple(tuple(t.data_ptr() for t in planes) for planes in tensors),
        )
        dims = geometry.block_dims()
        want = (geometry.num_blocks, *(dims[a] for a in layout.axes))
        for planes in tensors:
            for t in planes:
                if tuple(t.shape) != want or not t.is_contiguous() or t.dtype != ref.dtype:
                    raise LayoutError(
                        f"KV tensor of shape {tuple(t.shape)} (contiguous={t.is_contiguous()}, "
                        f"{t.dtype}) does not match layout {layout.name} shape {want} {ref.dtype}"
                    )
        return geometry


def compatible_geometry(local: CacheGeometry, remote: CacheGeometry) -> None:
    """Raise LayoutError unless blocks of `remote` can be read into `local`."""
    for name in ("head_size", "dtype_size", "planes"):
        if getattr(local, name) != getattr(remote, name):
            raise LayoutError(
                f"{name} differs: local {getattr(local, name)}, remote {getattr(remote, name)}"
            )
    if ("KV" in local.layout.axes) != ("KV" in remote.layout.axes):
        raise LayoutError(
            f"K/V packing differs: local {local.layout.name}, remote {remote.layout.name}"
        )
    if local.block_size % remote.block_size:
        raise LayoutError(
            f"remote block size {remote.block_size} does not divide local {local.block_size}"
        )


# --------------------------------------------------------------- byte runs

Run = tuple[int, int, int]  # (local address, remote address, nbytes)


def _strides(axes: Sequence[str], dims: dict[str, int], itemsize: int) -> dict[str, int]:
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


def head_slice_runs(
    layout: BlockLayout, src_dims: dict[str, int], dst_dims: dict[str, int],
    src_heads: tuple[int, int], dst_heads: tuple[int, int], itemsize: int,
) -> list[tuple[int, int, int]]:
    """(dst offset, src offset, nbytes) moving a head slice between two blocks of one layout."""
    if src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]:
        raise LayoutError(f"head slices differ in size: {src_heads} vs {dst_heads}")
    if "H" not in layout.axes:
        nbytes = math.prod(src_dims[a] for a in layout.axes) * itemsize
        return [(0, 0, nbytes)]
    s_str, d_str = _strides(layout.axes, src_dims, itemsize), _strides(layout.axes, dst_dims, itemsize)
    count = src_heads[1] - src_heads[0]
    s_pre = _prefix_offsets(layout.axes, src_dims, s_str, "H")
    d_pre = _prefix_offsets(layout.axes, dst_dims, d_str, "H")
    return [
        (d + dst_heads[0] * d_str["H"], s + src_heads[0] * s_str["H"], count * s_str["H"])
        for d, s in zip(d_pre, s_pre)
    ]


def token_runs(layout: BlockLayout, dims: dict[str, int], slot: int, itemsize: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of one token slot's data inside a block."""
    strides = _strides(layout.axes, dims, itemsize)
    run = strides["N"]
    return [(o + slot * strides["N"], run) for o in _prefix_offsets(layout.axes, dims, strides, "N")]


def merge_runs(runs: Iterable[Run]) -> list[Run]:
    """Coalesce runs that are adjacent on both sides (sorted by local address)."""
    merged: list[list[int]] = []
    for local, remote, nbytes in sorted(runs):
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == local and last[1] + last[2] == remote:
            last[2] += nbytes
        else:
            merged.append([local, remote, nbytes])
    return [tuple(r) for r in merged]  # type: ignore[misc]


def _layer_pairs(spec: ReadSpec, local: CacheGeometry, remote: CacheGeometry) -> list[int]:
    """Global layers both sides hold, limited to the read's layer range."""
    lo = max(local.first_layer, remote.first_layer)
    hi = min(local.first_layer + local.num_layers, remote.first_layer + remote.num_layers)
    if spec.layers is not None:
        lo, hi = max(lo, spec.layers[0]), min(hi, spec.layers[1])
    return list(range(lo, hi))


def check_block_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for block_id in block_ids:
        if not isinstance(block_id, int) or not 0 <= block_id < num_blocks:
            raise BlockRangeError(f"{side} block id {block_id!r} outside [0, {num_blocks})")


def block_read_runs(
    spec: ReadSpec, local: CacheGeometry, remote: CacheGeometry,
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
) -> list[Run]:
    """Runs that land `spec`'s head slice of the remote blocks in the local blocks.

    Local block j receives remote blocks [j*ratio, (j+1)*ratio) back to back,
    in the remote axis order with the local head count.
    """
    ratio = spec.block_size_ratio
    check_block_ids("local", local_block_ids, local.num_blocks)
    check_block_ids("remote", remote_block_ids, remote.num_blocks)
    if len(remote_block_ids) > len(local_block_ids) * ratio:
        raise BlockRangeError(
            f"{len(remote_block_ids)} remote blocks do not fit in {len(local_block_ids)} local "
            f"blocks at block size ratio {ratio}"
        )
    src_dims = remote.block_dims()
    dst_dims = remote.block_dims(num_heads=local.num_heads)
    sub_block = math.prod(dst_dims[a] for a in remote.layout.axes) * remote.dtype_size
    in_block = head_slice_runs(
        remote.layout, src_dims, dst_dims, spec.remote_heads, spec.local_heads, remote.dtype_size
    )
    runs: list[Run] = []
    for layer in _layer_pairs(spec, local, remote):
        for plane in range(local.planes):
            for i, remote_id in enumerate(remote_block_ids):
                local_base = local.block_address(layer, plane, local_block_ids[i // ratio])
                local_base += (i % ratio) * sub_block
                remote_base = remote.block_address(layer, plane, remote_id)
                runs.extend((local_base + d, remote_base + s, n) for d, s, n in in_block)
    return merge_runs(runs)


def token_read_runs(
    spec: ReadSpec, local: CacheGeometry, remote: CacheGeometry,
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int], num_tokens: int,
) -> list[Run]:
    """Runs for token-sharded (DCP) MLA caches: every token both shards hold.

    Token t lives on dcp rank t % d at slot t // d; block ids are shared by the
    ranks of one engine (vLLM's virtual blocks of block_size * d tokens).
    """
    if spec.token_shard is None:
        raise LayoutError("token_read_runs needs a token-sharded read spec")
    r_size, r_rank, l_size, l_rank = spec.token_shard
    check_block_ids("local", local_block_ids, local.num_blocks)
    check_block_ids("remote", remote_block_ids, remote.num_blocks)
    l_dims, r_dims = local.block_dims(), remote.block_dims()
    runs: list[Run] = []
    for t in range(num_tokens):
        if t % r_size != r_rank or t % l_size != l_rank:
            continue
        r_slot, l_slot = t // r_size, t // l_size
        r_blk, l_blk = r_slot // remote.block_size, l_slot // local.block_size
        if r_blk >= len(remote_block_ids) or l_blk >= len(local_block_ids):
            raise BlockRangeError(
                f"token {t} needs remote block #{r_blk} / local block #{l_blk}, but only "
                f"{len(remote_block_ids)} / {len(local_block_ids)} were given"
            )
        l_runs = token_runs(local.layout, l_dims, l_slot % local.block_size, local.dtype_size)
        r_runs = token_runs(remote.layout, r_dims, r_slot % remote.block_size, remote.dtype_size)
        if [n for _, n in l_runs] != [n for _, n in r_runs]:
            raise LayoutError(
                f"token rows differ between layouts {local.layout.name} and {remote.layout.name}"
            )
        for layer in _layer_pairs(spec, local, remote):
            for plane in range(local.planes):
                l_base = local.block_address(layer, plane, local_block_ids[l_blk])
                r_base = remote.block_address(layer, plane, remote_block_ids[r_blk])
                runs.extend((l_base + lo, r_base + ro, n) for (lo, n), (ro, _) in zip(l_runs, r_runs))
    return merge_runs(runs)


def check_runs_inside(runs: Iterable[Run], local: CacheGeometry, remote: CacheGeometry) -> None:
    """Every run must sit inside one registered region on each side."""
    l_regions, r_regions = local.regions(), remote.regions()
    for l_addr, r_addr, nbytes in runs:
        if not any(b <= l_addr and l_addr + nbytes <= b + n for b, n in l_regions):
            raise BlockRangeError(f"local range {l_addr:#x}+{nbytes} outside the registered cache")
        if not any(b <= r_addr and r_addr + nbytes <= b + n for b, n in r_regions):
            raise BlockRangeError(f"remote range {r_addr:#x}+{nbytes} outside the registered cache")


# -------------------------------------------------------- receive transforms


def to_local_layout(
    plane: torch.Tensor, block_ids: Sequence[int], remote_layout: BlockLayout,
    local_layout: BlockLayout, block_size_ratio: int,
) -> None:
    """Permute received blocks (remote order, `ratio` sub-blocks) into the local order, in place.

    `plane` is one local region shaped [num_blocks, *local block dims].
    """
    if block_size_ratio < 1:
        raise LayoutError(f"block size ratio must be >= 1, got {block_size_ratio}")
    if set(remote_layout.axes) != set(local_layout.axes):
        raise LayoutError(f"layouts {remote_layout.name} and {local_layout.name} hold different axes")
    if remote_layout == local_layout and block_size_ratio == 1:
        return
    if not block_ids:
        return
    check_block_ids("local", block_ids, plane.shape[0])
    local_dims = dict(zip(local_layout.axes, plane.shape[1:]))
    if local_dims["N"] % block_size_ratio:
        raise LayoutError(f"local block size {local_dims['N']} not divisible by ratio {block_size_ratio}")
    recv_dims = dict(local_dims, N=local_dims["N"] // block_size_ratio)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=plane.device)
    received = plane.index_select(0, index).view(
        len(block_ids), block_size_ratio, *(recv_dims[a] for a in remote_layout.axes)
    )
    names = ["B", "R", *remote_layout.axes]
    order = ["B"]
    for axis in local_layout.axes:
        order.extend(["R", "N"] if axis == "N" else [axis])
    permuted = received.permute(*(names.index(a) for a in order)).reshape(
        len(block_ids), *plane.shape[1:]
    )
    plane.index_copy_(0, index, permuted)


CANONICAL_AXES = ("KV", "H", "N", "D")


def canonical_view(plane: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """A view of a region [num_blocks, *block] with block axes in (KV, H, N, D) order.

    Axes the layout lacks are absent from the view; lets code address
    (block, head, token, dim) without caring how the bytes are ordered.
    """
    present = [a for a in CANONICAL_AXES if a in layout.axes]
    return plane.permute(0, *(1 + layout.axes.index(a) for a in present))


def copy_kv_blocks(
    src_caches: dict[str, torch.Tensor], dst_caches: dict[str, torch.Tensor],
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
) -> None:
    """Copy whole blocks layer by layer (e.g. a host staging buffer <-> the device cache)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise LayoutError(f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks")
    if set(src_caches) != set(dst_caches):
        raise LayoutError("source and destination caches hold different layers")
    if not src_block_ids:
        return
    for name, src in src_caches.items():
        dst = dst_caches[name]
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise LayoutError(f"layer {name}: block shape/dtype differ ({src.shape}, {dst.shape})")
        check_block_ids(f"source ({name})", src_block_ids, src.shape[0])
        check_block_ids(f"destination ({name})", dst_block_ids, dst.shape[0])
        src_index = torch.tensor(list(src_block_ids), dtype=torch.long, device=src.device)
        dst_index = torch.tensor(list(dst_block_ids), dtype=torch.long, device=dst.device)
        dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))


def clip_ssm_state_blocks(blocks: list[int], num_spec_blocks: int) -> list[int]:
    """Keep only the running-state slot of a mamba request (drop speculative scratch)."""
    if num_spec_blocks < 0:
        raise LayoutError(f"num_spec_blocks must be >= 0, got {num_spec_blocks}")
    if not blocks:
        return blocks
    scratch = min(num_spec_blocks, len(blocks) - 1)
    if scratch:
        blocks = blocks[:-scratch]
    return blocks[-1:]
