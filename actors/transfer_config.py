"""TransferConfig: how KV moves between a prefill and a decode engine (a deployment's `transfer:`).

One type for every layer that reads it: the deployment file's `transfer:` section
(serving.config), each engine's `EngineConfig.transfer`, and the vLLM connector, which gets it
back out of `kv_connector_extra_config` (actors.engine.vllm.extra_config). It lives at the top of
actors/, with no Ray or vLLM import, so that serving/ above and the vLLM worker processes below
can all import it; its defaults are written here once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from actors.config_base import StrictModel

FailurePolicy = Literal["fail", "recompute"]
VerifyMode = Literal["off", "sample", "all"]


class TransferConfig(StrictModel):
    """How KV moves between a prefill and a decode engine, and what a failed move does."""

    failure_policy: FailurePolicy = Field("recompute", description=(
        "a failed KV pull: `recompute` prefills the prompt again on the decode engine, `fail` ends the "
        "request with an error"))
    lease_ttl_s: float = Field(30.0, gt=0, description=(
        "how long a prefill engine holds a prefilled request's KV blocks for the decode engine to read"))
    read_timeout_s: float = Field(10.0, gt=0, description=(
        "a KV pull not done by then fails (a dead peer never leaves a request waiting)"))
    min_link_mbps: float = Field(100.0, ge=0, description=(
        "the slowest link a KV pull may cross: a pull of B bytes may take read_timeout_s plus B at this "
        "rate before it fails, so a slow link is not mistaken for a partition (0: read_timeout_s alone)"))
    sync_wait_s: float = Field(2.0, gt=0, description=(
        "vLLM decode engines: the longest a synchronous load may hold the engine's step (every stream on "
        "the engine waits meanwhile); a pull not done by then fails and the failure policy applies"))
    handoff_deadline_s: float = Field(60.0, gt=0, description=(
        "the coordinator's ledger fails a prefill->decode handoff that has no verdict by then"))
    sync_load_max_tokens: int = Field(4096, ge=0, description=(
        "vLLM decode engines: a pull of at most this many tokens loads before the step's forward (the "
        "request computes in the step that admits it); larger pulls load asynchronously (vLLM schedules "
        "the request once the pull is done, two steps later). 0: always asynchronous"))
    fault_rate: float = Field(0.0, ge=0.0, le=1.0, description=(
        "test knob: fail this fraction of KV pulls on purpose"))
    verify: VerifyMode = Field("off", description=(
        "KV integrity: producers checksum each (block, head) when they lease a prefill; readers check "
        "every block (`all`) or a 1-in-8 sample (`sample`) after the pull, and a mismatch fails it. "
        "Off by default: the checksums cost a large share of a pull's time on a CPU host"))
