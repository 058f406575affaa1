"""The reads that fill one local rank's KV cache from one remote pp rank.

`plan_reads` turns a `TransferTopology` and a registered remote engine into a
`ReadPlan`: for every remote rank read, which of its heads land on which local
heads, which layers (pipeline parallelism), the block-size ratio and, for
token-sharded (DCP) MLA caches, which tokens. Every local head (or token) is
filled exactly once; replicas that hold the same heads are only notified, so
each producer rank still hears from all of its `dcp_consumer_count` readers.
Computed once per (remote engine, pp rank) at handshake; requests reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.kv.transfer_errors import TopologyError
from actors.kv.plan.topology import EngineId, EngineTransferInfo, TransferTopology, rank_global_heads


@dataclass(frozen=True)
class ReadSpec:
    """One remote rank's contribution to this rank's KV cache.

    Heads are in each rank's own index space (0 = the first head that rank
    holds). `token_shard` is None when whole blocks are copied; otherwise the
    read is token by token: remote (dcp_size, dcp_rank), local (dcp_size,
    dcp_rank), and only tokens held by both move.
    """

    remote_rank: int
    remote_heads: tuple[int, int]
    local_heads: tuple[int, int]
    layers: tuple[int, int] | None
    block_size_ratio: int
    token_shard: tuple[int, int, int, int] | None = None
    remote_head0: int = 0  # the remote rank's first global head (its checksums are keyed by it)


@dataclass(frozen=True)
class ReadPlan:
    """Everything one local rank does to pull a request's KV from one remote pp rank."""

    remote_engine_id: EngineId
    remote_pp_rank: int
    reads: tuple[ReadSpec, ...]
    # Every handshake target, including replicas we skip, so each producer rank
    # hears from all its readers.
    notify_ranks: tuple[int, ...]
    # How many local ranks notify each of those remote ranks (what they wait for).
    consumers_per_remote_rank: int


def plan_reads(topology: TransferTopology, remote_engine_id: EngineId, remote_pp_rank: int = 0) -> ReadPlan:
    """The reads that fill each local head of this rank exactly once (KeyError if unregistered)."""
    t = topology
    info = t.get_engine_info(remote_engine_id, remote_pp_rank)
    targets = t.handshake_target_ranks(info.remote_tp_size, info.remote_dcp_size)
    ratio = t.block_size_ratio(info.remote_block_size)
    consumers = t.dcp_consumer_count(info.remote_tp_size, info.remote_dcp_size)
    if t.is_mla and (info.remote_dcp_size > 1 or t.dcp_size > 1):
        reads = _dcp_reads(t, info, targets, ratio)
    else:
        reads = _head_reads(t, info, targets, ratio)
    return ReadPlan(
        remote_engine_id=remote_engine_id,
        remote_pp_rank=remote_pp_rank,
        reads=tuple(reads),
        notify_ranks=tuple(targets),
        consumers_per_remote_rank=consumers,
    )


def _head_reads(t: TransferTopology, info: EngineTransferInfo, targets: list[int], ratio: int) -> list[ReadSpec]:
    heads = t.total_num_kv_heads
    local_g0, local_g1 = rank_global_heads(t.tp_rank, t.tp_size, heads, t.is_mla)
    covered: set[int] = set()
    reads: list[ReadSpec] = []
    for remote_rank in targets:
        rem_g0, rem_g1 = rank_global_heads(remote_rank, info.remote_tp_size, heads, t.is_mla)
        new = [g for g in range(max(local_g0, rem_g0), min(local_g1, rem_g1)) if g not in covered]
        if not new:
            continue  # a replica of heads we already read: notify only
        lo, hi = new[0], new[-1] + 1
        covered.update(new)
        reads.append(ReadSpec(
            remote_rank=remote_rank,
            remote_heads=(lo - rem_g0, hi - rem_g0),
            local_heads=(lo - local_g0, hi - local_g0),
            layers=info.layers,
            block_size_ratio=ratio,
            remote_head0=rem_g0,
        ))
    missing = set(range(local_g0, local_g1)) - covered
    if missing:  # only reachable through an inconsistent size pair
        raise TopologyError(
            f"local rank {t.tp_rank} heads {sorted(missing)} are held by none of remote "
            f"ranks {targets} (remote tp {info.remote_tp_size})"
        )
    return reads


def _dcp_reads(t: TransferTopology, info: EngineTransferInfo, targets: list[int], ratio: int) -> list[ReadSpec]:
    remote_dcp = info.remote_dcp_size
    if remote_dcp == t.dcp_size:
        # Same sharding on both sides (dcp == tp on both): one shard, whole blocks.
        sources = [r for r in targets if r % remote_dcp == t.dcp_rank][:1]
        token_shard = False
    elif remote_dcp > 1:
        sources = targets  # each remote shard overlapping mine (already filtered)
        token_shard = True
    else:
        sources = targets[:1]  # remote replicated: any one rank holds every token
        token_shard = True
    return [
        ReadSpec(
            remote_rank=r,
            remote_heads=(0, 1),
            local_heads=(0, 1),
            layers=info.layers,
            block_size_ratio=ratio,
            token_shard=(remote_dcp, r % remote_dcp, t.dcp_size, t.dcp_rank) if token_shard else None,
            remote_head0=rank_global_heads(r, info.remote_tp_size, t.total_num_kv_heads, t.is_mla)[0],
        )
        for r in sources
    ]
