"""Back registered KV memory with transparent huge pages before NIXL registers it.

On one host UCX moves KV with CMA (`process_vm_readv`), which pins the source's pages for every
descriptor: with 4 KiB pages that pinning, not the copy, dominates a READ of many small blocks;
2 MiB pages (`MADV_HUGEPAGE`) cut it (docs/nixl_notes.md). Contents are unchanged. Best
effort: a kernel or policy that refuses leaves the memory as it was; nothing here raises.

Memory already touched needs its 4 KiB pages replaced. Two ways, the same contents:
- a freshly zeroed, private anonymous region (an engine's KV cache when it registers: vLLM
  allocates it with `torch.zeros`) is handed back (`MADV_DONTNEED`) and faults in again as zeroed
  2 MiB pages on first touch (the zeros are checked first);
- anything else is copied into huge pages in place (`MADV_COLLAPSE`, Linux >= 6.1), at a cost in
  kernel time per GiB on every engine start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterable

import numpy as np

logger = logging.getLogger("raypd.transport")

HUGE = 2 << 20
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_ZERO_CHECK_CHUNK = 64 << 20  # stop at the first chunk that holds data


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _private_anonymous(start: int, end: int, maps: str = "/proc/self/maps") -> bool:
    """Whether every byte of [start, end) lies in private anonymous mappings (where
    MADV_DONTNEED means "zeros on next touch"; a shared or file-backed one would keep or
    reload other contents)."""
    covered = start
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if hi <= covered or lo > covered:
                    continue
                path = fields[5] if len(fields) > 5 else ""
                if fields[1][3] != "p" or path not in ("", "[heap]"):
                    return False
                covered = hi
                if covered >= end:
                    return True
    except (OSError, ValueError, IndexError):
        return False
    return False


def _all_zero(start: int, nbytes: int) -> bool:
    for off in range(0, nbytes, _ZERO_CHECK_CHUNK):
        n = min(_ZERO_CHECK_CHUNK, nbytes - off)
        words = np.frombuffer((ctypes.c_char * n).from_address(start + off), dtype=np.uint64)
        if words.any():
            return False
    return True


def back_with_huge_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Advise the 2 MiB-aligned interior of each (address, nbytes) region to huge pages, and
    replace the small pages already there (see the module's docstring for how).

    Returns the bytes now backed, or to be backed at first touch, by huge pages (0 when the
    kernel refused).
    """
    try:
        madvise = _madvise()
    except OSError:
        return 0
    if madvise is None:
        return 0
    backed = 0
    for addr, nbytes in regions:
        start = (addr + HUGE - 1) & ~(HUGE - 1)
        end = (addr + nbytes) & ~(HUGE - 1)
        if end <= start:
            continue
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            logger.debug("MADV_HUGEPAGE refused (errno %d)", ctypes.get_errno())
            return backed
        if _private_anonymous(start, end) and _all_zero(start, end - start):
            if madvise(start, end - start, MADV_DONTNEED) == 0:
                backed += end - start
                continue
            logger.debug("MADV_DONTNEED refused (errno %d)", ctypes.get_errno())
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            backed += end - start
        else:
            logger.debug("MADV_COLLAPSE refused (errno %d)", ctypes.get_errno())
    return backed
