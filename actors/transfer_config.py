"""TransferConfig: how KV moves between a prefill and a decode engine (a deployment's `transfer:`).

One type for every layer that reads it: the deployment file's `transfer:` section
(serving.config), each engine's `EngineConfig.transfer`, and the vLLM connector, which gets it
back out of `kv_connector_extra_config` (actors.engine.vllm.extra_config). It lives at the top of
actors/, with no Ray or vLLM import, so that serving/ above and the vLLM worker processes below
can all import it; its defaults are written here once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FailurePolicy = Literal["fail", "recompute"]
VerifyMode = Literal["off", "sample", "all"]


class TransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # a failed KV pull: `fail` ends the request with an error, `recompute` prefills it on the decode engine
    failure_policy: FailurePolicy = "fail"
    lease_ttl_s: float = Field(30.0, gt=0)  # a producer holds a prefill's blocks this long for its reader
    read_timeout_s: float = Field(10.0, gt=0)  # a pull not done by then fails (a dead peer never hangs it)
    # the coordinator's ledger gives a handoff this long to reach its verdict (actors.control.ledger)
    handoff_deadline_s: float = Field(60.0, gt=0)
    # vLLM decode: a pull of at most this many tokens loads synchronously, before the step's forward (the
    # request computes in the step that admits it); larger ones load asynchronously (vLLM schedules the
    # request once the pull is done: two scheduler steps later). 0: always async.
    sync_load_max_tokens: int = Field(4096, ge=0)
    fault_rate: float = Field(0.0, ge=0.0, le=1.0)  # test knob: fail this fraction of KV pulls on purpose
    # KV integrity (actors.kv.lease.integrity): producers checksum each (block, head) when they lease a
    # prefill, readers check all blocks or a 1-in-8 sample of them after the pull; a mismatch fails it.
    # Off by default: on CPU `all` adds 1.6-6x the pull's time, `sample` 20-140 % (benchmarks/transfer.py).
    verify: VerifyMode = "off"
