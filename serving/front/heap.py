"""The ingress's cyclic garbage collector, set for serving (`settle_heap`, called once at start-up).

What exists at start-up (Ray, vLLM's modules, the router) lives as long as the process: it is
frozen out of the collector's passes. What comes later and stays (the route table, the prefix
index copy, open streams) is still scanned by every full pass, and a full pass stalls every
request of the process for its length (tens of ms at cluster size: docs/control_plane.md).
CPython starts one after 10 passes of the middle generation once enough has piled up; raypd
lets 100 pass, so a full pass comes 10x more rarely and fewer requests wait behind one.
Refcounting frees everything that is dropped without a cycle, as before; cyclic garbage lives
up to 10x longer. `RAYPD_GC_THRESHOLD="700,10,10"` restores CPython's defaults.
"""

from __future__ import annotations

import gc
import os

THRESHOLD_ENV = "RAYPD_GC_THRESHOLD"
SERVING_THRESHOLD = (700, 10, 100)  # CPython's (700, 10, 10) but the last: full passes 10x rarer


class GcThresholdError(ValueError):
    """RAYPD_GC_THRESHOLD is not three non-negative integers."""


def gc_threshold(environ: dict[str, str] | None = None) -> tuple[int, int, int]:
    raw = (os.environ if environ is None else environ).get(THRESHOLD_ENV)
    if raw is None:
        return SERVING_THRESHOLD
    try:
        values = tuple(int(v) for v in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise GcThresholdError(f"{THRESHOLD_ENV}={raw!r}: expected three non-negative integers, e.g. 700,10,100")
    return values  # type: ignore[return-value]


def settle_heap(environ: dict[str, str] | None = None) -> tuple[int, int, int]:
    """Freeze what exists now and set the collector's thresholds; returns them."""
    threshold = gc_threshold(environ)
    gc.freeze()
    gc.set_threshold(*threshold)
    return threshold
