"""Tiny random Llamas for fast tests: `build_tiny_llama()` writes a float32 `LlamaForCausalLM`
with SmolLM2's tokenizer (the embedded model's folder, converted once if needed).

The seed changes the weights, never the config, so a test can tell which engine's weights
produced a token. Written atomically (`actors.models.local.atomic_dir`); torch and transformers
are imported only when a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

from actors.models.local import MARKER_FILE, Progress, atomic_dir, offline, say, smollm2_path
from actors.models.model_errors import ModelConfigError

# Head sizes the vLLM CPU attention backend supports (v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def build_tiny_llama(
    path: Path,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    hidden: int | None = None,
    intermediate: int | None = None,
    max_position_embeddings: int = 2048,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
    init_std: float = 0.1,
    overwrite: bool = False,
    progress: Progress = print,
) -> Path:
    """Write a tiny random float32 `LlamaForCausalLM` + tokenizer to `path`.

    The tokenizer (and so the vocabulary) comes from `tokenizer_dir`, default the
    embedded SmolLM2 folder (converted once if needed), so chat/text work. The
    config depends only on the shape arguments and the tokenizer; `seed` only
    changes the weights. `hidden` defaults to `num_heads * head_dim`,
    `intermediate` to `2 * hidden`. `init_std` (stored as the config's
    `initializer_range`) defaults to 0.1 rather than Llama's 0.02: at 0.02 a tiny
    model's logits are nearly flat and greedy decoding repeats one token, while at
    0.1 every generated token depends on the context (and so on the KV cache),
    with clear argmax margins. Written atomically; an existing non-empty `path`
    is an error unless `overwrite`.
    """
    path = Path(path).expanduser()
    _check_tiny_args(num_layers, num_heads, num_kv_heads, head_dim, hidden, intermediate,
                     max_position_embeddings, init_std)
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise ModelConfigError(f"{path} already exists and is not empty (pass overwrite=True)")
    source = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_path(progress=progress)

    offline()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    hidden = hidden if hidden is not None else num_heads * head_dim
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate if intermediate is not None else 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.eval()
    tokenizer.model_max_length = max_position_embeddings

    with atomic_dir(path, replace=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_FILE).write_text(json.dumps(
            {"source": "build_tiny_llama", "seed": seed, "init_std": init_std, "tokenizer": str(source),
             "dtype": "float32", "written_by": "raypd serving.models"}, indent=2) + "\n")
    say(progress, f"wrote tiny Llama ({num_layers} layers, {num_heads}/{num_kv_heads} heads, "
                   f"head_dim {head_dim}, seed {seed}) -> {path}")
    return path


def _check_tiny_args(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     hidden: int | None, intermediate: int | None, max_pos: int,
                     init_std: float) -> None:
    if num_layers < 1 or num_heads < 1 or num_kv_heads < 1 or max_pos < 1:
        raise ModelConfigError("num_layers, num_heads, num_kv_heads and max_position_embeddings must be >= 1")
    if num_heads % num_kv_heads:
        raise ModelConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim not in CPU_HEAD_SIZES:
        raise ModelConfigError(f"head_dim {head_dim} is not supported by vLLM's CPU attention; "
                               f"use one of {sorted(CPU_HEAD_SIZES)}")
    if hidden is not None and hidden < 1:
        raise ModelConfigError(f"hidden must be >= 1, got {hidden}")
    if intermediate is not None and intermediate < 1:
        raise ModelConfigError(f"intermediate must be >= 1, got {intermediate}")
    if not init_std > 0:
        raise ModelConfigError(f"init_std must be > 0, got {init_std}")
