"""What a model costs on the hardware: the rates a short measurement found, per engine size.

  EngineProfile      one engine size's rates (the product's one linear model, actors/rates.py):
                     seconds = step_s * steps + step_per_stream_s * steps * batch + prompt_tokens / prefill_tokens_per_s
  HardwareProfile    the unit (CPU cores or GPUs), how many the box has, the measured sizes, the KV
                     transfer between engines; `for_size(units)` gives any size (measured or extrapolated)
  load_profile(path) a profile file (YAML), validated; ProfileError names the bad field

A profile file (configs/profiles/*.yaml):

  unit: cpu                 # cpu: an engine's size is CPU cores; gpu: GPUs (its tensor parallel size)
  total_units: 2
  transfer_tokens_per_s: 20000
  transfer_overhead_s: 0.1
  engines:
    - {cores: 1, step_s: 0.06, step_per_stream_s: 0.002, prefill_tokens_per_s: 600}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from serving.config import ConfigError, read_config_file

Unit = Literal["cpu", "gpu"]
_STRICT = ConfigDict(extra="forbid")  # a misspelt field is an error, not a silent default
Positive = Annotated[float, Field(gt=0)]


class ProfileError(ValueError):
    """A profile file is missing, not YAML, or invalid; the message names the field."""


@dataclass(frozen=True, config=_STRICT)
class EngineProfile:
    """The rates of one engine of `cores` units (CPU cores or GPUs)."""

    cores: Annotated[int, Field(ge=1, le=1024)]
    step_s: Positive  # a: a step's fixed part
    step_per_stream_s: Annotated[float, Field(ge=0)]  # b: its growth per decoding stream
    prefill_tokens_per_s: Positive  # 1 / c
    measured: bool = True  # False: extrapolated from another size (`HardwareProfile.for_size`)

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s


@dataclass(frozen=True, config=_STRICT)
class HardwareProfile:
    """A model on one kind of box: its unit, how many units it has, the engine sizes measured there."""

    unit: Unit
    total_units: Annotated[int, Field(ge=1, le=4096)]
    engines: tuple[EngineProfile, ...]
    transfer_tokens_per_s: Positive  # a KV pull between two engines: overhead + tokens / this rate
    transfer_overhead_s: Annotated[float, Field(ge=0)]

    @model_validator(mode="after")
    def _sizes_fit(self) -> "HardwareProfile":
        sizes = [e.cores for e in self.engines]
        if not sizes:
            raise ValueError("engines: at least one measured size")
        if len(set(sizes)) != len(sizes):
            raise ValueError(f"engines: each size once (got cores {sizes})")
        if min(sizes) > self.total_units:
            raise ValueError(f"engines: no measured size fits in total_units {self.total_units}")
        return self

    @property
    def sizes(self) -> tuple[int, ...]:
        """The measured sizes that fit on the box, ascending."""
        return tuple(sorted(e.cores for e in self.engines if e.cores <= self.total_units))

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_overhead_s + tokens / self.transfer_tokens_per_s

    def for_size(self, cores: int) -> EngineProfile:
        """The measured profile of `cores`, else one extrapolated (`measured=False`) from the nearest
        measured size (ties: the smaller), assuming the prefill rate scales linearly with the units
        and the step time does not change. Both are guesses (cores share memory bandwidth; a wider
        tensor-parallel step pays more communication): measure the sizes you mean to deploy."""
        if cores < 1:
            raise ValueError(f"an engine needs at least one unit (got {cores})")
        nearest = min(self.engines, key=lambda e: (abs(e.cores - cores), e.cores))
        if nearest.cores == cores:
            return nearest
        return EngineProfile(cores=cores, step_s=nearest.step_s, step_per_stream_s=nearest.step_per_stream_s,
                             prefill_tokens_per_s=nearest.prefill_tokens_per_s * cores / nearest.cores,
                             measured=False)


def parse_profile(data: object, source: str = "profile") -> HardwareProfile:
    """A profile from the mapping a file holds; ProfileError lists every bad field."""
    if not isinstance(data, dict):
        raise ProfileError(f"{source} must hold a mapping at the top level")
    try:
        return HardwareProfile(**data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: "
                             f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors())
        raise ProfileError(f"invalid hardware profile {source}: {problems}") from None
    except TypeError as exc:  # a field missing or unknown before validation starts
        raise ProfileError(f"invalid hardware profile {source}: {exc}") from None


def load_profile(path: str | Path) -> HardwareProfile:
    try:
        data = read_config_file(path)  # the one YAML reader of raypd's files
    except ConfigError as exc:
        raise ProfileError(f"hardware profile: {exc}") from None
    return parse_profile(data, str(path))
