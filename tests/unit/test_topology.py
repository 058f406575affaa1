"""TransferTopology and read plans: each method against hand-worked cases, then properties."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.transfer_errors import TopologyError
from actors.kv.plan.read_plan import plan_reads
from actors.kv.plan.topology import (
    EngineTransferInfo,
    TransferTopology,
    rank_global_heads,
)


def topo(tp_rank=0, tp_size=1, heads=8, mla=False, dcp=1, block_size=16, engine="local"):
    # MLA with the checkpoint's head count, as vLLM builds it (the cache has one latent head)
    return TransferTopology(
        tp_rank=tp_rank, tp_size=tp_size, block_size=block_size, engine_id=engine,
        is_mla=mla, is_mamba=False, total_num_kv_heads=heads, dcp_size=dcp,
    )


def info(tp=1, block_size=16, pp_rank=0, start=0, end=0, dcp=1):
    return EngineTransferInfo(
        remote_tp_size=tp, remote_block_len=4096, remote_block_size=block_size,
        remote_physical_blocks_per_logical=1, remote_pp_rank=pp_rank,
        start_layer=start, end_layer=end, remote_dcp_size=dcp,
    )


# ------------------------------------------------------------------ registry


def test_register_is_idempotent_and_keyed_by_pp_rank():
    t = topo()
    first = t.register_remote_engine("p", info(tp=2, pp_rank=0))
    again = t.register_remote_engine("p", info(tp=4, pp_rank=0))
    assert again is first and t.get_engine_info("p").remote_tp_size == 2
    t.register_remote_engine("p", info(tp=2, pp_rank=1, start=2, end=4))
    assert t.get_engine_info("p", remote_pp_rank=1).layers == (2, 4)
    t.unregister_remote_engine("p")  # every pp rank goes
    for pp_rank in (0, 1):
        with pytest.raises(KeyError):
            t.get_engine_info("p", pp_rank)


def test_unknown_engine_lookups_raise_key_error():
    t = topo(tp_size=2, heads=8)
    t.register_remote_engine("p", info(tp=2))
    for lookup in (t.get_engine_info, t.target_remote_ranks, t.describe, t.is_kv_replicated,
                   t.replicates_kv_cache):
        with pytest.raises(KeyError):
            lookup("nobody")
        with pytest.raises(KeyError):
            lookup("p", 1)  # known engine, unknown pp rank
    with pytest.raises(KeyError):
        plan_reads(t, "nobody")
    # MLA is replicated whatever the engine: the reference answers without a lookup
    assert topo(mla=True, heads=8).replicates_kv_cache("nobody") is True


def test_register_refuses_local_engine_and_bad_pairs():
    t = topo(tp_size=2, heads=8)
    with pytest.raises(TopologyError, match="Cannot register local engine 'local' as remote"):
        t.register_remote_engine("local", info())
    with pytest.raises(TopologyError, match="Remote tensor parallel size 3 is not divisible by local tensor"):
        t.register_remote_engine("p", info(tp=3))
    with pytest.raises(TopologyError, match="Local block size 16 is not divisible by remote block size 32"):
        t.register_remote_engine("p", info(block_size=32))
    with pytest.raises(KeyError):
        t.get_engine_info("p")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp_rank=2, tp_size=2), "tp rank 2 outside"),
        (dict(tp_size=0), "tp size must be a positive int"),
        (dict(tp_size=2, dcp=3, mla=True, heads=1), "dcp size 3 must be 1 or the local tp size 2"),
        (dict(tp_size=2, dcp=2), "MLA only"),
        (dict(tp_size=3, heads=8), "local tp size 3 does not divide its 8 kv heads"),
        (dict(tp_size=12, heads=8), "not a multiple of its 8 kv heads"),
    ],
)
def test_invalid_local_topology(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        topo(**kwargs)


def test_invalid_remote_info():
    with pytest.raises(TopologyError, match="remote_tp_size must be a positive int"):
        info(tp=0)
    with pytest.raises(TopologyError, match="remote dcp size 2 must be 1 or the remote tp size 4"):
        info(tp=4, dcp=2)
    with pytest.raises(TopologyError, match="is empty"):
        info(start=4, end=2)
    with pytest.raises(ValueError):  # TopologyError is a ValueError
        info(block_size=-1)


# ------------------------------------------------------------------- ratios


def test_mla_accepts_any_head_count():
    for heads in (1, 3, 16, 128):  # DeepSeek-V3's checkpoint says 128
        for tp in (1, 2, 4):
            t = topo(tp_rank=tp - 1, tp_size=tp, heads=heads, mla=True)
            assert t.local_physical_heads == max(1, heads // tp)  # the reference's arithmetic
            assert t.local_replicates_kv_cache
            t.register_remote_engine("p", info(tp=4))
            assert t.replicates_kv_cache("p") and t.is_kv_replicated("p") == (4 > heads)
            assert "num_kv_heads=1," in t.describe("p")
            (spec,) = plan_reads(t, "p").reads  # one latent head: read one replica
            assert spec.remote_heads == spec.local_heads == (0, 1)
    with pytest.raises(TopologyError, match="does not divide its 3 kv heads"):
        topo(tp_size=2, heads=3, mla=False)  # a split GQA cache still needs an even split


def test_tp_ratio_sign_and_errors():
    assert topo(tp_size=4).tp_ratio(2) == 2
    assert topo(tp_size=2).tp_ratio(2) == 1
    assert topo(tp_size=2).tp_ratio(8) == -4
    with pytest.raises(TopologyError, match="Local tensor parallel size 4 is not divisible by remote tensor "
                                            "parallel size 3"):
        topo(tp_size=4).tp_ratio(3)


def test_block_size_ratio():
    assert topo(block_size=64).block_size_ratio(16) == 4
    assert topo(block_size=16).block_size_ratio(16) == 1
    with pytest.raises(TopologyError, match="Local block size 64 is not divisible by remote block size 24"):
        topo(block_size=64).block_size_ratio(24)


def test_replication_flags():
    t = topo(tp_size=2, heads=2)
    t.register_remote_engine("p4", info(tp=4))
    t.register_remote_engine("p2", info(tp=2))
    assert t.is_kv_replicated("p4") and t.replicates_kv_cache("p4")
    assert not t.is_kv_replicated("p2") and not t.replicates_kv_cache("p2")
    assert not t.local_replicates_kv_cache
    assert topo(tp_size=4, heads=2).local_replicates_kv_cache
    m = topo(mla=True, tp_size=2)
    m.register_remote_engine("p", info(tp=2))
    assert m.replicates_kv_cache("p") and m.local_replicates_kv_cache


def test_dcp_rank():
    assert [topo(tp_rank=r, tp_size=4, mla=True, dcp=4).dcp_rank for r in range(4)] == [0, 1, 2, 3]
    assert topo(tp_rank=3, tp_size=4, mla=True, dcp=1).dcp_rank == 0


# --------------------------------------------------------------- rank maps


def test_handshake_targets_tp():
    assert topo(tp_rank=3, tp_size=4).handshake_target_ranks(2) == [1]
    assert topo(tp_rank=1, tp_size=2).handshake_target_ranks(8) == [4, 5, 6, 7]


def test_dcp_source_ranks():
    # local replicated (dcp 1) reads every remote shard
    assert topo(tp_size=2, mla=True).dcp_source_ranks(4, 4) == [0, 1, 2, 3]
    # local dcp 2 coarser than remote dcp 4: shards whose rank % 2 == mine
    assert topo(tp_rank=1, tp_size=2, mla=True, dcp=2).dcp_source_ranks(4, 4) == [1, 3]
    # local dcp 4 finer than remote dcp 2: the one shard covering mine
    assert topo(tp_rank=3, tp_size=4, mla=True, dcp=4).dcp_source_ranks(2, 2) == [1]
    with pytest.raises(TopologyError, match="local dcp size 2 and remote dcp size 3"):
        topo(tp_size=2, mla=True, dcp=2).dcp_source_ranks(3, 3)


def test_dcp_consumer_count():
    assert topo(tp_size=4).dcp_consumer_count(2, 1) == 2
    assert topo(tp_size=2).dcp_consumer_count(4, 1) == 1
    assert topo(tp_size=2, mla=True).dcp_consumer_count(4, 4) == 2
    assert topo(tp_size=4, mla=True, dcp=4).dcp_consumer_count(2, 2) == 2
    assert topo(tp_size=2, mla=True, dcp=2).dcp_consumer_count(4, 4) == 1


def test_target_remote_ranks_and_describe():
    t = topo(tp_rank=1, tp_size=2, heads=8)
    t.register_remote_engine("p", info(tp=4))
    assert t.target_remote_ranks("p") == [2, 3]
    assert t.describe("p") == (
        "TransferTopology(tp_ratio=-2, num_kv_heads=8, local_tp=2, remote_tp=4, remote_pp=0, "
        "local_dcp=1, remote_dcp=1, local_rank=1, remote_block_len=4096)"
    )


# ---------------------------------------------------------------- read plan


def test_read_plan_head_sub_slice():
    t = topo(tp_rank=3, tp_size=4, heads=8)
    t.register_remote_engine("p", info(tp=2, block_size=8))
    plan = plan_reads(t, "p")
    (spec,) = plan.reads
    assert (spec.remote_rank, spec.remote_heads, spec.local_heads) == (1, (2, 4), (0, 2))
    assert spec.block_size_ratio == 2 and plan.notify_ranks == (1,) and plan.consumers_per_remote_rank == 2


def test_read_plan_concatenates_remote_ranks():
    t = topo(tp_rank=0, tp_size=1, heads=4)
    t.register_remote_engine("p", info(tp=4))
    plan = plan_reads(t, "p")
    assert [(s.remote_rank, s.remote_heads, s.local_heads) for s in plan.reads] == [
        (0, (0, 1), (0, 1)), (1, (0, 1), (1, 2)), (2, (0, 1), (2, 3)), (3, (0, 1), (3, 4))
    ]


def test_read_plan_skips_replicas_but_notifies_them():
    t = topo(tp_rank=0, tp_size=1, heads=2)
    t.register_remote_engine("p", info(tp=4))  # remote ranks hold heads 0,0,1,1
    plan = plan_reads(t, "p")
    assert [s.remote_rank for s in plan.reads] == [0, 2]
    assert plan.notify_ranks == (0, 1, 2, 3)


def test_read_plan_mla_reads_one_replica():
    t = topo(tp_rank=0, tp_size=1, mla=True)
    t.register_remote_engine("p", info(tp=4))
    plan = plan_reads(t, "p")
    assert [s.remote_rank for s in plan.reads] == [0] and plan.notify_ranks == (0, 1, 2, 3)


def test_read_plan_pp_layer_ranges():
    t = topo()
    t.register_remote_engine("p", info(pp_rank=0, start=0, end=3))
    t.register_remote_engine("p", info(pp_rank=1, start=3, end=6))
    assert plan_reads(t, "p", 0).reads[0].layers == (0, 3)
    assert plan_reads(t, "p", 1).reads[0].layers == (3, 6)
    assert plan_reads(t, "p", 1).remote_pp_rank == 1


def test_read_plan_dcp_token_shards():
    t = topo(tp_rank=1, tp_size=2, mla=True, dcp=1)
    t.register_remote_engine("p", info(tp=2, dcp=2))
    plan = plan_reads(t, "p")
    assert [s.token_shard for s in plan.reads] == [(2, 0, 1, 0), (2, 1, 1, 0)]
    same = topo(tp_rank=1, tp_size=2, mla=True, dcp=2)
    same.register_remote_engine("p", info(tp=2, dcp=2))
    (spec,) = plan_reads(same, "p").reads
    assert spec.remote_rank == 1 and spec.token_shard is None


# --------------------------------------------------------------- properties

sizes = st.sampled_from([1, 2, 4, 8])


@st.composite
def pairings(draw):
    mla = draw(st.booleans())
    heads = draw(st.sampled_from([1, 2, 4, 8] + ([3, 16, 128] if mla else [])))
    local_tp, remote_tp = draw(sizes), draw(sizes)
    local_dcp = draw(st.sampled_from([1, local_tp])) if mla else 1
    remote_dcp = draw(st.sampled_from([1, remote_tp])) if mla else 1
    pp = draw(st.sampled_from([1, 2, 3]))
    return mla, heads, local_tp, remote_tp, local_dcp, remote_dcp, pp


def _build(mla, heads, local_tp, remote_tp, local_dcp, remote_dcp, pp):
    ranks = []
    for r in range(local_tp):
        t = topo(tp_rank=r, tp_size=local_tp, heads=heads, mla=mla, dcp=local_dcp)
        for p in range(pp):
            t.register_remote_engine("p", info(tp=remote_tp, pp_rank=p, dcp=remote_dcp,
                                                start=2 * p if pp > 1 else 0,
                                                end=2 * p + 2 if pp > 1 else 0))
        ranks.append(t)
    return ranks


@settings(max_examples=400, deadline=None)
@given(pairings())
def test_every_local_head_and_token_filled_exactly_once(case):
    mla, heads, local_tp, remote_tp, local_dcp, remote_dcp, pp = case
    for t in _build(*case):
        local_g0, local_g1 = rank_global_heads(t.tp_rank, local_tp, heads, mla)
        for p in range(pp):
            plan = plan_reads(t, "p", p)
            assert plan.reads, "a rank must read something"
            if any(s.token_shard for s in plan.reads):
                # every token this rank holds comes from exactly one remote shard
                for tok in range(64):
                    if tok % local_dcp != t.dcp_rank:
                        continue
                    hits = [s for s in plan.reads if tok % s.token_shard[0] == s.token_shard[1]]
                    assert len(hits) == 1, (tok, plan)
                continue
            filled = Counter()
            for s in plan.reads:
                rem_g0, _ = rank_global_heads(s.remote_rank, remote_tp, heads, mla)
                assert s.remote_heads[1] - s.remote_heads[0] == s.local_heads[1] - s.local_heads[0]
                for off in range(s.local_heads[1] - s.local_heads[0]):
                    g_local = local_g0 + s.local_heads[0] + off
                    g_remote = rem_g0 + s.remote_heads[0] + off
                    assert g_local == g_remote, "a local head got another head's data"
                    filled[g_local] += 1
            assert filled == Counter(range(local_g0, local_g1))


@settings(max_examples=400, deadline=None)
@given(pairings())
def test_readers_per_remote_rank_match_consumer_count(case):
    mla, heads, local_tp, remote_tp, local_dcp, remote_dcp, pp = case
    ranks = _build(*case)
    for p in range(pp):
        notified = Counter()
        for t in ranks:
            plan = plan_reads(t, "p", p)
            targets = t.handshake_target_ranks(remote_tp, remote_dcp)
            assert {s.remote_rank for s in plan.reads} <= set(targets)
            assert set(plan.notify_ranks) == set(targets)
            notified.update(plan.notify_ranks)
        expected = {plan_reads(t, "p", p).consumers_per_remote_rank for t in ranks}
        assert len(expected) == 1
        assert set(notified) == set(range(remote_tp)), "every remote rank must hear from its readers"
        assert set(notified.values()) == expected


def test_pp_layer_range():
    from actors.kv.plan.topology import pp_layer_range

    assert [pp_layer_range(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert pp_layer_range(4, 1, 0) == (0, 4)
    with pytest.raises(TopologyError):
        pp_layer_range(2, 3, 0)
    with pytest.raises(TopologyError):
        pp_layer_range(4, 2, 2)
