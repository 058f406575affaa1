"""How a deployment runs: its HTTP front, Ray, and the restarts of what dies or hangs (a deployment's
`http:`, `ray:` and `restarts:` sections), as plain config.

Beside serving/config.py and importing nothing of serving/, so that the front and the cluster
layer import it from the config floor, never the other way round.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from actors.config_base import StrictModel


class RestartConfig(StrictModel):
    """Ray restarts crashed engines, their rank actors (synthetic engines), the coordinator and the
    autoscaler. A hung engine is restarted too: the coordinator probes every engine; one that fails
    `probe_failure_threshold` probes in a row (no answer in time while it calls the coordinator for
    nothing else, or vLLM's engine core behind it neither answering nor stepping) is evicted and
    killed, and Ray restarts it as a new incarnation."""

    max_restarts: int = Field(5, ge=0, le=1000, description=(
        "Ray restarts a crashed (or hung, killed) engine, its rank actors, the coordinator and the "
        "launcher at most this often"))
    probe_interval_s: float = Field(10.0, gt=0, description=(
        "the coordinator probes every engine this often (and at once when a router reports a missed deadline)"))
    probe_timeout_s: float = Field(10.0, gt=0, description="a probe not answered within this fails")
    probe_failure_threshold: int = Field(2, ge=1, le=100, description=(
        "an engine is judged hung after this many failed probes in a row; a probe is no failure when the "
        "engine called the coordinator, or its vLLM engine core stepped, while it waited"))
    startup_deadline_s: float | None = Field(None, gt=0, description=(
        "a restarted engine that has not registered again within this is killed and restarted again "
        "(unset: `startup_deadline_factor` x the longest start measured on the cluster, at least "
        "`startup_deadline_floor_s`; before any engine started, the launcher's engine start timeout)"))
    startup_deadline_factor: float = Field(3.0, ge=1, description=(
        "the derived start-up deadline is this many times the longest engine start measured"))
    startup_deadline_floor_s: float = Field(120.0, gt=0, description=(
        "the derived start-up deadline is never shorter than this"))


class HttpConfig(StrictModel):
    """The OpenAI-compatible front: Ray Serve ingress replicas. API keys never sit in the config (it
    travels as Serve arguments and shows in logs): each replica reads RAYPD_API_KEYS and
    `api_keys_file` when it starts (serving.front.api_keys)."""

    host: str = Field("127.0.0.1", description="the address the front listens on")
    port: int = Field(8000, ge=0, le=65535, description="its port")
    api_keys_file: str | None = Field(None, description="a file of API keys, one per line, '#' comments")
    require_api_keys: bool = Field(False, description="refuse to start a replica that finds no key")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="a larger request body is refused (413)")
    served_model_name: str | None = Field(None, description=(
        "the model name clients ask for (unset: vLLM's naming of `model`)"))
    max_inflight_requests: int = Field(512, ge=1, description=(
        "requests in flight per ingress replica; beyond it: 429"))
    num_replicas: int = Field(1, ge=1, le=64, description="Ray Serve ingress replicas")
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0, description=(
        "when Serve stops an ingress replica (a redeploy, a scale-down), its streams get this long to "
        "finish: cover the longest answer"))
    replica_num_cpus: float = Field(0.0, ge=0, description="Ray CPUs reserved per ingress replica")
    replica_resources: dict[str, float] = Field({"node:__internal_head__": 0.001}, description=(
        "Ray resources each ingress replica asks for; by default the head node's own, so that the router "
        "shares the head's fate and not an engine host's (a host cut off from its peers would cut the "
        "router off too); {} lets Ray place replicas on any node"))
    trace: bool = Field(False, description=(
        "answer requests sent with `X-Raypd-Trace: 1` with their first token's hop stamps, and log the "
        "ingress loop's long lags and gc pauses"))

    @model_validator(mode="before")
    @classmethod
    def _no_inline_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_keys" in data:
            raise ValueError("inline API keys (http.api_keys) are not accepted: the config travels as Ray "
                             "Serve arguments and shows in logs. Put the keys in the RAYPD_API_KEYS "
                             "environment variable (comma-separated) or in a file named by http.api_keys_file "
                             "(one key per line)")
        return data


class RayConfig(StrictModel):
    """The Ray cluster the deployment runs on."""

    address: str | None = Field(None, description="a running cluster's address (`auto`, ...); unset: start a local one")
    num_cpus: int | None = Field(None, ge=1, description="a local cluster's CPUs (unset: Ray's count of this host)")
