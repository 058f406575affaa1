"""Huge-page backing of registered KV memory is best effort and never changes contents."""

import pytest
import torch

from actors.kv.nixl.hugepages import HUGE, _private_anonymous, back_with_huge_pages


def _anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of this process's mappings that overlap [start, end), from smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def test_contents_survive_and_small_or_unmapped_regions_are_skipped():
    t = torch.randn(3 * HUGE // 4)  # 6 MiB: at least one aligned 2 MiB page inside
    before = t.clone()
    collapsed = back_with_huge_pages([(t.data_ptr(), t.numel() * 4)])
    assert torch.equal(t, before)
    assert collapsed % HUGE == 0 and collapsed <= t.numel() * 4
    small = torch.randn(1024)
    assert back_with_huge_pages([(small.data_ptr(), small.numel() * 4)]) == 0  # no whole huge page inside
    assert back_with_huge_pages([(HUGE * 7, HUGE * 2)]) == 0  # not our memory: refused quietly


def _thp_off() -> bool:
    try:
        return "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return True


def test_a_zeroed_region_is_still_zero_after_the_hand_back():
    # an engine's KV cache when it registers: torch.zeros, every page touched
    t = torch.zeros(16 * HUGE // 4)  # 16 MiB
    back_with_huge_pages([(t.data_ptr(), t.numel() * 4)])
    assert not t.any()
    t.fill_(1.0)
    assert bool((t == 1.0).all())


@pytest.mark.skipif(_thp_off(), reason="transparent huge pages are off on this host")
def test_a_zeroed_region_faults_back_in_as_huge_pages():
    t = torch.zeros(16 * HUGE // 4)
    start = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    backed = back_with_huge_pages([(t.data_ptr(), t.numel() * 4)])
    assert backed >= 14 * HUGE
    t.fill_(1.0)  # first touch after the hand-back
    assert _anon_huge_bytes(start, start + backed) >= backed // 2


def test_only_private_anonymous_memory_counts_as_zero_on_refault():
    t = torch.zeros(4 * HUGE // 4)
    assert _private_anonymous(t.data_ptr(), t.data_ptr() + t.numel() * 4)
    with open("/proc/self/maps") as f:
        lib = next(line for line in f if ".so" in line)
    lo, hi = (int(x, 16) for x in lib.split()[0].split("-"))
    assert not _private_anonymous(lo, hi)  # file-backed (a shared library)
