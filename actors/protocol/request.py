"""A request's types between the front, the router and the engines (typed, picklable over Ray).

Invariants: engines never tokenize a prompt (the front renders and tokenizes it into an
`EngineRequest`: token ids + `SamplingSpec`); a prefill's `PrefillResult` carries the first token
and the transfer params naming the prompt's KV blocks; the first `TokenChunk` of a decode carries
the transfer verdict. `kv_transfer_params` stays a dict: it is vLLM's own boundary
(`SamplingParams.extra_args`), validated by `actors.transfer_params`. The life cycle of one P/D
request through these types: `EngineRequest`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any


class EngineRequestError(ValueError):
    """The engine refuses the request itself (bad prompt, bad params, too long): the client's fault."""


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. The front derives it the way vLLM's OpenAI server does
    (request values, then the model's generation config, then OpenAI's defaults).

    `vllm_params` is that `vllm.SamplingParams`, pickled: only the vLLM backend
    decodes it, so the router and the synthetic engine never import vLLM; the
    plain fields repeat what they read.
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    vllm_params: bytes | None = None


@dataclass(frozen=True)
class EngineRequest:
    """Life cycle of one P/D request through these types:

      front    the HTTP body is parsed, rendered (chat template) and tokenized with the
               served model's tokenizer into an `EngineRequest`: prompt token ids +
               `SamplingSpec` (engines never tokenize a prompt);
      prefill  `Backend.prefill(EngineRequest)` -> `PrefillResult`: the first
               sampled token (streamed to the client at once) and the transfer
               params that name the prompt's KV blocks on the prefill engine;
      decode   `Backend.generate(EngineRequest)` with prompt + first token and the
               transfer params -> a stream of `TokenChunk`s; the first chunk
               carries the transfer verdict (`recomputed`, or an error);
      front    each `TokenChunk` becomes an SSE event or part of the JSON answer.

    `kv_transfer_params` stays a dict: it is vLLM's own boundary
    (`SamplingParams.extra_args`), validated by `actors.transfer_params`.
    """

    request_id: str
    sampling: SamplingSpec = SamplingSpec()
    prompt_token_ids: tuple[int, ...] = ()
    kv_transfer_params: dict[str, Any] | None = None
    # A continuation: the prompt ends with this many tokens the model already generated
    # (the prefill engine's first token, or a migrated stream's tokens).
    num_resumed_tokens: int = 0
    # The summed logprob of those tokens (the prefill engine's), when logprobs were asked for:
    # the decode engine's cumulative logprob continues from it.
    resumed_logprob: float | None = None
    lease_ttl_s: float | None = None
    kv_seed: int = 0  # synthetic backend: the seed of its KV pattern

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def replace(self, **changes: Any) -> "EngineRequest":
        return dataclasses.replace(self, **changes)

    def with_max_tokens(self, max_tokens: int) -> "EngineRequest":
        return self.replace(sampling=dataclasses.replace(self.sampling, max_tokens=max_tokens))


@dataclass(frozen=True)
class TokenLogprob:
    """One entry of a position's logprobs as vLLM returns them (the sampled token, then the top ones)."""

    token_id: int
    logprob: float
    rank: int | None = None
    decoded: str | None = None


# Per generated token, in order: that position's entries.
Logprobs = tuple[tuple[TokenLogprob, ...], ...]


@dataclass(frozen=True)
class PrefillResult:
    """A prefill's output: the first token and, when a decode engine must continue, the KV handoff."""

    prompt_token_ids: tuple[int, ...]
    first_token_ids: tuple[int, ...]
    first_text: str
    finish_reason: str | None  # "length": the decode engine continues; "stop": the answer is complete
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int | None = None  # vLLM: prompt tokens the prefill engine's prefix cache held
    first_logprobs: Logprobs | None = None  # the first token's logprobs (requests that ask for them)
    cumulative_logprob: float | None = None
    # Characters at the end of `first_text` that one engine's stream would still hold back when
    # the answer goes on (vLLM's stop-string buffer: the longest stop string less one); the
    # decode engine streams them (or the stop string they begin) with the next tokens.
    held_chars: int = 0
    # (hop, CLOCK_MONOTONIC seconds) set by the engine on the way to the first token (`Stamps`)
    stamps: tuple[tuple[str, float], ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def replace(self, **changes: Any) -> "PrefillResult":
        return dataclasses.replace(self, **changes)

    @property
    def streamed_text(self) -> str:
        """What the client gets with the first token: `first_text` less the held-back tail
        when the decode engine continues (all of it when the answer is complete)."""
        held = min(self.held_chars, len(self.first_text)) if self.needs_decode else 0
        return self.first_text[:len(self.first_text) - held]

    @property
    def needs_decode(self) -> bool:
        return self.kv_transfer_params is not None and self.finish_reason == "length"

    def continuation(self, req: EngineRequest) -> EngineRequest:
        """The decode engine's request: prompt + first token, the KV handoff, the rest of max_tokens."""
        return req.replace(
            prompt_token_ids=self.prompt_token_ids + self.first_token_ids,
            kv_transfer_params=self.kv_transfer_params, num_resumed_tokens=len(self.first_token_ids),
            resumed_logprob=self.cumulative_logprob,
        ).with_max_tokens(req.max_tokens - len(self.first_token_ids))


@dataclass(frozen=True)
class TokenChunk:
    """One streamed delta; the last one has `finished` and `finish_reason`."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop | length | error | abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None  # first chunk of a vLLM decode: prompt tokens it did not compute
    recomputed: bool = False  # first chunk: the KV pull failed and the prompt was recomputed locally
    error: str | None = None
    logprobs: Logprobs | None = None  # one entry per token id (requests that ask for logprobs)
    cumulative_logprob: float | None = None  # of the whole answer so far
    stamps: tuple[tuple[str, float], ...] = ()  # first chunk of a stream: (hop, CLOCK_MONOTONIC s), see Stamps

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error"

    @property
    def failed_before_output(self) -> bool:
        """A failure with no token: nothing reached the client, another engine may take it."""
        return self.failed and not self.token_ids

    def replace(self, **changes: Any) -> "TokenChunk":
        return dataclasses.replace(self, **changes)

    def merge(self, later: "TokenChunk") -> "TokenChunk":
        """This delta followed by `later` as one delta (a consumer that fell behind takes what
        arrived at once): token ids and text concatenated; what the first delta of a stream says
        (prompt size, cached tokens, the transfer verdict, stamps) from this one; how the stream
        ended (finished, finish_reason, error) from `later`; logprobs concatenated, the cumulative
        logprob the later one's."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or ()) + (later.logprobs or ())
        return TokenChunk(
            self.request_id, self.token_ids + later.token_ids, self.text + later.text,
            finished=later.finished, finish_reason=later.finish_reason,
            num_prompt_tokens=self.num_prompt_tokens or later.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens if self.num_cached_tokens is not None else later.num_cached_tokens,
            recomputed=self.recomputed or later.recomputed, error=later.error,
            stamps=self.stamps or later.stamps, logprobs=logprobs,
            cumulative_logprob=later.cumulative_logprob if later.cumulative_logprob is not None
            else self.cumulative_logprob)

    @classmethod
    def error_chunk(cls, request_id: str, message: str, num_prompt_tokens: int = 0) -> "TokenChunk":
        return cls(request_id, finished=True, finish_reason="error", error=message,
                   num_prompt_tokens=num_prompt_tokens)


@dataclass(frozen=True)
class InboxRoute:
    """Where an engine sends one stream's chunks instead of Ray items: a same-node consumer's
    inbox (`serving.cluster.token_inbox`). `key` is the stream's random key: the inbox drops,
    unread, every frame that does not carry a key it handed out."""

    node_id: str  # the consumer's Ray node: an engine elsewhere refuses (InboxUnreachable)
    endpoint: str  # ipc://... in a directory only this user can enter
    key: bytes


class InboxUnreachable(RuntimeError):
    """The engine refuses this inbox: it is on another node (nothing ran; read it by Ray items)."""


class Stamps:
    """Per-request timestamps on the way to the first token: (hop, seconds) pairs of
    CLOCK_MONOTONIC (`time.monotonic()`), which every process of one host shares; across
    hosts only differences taken within one process mean anything. Appending costs a
    clock read, so they are always taken; the front shows them on request (`serving.front.trace`)."""

    FRONT_IN = "front_in"  # the ingress's handler has the request (after HTTP, the Serve proxy, the replica)
    PREPARED = "prepared"  # parsed, rendered, tokenized, sampling params derived
    ROUTED = "routed"  # the router chose the engines and calls the prefill engine
    ENGINE_IN = "engine_in"  # the engine actor's method runs
    VLLM_QUEUED = "vllm_queued"  # vLLM's scheduler queued the request (derived from vLLM's own stats)
    VLLM_SCHEDULED = "vllm_scheduled"  # vLLM first scheduled it (its prefill computes from here)
    VLLM_OUT = "vllm_out"  # vLLM's output handler has the first token
    ENGINE_OUT = "engine_out"  # the engine actor returns / yields it
    ROUTER_IN = "router_in"  # the router has the first token back
    SSE = "sse"  # the front writes the response's first bytes
    # not a time: prompt tokens vLLM computed in the step that produced the first token (several
    # prompts packed into one step all wait for the whole step)
    VLLM_STEP_TOKENS = "vllm_step_prompt_tokens"

    @staticmethod
    def now(name: str) -> tuple[str, float]:
        return (name, time.monotonic())


@dataclass(frozen=True)
class ModelInfo:
    """What the front needs to know about the served model, learned once from an engine."""

    backend: str  # "vllm" | "synthetic"
    max_model_len: int
    vocab_size: int
    model_path: str | None = None  # vllm: the local folder the engines loaded (tokenizer, chat template)
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    # vLLM's `ModelConfig.get_diff_sampling_param()`: the generation config's sampling
    # defaults (vLLM's own boundary, kept as the dict vLLM's request models take).
    default_sampling_params: dict[str, Any] = dataclasses.field(default_factory=dict)
    override_max_tokens: int | None = None
