"""The served model as the front sees it: render prompts, derive sampling, tokenize.

One `ServedModel` per ingress replica, built once from the `ModelInfo` an
engine reports (tokenizer folder, context length, vocabulary, the generation
config's sampling defaults):

  VllmServedModel       vLLM's own preprocessing without an engine (what
                        `vllm launch render` runs): `OnlineRenderer` applies
                        the chat template and tokenizes in its thread pool,
                        truncates and checks lengths and token ids with
                        vLLM's messages; `SamplingParams.verify` checks the
                        sampling parameters against the model;
  SyntheticServedModel  the synthetic engine's byte tokenizer and template.

Both derive `SamplingParams` exactly as vLLM's serving code does:
`get_max_tokens(...)` then `request.to_sampling_params(max_tokens,
default_sampling_params)` (request value, then generation config, then
OpenAI's default).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import SamplingParams

from actors.decode_caps import NO_CAPS, replay_reason
from actors.protocol.request import ModelInfo
from actors.engine.synthetic.tokenizer import chat_to_text, decode_tokens, encode_text

if TYPE_CHECKING:
    from ray.actor import ActorHandle

SEED_BITS = 63

OpenAIRequest = CompletionRequest | ChatCompletionRequest


class ServedModel:
    """Shared part: the sampling parameters, derived the way vLLM's serving code does."""

    info: ModelInfo

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def sampling_params(self, request: OpenAIRequest, num_prompt_tokens: int) -> SamplingParams:
        requested = request.max_tokens
        if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
            requested = request.max_completion_tokens
        max_tokens = get_max_tokens(self.info.max_model_len, requested, num_prompt_tokens,
                                    self.info.default_sampling_params, self.info.override_max_tokens,
                                    truncate_prompt_tokens=request.truncate_prompt_tokens)
        sp = request.to_sampling_params(max_tokens, self.info.default_sampling_params)
        if sp.seed is None and sp.temperature > 0 and replay_reason(sp, NO_CAPS) is not None:
            # A parameter the decode engine may have to replay the first token for: a seed, so
            # that the replay draws the prefill engine's token again (actors.decode_caps).
            # Other requests keep vLLM's unseeded sampling.
            sp.seed = random.getrandbits(SEED_BITS)
        self.verify(sp)
        return sp

    def verify(self, sp: SamplingParams) -> None:
        return None

    def check_token_ids(self, ids: list[int], parameter: str = "prompt") -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.info.vocab_size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise VLLMValidationError(f"Token id {bad} is out of vocabulary", parameter=parameter)


class VllmServedModel(ServedModel):
    def __init__(self, info: ModelInfo):
        """Blocking (loads the tokenizer and the model's config): build it in a thread."""
        from vllm import envs
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        self.info = info
        args = AsyncEngineArgs(model=info.model_path, tokenizer=info.tokenizer or info.model_path,
                               tokenizer_mode=info.tokenizer_mode, trust_remote_code=info.trust_remote_code,
                               max_model_len=info.max_model_len)
        model_config = args.create_model_config()
        model_config.quantization = None  # preprocessing only, as vLLM's render server
        envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache here: silence the CPU platform's warning
        self.vllm_config = VllmConfig(model_config=model_config,
                                      structured_outputs_config=args.create_structured_outputs_config())
        self.model_config = model_config
        self.renderer = renderer_from_config(self.vllm_config)
        self.online = OnlineRenderer(model_config=model_config, renderer=self.renderer, request_logger=None,
                                     chat_template=None, chat_template_content_format="auto")
        self.online.warmup()

    @property
    def tokenizer(self) -> Any:
        return self.renderer.get_tokenizer()

    @staticmethod
    def _ids(result: Any) -> list[int]:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if isinstance(result, ErrorResponse):
            raise VLLMValidationError(result.error.message, parameter=result.error.param)
        engine_inputs = result[1] if isinstance(result, tuple) else result
        if len(engine_inputs) != 1:
            raise VLLMValidationError(f"batched prompts ({len(engine_inputs)}) are not supported: "
                                      "send one prompt per request", parameter="prompt")
        return list(engine_inputs[0]["prompt_token_ids"])

    async def render_completion(self, request: CompletionRequest) -> list[int]:
        ids = self._ids(await self.online.render_completion(request))
        self.renderer.validate_token_ids(ids, parameter="prompt")
        return ids

    async def render_chat(self, request: ChatCompletionRequest) -> list[int]:
        return self._ids(await self.online.render_chat(request))

    def verify(self, sp: SamplingParams) -> None:
        sp.verify(self.model_config, None, self.vllm_config.structured_outputs_config, self.tokenizer)

    async def tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if isinstance(request, TokenizeChatRequest):
            err = self.online.validate_chat_template(request.chat_template, request.chat_template_kwargs, False)
            if err is not None:
                raise VLLMValidationError(err.error.message)
            _, inputs = await self.online.preprocess_chat(
                request, request.messages, default_template=None, default_template_content_format="auto",
                default_template_kwargs=None,
                tool_dicts=None if request.tools is None else [t.model_dump() for t in request.tools],
                skip_mm_cache=True)
        else:
            inputs = await self.online.preprocess_completion(request, prompt_input=request.prompt,
                                                             prompt_embeds=None, skip_mm_cache=True)
        ids = [t for i in inputs for t in i["prompt_token_ids"]]
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return ids, strs

    async def detokenize(self, request: DetokenizeRequest) -> str:
        prompt = await self.renderer.tokenize_prompt_async(TokensPrompt(prompt_token_ids=request.tokens),
                                                            request.build_tok_params(self.model_config))
        return prompt["prompt"]


class SyntheticServedModel(ServedModel):
    """The synthetic engine's byte tokenizer; vLLM's request models, limits and messages."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self.model_config = _Limits(info.max_model_len)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise VLLMValidationError(f"batched prompts ({len(prompt)}) are not supported: "
                                          "send one prompt per request", parameter="prompt")
            prompt = prompt[0]
        return encode_text(prompt) if isinstance(prompt, str) else list(prompt or [])

    def _checked(self, request: Any, ids: list[int]) -> list[int]:
        if not ids:
            raise VLLMValidationError("The decoder prompt cannot be empty", parameter="prompt")
        self.check_token_ids(ids)
        tokens = request.build_tok_params(self.model_config).apply_post_tokenization(
            None, TokensPrompt(prompt_token_ids=ids))
        return list(tokens["prompt_token_ids"])

    async def render_completion(self, request: CompletionRequest) -> list[int]:
        if request.suffix is not None:
            raise VLLMValidationError("suffix is only supported for models with FIM completion rendering",
                                      parameter="suffix")
        return self._checked(request, self._prompt_ids(request.prompt))

    def _chat_text(self, request: ChatCompletionRequest | TokenizeChatRequest) -> str:
        pairs = []
        for m in request.messages:
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            if isinstance(content, list):
                texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(texts) != len(content):
                    raise VLLMValidationError("the synthetic model takes text content only", parameter="messages")
                content = "".join(texts)
            role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "user")
            pairs.append((str(role), content or ""))
        return chat_to_text(pairs, add_generation_prompt=request.add_generation_prompt)

    async def render_chat(self, request: ChatCompletionRequest) -> list[int]:
        # UTF-8 bytes are the tokens: cheaper inline than a hop to a thread
        return self._checked(request, encode_text(self._chat_text(request)))

    async def tokenize(self, request: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        text = self._chat_text(request) if isinstance(request, TokenizeChatRequest) else request.prompt
        ids = encode_text(text)
        return ids, [decode_tokens([t]) for t in ids] if request.return_token_strs else None

    async def detokenize(self, request: DetokenizeRequest) -> str:
        self.check_token_ids(list(request.tokens), parameter="tokens")
        return decode_tokens(request.tokens)


class _Limits:
    """The part of vLLM's ModelConfig that the request models' `build_tok_params` read."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len


async def served_model(info: ModelInfo) -> ServedModel:
    if info.backend == "vllm":
        return await asyncio.to_thread(VllmServedModel, info)
    return SyntheticServedModel(info)


class LaunchedEngines(Protocol):
    """What the front reads of a launched deployment (`serving.cluster.engines.Deployment`)."""

    @property
    def decodes(self) -> Mapping[str, ActorHandle]: ...


def model_info_of(deployment: LaunchedEngines) -> ModelInfo:
    """Ask one decode engine of a launched deployment. Blocking."""
    import ray

    return ray.get(next(iter(deployment.decodes.values())).model_info.remote())


def served_model_of(deployment: LaunchedEngines) -> ServedModel:
    """The front's model for a launched deployment (launchers, tests). Blocking."""
    info = model_info_of(deployment)
    return VllmServedModel(info) if info.backend == "vllm" else SyntheticServedModel(info)
