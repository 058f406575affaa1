"""Back registered KV memory with transparent huge pages before NIXL registers it.

On one host UCX moves KV with CMA (`process_vm_readv`), which pins the
source's pages for every descriptor: with 4 KiB pages that pinning, not the
copy, dominates a READ of many small blocks. Asking the kernel to back the
regions with 2 MiB pages (`MADV_HUGEPAGE`, then `MADV_COLLAPSE` for memory
already touched, Linux >= 6.1) cuts it; measured on the dev box in
`actors/kv/NIXL_NOTES.md`. Contents are unchanged. Best effort: a kernel or
policy that refuses leaves the memory as it was; nothing here raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Iterable

logger = logging.getLogger("raypd.transport")

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def back_with_huge_pages(regions: Iterable[tuple[int, int]]) -> int:
    """Advise (and collapse) the 2 MiB-aligned interior of each (address, nbytes) region.

    Returns the bytes the kernel collapsed into huge pages (0 when it refused).
    """
    try:
        madvise = _madvise()
    except OSError:
        return 0
    if madvise is None:
        return 0
    collapsed = 0
    for addr, nbytes in regions:
        start = (addr + HUGE - 1) & ~(HUGE - 1)
        end = (addr + nbytes) & ~(HUGE - 1)
        if end <= start:
            continue
        if madvise(start, end - start, MADV_HUGEPAGE) != 0:
            logger.debug("MADV_HUGEPAGE refused (errno %d)", ctypes.get_errno())
            return collapsed
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += end - start
        else:
            logger.debug("MADV_COLLAPSE refused (errno %d)", ctypes.get_errno())
    return collapsed
