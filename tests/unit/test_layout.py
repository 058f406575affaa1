"""Descriptor plans and receive transforms, checked token by token against a reference.

A READ is simulated in-process: the descriptor tables a reader prepares at
handshake (`build_stage`) are expanded to addresses and the descriptor indices
a request computes (`SourceRead.indices`) are copied with ctypes.memmove, so
the same indices the NIXL transport posts are what is verified here.
"""

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.plan.descriptors import checked_block_ids
from actors.kv.transfer_errors import BlockRangeError, LayoutError
from actors.kv.handshake import CompatInfo, RankHandshake
from actors.kv.plan.layout import (
    CPU_HKND,
    HND,
    MLA_ND,
    NHD,
    BlockLayout,
    CacheGeometry,
    canonical_view,
    compatible_geometry,
    to_local_layout,
)
from actors.kv.plan.pull_plan import build_stage
from actors.kv.plan.read_plan import plan_reads
from actors.kv.plan.topology import EngineTransferInfo, TransferTopology, rank_global_heads

D = 4


def value(layer, head, token, kv, d):
    # exact in float32 for the sizes used here
    return float((((layer * 16 + head) * 2 + kv) * 256 + token) * 8 + d)


class Cache:
    """Per-layer planes for one rank, filled or checked through canonical views."""

    def __init__(self, layout, layers, blocks, block_size, heads, planes=None, first_layer=0):
        self.layout, self.block_size, self.heads = layout, block_size, heads
        if planes is None:
            planes = 1 if ("KV" in layout.axes or "H" not in layout.axes) else 2
        dims = {"KV": 2, "H": heads, "N": block_size, "D": D}
        shape = (blocks, *(dims[a] for a in layout.axes))
        self.tensors = [[torch.full(shape, -1.0) for _ in range(planes)] for _ in range(layers)]
        self.geometry = CacheGeometry.from_tensors(
            self.tensors, layout, block_size, heads, D, first_layer=first_layer
        )

    def cell(self, layer, plane, block, head, slot, kv):
        view = canonical_view(self.tensors[layer - self.geometry.first_layer][plane], self.layout)
        index = [block]
        if "KV" in self.layout.axes:
            index.append(kv)
        if "H" in self.layout.axes:
            index.append(head)
        index.append(slot)
        return view[tuple(index)]

    def kv_of(self, plane, kv):
        return kv if "KV" in self.layout.axes else plane

    def write_tokens(self, block_ids, num_tokens, global_heads, token_filter=lambda t: True, slot_of=lambda t: t):
        for layer in self.geometry.layers:
            for plane in range(len(self.tensors[0])):
                for kv in range(2 if "KV" in self.layout.axes else 1):
                    for t in range(num_tokens):
                        if not token_filter(t):
                            continue
                        s = slot_of(t)
                        blk = block_ids[s // self.block_size]
                        for h, g in enumerate(global_heads):
                            cell = self.cell(layer, plane, blk, h, s % self.block_size, kv)
                            cell.copy_(torch.tensor([value(layer, g, t, self.kv_of(plane, kv), d) for d in range(D)]))

    def check_tokens(self, block_ids, num_tokens, global_heads, layers=None, token_filter=lambda t: True, slot_of=lambda t: t):
        bad = 0
        for layer in layers or self.geometry.layers:
            for plane in range(len(self.tensors[0])):
                for kv in range(2 if "KV" in self.layout.axes else 1):
                    for t in range(num_tokens):
                        if not token_filter(t):
                            continue
                        s = slot_of(t)
                        blk = block_ids[s // self.block_size]
                        for h, g in enumerate(global_heads):
                            got = self.cell(layer, plane, blk, h, s % self.block_size, kv)
                            want = torch.tensor([value(layer, g, t, self.kv_of(plane, kv), d) for d in range(D)])
                            bad += int(not torch.equal(got, want))
        return bad


class Lists:
    """The transport's list cache, in memory: tables expanded to (address, nbytes)."""

    def local_list(self, table):
        return table.addresses()

    def remote_list(self, key, table):
        return table.addresses()


COMPAT = CompatInfo("m", "float32", 4, 4, D, "float32", "split")


def peer(rank, cache, tp=1, pp_rank=0, pp=1, dcp=1):
    return RankHandshake("p", "prefill", rank, tp, pp_rank, pp, dcp, cache.block_size, f"p{rank}", b"x",
                         cache.geometry, COMPAT)


def pull(local, topology, remotes, local_ids, remote_ids, num_tokens=0, pp_rank=0):
    """Post a pull's descriptor indices as memmoves; returns how many descriptors moved."""
    plan = plan_reads(topology, "p", pp_rank)
    peers = {r: peer(r, c, topology.get_engine_info("p", pp_rank).remote_tp_size, pp_rank) for r, c in remotes.items()}
    stage = build_stage(Lists(), local.geometry, plan, peers)
    li_ids = checked_block_ids("local", local_ids, local.geometry.num_blocks)
    ri_ids = checked_block_ids("remote", remote_ids, min(c.geometry.num_blocks for c in remotes.values()))
    moved = 0
    for src in stage.reads:
        li, ri, nbytes, _ = src.indices(li_ids, ri_ids, num_tokens)
        (l_addr, l_len), (r_addr, r_len) = src.local, src.remote
        assert np.array_equal(l_len[li], r_len[ri]) and int(l_len[li].sum()) == nbytes
        for a, b, n in zip(l_addr[li].tolist(), r_addr[ri].tolist(), l_len[li].tolist()):
            ctypes.memmove(a, b, n)
        moved += li.size
    return stage, moved


def finish(local, stage, local_ids):
    index = torch.tensor(local_ids, dtype=torch.long)
    for layer in stage.transform_layers:
        for plane in local.tensors[layer - local.geometry.first_layer]:
            to_local_layout(plane, index, stage.remote_layout, local.layout, stage.ratio)


def topo(rank=0, tp=1, bs=4, heads=1, mla=False, dcp=1):
    return TransferTopology(rank, tp, bs, "d", mla, False, heads, dcp_size=dcp)


# ----------------------------------------------------------------- basics


def test_layout_parse_and_names():
    assert BlockLayout.parse("hcnd") == CPU_HKND and CPU_HKND.name == "HCND"
    assert BlockLayout.parse("NHD") == NHD
    with pytest.raises(LayoutError):
        BlockLayout(("H", "H", "N", "D"))
    with pytest.raises(LayoutError):
        BlockLayout(("H", "D"))


def test_geometry_roundtrip_and_validation():
    cache = Cache(HND, layers=2, blocks=3, block_size=4, heads=2)
    geo = cache.geometry
    assert CacheGeometry.from_dict(geo.to_dict()) == geo
    assert geo.planes == 2 and geo.block_bytes == 2 * 4 * D * 4
    assert geo.region_index(1, 1) == 3 and len(geo.regions()) == 4
    with pytest.raises(LayoutError, match="does not match layout"):
        CacheGeometry.from_tensors([[torch.zeros(3, 2, 4, 5)]], HND, 4, 2, D)


def test_compatible_geometry_rejects_mismatches():
    hnd = Cache(HND, 1, 2, 8, 2).geometry
    compatible_geometry(hnd, Cache(NHD, 1, 2, 4, 2).geometry)
    with pytest.raises(LayoutError, match="K/V packing"):
        compatible_geometry(Cache(CPU_HKND, 1, 2, 8, 2).geometry, Cache(HND, 1, 2, 8, 2, planes=1).geometry)
    with pytest.raises(LayoutError, match="does not divide"):
        compatible_geometry(Cache(HND, 1, 2, 4, 2).geometry, Cache(HND, 1, 2, 8, 2).geometry)


# -------------------------------------------------------------- transfers


@pytest.mark.parametrize("remote_layout", [HND, NHD, CPU_HKND])
@pytest.mark.parametrize("local_layout", [HND, NHD, CPU_HKND])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_transfer_then_transform_matches_reference(remote_layout, local_layout, ratio):
    if ("KV" in remote_layout.axes) != ("KV" in local_layout.axes):
        pytest.skip("K/V packing must match (refused by compatible_geometry)")
    local_bs, tokens, heads = 8, 19, 2
    remote = Cache(remote_layout, layers=2, blocks=12, block_size=local_bs // ratio, heads=heads)
    local = Cache(local_layout, layers=2, blocks=6, block_size=local_bs, heads=heads)
    remote_ids = [11, 3, 7, 0, 5, 9, 2, 4, 6, 8][: -(-tokens // (local_bs // ratio))]
    local_ids = [4, 1, 5]
    remote.write_tokens(remote_ids, tokens, range(heads))
    t = topo(bs=local_bs, heads=heads)
    t.register_remote_engine("p", EngineTransferInfo(1, remote.geometry.block_bytes, local_bs // ratio, 1))
    stage, _ = pull(local, t, {0: remote}, local_ids, remote_ids)
    assert bool(stage.transform_layers) == (remote_layout != local_layout or ratio > 1)
    finish(local, stage, local_ids)
    assert local.check_tokens(local_ids, tokens, range(heads)) == 0


@pytest.mark.parametrize("layout", [HND, NHD, CPU_HKND])
@pytest.mark.parametrize("local_tp, remote_tp, heads", [(1, 2, 4), (2, 1, 4), (4, 2, 4), (2, 4, 4), (1, 4, 2), (4, 1, 2)])
def test_heterogeneous_tp_fills_every_local_head(layout, local_tp, remote_tp, heads):
    tokens, bs = 11, 4
    ids = [2, 0, 3]
    remotes = {}
    for r in range(remote_tp):
        g0, g1 = rank_global_heads(r, remote_tp, heads, False)
        remotes[r] = Cache(layout, 2, 4, bs, g1 - g0)
        remotes[r].write_tokens(ids, tokens, range(g0, g1))
    for lr in range(local_tp):
        g0, g1 = rank_global_heads(lr, local_tp, heads, False)
        local = Cache(layout, 2, 4, bs, g1 - g0)
        t = topo(lr, local_tp, bs, heads)
        t.register_remote_engine("p", EngineTransferInfo(remote_tp, 1, bs, 1))
        pull(local, t, remotes, ids, ids)
        assert local.check_tokens(ids, tokens, range(g0, g1)) == 0


def test_descriptor_counts_per_layout():
    """HND head slices are one descriptor per block; whole blocks too; NHD slices one per token."""
    remote = Cache(HND, 1, 8, 4, 4)
    half = topo(1, 2, 4, 4)
    half.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    _, moved = pull(Cache(HND, 1, 8, 4, 2), half, {0: remote}, [0, 1, 2], [0, 1, 2])
    assert moved == 2 * 3  # 2 planes x 3 blocks
    full = topo(0, 1, 4, 4)
    full.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    _, moved = pull(Cache(NHD, 1, 8, 4, 4), full, {0: Cache(NHD, 1, 8, 4, 4)}, [3, 4, 5], [0, 1, 2])
    assert moved == 2 * 3  # a whole NHD block is one run
    _, moved = pull(Cache(NHD, 1, 8, 4, 2), half, {0: Cache(NHD, 1, 8, 4, 4)}, [3, 4, 5], [0, 1, 2])
    assert moved == 2 * 3 * 4  # an NHD head slice is one run per token slot


def test_pp_layer_range_only_touches_its_layers():
    remote = Cache(HND, layers=2, blocks=2, block_size=4, heads=1, first_layer=2)
    local = Cache(HND, layers=4, blocks=2, block_size=4, heads=1)
    remote.write_tokens([1], 4, [0])
    t = topo()
    t.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1, remote_pp_rank=1, start_layer=2, end_layer=4))
    pull(local, t, {0: remote}, [0], [1], pp_rank=1)
    assert local.check_tokens([0], 4, [0], layers=[2, 3]) == 0
    assert bool((local.tensors[0][0] == -1).all()) and bool((local.tensors[1][0] == -1).all())


@pytest.mark.parametrize("local_dcp, remote_dcp", [(1, 2), (2, 1), (4, 2), (2, 4), (1, 4)])
def test_dcp_token_reads(local_dcp, remote_dcp):
    tokens, bs = 23, 4
    ids = [3, 1, 0, 2, 5, 4]
    remotes = {}
    for r in range(remote_dcp):
        remotes[r] = Cache(MLA_ND, 2, 8, bs, 1)
        remotes[r].write_tokens(ids, tokens, [0], token_filter=lambda t, r=r: t % remote_dcp == r,
                                slot_of=lambda t: t // remote_dcp)
    for lr in range(local_dcp):
        local = Cache(MLA_ND, 2, 8, bs, 1)
        t = topo(lr, local_dcp, bs, heads=16, mla=True, dcp=local_dcp)  # MLA: any head count
        t.register_remote_engine("p", EngineTransferInfo(remote_dcp, 1, bs, 1, remote_dcp_size=remote_dcp))
        plan = plan_reads(t, "p")
        sources = {s.remote_rank: remotes[s.remote_rank] for s in plan.reads}
        pull(local, t, sources, ids, ids, num_tokens=tokens)
        assert local.check_tokens(ids, tokens, [0], token_filter=lambda t: t % local_dcp == lr,
                                  slot_of=lambda t: t // local_dcp) == 0


def test_out_of_range_block_ids_are_typed_errors():
    remote, local = Cache(HND, 1, 4, 4, 1), Cache(HND, 1, 4, 4, 1)
    t = topo()
    t.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    with pytest.raises(BlockRangeError, match="remote block id 4"):
        pull(local, t, {0: remote}, [0], [4])
    with pytest.raises(BlockRangeError, match="local block id -1"):
        pull(local, t, {0: remote}, [-1], [0])
    with pytest.raises(BlockRangeError, match="do not fit"):
        pull(local, t, {0: remote}, [0], [0, 1])
    mla = Cache(MLA_ND, 1, 4, 4, 1)
    m = topo(0, 2, 4, 1, mla=True, dcp=2)
    m.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    with pytest.raises(BlockRangeError, match="tokens need"):
        pull(Cache(MLA_ND, 1, 4, 4, 1), m, {0: mla}, [0], [0], num_tokens=9)


@settings(max_examples=60, deadline=None)
@given(
    ratio=st.sampled_from([1, 2, 4]),
    remote_layout=st.sampled_from([HND, NHD]),
    local_layout=st.sampled_from([HND, NHD]),
    data=st.data(),
)
def test_transform_equals_token_reference(ratio, remote_layout, local_layout, data):
    """to_local_layout alone: remote-ordered sub-blocks -> local order, token by token."""
    heads, local_bs = 2, 8
    remote_bs = local_bs // ratio
    n_local = data.draw(st.integers(1, 3))
    ids = data.draw(st.permutations(range(4)))[:n_local]
    dims_r = {"H": heads, "N": remote_bs, "D": D}
    plane = torch.zeros(4, *({"H": heads, "N": local_bs, "D": D}[a] for a in local_layout.axes))
    for j, blk in enumerate(ids):
        sub = []
        for i in range(ratio):
            r = torch.empty(*(dims_r[a] for a in remote_layout.axes))
            rv = canonical_view(r.unsqueeze(0), remote_layout)[0]
            for h in range(heads):
                for n in range(remote_bs):
                    rv[h, n] = torch.tensor([value(0, h, (j * ratio + i) * remote_bs + n, 0, d) for d in range(D)])
            sub.append(r.flatten())
        plane[blk] = torch.cat(sub).view(plane.shape[1:])
    to_local_layout(plane, torch.tensor(ids, dtype=torch.long), remote_layout, local_layout, ratio)
    view = canonical_view(plane, local_layout)
    for j, blk in enumerate(ids):
        for h in range(heads):
            for n in range(local_bs):
                want = torch.tensor([value(0, h, j * local_bs + n, 0, d) for d in range(D)])
                assert torch.equal(view[blk, h, n], want)
