"""Models named by a Hugging Face hub id ("org/name").

raypd itself never downloads weights. A hub id resolves to
- its snapshot folder when the local Hugging Face cache holds it (works offline);
- else, with HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, a clear error: the
  model must be put in the cache beforehand, or given as a local folder;
- else the id itself, once a metadata request shows the hub answers and knows
  the model: vLLM downloads it when the engine starts (on every node, into the
  Hugging Face cache). No hub access gives a clear error naming both ways out.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from actors.models.model_errors import HubModelUnavailableError as Unavailable

HUB_PROBE_TIMEOUT_S = 10.0
# A hub repo id: "name" or "org/name" (letters, digits, '-', '_', '.'), as huggingface_hub validates it.
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_TRUE = {"1", "on", "yes", "true"}


def looks_like_hub_id(text: str) -> bool:
    return bool(HUB_ID.match(text)) and ".." not in text and "--" not in text


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as set now (huggingface_hub reads them once, at import)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True,
                                        cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError):
        return None
    return folder if (folder / "config.json").is_file() else None


def resolve_hub_model(repo_id: str) -> Path | str:
    """The cached snapshot folder of `repo_id`, or `repo_id` itself for vLLM to download."""
    cached = _cached_snapshot(repo_id)
    if cached is not None:
        return cached
    local = ("or set `model:` / --model to a local model folder (a folder with config.json, "
             "e.g. one made with `hf download " + repo_id + " --local-dir DIR` where the hub is reachable)")
    if hub_offline():
        raise Unavailable(f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, "
                          f"so it cannot be downloaded: fill the cache where the hub is reachable "
                          f"(`hf download {repo_id}`, same HF_HOME), {local}")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
    except GatedRepoError:
        raise Unavailable(f"model {repo_id!r} is gated on the hub: accept its terms, set HF_TOKEN, {local}") from None
    except RepositoryNotFoundError:
        raise Unavailable(f"model {repo_id!r} was not found on the hub at {endpoint} (a private model needs "
                          f"HF_TOKEN); {local}") from None
    except Exception as exc:  # noqa: BLE001 - any network failure means: no hub access from here
        raise Unavailable(
            f"model {repo_id!r} is not in the local Hugging Face cache and the hub at {endpoint} cannot be reached "
            f"({type(exc).__name__}). Without hub access: set HF_HUB_OFFLINE=1 with the model in the local "
            f"Hugging Face cache, {local}") from None
    return repo_id
