"""Per-(block, head) KV checksums: recorded by the producer at hold, checked by the reader (`transfer.verify`).

`verify` is `off`, `sample` or `all`. With it on, the producer checksums each (block, head) of a
finished prefill's leased blocks over every layer and plane it holds and writes them into its lease
board (`lease_board`); a reader READs the entries of the blocks it checks with the lease record (no
extra round trip), recomputes them from what landed in its own cache (after the layout permute) and
fails the pull on any difference. `sample` checks the blocks whose id hashes with the lease's tag to
0 mod `SAMPLE_EVERY`: both sides pick the same ones.

The checksum is position-weighted and layout-independent (`region_sums`): both sides agree whatever
their axis order, block size (ratio) or TP split; one flipped bit always changes it. Computed with
torch on the cache's own device.
"""

from __future__ import annotations

import numpy as np
import torch

from actors.kv.plan.layout import BlockLayout, canonical_view

VERIFY_MODES = ("off", "sample", "all")
SAMPLE_EVERY = 8
_M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9


def check_mode(mode: str) -> str:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {mode!r}")
    return mode


def sampled(tag: int, block_ids: np.ndarray) -> np.ndarray:
    """Which of `block_ids` a `sample` check covers for the lease of `tag` (same on both sides)."""
    with np.errstate(over="ignore"):
        x = (block_ids.astype(np.uint64) ^ np.uint64(tag & (2**64 - 1))) * np.uint64(_M1)
        x ^= x >> np.uint64(31)
        x *= np.uint64(_M2)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(SAMPLE_EVERY)) == 0


def _signed(v: int) -> int:
    v &= 2**64 - 1
    return v - 2**64 if v >= 2**63 else v


def _mix(v: int) -> int:
    v = (v * _M1) & (2**64 - 1)
    v ^= v >> 31
    v = (v * _M2) & (2**64 - 1)
    return _signed((v ^ (v >> 29)) | 1)


_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def _narrow(v: int, bits: int) -> int:
    """The low `bits` bits of v as a signed int of that width (v odd stays odd)."""
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def word_weights(k: int, device: torch.device) -> torch.Tensor:
    """b: k odd 32-bit weights, one per word of a (block, head) slice (cached per length and device)."""
    key = (k, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.tensor([_narrow(_mix(1 + i), 32) for i in range(k)], dtype=torch.int32,
                                         device=device)
    return w


def head_weight(layer: int, kv: int, head: int) -> int:
    return _mix((layer << 32) ^ (kv << 24) ^ (head + 0x5151))


def kv_rows(plane: torch.Tensor, layout: BlockLayout, plane_index: int) -> list[tuple[int, torch.Tensor]]:
    """(kv, [blocks, heads, tokens, dim] view) pairs of one region, in canonical order."""
    view = canonical_view(plane, layout)
    if "KV" in layout.axes:
        return [(kv, view[:, kv]) for kv in range(view.shape[1])]
    if "H" not in layout.axes:
        return [(plane_index, view.unsqueeze(1))]
    return [(plane_index, view)]


def word_sums(words: torch.Tensor, w: torch.Tensor, matvec: bool) -> torch.Tensor:
    """Per row of int32 words: the sum of word * weight mod 2^32, as int32 (two ways, one value)."""
    if matvec:  # CPU: an integer matrix-vector product
        return torch.mv(words, w)
    return (words * w).sum(dim=1, dtype=torch.int64).to(torch.int32)  # CUDA has no integer mv


def region_sums(rows: torch.Tensor, layer: int, kv: int, heads: list[int]) -> torch.Tensor:
    """Checksum contribution [blocks, heads] of one (layer, kv) slice [blocks, heads, n, d] (int64).

    Per (layer, K/V, block, head) the block's elements of that head, in canonical (token, dim)
    order, are read as 32-bit words (D is the innermost axis of every layout, so the words are the
    same on both sides) and

        s = sum over words of  word * b(position)          (mod 2^32)
        checksum(block, head) = sum over (layer, kv) of  a(layer, kv, global head) * s   (mod 2^64)

    with `b` odd 32-bit and `a` odd 64-bit constants (token within the producer's block, word;
    global layer, K/V, global head). An odd weight is invertible mod 2^32, so one flipped bit
    always changes it; moved or swapped elements change it but for chance collisions. On CPU `s`
    is an integer matrix-vector product, elsewhere a multiply-and-sum truncated to 32 bits (the
    same value: `word_sums`).
    """
    r = rows.contiguous()
    if (r.shape[-1] * r.element_size()) % 4:
        raise ValueError(f"a head row of {r.shape[-1]} x {r.element_size()} bytes is not whole 32-bit words")
    b, h = r.shape[:2]
    words = r.view(torch.int32).reshape(b * h, -1)
    s = word_sums(words, word_weights(words.shape[1], r.device), matvec=r.device.type == "cpu")
    a = torch.tensor([head_weight(layer, kv, g) for g in heads], dtype=torch.int64, device=r.device)
    return s.to(torch.int64).view(b, h) * a


def producer_sums(planes: list[list[torch.Tensor]], layout: BlockLayout, first_layer: int, head0: int,
                  block_ids: np.ndarray) -> np.ndarray:
    """[len(block_ids), heads] checksums of whole blocks of a producer rank (uint64)."""
    if block_ids.size == 0:
        return np.zeros((0, 0), dtype=np.uint64)
    device = planes[0][0].device
    index = torch.from_numpy(block_ids.astype(np.int64)).to(device)
    total = None
    for i, layer_planes in enumerate(planes):
        for p, plane in enumerate(layer_planes):
            for kv, rows in kv_rows(plane.index_select(0, index), layout, p):
                part = region_sums(rows, first_layer + i, kv, list(range(head0, head0 + rows.shape[1])))
                total = part if total is None else total + part
    return total.cpu().numpy().view(np.uint64)


def reader_sums(planes: list[list[torch.Tensor]], layout: BlockLayout, first_layer: int, layers: tuple[int, ...],
                local_blocks: np.ndarray, units: np.ndarray, ratio: int, local_heads: tuple[int, int],
                remote_heads: list[int]) -> np.ndarray:
    """The checksums a producer recorded, recomputed from what landed here: [items, heads read] (uint64).

    Item k is a remote block that filled sub-block `units[k]` (of `ratio`) of
    local block `local_blocks[k]`, with local heads `local_heads` holding the
    producer's global heads `remote_heads`; `layers` are the global layers.
    """
    device = planes[0][0].device
    blocks = torch.from_numpy(local_blocks.astype(np.int64)).to(device)
    unit = torch.from_numpy(units.astype(np.int64)).to(device)
    rows_of = torch.arange(blocks.numel(), device=device)
    total = None
    for layer in layers:
        for p, plane in enumerate(planes[layer - first_layer]):
            for kv, rows in kv_rows(plane, layout, p):
                got = rows.index_select(0, blocks)[:, local_heads[0]:local_heads[1]]
                if ratio > 1:
                    m, h, n, d = got.shape
                    got = got.reshape(m, h, ratio, n // ratio, d)[rows_of, :, unit]  # [items, heads, n_remote, d]
                part = region_sums(got, layer, kv, remote_heads)
                total = part if total is None else total + part
    return total.cpu().numpy().view(np.uint64)
