"""Set-up (e0)'s deployment: raypd's default (e) with placement that never disaggregates (issue 30).

(e0) measures what raypd's stack costs with P/D taken out, against (a2)'s two plain vLLM
servers. raypd has no placement that serves colocated only: `router.placement` is `slo`
(per request, colocated or disaggregated) or `disaggregate` (serving/config.py). So (e0) is
(e)'s config file, read at run time so the two cannot drift, with one knob of the SLO model
changed: the remote path's fixed cost before the first token (`router.slo.
remote_first_token_overhead_s`) set to 10^6 s. For two `both` engines every disaggregated
option (prefill on Y, decode on X) has a colocated twin on Y with the same prefill side and no
handoff, so a handoff of 10^6 s puts every remote option behind some colocated one whatever
the engines' load (serving/routing/slo_model.py). The knob is used by the placement model
only, not by the chunk budget (`PlacementConfig.chunk_budget`): (e0)'s engines start with
exactly (e)'s vLLM arguments. Kept: placement `slo`, the connector (kv_both), KV events,
leases, deadlines, migration. The benchmark checks from the front's decision counters that
no request was disaggregated.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

NEVER_REMOTE_S = 1e6
OVERRIDES: dict[str, Any] = {"name": "raypd-bench-colocated",
                             "router": {"slo": {"remote_first_token_overhead_s": NEVER_REMOTE_S}}}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` written into it, mappings merged key by key (neither is changed)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def colocated_only(base: dict[str, Any]) -> dict[str, Any]:
    """(e0)'s deployment mapping from (e)'s."""
    if base.get("router", {}).get("placement", "slo") != "slo":
        raise ValueError("(e0) derives from a config with router.placement slo")
    return merged(base, OVERRIDES)


def write_config(base_path: Path, out_path: Path) -> Path:
    """(e0)'s config file, derived from (e)'s `base_path`, written to `out_path` (the run directory)."""
    import yaml

    data = colocated_only(yaml.safe_load(base_path.read_text()) or {})
    out_path.write_text(f"# set-up (e0) of benchmarks/pd_vs_vllm.py: {base_path.name} + {OVERRIDES}\n"
                        + yaml.safe_dump(data, sort_keys=False))
    return out_path
