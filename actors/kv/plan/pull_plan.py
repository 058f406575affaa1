"""What a reader prepares once per remote engine so that a pull costs a lookup.

At handshake (`plan_stage`), for every remote pp rank (`StagePlan`) and every remote rank it reads
(`SourceRead`), the read plan's head slice, layers, block-size ratio or token shard is turned into
two `DescTable`s (ours and the peer's), both prepared with the transport once, plus the first
descriptor index of every (region pair, run). Invariant: nothing is planned per request; a request
only has its block ids checked (one vectorised min/max per side) and its descriptor indices
computed by numpy broadcasting (`SourceRead.indices`, which also counts the extents NIXL posts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.kv.plan.descriptors import DescTable, index_dtype, read_cuts, table_of
from actors.kv.transfer_errors import BlockRangeError
from actors.kv.handshake import RankHandshake
from actors.kv.plan.layout import BlockLayout, CacheGeometry
from actors.kv.plan.read_plan import ReadPlan, ReadSpec, plan_reads
from actors.kv.plan.topology import EngineTransferInfo, TransferTopology
from actors.kv.transport import PeerKey, TransportBase



@dataclass(frozen=True)
class SourceRead:
    """One remote rank's part of every pull from its engine, prepared at handshake."""

    key: PeerKey
    local: Any  # prepared local descriptor list
    remote: Any  # prepared remote descriptor list
    local_base: np.ndarray  # [regions, runs, 1] index of block 0 / unit 0, ours
    remote_base: np.ndarray  # the same in the peer's list
    local_units: int  # units per local block (block-size ratio, or token slots)
    remote_units: int
    token_shard: tuple[int, int, int, int] | None
    remote_num_blocks: int
    bytes_per_item: int  # bytes moved per remote block (or per token) over every region
    dtype: type
    # adjacent positions are adjacent bytes on both sides (one run tiling each unit), so NIXL
    # merges pairs adjacent in both caches into one extent
    merges: bool = False
    # what the lease confirmation needs to recompute this source's checksums (actors.kv.lease.confirm)
    local_heads: tuple[int, int] = (0, 1)
    remote_heads: tuple[int, int] = (0, 1)  # in the source's own head indices
    remote_head0: int = 0  # the source's first global head
    all_layers: tuple[int, ...] | None = None  # layers read, when they are every layer the source holds

    def indices(self, local_ids: np.ndarray, remote_ids: np.ndarray, num_tokens: int
                ) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(local indices, remote indices, bytes, spans) of one request; ids are already checked.

        Descriptor order is region-major, then run, then local block: a request's pairs are sorted
        by their local position, so every run of blocks adjacent in *both* caches sits next to each
        other in the READ in ascending order, whatever order the engine listed them in (vLLM hands
        out freed blocks in reverse), and NIXL merges each run into one extent. On one host every
        extent is one `process_vm_readv` call (docs/nixl_notes.md): fewer extents is what makes
        scattered pulls fast. `spans` is the number of extents NIXL posts once it merged neighbours.
        """
        if self.token_shard is None:
            ratio = self.local_units
            if remote_ids.size > local_ids.size * ratio:
                raise BlockRangeError(
                    f"{remote_ids.size} remote blocks do not fit in {local_ids.size} local blocks "
                    f"at block size ratio {ratio}"
                )
            item = np.arange(remote_ids.size)
            local_pos = local_ids[item // ratio] * ratio + item % ratio
            order = np.argsort(local_pos, kind="stable")  # runs adjacent in both caches: ascending
            local_pos, remote_pos = local_pos[order], remote_ids[order]
        else:
            r_size, r_rank, l_size, l_rank = self.token_shard
            tokens = np.arange(num_tokens)
            tokens = tokens[(tokens % r_size == r_rank) & (tokens % l_size == l_rank)]
            r_slot, l_slot = tokens // r_size, tokens // l_size
            r_blk, l_blk = r_slot // self.remote_units, l_slot // self.local_units
            if tokens.size and (r_blk[-1] >= remote_ids.size or l_blk[-1] >= local_ids.size):
                raise BlockRangeError(
                    f"{num_tokens} tokens need {int(r_blk[-1]) + 1} remote / {int(l_blk[-1]) + 1} local "
                    f"blocks, but {remote_ids.size} / {local_ids.size} were given"
                )
            remote_pos = remote_ids[r_blk] * self.remote_units + r_slot % self.remote_units
            local_pos = local_ids[l_blk] * self.local_units + l_slot % self.local_units
        li = (self.local_base + local_pos[None, None, :]).astype(self.dtype).ravel()
        ri = (self.remote_base + remote_pos[None, None, :]).astype(self.dtype).ravel()
        spans = li.size
        if self.merges and local_pos.size > 1:
            joined = int(np.count_nonzero((np.diff(local_pos) == 1) & (np.diff(remote_pos) == 1)))
            spans -= joined * self.local_base.shape[0] * self.local_base.shape[1]
        return li, ri, int(local_pos.size) * self.bytes_per_item, spans


@dataclass(frozen=True)
class StagePlan:
    """Everything read from, and said to, one remote pp rank."""

    pp_rank: int
    reads: tuple[SourceRead, ...]
    notify: tuple[PeerKey, ...]  # every rank told when we are done (replicas too)
    skipped: tuple[PeerKey, ...]  # replicas we do not read: told at once
    consumers: int  # readers each remote rank waits for
    # whole-block reads land in the remote axis order: permute these local layers after
    remote_layout: BlockLayout | None
    ratio: int
    transform_layers: tuple[int, ...]


@dataclass(frozen=True)
class PeerPlan:
    """One remote engine, as a reader of a given request shape sees it."""

    engine_id: str
    stages: tuple[StagePlan, ...]

    @property
    def remote_num_blocks(self) -> int:
        return min((src.remote_num_blocks for stage in self.stages for src in stage.reads), default=0)


def plan_stage(topology: TransferTopology, transport: TransportBase, local: CacheGeometry, engine_id: str,
               pp_rank: int, peers: dict[int, RankHandshake]) -> StagePlan:
    """One remote pp rank, from its ranks' handshakes to prepared lists: register the engine with the
    topology, plan its reads (`plan_reads`), prepare their descriptor lists (`build_stage`)."""
    first = next(iter(peers.values()))
    g = first.geometry
    layers = (g.first_layer, g.first_layer + g.num_layers) if first.pp_size > 1 else (0, 0)
    topology.register_remote_engine(engine_id, EngineTransferInfo(
        remote_tp_size=first.tp_size, remote_block_len=g.block_bytes, remote_block_size=first.block_size,
        remote_physical_blocks_per_logical=1, remote_pp_rank=pp_rank,
        start_layer=layers[0], end_layer=layers[1], remote_dcp_size=first.dcp_size,
    ))
    return build_stage(transport, local, plan_reads(topology, engine_id, pp_rank), peers)


def build_stage(transport: TransportBase, local: CacheGeometry, plan: ReadPlan, peers: dict[int, RankHandshake]) -> StagePlan:
    """Prepare every descriptor list one remote pp rank's reads need (handshake time)."""
    engine_id, pp_rank = plan.remote_engine_id, plan.remote_pp_rank
    reads, transform_layers = [], set()
    remote_layout, ratio = None, 1
    for spec in plan.reads:
        hs = peers[spec.remote_rank]
        remote = hs.geometry
        layers = _layer_pairs(spec, local, remote)
        if not layers:
            continue
        l_cut, r_cut = read_cuts(spec, local, remote)
        l_table, r_table = table_of(local, l_cut), table_of(remote, r_cut)
        planes = range(local.planes)
        l_regions = np.array([local.region_index(g, p) for g in layers for p in planes], dtype=np.int64)
        r_regions = np.array([remote.region_index(g, p) for g in layers for p in planes], dtype=np.int64)
        reads.append(SourceRead(
            key=hs.key,
            local=transport.local_list(l_table),
            remote=transport.remote_list(hs.key, r_table),
            local_base=l_table.region_run_base(l_regions),
            remote_base=r_table.region_run_base(r_regions),
            local_units=l_cut.units,
            remote_units=r_cut.units,
            token_shard=spec.token_shard,
            remote_num_blocks=remote.num_blocks,
            bytes_per_item=l_cut.bytes_per_unit * len(l_regions),
            dtype=index_dtype(max(len(l_table), len(r_table))),
            merges=spec.token_shard is None and l_cut.tiles and r_cut.tiles,
            local_heads=spec.local_heads, remote_heads=spec.remote_heads,
            remote_head0=spec.remote_head0,
            all_layers=tuple(layers) if layers == list(remote.layers) else None,
        ))
        if spec.token_shard is None:
            remote_layout, ratio = remote.layout, spec.block_size_ratio
            transform_layers.update(layers)
    if remote_layout == local.layout and ratio == 1:
        transform_layers.clear()  # bytes already sit where the local layout wants them
    read_ranks = {src.key[2] for src in reads}
    return StagePlan(
        pp_rank=pp_rank,
        reads=tuple(reads),
        notify=tuple((engine_id, pp_rank, r) for r in plan.notify_ranks),
        skipped=tuple((engine_id, pp_rank, r) for r in plan.notify_ranks if r not in read_ranks),
        consumers=plan.consumers_per_remote_rank,
        remote_layout=remote_layout,
        ratio=ratio,
        transform_layers=tuple(sorted(transform_layers)),
    )


def _layer_pairs(spec: ReadSpec, local: CacheGeometry, remote: CacheGeometry) -> list[int]:
    """Global layers both sides hold, limited to the read's layer range."""
    lo = max(local.first_layer, remote.first_layer)
    hi = min(local.first_layer + local.num_layers, remote.first_layer + remote.num_layers)
    if spec.layers is not None:
        lo, hi = max(lo, spec.layers[0]), min(hi, spec.layers[1])
    return list(range(lo, hi))
