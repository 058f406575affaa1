"""Can a prefill engine's KV be read by a decode engine? Decided from handshakes alone.

The coordinator calls `pair_problem` when an engine registers, so an
incompatible pair is refused with a reason up front and never routed.
"""

from __future__ import annotations

from actors.kv.transfer_errors import KVTransferError
from actors.kv.handshake import RankHandshake
from actors.kv.plan.layout import compatible_geometry
from actors.kv.plan.read_plan import plan_reads
from actors.kv.plan.topology import EngineTransferInfo, TransferTopology


def pair_problem(prefill: list[RankHandshake], decode: list[RankHandshake]) -> str | None:
    """None if every decode rank can plan reads from `prefill`; else the reason."""
    p0, d0 = prefill[0], decode[0]
    if p0.compat.compat_hash() != d0.compat.compat_hash():
        return "different model/cache: " + "; ".join(d0.compat.differences(p0.compat))
    try:
        for d in decode:
            compatible_geometry(d.geometry, p0.geometry)
            topology = TransferTopology(
                tp_rank=d.tp_rank, tp_size=d.tp_size, block_size=d.block_size,
                engine_id=d.engine_id, is_mla=d.compat.is_mla, is_mamba=False,
                total_num_kv_heads=d.compat.num_kv_heads, dcp_size=d.dcp_size,
            )
            for p in prefill:
                if p.tp_rank:
                    continue  # one rank per pp stage describes the stage
                layers = (p.geometry.first_layer, p.geometry.first_layer + p.geometry.num_layers)
                topology.register_remote_engine(p.engine_id, EngineTransferInfo(
                    remote_tp_size=p.tp_size, remote_block_len=p.geometry.block_bytes,
                    remote_block_size=p.block_size, remote_physical_blocks_per_logical=1,
                    remote_pp_rank=p.pp_rank,
                    start_layer=layers[0] if p.pp_size > 1 else 0,
                    end_layer=layers[1] if p.pp_size > 1 else 0,
                    remote_dcp_size=p.dcp_size,
                ))
                plan_reads(topology, p.engine_id, p.pp_rank)
    except (KVTransferError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
