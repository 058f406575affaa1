"""Joining or starting a Ray cluster, and Ray's token authentication as raypd uses it.

Ray's token authentication is left as Ray configures it: a local cluster
started here gets Ray's default (token mode, the token created in
~/.ray/auth_token or reused from it, RAY_AUTH_TOKEN(_PATH)); joining a cluster
follows Ray's client rules (`auto` picks up a local token; an explicit address
needs RAY_AUTH_MODE=token, as for any Ray client).
"""

from __future__ import annotations

import os

import ray

from serving.cluster.names import NAMESPACE
from serving.cluster.ray_profile import apply_ray_profile
from serving.config import DeploymentConfig

DEFAULT_TEMP_DIR = "/tmp/raypd-ray"


class RayAuthError(RuntimeError):
    """The cluster refused this client's Ray token (or the missing one)."""


def init_ray(cfg: DeploymentConfig | None = None, address: str | None = None,
             temp_dir: str = DEFAULT_TEMP_DIR, log_to_driver: bool = False) -> bool:
    """Join `address` (or `cfg.ray.address`) or start a local cluster; True when we started it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    address = address or (cfg.ray.address if cfg is not None else None)
    if address:
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        except (ConnectionError, RuntimeError) as exc:
            if not _refused_token(exc):
                raise
            raise RayAuthError(
                f"the Ray cluster at {address} refused this client's Ray token (missing or wrong; RAY_AUTH_MODE "
                f"here: {os.environ.get('RAY_AUTH_MODE', 'unset')}). An explicit address does not turn token mode "
                f"on by itself: set RAY_AUTH_MODE=token and provide the cluster's token in ~/.ray/auth_token, "
                f"RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN") from None
        return False
    num_cpus = (cfg.ray.num_cpus if cfg is not None else None) or 4
    apply_ray_profile()  # Ray's processes inherit this environment (serving/cluster/ray_profile.py)
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=temp_dir, namespace=NAMESPACE,
             log_to_driver=log_to_driver)
    return True


def _refused_token(exc: BaseException) -> bool:
    """Did the GCS refuse our token? (ray.init reports it as a ConnectionError whose cause's text,
    not its type, carries the AuthenticationError.)"""
    from ray.exceptions import AuthenticationError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def use_ray_token_auth() -> None:
    """Connect with Ray token authentication unless RAY_AUTH_MODE says otherwise.

    Ray reads RAY_AUTH_MODE into its config when it loads, so the config is
    refreshed the way Ray itself does it for a new local cluster.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()


def ray_auth_mode() -> str:
    """"token" or "disabled": the mode this (connected) process runs Ray with."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return "token" if is_token_auth_enabled() else "disabled"


def ray_logs_dir() -> str:
    """This node's Ray session log folder (engine and replica logs: worker-*.out / .err)."""
    node = ray._private.worker.global_worker.node
    return node.get_logs_dir_path()
