"""From an HTTP body to the engines' `EngineRequest`, with vLLM's semantics.

  parse      vLLM's own request models (`CompletionRequest`,
             `ChatCompletionRequest`) validate the body: every parameter vLLM
             accepts is accepted, with vLLM's defaults and messages;
  refuse     what raypd cannot carry through P/D (below) gets a 400 that says so;
  render     the served model renders (chat template) and tokenizes the prompt,
             once, off the event loop, and checks ids and lengths;
  sample     `SamplingParams` derived as vLLM's serving code derives them
             (generation-config defaults included), then verified;
  hand over  `EngineRequest(prompt_token_ids, SamplingSpec)`: engines never
             tokenize; the SamplingParams travel pickled for the vLLM backend.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from actors.protocol.request import EngineRequest, SamplingSpec
from serving.front.http_errors import CLIENT_ERRORS, ApiError, invalid_request, invalid_value
from serving.front.served_model import OpenAIRequest, ServedModel

Kind = Literal["completions", "chat"]

# Fields raypd sets itself (transport between its engines): never from a client.
TRANSPORT_FIELDS = ("kv_transfer_params", "ec_transfer_params")


@dataclass(frozen=True)
class Refusal:
    param: str
    why: str


def _refusals(request: OpenAIRequest) -> list[Refusal]:
    """vLLM features raypd does not carry through P/D (each one said in the README)."""
    r: list[Refusal] = []
    if (request.n or 1) != 1:
        r.append(Refusal("n", f"n={request.n} is not supported: raypd returns exactly one choice (n=1)"))
    if request.use_beam_search:
        r.append(Refusal("use_beam_search", "beam search is not supported by raypd"))
    if request.logprobs not in (None, False, 0) or getattr(request, "top_logprobs", None) not in (None, 0):
        r.append(Refusal("logprobs", "logprobs are not supported by raypd"))
    if request.prompt_logprobs is not None:
        r.append(Refusal("prompt_logprobs", "prompt_logprobs are not supported by raypd"))
    if request.echo:
        r.append(Refusal("echo", "echo is not supported by raypd"))
    if getattr(request, "prompt_embeds", None) is not None:
        r.append(Refusal("prompt_embeds", "prompt_embeds are not supported by raypd"))
    if request.cache_salt is not None:
        r.append(Refusal("cache_salt", "cache_salt is not supported by raypd"))
    if request.priority != 0:
        r.append(Refusal("priority", "priority scheduling is not enabled"))
    for name in TRANSPORT_FIELDS:
        if getattr(request, name, None) is not None:
            r.append(Refusal(name, f"'{name}' is set by raypd between its engines; clients may not send it"))
    return r


@dataclass(frozen=True)
class PreparedRequest:
    kind: Kind
    request: OpenAIRequest
    engine_request: EngineRequest

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage)

    @property
    def continuous_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.include_usage and opts.continuous_usage_stats)

    @property
    def return_token_ids(self) -> bool:
        return bool(self.request.return_token_ids)


def parse(kind: Kind, body: dict[str, Any]) -> OpenAIRequest:
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc) from None
    except CLIENT_ERRORS as exc:  # a vLLM validator raising its own error class passes through pydantic
        raise invalid_value(exc) from None
    refused = _refusals(request)
    if refused:
        raise ApiError(400, refused[0].why, param=refused[0].param, code="unsupported_parameter")
    return request


async def prepare(kind: Kind, request: OpenAIRequest, model: ServedModel, request_id: str) -> PreparedRequest:
    """Render, tokenize and derive sampling; vLLM's refusals become 400s."""
    try:
        if kind == "chat":
            ids = await model.render_chat(request)
        else:
            ids = await model.render_completion(request)
        sp = model.sampling_params(request, len(ids))
    except CLIENT_ERRORS as exc:
        raise invalid_value(exc) from None
    except Exception as exc:  # noqa: BLE001 - a template the request breaks (jinja2.TemplateError...)
        if any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__):
            raise invalid_value(exc) from None
        raise
    spec = SamplingSpec(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
        stop=tuple(sp.stop or ()), ignore_eos=sp.ignore_eos,
        vllm_params=pickle.dumps(sp) if model.info.backend == "vllm" else None,
    )
    return PreparedRequest(kind, request, EngineRequest(request_id, spec, prompt_token_ids=tuple(ids)))
