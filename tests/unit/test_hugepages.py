"""Huge-page backing of registered KV memory is best effort and never changes contents."""

import torch

from actors.kv.hugepages import HUGE, back_with_huge_pages


def test_contents_survive_and_small_or_unmapped_regions_are_skipped():
    t = torch.randn(3 * HUGE // 4)  # 6 MiB: at least one aligned 2 MiB page inside
    before = t.clone()
    collapsed = back_with_huge_pages([(t.data_ptr(), t.numel() * 4)])
    assert torch.equal(t, before)
    assert collapsed % HUGE == 0 and collapsed <= t.numel() * 4
    small = torch.randn(1024)
    assert back_with_huge_pages([(small.data_ptr(), small.numel() * 4)]) == 0  # no whole huge page inside
    assert back_with_huge_pages([(HUGE * 7, HUGE * 2)]) == 0  # not our memory: refused quietly
