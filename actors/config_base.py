"""The base of every raypd config model: a key it does not know is refused, and it is frozen.

Imports nothing of raypd, so that every config module, in actors/ and serving/, builds on it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown keys (a misspelt setting is an error, never a silent
    default) and cannot be changed once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
