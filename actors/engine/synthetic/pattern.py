"""The deterministic KV contents a synthetic prefill writes and a decode verifies.

value(seed, token id, position, layer, global head, kv, dim) is an integer
hash mapped to a float in [-1, 1) with 20 significant bits, so it is exact in
float32 and any misplaced or corrupted element is detected by equality.
"""

from __future__ import annotations

import torch

_MASK = (1 << 62) - 1
_BITS = 20


def _mix(x: torch.Tensor) -> torch.Tensor:
    # splitmix-style avalanche on int64 (overflow wraps, which is what we want)
    x = x & _MASK
    x = (x ^ (x >> 31)) * 0x5DEECE66D
    x = x & _MASK
    x = (x ^ (x >> 29)) * 0x2545F491
    x = x & _MASK
    return x ^ (x >> 32)


def kv_values(
    seed: int, token_ids: torch.Tensor, positions: torch.Tensor, layer: int,
    heads: torch.Tensor, kv: int, head_size: int,
) -> torch.Tensor:
    """Float32 values shaped [heads, tokens, head_size] for one layer and K or V."""
    dims = torch.arange(head_size, dtype=torch.int64)
    base = (seed * 1_000_003 + layer * 7_919 + kv * 104_729) & _MASK
    tok = (token_ids.to(torch.int64) * 2_654_435_761 + positions.to(torch.int64) * 40_503)
    x = (
        base
        + heads.to(torch.int64).view(-1, 1, 1) * 6_700_417
        + tok.view(1, -1, 1) * 97
        + dims.view(1, 1, -1) * 131_071
    )
    bits = _mix(x) & ((1 << _BITS) - 1)
    return (bits.to(torch.float32) - float(1 << (_BITS - 1))) / float(1 << (_BITS - 1))


def tokens_from_checksums(checksums: list[float], max_tokens: int, vocab_size: int) -> list[int]:
    """Output tokens derived from per-position KV checksums (decode 'generation')."""
    if not checksums:
        return []
    out = []
    for i in range(max_tokens):
        c = checksums[(len(checksums) - 1 - i) % len(checksums)]
        out.append(int(abs(c) * 1_000_003 + i * 7) % vocab_size)
    return out


def generate_tokens(checksums: list[float], skip: int, count: int, vocab_size: int) -> list[int]:
    """Tokens `skip` .. `skip + count` of the 'generation' from a prompt's KV checksums.

    Autoregressive in the only sense the synthetic model needs: a stream resumed
    after `skip` tokens (the prefill engine's first token, a migrated stream)
    continues exactly where the uninterrupted one would be.
    """
    return tokens_from_checksums(checksums, skip + count, vocab_size)[skip:]
