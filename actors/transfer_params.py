"""The KV transfer params a prefill engine hands to a decode engine, validated.

They travel prefill engine -> router -> decode engine -> vLLM scheduler ->
decode workers. Anything forged or inconsistent is refused here with a typed
error before a single descriptor is built.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class TransferParamsError(ValueError):
    """kv_transfer_params are malformed or inconsistent."""


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
    # Fault-injection hook for tests: the pull of this request fails on purpose. Only the
    # router/tests set it; the HTTP front never forwards client-supplied transfer params.
    inject_fault: bool = False

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
