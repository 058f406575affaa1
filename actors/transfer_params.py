"""The KV transfer params a prefill engine hands to a decode engine, validated.

They travel prefill engine -> router -> decode engine -> vLLM scheduler ->
decode workers. Anything forged or inconsistent is refused here with a typed
error before a single descriptor is built; block ids are checked against the
producer's registered block count by the reading rank. `pull_request` is the
one place a reader's `PullRequest` is built from them (vLLM connector and
synthetic rank alike). Test-only fault injection is not a wire field: it is a
policy given to the ranks (`actors.kv.faults`).
"""

from __future__ import annotations

import math
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.kv.plan.pull_types import PullRequest


class TransferParamsError(ValueError):
    """kv_transfer_params are malformed or inconsistent."""


def agent_incarnation(agent_name: str) -> str:
    """The incarnation suffix of a rank's NIXL agent name (`<engine>-pp<i>-tp<j>-<incarnation>`)."""
    return agent_name.rsplit("-", 1)[-1]


class TransferParams(BaseModel):
    # vLLM adds keys of its own (remote_prefill_cached_tokens, ...): ignore them.
    model_config = ConfigDict(extra="ignore", frozen=True)

    do_remote_prefill: bool = True
    remote_engine_id: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    remote_block_ids: list[int] = Field(max_length=1_000_000)
    num_tokens: int = Field(ge=1)
    tp_size: int = Field(ge=1, le=1024)
    pp_size: int = Field(1, ge=1, le=1024)
    dcp_size: int = Field(1, ge=1, le=1024)
    block_size: int = Field(ge=1, le=4096)
    lease_expiry: float = 0.0
    remote_request_id: str | None = Field(None, max_length=512)  # the producer's id (names its lease)
    handshakes: list[str] = Field(default_factory=list, max_length=4096)  # base64 rank payloads
    # the producer incarnation that holds the blocks (the suffix of its ranks' agent names): a
    # reader refuses to pull these block ids from a later incarnation (its memory holds other KV)
    remote_incarnation: str | None = Field(None, pattern=r"^[0-9a-f]{8,32}$")

    @model_validator(mode="after")
    def _consistent(self) -> "TransferParams":
        if any(b < 0 for b in self.remote_block_ids):
            raise ValueError("remote_block_ids must be >= 0")
        if self.dcp_size not in (1, self.tp_size):
            raise ValueError(f"dcp_size {self.dcp_size} must be 1 or tp_size {self.tp_size}")
        needed = math.ceil(math.ceil(self.num_tokens / self.dcp_size) / self.block_size)
        if len(self.remote_block_ids) < needed:
            raise ValueError(
                f"{len(self.remote_block_ids)} remote blocks cannot hold {self.num_tokens} tokens "
                f"at block size {self.block_size}"
            )
        return self

    def pull_request(self, local_block_ids: Sequence[int], remote_block_ids: Sequence[int] | None = None,
                     num_tokens: int | None = None) -> PullRequest:
        """What a reader rank pulls: these params, with the local blocks to fill.

        `remote_block_ids` / `num_tokens` narrow the read (vLLM skips blocks it
        already has cached); by default every remote block and token is read.
        """
        return PullRequest(
            remote_engine_id=self.remote_engine_id,
            remote_block_ids=self.remote_block_ids if remote_block_ids is None else remote_block_ids,
            remote_tp_size=self.tp_size, remote_pp_size=self.pp_size, remote_dcp_size=self.dcp_size,
            local_block_ids=local_block_ids, num_tokens=self.num_tokens if num_tokens is None else num_tokens,
            remote_request_id=self.remote_request_id,
        )

    @classmethod
    def parse(cls, data: object) -> "TransferParams":
        if not isinstance(data, dict):
            raise TransferParamsError("kv_transfer_params must be an object")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
            )
            raise TransferParamsError(f"invalid kv_transfer_params: {problems}") from None
