"""API keys of the OpenAI front: from the environment or a file, never from the config.

Each ingress replica calls `load_api_keys` when it starts: the keys come from
`RAYPD_API_KEYS` (comma-separated, in the replica's environment, i.e. the Ray
node's: `raypd up` passes its own environment to the local cluster it starts)
and from `http.api_keys_file` (one key per line, '#' starts a comment). Only
the file's path travels in the config (Serve arguments, logs, status); the keys
stay in this process. `http.require_api_keys` makes a replica that finds no key
refuse to start, so a key set on the wrong machine never leaves the API open.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from serving.config import HttpConfig

logger = logging.getLogger("raypd.api_keys")

ENV_VAR = "RAYPD_API_KEYS"


class ApiKeyError(ValueError):
    """The key file cannot be read, or keys are required and none was found."""


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys (bytes, for constant-time comparison). The repr never shows them."""

    keys: tuple[bytes, ...] = field(repr=False)
    sources: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self.keys)} key(s) from {', '.join(self.sources) or 'nowhere'})"


def _keys_from_file(path: str) -> list[str]:
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ApiKeyError(f"http.api_keys_file {path!r} cannot be read: {exc.strerror or exc}") from None
    keys = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [k for k in keys if k]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_api_keys(http: HttpConfig, environ: Mapping[str, str] | None = None) -> ApiKeys:
    """The keys this process accepts; warns when a non-loopback bind has none."""
    environ = os.environ if environ is None else environ
    keys: list[str] = []
    sources = []
    from_env = [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]
    if from_env:
        keys += from_env
        sources.append(ENV_VAR)
    if http.api_keys_file:
        from_file = _keys_from_file(http.api_keys_file)
        if not from_file:
            raise ApiKeyError(f"http.api_keys_file {http.api_keys_file!r} holds no key (one per line, '#' comments)")
        keys += from_file
        sources.append(http.api_keys_file)
    if http.require_api_keys and not keys:
        raise ApiKeyError(f"http.require_api_keys is set but no API key was found here: set {ENV_VAR} in the "
                          f"environment of the Ray nodes (where `ray start` ran) or use http.api_keys_file")
    if not keys and not is_loopback(http.host):
        logger.warning("binding %s with no API key: anyone who reaches the port can use the model "
                       "(set %s or http.api_keys_file)", http.host, ENV_VAR)
    return ApiKeys(tuple(dict.fromkeys(k.encode() for k in keys)), tuple(sources))
