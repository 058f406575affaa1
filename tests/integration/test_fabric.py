"""Real KV bytes between real Ray actors over real NIXL, for every supported topology.

Each case: prefill ranks write deterministic KV, decode ranks pull it with
their read plans, confirm every source's lease and check its checksums
(`verify: all`, which must never flag a clean pull), every element is
verified, the output equals a colocated engine's, every prefill rank hears
exactly its readers and frees its blocks, and nothing stays registered with
NIXL after shutdown.
"""

import asyncio
import itertools

import pytest

from actors.transfer_params import TransferParams
from actors.engine.synthetic.engine import EngineShape, SyntheticEngine
from actors.engine.synthetic.rank import SyntheticModel

PROMPT = list(range(1000, 1000 + 45))  # 45 tokens: partial blocks at every block size used

_ids = itertools.count()

# (name, model kwargs, prefill shape, decode shape)
CASES = [
    ("tp1-tp1", dict(num_kv_heads=4), EngineShape(1), EngineShape(1)),
    ("tp1-tp2", dict(num_kv_heads=4), EngineShape(1), EngineShape(2)),
    ("tp2-tp1", dict(num_kv_heads=4), EngineShape(2), EngineShape(1)),
    ("tp2-tp4", dict(num_kv_heads=4), EngineShape(2), EngineShape(4)),
    ("tp4-tp2", dict(num_kv_heads=4), EngineShape(4), EngineShape(2)),
    ("tp4-tp1", dict(num_kv_heads=4), EngineShape(4), EngineShape(1)),
    ("gqa-replicated-P", dict(num_kv_heads=2), EngineShape(4), EngineShape(1)),
    ("gqa-replicated-D", dict(num_kv_heads=2), EngineShape(1), EngineShape(4)),
    ("mla-dcp1-dcp1", dict(num_kv_heads=1, is_mla=True), EngineShape(2, layout="ND"), EngineShape(1, layout="ND")),
    ("mla-Pdcp2-Ddcp1", dict(num_kv_heads=1, is_mla=True), EngineShape(2, dcp_size=2, layout="ND"), EngineShape(2, layout="ND")),
    ("mla-Pdcp1-Ddcp2", dict(num_kv_heads=1, is_mla=True), EngineShape(1, layout="ND"), EngineShape(2, dcp_size=2, layout="ND")),
    ("mla-Pdcp2-Ddcp2", dict(num_kv_heads=1, is_mla=True), EngineShape(2, dcp_size=2, layout="ND"), EngineShape(2, dcp_size=2, layout="ND")),
    ("pp2-pp1", dict(num_kv_heads=4), EngineShape(1, pp_size=2), EngineShape(1)),
    ("pp2tp2-tp1", dict(num_kv_heads=4), EngineShape(2, pp_size=2), EngineShape(1)),
    ("block-ratio-2", dict(num_kv_heads=4), EngineShape(1, block_size=8), EngineShape(1, block_size=16)),
    ("block-ratio-4", dict(num_kv_heads=4), EngineShape(2, block_size=4), EngineShape(1, block_size=16)),
    ("hnd-nhd", dict(num_kv_heads=4), EngineShape(1, layout="HND"), EngineShape(2, layout="NHD")),
    ("nhd-hnd", dict(num_kv_heads=4), EngineShape(2, layout="NHD"), EngineShape(1, layout="HND")),
    ("nhd-hnd-ratio-2", dict(num_kv_heads=4), EngineShape(1, block_size=8, layout="NHD"), EngineShape(1, block_size=16, layout="HND")),
    ("cpu-packed", dict(num_kv_heads=4), EngineShape(2, layout="HCND"), EngineShape(1, layout="HCND")),
]


async def run_case(coordinator, model, p_shape, d_shape):
    n = next(_ids)
    p = SyntheticEngine(f"P{n}", "prefill", model, p_shape, coordinator, verify="all")
    d = SyntheticEngine(f"D{n}", "decode", model, d_shape, coordinator, verify="all")
    ref = SyntheticEngine(f"C{n}", "both", model, d_shape)  # colocated, not registered
    try:
        await asyncio.gather(p.start(), d.start(), ref.start())
        assert await coordinator.pair_verdict.remote(p.engine_id, d.engine_id) is None
        params = await p.prefill("req-1", PROMPT, seed=3)
        out = await d.decode("req-1", TransferParams.parse(params), PROMPT, seed=3, max_tokens=8)
        await p.wait_released("req-1", timeout_s=10)
        want = await ref.generate_local("c", PROMPT, seed=3, max_tokens=8)
        p_stats, d_stats = await p.rank_stats(), await d.rank_stats()
        return out, want, p, d, p_stats, d_stats
    finally:
        closing = [await e.shutdown() for e in (p, d, ref)]
        for stats in closing:
            assert all(s["registered_regions"] == 0 for s in stats), stats
            assert all(s["transport_in_flight"] == 0 and s["peers"] == 0 for s in stats), stats


@pytest.mark.parametrize("name, model_kwargs, p_shape, d_shape", CASES, ids=[c[0] for c in CASES])
def test_fabric(coordinator, name, model_kwargs, p_shape, d_shape):
    # one model id per case: the coordinator refuses one model id under two shapes
    model = SyntheticModel(model_id=f"fabric-{name}", num_layers=4, head_size=32, **model_kwargs)
    out, want, p, d, p_stats, d_stats = asyncio.run(run_case(coordinator, model, p_shape, d_shape))
    assert out["mismatches"] == 0
    assert out["checksums"] == want["checksums"] and out["token_ids"] == want["token_ids"]
    assert p.pool.num_free == p.pool.num_blocks and d.pool.num_free == d.pool.num_blocks
    for s in p_stats:  # every prefill rank heard exactly its readers, then freed
        assert s["leases"]["held"] == 0 and s["leases"]["released_by_readers"] == 1, s
        assert s["leases"]["expired"] == 0 and s["leases"]["unknown_notifications"] == 0, s
    assert sum(s["bytes_posted"] for s in d_stats) > 0
    assert all(s["integrity"]["mismatched_pulls"] == 0 for s in d_stats), d_stats
    token_sharded = name in ("mla-Pdcp2-Ddcp1", "mla-Pdcp1-Ddcp2")  # per-block checksums do not apply
    assert token_sharded or sum(s["integrity"]["checked_blocks"] for s in d_stats) > 0, d_stats
