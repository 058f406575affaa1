"""Which sampling parameters a resumed request cannot continue exactly from prompt + k tokens.

A decode engine resumes an answer from the prompt plus the k tokens the client already has
(`actors.engine.vllm.decode`); a few parameters keep state that only the engine's own sampled
outputs feed, and some need what an engine may lack (`DecodeCaps`). `replay_reason` names the
first such parameter. Two sides ask it: the decode engine (with its own caps) to decide whether
to replay the k-th token, and the front (with `NO_CAPS`, before it knows the engine) to seed the
requests whose replay must draw the same token again. Kept here, apart from the engine, so the
front asks it without importing vLLM's engine side. No Ray, no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


@dataclass(frozen=True)
class DecodeCaps:
    """What a decode engine offers a resumed request (`actors.engine.vllm.decode.decode_caps`)."""

    penalties: bool = False  # ResumedPenalties is registered (V1 runner, no speculative decoding)
    seed_advance: bool = False  # the worker advances a seeded generator exactly (CPU sampler checked)
    custom_processors: bool = False  # the user registered logits processors: their state is unknown
    watermark: bool = False  # vLLM watermarks tokens (keyed by what it generated)


NO_CAPS = DecodeCaps()  # an engine that can continue only stateless sampling exactly


class ResumableSampling(Protocol):
    """What the rule reads of a request's sampling parameters (vLLM's `SamplingParams`; read-only
    properties so that any object with these attributes fits). Attributes that only some vLLM
    versions have (`thinking_token_budget`, `repetition_detection`, the tokenized bad words) are
    read with getattr."""

    @property
    def structured_outputs(self) -> object | None: ...

    @property
    def bad_words(self) -> list[str] | None: ...

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def seed(self) -> int | None: ...

    @property
    def temperature(self) -> float: ...


def multi_token_bad_words(sp: ResumableSampling) -> bool:
    """Whether a bad word spans tokens (vLLM bans its last token after the others as *outputs*);
    unknown token ids (no tokenizer has seen the params yet) count as multi-token."""
    if not sp.bad_words:
        return False
    ids: list[list[int]] | None = getattr(sp, "_bad_words_token_ids", None)
    return ids is None or any(len(word) > 1 for word in ids)


def replay_reason(sp: ResumableSampling, caps: DecodeCaps) -> str | None:
    """Why a request resumed from prompt + k would sample differently from one engine (None: it
    would not). Pure: the front asks it with `NO_CAPS` to seed what may replay."""
    if sp.structured_outputs is not None:
        return "structured_outputs"  # the grammar advances on sampled tokens only
    if getattr(sp, "thinking_token_budget", None) is not None:
        return "thinking_token_budget"  # counts output tokens
    if getattr(sp, "repetition_detection", None) is not None:
        return "repetition_detection"  # output-only n-grams
    if multi_token_bad_words(sp):
        return "bad_words"  # the word's prefix is matched against outputs only
    if caps.custom_processors:
        return "logits_processors"
    if caps.watermark:
        return "watermarking"
    if (sp.presence_penalty or sp.frequency_penalty) and not caps.penalties:
        return "penalties"
    if sp.seed is not None and sp.temperature >= SAMPLING_EPS and not caps.seed_advance:
        return "seed"
    return None
