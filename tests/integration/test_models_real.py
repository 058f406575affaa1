"""actors.models.local for real: GGUF -> safetensors conversion and tiny random Llamas (transformers, no vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from actors.models.local import MARKER_FILE, SMOLLM2_NAME, smollm2_path  # noqa: E402
from actors.models.tiny_llama import build_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """A fresh conversion into a temp cache (about 25 s on 2 cores); removed afterwards (540 MB)."""
    root = tmp_path_factory.mktemp("model-cache")
    messages: list[str] = []
    started = time.monotonic()
    path = smollm2_path(root, progress=messages.append)
    elapsed = time.monotonic() - started
    yield path, messages, elapsed
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2[0], local_files_only=True)


def test_conversion_writes_a_complete_float32_folder(smollm2):
    path, messages, elapsed = smollm2
    assert path.name == SMOLLM2_NAME
    assert messages[0].startswith(f"converting {SMOLLM2_NAME} GGUF -> safetensors (one time")
    names = {p.name for p in path.iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_FILE}
    assert expected <= names
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"], config["vocab_size"]) == (30, 9, 3, 64, 576, 49152)
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config

    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as weights:
        keys = list(weights.keys())
        dtypes = {str(weights.get_slice(k).get_dtype()) for k in keys}
    assert dtypes == {"F32"}
    assert len(keys) >= 30 * 9 + 2  # 9 tensors per layer + embeddings + final norm


def test_second_call_is_immediate(smollm2):
    path = smollm2[0]
    started = time.monotonic()
    assert smollm2_path(path.parent, progress=None) == path
    assert time.monotonic() - started < 1.0


def test_tokenizer_and_chat_template(tokenizer):
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    for special, token_id in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)]:
        assert tokenizer(special, add_special_tokens=False).input_ids == [token_id]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_weights_load_and_answer_sensibly(smollm2, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2[0], local_files_only=True).eval()
    assert model.dtype == torch.float32
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_tiny_llama_seed_changes_weights_not_config(smollm2, tmp_path):
    import torch

    a = build_tiny_llama(tmp_path / "a", tokenizer_dir=smollm2[0], seed=0, progress=None)
    b = build_tiny_llama(tmp_path / "b", tokenizer_dir=smollm2[0], seed=1, progress=None)
    a_again = build_tiny_llama(tmp_path / "a2", tokenizer_dir=smollm2[0], seed=0, progress=None)

    config_a = json.loads((a / "config.json").read_text())
    assert config_a == json.loads((b / "config.json").read_text())
    shape = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
             "vocab_size")
    assert tuple(config_a[k] for k in shape) == (2, 4, 2, 64, 256, 49152)
    assert config_a.get("dtype", config_a.get("torch_dtype")) == "float32"

    wa, wb, wa2 = _tensors(a), _tensors(b), _tensors(a_again)
    assert wa.keys() == wb.keys() == wa2.keys()
    assert all(t.dtype == torch.float32 for t in wa.values())
    random_keys = [k for k in wa if "norm" not in k]  # norms start at 1 whatever the seed
    assert random_keys and all(not torch.equal(wa[k], wb[k]) for k in random_keys)
    assert all(torch.equal(wa[k], wa2[k]) for k in wa)  # same seed, same weights
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_tiny_llama_generates_with_its_tokenizer(smollm2, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_llama(tmp_path / "tiny", tokenizer_dir=smollm2[0], num_layers=1, head_dim=32,
                            seed=3, progress=None)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    new = out[0, inputs.input_ids.shape[1]:].tolist()
    assert len(new) == 6 and len(set(new)) > 1  # context-dependent, not one repeated token
    assert isinstance(tok.decode(new), str)
