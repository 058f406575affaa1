"""The Ray Serve application: `build_app(config) -> serve.Application`.

One ingress deployment (FastAPI, `serving.front`) whose replicas attach to the deployment's engines
through its launcher (`serving.cluster.launcher`, the one owner of engine start-up: the first
replica's attach launches them) and route over them (`serving.routing.router`). `config` is a
deployment dict (validated by `DeploymentConfig`) or `{"config_path": <yaml>, ...overrides}`. The
three entry points it serves: `build_app`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve

from serving.config import DeploymentConfig, check_engine_args, load_config
from serving.routing.status import Readiness, RouterSnapshot

logger = logging.getLogger("raypd.app")

INGRESS_NAME = "RaypdIngress"
# The front is async end to end (tokenization runs in vLLM's thread pool): its requests run
# on the replica's own event loop instead of a second loop in a thread (a handoff per message).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_config(config: dict[str, Any] | DeploymentConfig | None) -> DeploymentConfig:
    if isinstance(config, DeploymentConfig):
        return config
    config = dict(config or {})
    path = config.pop("config_path", None)
    if path is None and isinstance(config.get("config"), str):
        path = config.pop("config")
    if path is None:
        return DeploymentConfig.from_dict(config)
    base = load_config(_find(path)).model_dump(mode="json", exclude_unset=True)
    if not config:
        return DeploymentConfig.from_dict(base)
    return DeploymentConfig.from_dict(_merge(base, _coerce(config)))


def _find(path: str) -> Path:
    """A config path as given, else relative to the project root (Serve's working dir may differ)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    in_project = Path(__file__).resolve().parents[2] / p
    return in_project if in_project.exists() else p


def _coerce(args: dict) -> dict:
    """`serve run ... http.port=8001` passes strings with dotted keys: nest them, parse scalars."""
    import yaml

    out: dict = {}
    for key, value in args.items():
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


@dataclass(frozen=True)
class IngressStatus:
    readiness: Readiness
    router: RouterSnapshot


@serve.ingress()
class RaypdIngress:
    """One replica of the HTTP front; the engines are shared by every replica."""

    async def __init__(self, config: dict):
        from serving.cluster.clients import build_router
        from serving.cluster.launcher import attach
        from serving.front import served_model

        self.cfg = DeploymentConfig.from_dict(config)
        self.deployment = await attach(self.cfg)  # the launcher starts the engines, once
        self.router = build_router(self.cfg, self.deployment)
        self.model = await served_model(await next(iter(self.deployment.decodes.values())).model_info.remote())
        logger.info("ingress replica attached to %d engines of %s", len(self.deployment.engines), self.cfg.name)

    def __serve_build_asgi_app__(self) -> Any:
        from serving.front import create_app

        return create_app(self.cfg, self.router, self.model)

    async def status(self) -> IngressStatus:
        """For `raypd status` (through a deployment handle): readiness, routing state, engine stats."""
        readiness = await self.router.readiness()
        await self.router.refresh_engine_stats()
        return IngressStatus(readiness, self.router.snapshot())

    async def check_health(self) -> None:
        """Serve's replica health check reports this replica: it answers while its event loop runs.

        Serve stops a replica whose check fails (three times in a row), which would cut every
        stream it serves, those on healthy engines too. Whether a P/D path exists is
        readiness, not liveness: `/health` answers 503 with the reason and the router refuses
        what it cannot place, while engines restart, hang or recover underneath."""


def build_app(config: dict[str, Any] | None = None) -> serve.Application:
    """The raypd Serve application for one deployment config.

    The same builder serves three entry points:

      serve run serving.cluster.app:build_app config_path=configs/synthetic.yaml
      a Serve config file / KubeRay RayService:
          applications:
            - name: raypd
              route_prefix: /
              import_path: serving.cluster.app:build_app
              args: {config_path: configs/local.yaml}     # or the deployment inline
      raypd up (serving.cli), which launches the engines first.

    `config` is either a deployment dict (validated by `DeploymentConfig`) or
    `{"config_path": <yaml>, ...overrides}`.
    """
    cfg = resolve_config(config)
    # engine_kwargs are checked by vLLM's own classes before anything deploys (as `raypd up` does)
    for note in check_engine_args(cfg):
        logger.info("raypd: note: %s", note)
    http = cfg.http
    ingress = serve.deployment(
        RaypdIngress,
        name=INGRESS_NAME,
        num_replicas=http.num_replicas,
        # our own admission control answers 429; Serve must not queue before it
        max_ongoing_requests=http.max_inflight_requests + 16,
        # a replica being stopped lets its streams finish (Serve's default cuts them after 20 s)
        graceful_shutdown_timeout_s=http.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": http.replica_num_cpus, "resources": dict(http.replica_resources),
                           "runtime_env": {"env_vars": REPLICA_ENV}},
    )
    return ingress.bind(cfg.model_dump(mode="json"))
