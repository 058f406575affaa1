"""The front's vLLM preprocessing on the embedded model's folder (tokenizer only, no engine)."""

from __future__ import annotations

import asyncio

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError

from actors.models.local import resolve_model
from actors.protocol.request import ModelInfo
from serving.front.served_model import VllmServedModel

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model():
    path = str(resolve_model("smollm2"))
    return VllmServedModel(ModelInfo("vllm", 512, 49152, model_path=path, tokenizer=path,
                                     default_sampling_params={"temperature": 0.3, "top_k": 7}))


def test_chat_is_rendered_with_the_models_template(model):
    ids = asyncio.run(model.render_chat(ChatCompletionRequest(messages=MESSAGES)))
    text = model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ids == model.tokenizer.encode(text, add_special_tokens=False)


def test_out_of_vocabulary_ids_are_refused(model):
    with pytest.raises(VLLMValidationError, match="out of vocabulary"):
        asyncio.run(model.render_completion(CompletionRequest(prompt=[1, 49152])))


def test_unset_sampling_parameters_come_from_the_generation_config(model):
    sp = model.sampling_params(CompletionRequest(prompt="hi", top_k=3), num_prompt_tokens=1)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.3, 3, 16)
