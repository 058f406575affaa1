"""Block byte math and receive transforms, checked token by token against a reference.

A READ is simulated in-process with ctypes.memmove over the computed runs, so
the same runs the NIXL transport posts are what is verified here.
"""

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.errors import BlockRangeError, LayoutError
from actors.kv.layout import (
    CPU_HKND,
    HND,
    MLA_ND,
    NHD,
    BlockLayout,
    CacheGeometry,
    block_read_runs,
    canonical_view,
    check_runs_inside,
    clip_ssm_state_blocks,
    compatible_geometry,
    copy_kv_blocks,
    merge_runs,
    to_local_layout,
    token_read_runs,
)
from actors.kv.topology import EngineTransferInfo, TransferTopology, rank_global_heads

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


def apply(runs):
    for local, remote, nbytes in runs:
        ctypes.memmove(local, remote, nbytes)


def transfer(local, remote, spec, local_ids, remote_ids):
    runs = block_read_runs(spec, local.geometry, remote.geometry, local_ids, remote_ids)
    check_runs_inside(runs, local.geometry, remote.geometry)
    apply(runs)
    return runs


def finish(local, remote_layout, local_ids, ratio):
    for planes in local.tensors:
        for plane in planes:
            to_local_layout(plane, local_ids, remote_layout, local.layout, ratio)


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
    with pytest.raises(BlockRangeError):
        geo.block_address(0, 0, 3)
    with pytest.raises(BlockRangeError):
        geo.block_address(2, 0, 0)
    with pytest.raises(LayoutError, match="does not match layout"):
        CacheGeometry.from_tensors([[torch.zeros(3, 2, 4, 5)]], HND, 4, 2, D)


def test_merge_runs_coalesces_only_when_both_sides_adjacent():
    assert merge_runs([(100, 500, 10), (110, 510, 5), (120, 515, 5)]) == [(100, 500, 15), (120, 515, 5)]


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
    spec_t = TransferTopology(0, 1, local_bs, "d", False, False, heads)
    spec_t.register_remote_engine("p", EngineTransferInfo(1, remote.geometry.block_bytes, local_bs // ratio, 1))
    (spec,) = spec_t.read_plan("p").reads
    transfer(local, remote, spec, local_ids, remote_ids)
    finish(local, remote_layout, local_ids, ratio)
    assert local.check_tokens(local_ids, tokens, range(heads)) == 0


@pytest.mark.parametrize("layout", [HND, NHD, CPU_HKND])
@pytest.mark.parametrize("local_tp, remote_tp, heads", [(1, 2, 4), (2, 1, 4), (4, 2, 4), (2, 4, 4), (1, 4, 2), (4, 1, 2)])
def test_heterogeneous_tp_fills_every_local_head(layout, local_tp, remote_tp, heads):
    tokens, bs = 11, 4
    ids = [2, 0, 3]
    remotes = []
    for r in range(remote_tp):
        g0, g1 = rank_global_heads(r, remote_tp, heads, False)
        cache = Cache(layout, 2, 4, bs, g1 - g0)
        cache.write_tokens(ids, tokens, range(g0, g1))
        remotes.append(cache)
    for lr in range(local_tp):
        g0, g1 = rank_global_heads(lr, local_tp, heads, False)
        local = Cache(layout, 2, 4, bs, g1 - g0)
        t = TransferTopology(lr, local_tp, bs, "d", False, False, heads)
        t.register_remote_engine("p", EngineTransferInfo(remote_tp, 1, bs, 1))
        for spec in t.read_plan("p").reads:
            transfer(local, remotes[spec.remote_rank], spec, ids, ids)
        assert local.check_tokens(ids, tokens, range(g0, g1)) == 0


def test_head_slice_of_hnd_is_one_run_per_block_and_merges_across_blocks():
    remote = Cache(HND, 1, 8, 4, 4)
    local = Cache(HND, 1, 8, 4, 2)
    t = TransferTopology(1, 2, 4, "d", False, False, 4)
    t.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    (spec,) = t.read_plan("p").reads
    runs = block_read_runs(spec, local.geometry, remote.geometry, [0, 1, 2], [0, 1, 2])
    assert len(runs) == 2 * 3  # 2 planes x 3 blocks, a contiguous head slice per block
    full = TransferTopology(0, 1, 4, "d", False, False, 4)
    full.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    (spec,) = full.read_plan("p").reads
    same = Cache(HND, 1, 8, 4, 4)
    runs = block_read_runs(spec, same.geometry, remote.geometry, [3, 4, 5], [0, 1, 2])
    assert len(runs) == 2  # whole adjacent blocks merge into one run per plane


def test_pp_layer_range_only_touches_its_layers():
    remote = Cache(HND, layers=2, blocks=2, block_size=4, heads=1, first_layer=2)
    local = Cache(HND, layers=4, blocks=2, block_size=4, heads=1)
    remote.write_tokens([1], 4, [0])
    t = TransferTopology(0, 1, 4, "d", False, False, 1)
    t.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1, remote_pp_rank=1, start_layer=2, end_layer=4))
    (spec,) = t.read_plan("p", 1).reads
    transfer(local, remote, spec, [0], [1])
    assert local.check_tokens([0], 4, [0], layers=[2, 3]) == 0
    assert bool((local.tensors[0][0] == -1).all()) and bool((local.tensors[1][0] == -1).all())


@pytest.mark.parametrize("local_dcp, remote_dcp", [(1, 2), (2, 1), (4, 2), (2, 4), (1, 4)])
def test_dcp_token_reads(local_dcp, remote_dcp):
    tokens, bs = 23, 4
    ids = [3, 1, 0, 2, 5, 4]
    remotes = []
    for r in range(max(remote_dcp, 1)):
        cache = Cache(MLA_ND, 2, 8, bs, 1)
        cache.write_tokens(ids, tokens, [0], token_filter=lambda t, r=r: t % remote_dcp == r,
                           slot_of=lambda t: t // remote_dcp)
        remotes.append(cache)
    for lr in range(local_dcp):
        local = Cache(MLA_ND, 2, 8, bs, 1)
        t = TransferTopology(lr, local_dcp, bs, "d", True, False, 1, dcp_size=local_dcp)
        t.register_remote_engine("p", EngineTransferInfo(remote_dcp, 1, bs, 1, remote_dcp_size=remote_dcp))
        for spec in t.read_plan("p").reads:
            runs = token_read_runs(spec, local.geometry, remotes[spec.remote_rank].geometry, ids, ids, tokens)
            check_runs_inside(runs, local.geometry, remotes[spec.remote_rank].geometry)
            apply(runs)
        assert local.check_tokens(ids, tokens, [0], token_filter=lambda t: t % local_dcp == lr,
                                  slot_of=lambda t: t // local_dcp) == 0


def test_out_of_range_block_ids_are_typed_errors():
    remote, local = Cache(HND, 1, 4, 4, 1), Cache(HND, 1, 4, 4, 1)
    t = TransferTopology(0, 1, 4, "d", False, False, 1)
    t.register_remote_engine("p", EngineTransferInfo(1, 1, 4, 1))
    (spec,) = t.read_plan("p").reads
    with pytest.raises(BlockRangeError, match="remote block id 4"):
        block_read_runs(spec, local.geometry, remote.geometry, [0], [4])
    with pytest.raises(BlockRangeError, match="local block id -1"):
        block_read_runs(spec, local.geometry, remote.geometry, [-1], [0])
    with pytest.raises(BlockRangeError, match="do not fit"):
        block_read_runs(spec, local.geometry, remote.geometry, [0], [0, 1])
    with pytest.raises(BlockRangeError, match="outside the registered cache"):
        check_runs_inside([(local.geometry.bases[0][0], 0x10, 16)], local.geometry, remote.geometry)


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
    to_local_layout(plane, ids, remote_layout, local_layout, ratio)
    view = canonical_view(plane, local_layout)
    for j, blk in enumerate(ids):
        for h in range(heads):
            for n in range(local_bs):
                want = torch.tensor([value(0, h, j * local_bs + n, 0, d) for d in range(D)])
                assert torch.equal(view[blk, h, n], want)


# --------------------------------------------------------------- helpers


def test_copy_kv_blocks():
    src = {"a": torch.arange(24.0).view(4, 6), "b": torch.arange(24.0, 48.0).view(4, 6)}
    dst = {"a": torch.zeros(3, 6), "b": torch.zeros(3, 6)}
    copy_kv_blocks(src, dst, [3, 1], [0, 2])
    assert torch.equal(dst["a"][0], src["a"][3]) and torch.equal(dst["b"][2], src["b"][1])
    assert torch.equal(dst["a"][1], torch.zeros(6))
    with pytest.raises(LayoutError):
        copy_kv_blocks(src, dst, [1], [0, 1])
    with pytest.raises(BlockRangeError):
        copy_kv_blocks(src, dst, [1], [3])


def test_clip_ssm_state_blocks():
    assert clip_ssm_state_blocks([], 2) == []
    assert clip_ssm_state_blocks([7], 3) == [7]
    assert clip_ssm_state_blocks([1, 2, 3, 4], 2) == [2]
    assert clip_ssm_state_blocks([1, 2, 3], 0) == [3]
    with pytest.raises(LayoutError):
        clip_ssm_state_blocks([1], -1)
