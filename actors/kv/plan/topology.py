"""Rank mapping between a local engine and the remote engines it reads KV from.

Every rank owns one `TransferTopology`. It answers from sizes alone whom to handshake with, whom
to read from, how many local readers each remote rank must hear from before it frees a request's
blocks, the block-size and TP ratios, and whether a cache is replicated; `plan.read_plan` turns
these answers into the reads that fill a rank. Semantics follow vLLM's class of the same name:
unknown engines raise `KeyError`; input errors are `TopologyError` (a `ValueError`) naming both
sides. Head ownership and DCP: `TransferTopology`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors.kv.transfer_errors import TopologyError

EngineId = str


@dataclass(frozen=True)
class EngineTransferInfo:
    """What a rank knows of one remote engine's pp rank, computed at handshake."""

    remote_tp_size: int
    remote_block_len: int  # bytes of one block of one layer (one plane)
    remote_block_size: int  # tokens per block
    remote_physical_blocks_per_logical: int
    remote_pp_rank: int = 0
    start_layer: int = 0  # first global layer owned by this pp rank
    end_layer: int = 0  # exclusive; 0 with start_layer 0 means "every layer"
    remote_dcp_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "remote_tp_size",
            "remote_block_size",
            "remote_physical_blocks_per_logical",
            "remote_dcp_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"remote engine {name} must be a positive int, got {value!r}")
        if self.remote_block_len < 0 or self.remote_pp_rank < 0 or self.start_layer < 0:
            raise TopologyError(
                "remote engine remote_block_len, remote_pp_rank and start_layer must be >= 0, got "
                f"{self.remote_block_len}, {self.remote_pp_rank}, {self.start_layer}"
            )
        if self.end_layer and self.end_layer <= self.start_layer:
            raise TopologyError(
                f"remote engine layer range [{self.start_layer}, {self.end_layer}) is empty"
            )
        if self.remote_dcp_size not in (1, self.remote_tp_size):
            raise TopologyError(
                f"remote dcp size {self.remote_dcp_size} must be 1 or the remote tp size "
                f"{self.remote_tp_size}"
            )

    @property
    def layers(self) -> tuple[int, int] | None:
        """Global layer range [start, end) of this pp rank, or None for every layer."""
        if self.start_layer == 0 and self.end_layer == 0:
            return None
        return (self.start_layer, self.end_layer)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name} must be a positive int, got {value!r}")


def rank_global_heads(rank: int, tp_size: int, num_kv_heads: int, is_mla: bool) -> tuple[int, int]:
    """Global kv heads [g0, g1) held by `rank` of an engine with `tp_size` ranks."""
    if is_mla:
        return (0, 1)
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return (rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return (head, head + 1)


def check_head_split(side: str, tp_size: int, num_kv_heads: int) -> None:
    """Heads must split evenly over ranks, or ranks evenly over heads."""
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise TopologyError(f"{side} tp size {tp_size} does not divide its {num_kv_heads} kv heads")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise TopologyError(
            f"{side} tp size {tp_size} is not a multiple of its {num_kv_heads} kv heads"
        )


@dataclass
class TransferTopology:
    """Single source of truth for local TP identity and per-engine remote info.

    `attn_backends` and `tensor_shape` are carried for parity with vLLM's
    class (opaque here: this package imports no vLLM).

    Head ownership. A non-MLA cache with K kv heads split over `tp` ranks gives
    rank r the global heads [r*K/tp, (r+1)*K/tp) when tp <= K, and the single
    head r // (tp/K) when tp > K (the cache is then replicated in groups). MLA
    keeps one latent "head" that every rank holds.

    Decode context parallelism (DCP, MLA only here) shards tokens: with dcp size d
    the rank of dcp rank j holds the tokens t with t % d == j. raypd supports
    dcp in {1, tp} on either side with sizes dividing one another, as vLLM does.

    Semantics follow the customer's reference (vLLM's class of the same name):
    unknown engines raise `KeyError`; an MLA topology accepts any
    `total_num_kv_heads` (the checkpoint's head count; the cache has one latent
    head). Input errors are `TopologyError` (a `ValueError`) naming both sides.
    """

    tp_rank: int
    tp_size: int
    block_size: int
    engine_id: EngineId
    is_mla: bool
    is_mamba: bool
    total_num_kv_heads: int
    attn_backends: list[Any] = field(default_factory=list)
    dcp_size: int = 1
    tensor_shape: Any = None

    def __post_init__(self) -> None:
        _check_positive("local tp size", self.tp_size)
        _check_positive("local block size", self.block_size)
        _check_positive("local total kv heads", self.total_num_kv_heads)
        _check_positive("local dcp size", self.dcp_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise TopologyError(f"local tp rank {self.tp_rank} outside [0, {self.tp_size})")
        if self.dcp_size not in (1, self.tp_size):
            raise TopologyError(
                f"local dcp size {self.dcp_size} must be 1 or the local tp size {self.tp_size}"
            )
        if self.dcp_size > 1 and not self.is_mla:
            raise TopologyError("decode context parallelism (dcp > 1) is supported for MLA only")
        if not self.is_mla:
            # An MLA cache is one latent head whatever the checkpoint's head count says.
            check_head_split("local", self.tp_size, self.total_num_kv_heads)
        self.local_physical_heads = max(1, self.total_num_kv_heads // self.tp_size)
        self._engines: dict[tuple[EngineId, int], EngineTransferInfo] = {}

    # ---------------------------------------------------------------- registry

    def register_remote_engine(
        self, remote_engine_id: EngineId, info: EngineTransferInfo
    ) -> EngineTransferInfo:
        """Store `info` under (engine, pp rank); a second call returns the first info.

        raypd addition: an unmappable pair is refused here (typed error) instead
        of failing later in the middle of a request.
        """
        if remote_engine_id == self.engine_id:
            raise TopologyError(
                f"Cannot register local engine {self.engine_id!r} as remote. "
                "Local identity is set via __init__ params."
            )
        key = (remote_engine_id, info.remote_pp_rank)
        stored = self._engines.get(key)
        if stored is not None:
            return stored
        self.tp_ratio(info.remote_tp_size)
        self.block_size_ratio(info.remote_block_size)
        self._check_dcp_pair(info.remote_tp_size, info.remote_dcp_size)
        if not self.is_mla:
            check_head_split("remote", info.remote_tp_size, self.total_num_kv_heads)
        self._engines[key] = info
        return info

    def get_engine_info(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> EngineTransferInfo:
        """Raises KeyError for an engine (pp rank) that is not registered."""
        return self._engines[(remote_engine_id, remote_pp_rank)]

    def unregister_remote_engine(self, remote_engine_id: EngineId) -> None:
        """Forget every pp rank of a remote engine."""
        for key in [k for k in self._engines if k[0] == remote_engine_id]:
            del self._engines[key]

    # ------------------------------------------------------------ size ratios

    @property
    def dcp_rank(self) -> int:
        """This rank's DCP coverage rank (dcp size is 1 or the tp size)."""
        return self.tp_rank % self.dcp_size

    def tp_ratio(self, remote_tp_size: int) -> int:
        """local/remote when local >= remote, else -(remote/local)."""
        _check_positive("remote tp size", remote_tp_size)
        if self.tp_size >= remote_tp_size:
            if self.tp_size % remote_tp_size:
                raise TopologyError(
                    f"Local tensor parallel size {self.tp_size} is not divisible "
                    f"by remote tensor parallel size {remote_tp_size}."
                )
            return self.tp_size // remote_tp_size
        if remote_tp_size % self.tp_size:
            raise TopologyError(
                f"Remote tensor parallel size {remote_tp_size} is not divisible "
                f"by local tensor parallel size {self.tp_size}."
            )
        return -(remote_tp_size // self.tp_size)

    def block_size_ratio(self, remote_block_size: int) -> int:
        """How many remote blocks make one local block (local >= remote only)."""
        _check_positive("remote block size", remote_block_size)
        if self.block_size % remote_block_size:
            raise TopologyError(
                f"Local block size {self.block_size} is not divisible "
                f"by remote block size {remote_block_size} or vice versa."
            )
        return self.block_size // remote_block_size

    def is_kv_replicated(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        """The remote has more TP ranks than kv heads, so ranks hold copies."""
        info = self._engines[(remote_engine_id, remote_pp_rank)]
        return info.remote_tp_size > self.total_num_kv_heads

    def replicates_kv_cache(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> bool:
        # MLA's latent vector cannot be split across ranks: always replicated.
        return self.is_mla or self.is_kv_replicated(remote_engine_id, remote_pp_rank)

    @property
    def local_replicates_kv_cache(self) -> bool:
        return self.is_mla or self.tp_size > self.total_num_kv_heads

    # -------------------------------------------------------------- rank maps

    def _check_dcp_pair(self, remote_tp_size: int, remote_dcp_size: int) -> None:
        _check_positive("remote dcp size", remote_dcp_size)
        if remote_dcp_size not in (1, remote_tp_size):
            raise TopologyError(
                f"remote dcp size {remote_dcp_size} must be 1 or the remote tp size "
                f"{remote_tp_size} (local dcp size {self.dcp_size})"
            )
        big, small = max(self.dcp_size, remote_dcp_size), min(self.dcp_size, remote_dcp_size)
        if big % small:
            raise TopologyError(
                f"local dcp size {self.dcp_size} and remote dcp size {remote_dcp_size} "
                "must divide one another"
            )
        if remote_dcp_size > 1 and not self.is_mla:
            raise TopologyError(
                f"remote dcp size {remote_dcp_size} > 1 needs an MLA cache; local is not MLA"
            )

    def dcp_source_ranks(self, remote_tp_size: int, remote_dcp_size: int) -> list[int]:
        """Remote ranks whose DCP slice overlaps mine (MLA, remote_dcp_size > 1)."""
        self._check_dcp_pair(remote_tp_size, remote_dcp_size)
        if self.dcp_size <= remote_dcp_size:
            # Every remote shard that sits inside mine (all of them when local dcp is 1).
            return [r for r in range(remote_tp_size) if r % self.dcp_size == self.dcp_rank]
        # Local shards are finer: exactly one remote shard covers mine.
        return [self.dcp_rank % remote_dcp_size]

    def _tp_targets(self, remote_tp_size: int) -> list[int]:
        ratio = self.tp_ratio(remote_tp_size)
        if ratio > 0:
            return [self.tp_rank // ratio]
        return [self.tp_rank * -ratio + i for i in range(-ratio)]

    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int = 1) -> list[int]:
        """Remote ranks to fetch handshake metadata from; sizes alone decide."""
        if remote_dcp_size > 1:
            return self.dcp_source_ranks(remote_tp_size, remote_dcp_size)
        self._check_dcp_pair(remote_tp_size, remote_dcp_size)
        return self._tp_targets(remote_tp_size)

    def dcp_consumer_count(self, remote_tp_size: int, remote_dcp_size: int) -> int:
        """How many local ranks read (and notify) each remote rank they target."""
        self._check_dcp_pair(remote_tp_size, remote_dcp_size)
        if remote_dcp_size > 1:
            if self.dcp_size == 1:
                return self.tp_size  # replicated locally: every local rank reads every shard
            return max(1, self.dcp_size // remote_dcp_size)
        return max(1, self.tp_ratio(remote_tp_size))

    def target_remote_ranks(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> list[int]:
        """Remote TP ranks this rank reads from for a registered engine (KeyError if unknown)."""
        info = self._engines[(remote_engine_id, remote_pp_rank)]
        return self._tp_targets(info.remote_tp_size)

    def describe(self, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> str:
        """One-line summary of the transfer config for logging (KeyError if unknown)."""
        info = self._engines[(remote_engine_id, remote_pp_rank)]
        return (
            f"TransferTopology("
            f"tp_ratio={self.tp_ratio(info.remote_tp_size)}, "
            f"num_kv_heads={self.total_num_kv_heads if not self.is_mla else 1}, "
            f"local_tp={self.tp_size}, "
            f"remote_tp={info.remote_tp_size}, "
            f"remote_pp={remote_pp_rank}, "
            f"local_dcp={self.dcp_size}, "
            f"remote_dcp={info.remote_dcp_size}, "
            f"local_rank={self.tp_rank}, "
            f"remote_block_len={info.remote_block_len})"
        )


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Global layers [start, end) of one pipeline stage; earlier stages take the remainder."""
    _check_positive("pp size", pp_size)
    if not 0 <= pp_rank < pp_size:
        raise TopologyError(f"pp rank {pp_rank} outside [0, {pp_size})")
    if num_layers < pp_size:
        raise TopologyError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
