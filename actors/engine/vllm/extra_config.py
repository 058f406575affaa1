"""What raypd's connector reads from vLLM's `kv_connector_extra_config`, typed on both sides.

vLLM carries `kv_connector_extra_config` as a plain dict from the engine's arguments to the
connector it builds in the engine core (scheduler half) and in every worker process (worker half).
The engine writes it with `ConnectorExtraConfig.to_extra_config()`; the connector reads it back
once with `ConnectorExtraConfig.from_extra_config()`. The deployment's `transfer:` section crosses
whole, as `TransferConfig.model_dump()` under one key (`TRANSFER_KEY`), so its defaults stay in
`TransferConfig` and nothing below reads it by string key.

No vLLM or torch import here: the engine actor builds it before vLLM starts, and unit tests use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from actors.transfer_config import TransferConfig

TRANSFER_KEY = "raypd_transfer"  # the key of TransferConfig.model_dump() in kv_connector_extra_config


class ConnectorExtraConfig(BaseModel):
    # extra="ignore": vLLM (or an operator's kv_transfer_config) may put keys of its own beside ours
    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    engine_id: str | None = None  # None: the connector uses kv_transfer_config.engine_id
    handshake_dir: str | None = None  # where each rank writes its handshake payload for the engine actor
    model_id: str | None = None  # what the compatibility hash calls the model (None: the model folder's name)
    incarnation: str | None = None  # suffix of this engine's agent names, shared by its ranks (None: per rank)
    fault_seed: int = 0  # seeds the fault knob's verdicts (transfer.fault_rate)
    transfer: TransferConfig = Field(TransferConfig(), alias=TRANSFER_KEY)

    def to_extra_config(self) -> dict[str, Any]:
        """The dict vLLM carries (plain JSON values: vLLM pickles it into its processes)."""
        return self.model_dump(mode="json", by_alias=True)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorExtraConfig":
        """Validate what vLLM handed the connector (a missing key takes the typed default)."""
        return cls.model_validate(dict(extra or {}))
