"""A request's placement decision and its reason, typed.

The enum values are the labels of `raypd_disagg_decisions_total{decision,reason}` and of the
fallbacks' counter: dashboards, `raypd status` and the benchmarks' results read them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Decision(StrEnum):
    REMOTE = "remote"  # prefill on a prefill engine, then the KV handoff
    LOCAL = "local"  # the decode engine prefills itself (colocated)
    REJECT = "reject"  # no option is allowed: the request is refused


class DecisionReason(StrEnum):
    # placement `disaggregate` (`serving.routing.policy.decide_prefill`)
    UNCACHED_PROMPT = "uncached_prompt"  # a usable prefill engine exists
    NO_PREFILL_ENGINE = "no_prefill_engine"  # none does (also the SLO model's colocated-only case)
    # placement `slo` (`serving.routing.slo_model`): what made the chosen option win
    ONLY_OPTION = "only_option"
    ITL_PROTECT = "itl_protect"
    PREFILL_QUEUE = "prefill_queue"
    PREFIX_CACHED = "prefix_cached"
    TTFT = "ttft"
    # placement `colocate`: the SLO model among colocated options only
    COLOCATE = "colocate"


class FallbackReason(StrEnum):
    """Why a request meant for a remote prefill was prefilled by its decode engine."""

    PREFILL_FAILED = "prefill_failed"
    NO_PREFILL_ENGINE = "no_prefill_engine"


@dataclass(frozen=True)
class DisaggDecision:
    decision: Decision
    reason: DecisionReason

    @property
    def remote(self) -> bool:
        return self.decision == Decision.REMOTE
