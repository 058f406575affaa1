"""KV cache geometry, block layouts and the transforms applied on receive.

A rank's cache is `num_layers` layers of `planes` regions, each `num_blocks` dense blocks whose
axes, in memory order, a `BlockLayout` names. Invariant: a whole-block READ lands in the *remote*
axis order (with the local head count), and `to_local_layout` then permutes the received blocks in
place into the local order; token-sharded (DCP) reads move single token rows straight to their
final place. `compatible_geometry` refuses what cannot be mapped. The axes and examples:
`CacheGeometry`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from actors.kv.transfer_errors import LayoutError

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
    """Where a rank's KV blocks live; sent to peers in the handshake.

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

    def region_index(self, layer: int, plane: int) -> int:
        """Index of (global layer, plane) in `regions()` order."""
        return (layer - self.first_layer) * self.planes + plane

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


# ----------------------------------------------------------------- strides


# -------------------------------------------------------- receive transforms


def to_local_layout(
    plane: torch.Tensor, index: torch.Tensor, remote_layout: BlockLayout,
    local_layout: BlockLayout, block_size_ratio: int,
) -> None:
    """Permute received blocks (remote order, `ratio` sub-blocks) into the local order, in place.

    `plane` is one local region shaped [num_blocks, *local block dims]; `index`
    holds the local block ids that were received (already bounds-checked).
    """
    if block_size_ratio < 1:
        raise LayoutError(f"block size ratio must be >= 1, got {block_size_ratio}")
    if set(remote_layout.axes) != set(local_layout.axes):
        raise LayoutError(f"layouts {remote_layout.name} and {local_layout.name} hold different axes")
    if (remote_layout == local_layout and block_size_ratio == 1) or index.numel() == 0:
        return
    local_dims = dict(zip(local_layout.axes, plane.shape[1:]))
    if local_dims["N"] % block_size_ratio:
        raise LayoutError(f"local block size {local_dims['N']} not divisible by ratio {block_size_ratio}")
    recv_dims = dict(local_dims, N=local_dims["N"] // block_size_ratio)
    count = index.numel()
    received = plane.index_select(0, index).view(
        count, block_size_ratio, *(recv_dims[a] for a in remote_layout.axes)
    )
    names = ["B", "R", *remote_layout.axes]
    order = ["B"]
    for axis in local_layout.axes:
        order.extend(["R", "N"] if axis == "N" else [axis])
    permuted = received.permute(*(names.index(a) for a in order)).reshape(count, *plane.shape[1:])
    plane.index_copy_(0, index, permuted)


CANONICAL_AXES = ("KV", "H", "N", "D")


def canonical_view(plane: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """A view of a region [num_blocks, *block] with block axes in (KV, H, N, D) order.

    Axes the layout lacks are absent from the view; lets code address
    (block, head, token, dim) without caring how the bytes are ordered.
    """
    present = [a for a in CANONICAL_AXES if a in layout.axes]
    return plane.permute(0, *(1 + layout.axes.index(a) for a in present))
