"""What the product soak counts beyond its answers: the engines' KV pull counters summed over every
incarnation, and the router's placement counters as the front's /metrics exports them.

An engine's counters (vLLM backend: `kv_pulls`, `kv_failures`, `recomputed`, `pull_failures_<kind>`)
start at 0 in each incarnation and die with it, so `PullCounts` keeps the last sample of each
incarnation (keyed by the actor's pid): sample an engine right before it is killed or frozen and every
engine once at the end, and the sums count each incarnation up to its last sample. The router lives
through the engine faults: its counters need no such care.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.protocol.stats import EngineStats

FAILURE_KINDS = ("transfer", "lease_ended", "no_lease_record", "integrity")  # actors.engine.vllm.leases.PullFailures


@dataclass
class PullCounts:
    """The vLLM backend's pull counters, per incarnation (its actor's pid) -> its last sample."""

    last: dict[int, dict[str, int]] = field(default_factory=dict)

    def sample(self, stats: EngineStats) -> None:
        self.last[stats.pid] = {k: v for k, v in stats.backend.counters.items() if isinstance(v, int)}

    def total(self, key: str) -> int:
        return sum(c.get(key, 0) for c in self.last.values())

    @property
    def pulls(self) -> int:
        """Pulls the decode engines set out to make: attached to vLLM (`kv_pulls`), or failed at the
        handshake (`kv_failures`: under the `recompute` policy no other failure counts there)."""
        return self.total("kv_pulls") + self.total("kv_failures")

    @property
    def read_errors(self) -> int:
        """Failed pulls the reader ranks reported as `transfer` failures: the knob's injected READ
        errors (`InjectedFault`), and reads a killed or frozen producer broke."""
        return self.total("pull_failures_transfer")

    @property
    def failed_pulls(self) -> int:
        """Every pull that failed, whatever the kind, and the handshakes that failed: each one is
        recomputed on the decode engine under the `recompute` policy."""
        return sum(self.total(f"pull_failures_{k}") for k in FAILURE_KINDS) + self.total("kv_failures")

    @property
    def recomputed(self) -> int:
        return self.total("recomputed")

    def summary(self) -> dict[str, int]:
        return {"incarnations": len(self.last), "pulls": self.pulls, "read_errors": self.read_errors,
                "failed_pulls": self.failed_pulls, "recomputed": self.recomputed}


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` in a Prometheus text exposition whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        got = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
        if all(got.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
    return total
