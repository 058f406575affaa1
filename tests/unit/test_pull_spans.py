"""Pairs adjacent in both caches become one extent: descriptor order and the span count.

NIXL merges consecutive descriptors whose local and remote bytes both
continue the previous one. `SourceRead.indices` sorts a request's pairs by
local position so such runs sit next to each other ascending (also when the
engine listed them descending, as vLLM's free queue hands them out), and
reports how many extents remain (`spans`). Checked here against a brute-force
merge of the expanded addresses.
"""

import numpy as np
import pytest
import torch

from actors.kv.plan.descriptors import checked_block_ids
from actors.kv.handshake import CompatInfo, RankHandshake
from actors.kv.plan.layout import HND, CacheGeometry
from actors.kv.plan.pull_plan import build_stage
from actors.kv.plan.read_plan import plan_reads
from actors.kv.plan.topology import EngineTransferInfo, TransferTopology

COMPAT = CompatInfo("m", "float32", 2, 2, 4, "float32", "split")


class Lists:
    def local_list(self, table):
        return table.addresses()

    def remote_list(self, key, table):
        return table.addresses()


def geometry(heads: int, block_size: int, blocks: int = 32) -> CacheGeometry:
    shape = (blocks, heads, block_size, 4)
    planes = [[torch.zeros(shape) for _ in range(2)] for _ in range(2)]
    geometry.keep.append(planes)  # the addresses must stay valid for the test's duration
    return CacheGeometry.from_tensors(planes, HND, block_size, heads, 4)


geometry.keep = []


def stage_for(local_tp: int, remote_tp: int, local_bs: int, remote_bs: int):
    heads = 2
    topo = TransferTopology(0, local_tp, local_bs, "d", False, False, heads)
    topo.register_remote_engine("p", EngineTransferInfo(
        remote_tp_size=remote_tp, remote_block_len=0, remote_block_size=remote_bs,
        remote_physical_blocks_per_logical=1))
    local = geometry(heads // local_tp, local_bs)
    peers = {r: RankHandshake("p", "prefill", r, remote_tp, 0, 1, 1, remote_bs, f"p{r}", b"x",
                              geometry(heads // remote_tp, remote_bs), COMPAT)
             for r in topo.handshake_target_ranks(remote_tp, 1)}
    return build_stage(Lists(), local, plan_reads(topo, "p"), peers), local


def merged(src, li, ri) -> int:
    (l_addr, l_len), (r_addr, _) = src.local, src.remote
    la, ra, n = l_addr[li], r_addr[ri], l_len[li]
    joins = (la[1:] == la[:-1] + n[:-1]) & (ra[1:] == ra[:-1] + n[:-1])
    return int(li.size - np.count_nonzero(joins))


@pytest.mark.parametrize("local_ids, remote_ids, spans_per_region", [
    (list(range(8)), list(range(8)), 1),  # contiguous
    (list(range(7, -1, -1)), list(range(17, 9, -1)), 1),  # both descending: one run once sorted
    ([3, 9, 4, 10], [20, 1, 21, 2], 2),  # interleaved runs
    ([5, 4, 3], [1, 2, 3], 3),  # opposite directions never merge
    ([0, 2, 4, 6], [0, 2, 4, 6], 4),  # gaps
])
def test_spans_match_a_brute_force_merge_of_the_addresses(local_ids, remote_ids, spans_per_region):
    stage, local = stage_for(1, 1, 16, 16)
    (src,) = stage.reads
    li, ri, nbytes, spans = src.indices(np.array(local_ids), np.array(remote_ids), 0)
    assert spans == merged(src, li, ri) == spans_per_region * 4  # 2 layers x 2 planes
    pairs = {(int(a), int(b)) for a, b in zip(src.local[0][li], src.remote[0][ri])}
    assert len(pairs) == li.size  # every pair once, only the order changed


def test_block_size_ratio_joins_sub_blocks_and_head_slices_never_merge():
    stage, _ = stage_for(1, 1, 32, 16)  # ratio 2: local block j takes remote blocks 2j, 2j+1
    (src,) = stage.reads
    li, ri, _, spans = src.indices(np.array([5, 4]), np.array([7, 8, 9, 10]), 0)
    assert spans == merged(src, li, ri)
    stage, _ = stage_for(2, 1, 16, 16)  # local rank holds 1 of the remote's 2 heads
    (src,) = stage.reads
    assert not src.merges
    li, ri, _, spans = src.indices(np.array([0, 1, 2]), np.array([0, 1, 2]), 0)
    assert spans == li.size == merged(src, li, ri)


def test_ids_are_still_checked_before_any_index_is_computed():
    stage, local = stage_for(1, 1, 16, 16)
    with pytest.raises(Exception, match="outside"):
        checked_block_ids("local", [0, 32], local.num_blocks)


def test_the_read_deadline_grows_with_the_bytes_at_the_slowest_link():
    from actors.kv.transport import TransportBase

    t = TransportBase.__new__(TransportBase)
    TransportBase.__init__(t, "r", None, read_timeout_s=10.0, min_link_mbps=100.0)
    assert t.read_deadline_s(0) == 10.0
    assert t.read_deadline_s(77_000_000) == pytest.approx(10.0 + 77e6 * 8 / 100e6)  # 77 MB at 100 Mbit/s: +6.2 s
    TransportBase.__init__(t, "r", None, read_timeout_s=10.0)
    assert t.read_deadline_s(77_000_000) == 10.0  # 0: read_timeout_s alone
