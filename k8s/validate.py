#!/usr/bin/env python3
"""Validate raypd's Kubernetes manifests without a cluster; every check returns messages, [] = valid.

    python k8s/validate.py k8s/base/rayservice.yaml k8s/security/networkpolicy.yaml k8s/monitoring/podmonitor.yaml
    python k8s/render.py --prefill-replicas 4 --monitoring | python k8s/validate.py -

Per document (tests/unit/test_k8s_manifests.py runs all of them):

crd_errors       (crd.py) RayService/RayCluster/RayJob against the KubeRay CRD's OpenAPI v3
                 schema (k8s/kuberay_crds, vendored), strict like `kubectl apply`.
core_errors      (kube_rules.py) the core Kubernetes rules for the pod templates KubeRay turns
                 into Pods, and the KubeRay operator's own checks.
security_errors  (posture.py) raypd's own security rules: Ray token auth (authOptions), no
                 exposed head Service, no uid 0, IPC_LOCK the only added capability and only
                 for RDMA, /tmp writable under a read-only root, API keys only from a Secret.
                 The generic pod hardening is checkov's (checkov_scan.py).
document_errors  (policies.py) NetworkPolicy, PodMonitor and Secret against small schemas of
                 our own plus their rules; Ray pods' metrics port and prometheus.io annotations.
raypd_errors     the raypd deployment inside a RayService: Ray Serve's schema for
                 serveConfigV2, import_path == serving.cluster.app:build_app (imported and called:
                 it validates the args with DeploymentConfig and builds the Serve app), no API
                 keys inline, and the manifest <-> config consistency: replicas == <role>.count
                 with one engine per pod (custom resources), GPUs == tp_size, engine CPUs fit,
                 ports, /health readiness on the engine pods (never on the head), the model
                 folder on a volume, /dev/shm, UCX. For a RayJob: its `raypd bench` entrypoint
                 parses with raypd's own CLI parser and takes its API key from the environment.

Across all documents given (release_fit.release_errors): the NetworkPolicies / PodMonitors /
Secrets fit the Ray pods they are for. The CLI also prints, per Ray document, the Pod
Security Standards level its pods meet (the namespace's enforce level must allow it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import shlex
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import yaml

K8S_DIR = Path(__file__).resolve().parent
REPO = K8S_DIR.parent
if str(REPO) not in sys.path:  # raypd (serving.*) for the raypd layer
    sys.path.insert(0, str(REPO))
if str(K8S_DIR) not in sys.path:
    sys.path.insert(0, str(K8S_DIR))

from crd import crd_errors  # noqa: E402
from kube_rules import core_errors, parse_quantity  # noqa: E402
from policies import KINDS as POLICY_KINDS, document_errors  # noqa: E402
from posture import API_KEYS_ENV, document_security_level, security_errors  # noqa: E402
from release_fit import release_errors  # noqa: E402
from render import IMPORT_PATH, ROLES, parse_ray_resources_param  # noqa: E402

GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------------------- raypd
def ray_container(group: dict) -> dict:
    """The Ray container of a group (KubeRay: the first one)."""
    return ((group.get("template") or {}).get("spec") or {}).get("containers", [{}])[0]


def named_port(container: dict, name_or_number: Any) -> int | None:
    if isinstance(name_or_number, int):
        return name_or_number
    for p in container.get("ports") or []:
        if p.get("name") == name_or_number:
            return p.get("containerPort")
    return None


def group_ray_resources(group: dict) -> dict[str, float]:
    """Custom Ray resources one pod of the group advertises (rayStartParams resources)."""
    value = (group.get("rayStartParams") or {}).get("resources")
    return parse_ray_resources_param(value) if value else {}


def _quantity(container: dict, name: str) -> Decimal | None:
    res = container.get("resources") or {}
    for kind in ("limits", "requests"):
        if name in (res.get(kind) or {}):
            return parse_quantity(res[kind][name])
    return None


def pod_ray_cpus(group: dict) -> float | None:
    """The CPUs Ray sees on one pod: rayStartParams num-cpus, else (as KubeRay) the container's cpu."""
    params = group.get("rayStartParams") or {}
    if "num-cpus" in params:
        return float(params["num-cpus"])
    cpu = _quantity(ray_container(group), "cpu")
    return float(cpu) if cpu is not None else None


def load_serve_config(doc: dict) -> dict:
    text = (doc.get("spec") or {}).get("serveConfigV2")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("spec.serveConfigV2: required (a Ray Serve config as a YAML string)")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("spec.serveConfigV2: must be a YAML mapping")
    return data


def raypd_app(serve_config: dict) -> dict:
    """The raypd application: the only one, or the one whose import_path is raypd's builder."""
    apps = serve_config.get("applications") or []
    if len(apps) != 1:
        apps = [a for a in apps if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise ValueError(f"serveConfigV2: expected one raypd application (import_path {IMPORT_PATH}), "
                         f"found {len(apps)}")
    return apps[0]


def resolve_import_path(path: str) -> Any:
    module, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _env(container: dict) -> dict[str, str]:
    return {e.get("name"): e.get("value") for e in container.get("env") or []}


def raypd_errors(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    if doc.get("kind") == "RayJob":
        return _bench_job_errors(doc)
    if doc.get("kind") != "RayService":
        return []
    try:
        serve_config = load_serve_config(doc)
        app = raypd_app(serve_config)
    except (ValueError, yaml.YAMLError) as exc:
        return [str(exc)]
    errs = []
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(serve_config)
    except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError
        errs.append(f"serveConfigV2 is not a valid Ray Serve config: {exc}")
    if app.get("route_prefix", "/") != "/":
        errs.append(f"serveConfigV2: the raypd app's route_prefix must be '/' (OpenAPI paths), "
                    f"got {app['route_prefix']!r}")
    from serving.config import ConfigError

    if app.get("import_path") != IMPORT_PATH:
        errs.append(f"serveConfigV2: import_path {app.get('import_path')!r} is not raypd's builder {IMPORT_PATH}")
    try:
        builder = resolve_import_path(app.get("import_path") or "")
        import serving.cluster.app

        if builder is not serving.cluster.app.build_app:
            return errs + [f"import_path {app.get('import_path')!r} does not resolve to serving.cluster.app.build_app"]
        cfg = serving.cluster.app.resolve_config(app.get("args"))  # what build_app does with its args
        application = builder(app.get("args"))
    except ConfigError as exc:
        return errs + [f"serveConfigV2 args: {exc}"]
    except (ImportError, AttributeError, ValueError) as exc:
        return errs + [f"import_path {app.get('import_path')!r} does not resolve: {exc}"]
    from ray.serve.deployment import Application

    if not isinstance(application, Application):
        errs.append(f"{app['import_path']}(args) returned {type(application).__name__}, not a Serve Application")
    return errs + _api_key_config_errors(serve_config, app, cfg) + _consistency_errors(doc, serve_config, cfg)


def _api_key_config_errors(serve_config: dict, app: dict, cfg: Any) -> list[str]:
    """serveConfigV2 is readable by anyone who can read the RayService: no keys in it.

    (Inline `http.api_keys` is refused by raypd's config model itself.)
    """
    errs = []
    envs = [(app.get("runtime_env") or {}).get("env_vars") or {}]
    envs += [((d.get("ray_actor_options") or {}).get("runtime_env") or {}).get("env_vars") or {}
             for d in app.get("deployments") or []]
    if any(API_KEYS_ENV in env for env in envs):
        errs.append(f"serveConfigV2: {API_KEYS_ENV} in a runtime_env puts the keys in the RayService; "
                    f"use the pods' env from a Secret")
    return errs


def _consistency_errors(doc: dict, serve_config: dict, cfg: Any) -> list[str]:
    errs = []
    cluster = doc["spec"].get("rayClusterConfig") or {}
    head = cluster.get("headGroupSpec") or {}
    groups = {g.get("groupName"): g for g in cluster.get("workerGroupSpecs") or []}
    http_options = serve_config.get("http_options") or {}
    serve_port = http_options.get("port", 8000)
    if serve_port != cfg.http.port:
        errs.append(f"Serve http_options.port {serve_port} != raypd http.port {cfg.http.port}")
    if http_options.get("host", "0.0.0.0") != "0.0.0.0" or cfg.http.host != "0.0.0.0":
        errs.append(f"Serve http_options.host and raypd http.host must be 0.0.0.0 in a pod "
                    f"(got {http_options.get('host')!r} and {cfg.http.host!r})")
    head_c = ray_container(head)
    if named_port(head_c, "serve") != serve_port:
        errs.append(f"head container: needs a port named 'serve' = {serve_port}")
    if str((head.get("rayStartParams") or {}).get("num-cpus")) != "0":
        errs.append("headGroupSpec.rayStartParams num-cpus must be \"0\": no engine or CPU work on the head")
    head_probe = ((head_c.get("readinessProbe") or {}).get("httpGet") or {})
    if head_probe.get("path") == "/health":
        errs.append("head container: no /health readinessProbe (KubeRay deploys the Serve app only once the head "
                    "is Ready, so it would never pass)")
    for where, container in [("head container", head_c)] + [
            (f"worker group {name!r}", ray_container(g)) for name, g in groups.items()]:
        for kind in ("livenessProbe", "startupProbe"):
            if ((container.get(kind) or {}).get("httpGet") or {}).get("path") == "/health":
                errs.append(f"{where}: no {kind} on /health: it is readiness (503 while an engine restarts or "
                            f"hangs), and a failed {kind} restarts the pod and its engines")
    head_res = group_ray_resources(head)
    for role in ROLES:
        ecfg, group_cfg = cfg.engine_config(role), getattr(cfg, role)
        demand = dict(group_cfg.resources)
        if role in head_res:
            errs.append(f"the head advertises the {role!r} resource: {role} engines could land there")
        group = groups.get(role)
        if group is None:
            if group_cfg.count:
                errs.append(f"no worker group {role!r} for {group_cfg.count} {role} engine(s)")
            continue
        gw = f"worker group {role!r}"
        if not demand:
            errs.append(f"{role}.resources is empty: {role} engines would not be tied to the {role!r} pods "
                        f"(use resources: {{{role}: 1}})")
        supply = group_ray_resources(group)
        per_pod = min((int(supply.get(k, 0) // v) for k, v in demand.items() if v > 0), default=0)
        if demand and per_pod != 1:
            errs.append(f"{gw}: a pod must fit exactly one {role} engine (pod resources {supply}, "
                        f"engine asks {demand}: fits {per_pod})")
        for other, og in groups.items():
            if other != role and demand and all(group_ray_resources(og).get(k, 0) >= v for k, v in demand.items()):
                errs.append(f"worker group {other!r} also fits {role} engines ({demand})")
        replicas, lo, hi = group.get("replicas"), group.get("minReplicas"), group.get("maxReplicas")
        if not replicas == lo == hi == group_cfg.count:
            errs.append(f"{gw}: replicas/minReplicas/maxReplicas {replicas}/{lo}/{hi} must all equal "
                        f"{role}.count {group_cfg.count} (one engine per pod, static engine count)")
        c = ray_container(group)
        cpus = pod_ray_cpus(group)
        bundle_cpus = max(ecfg.num_cpus, 0.01)  # the engine's placement-group bundle (serving/cluster/launcher.py)
        if cpus is not None and bundle_cpus > cpus:
            errs.append(f"{gw}: an engine's placement group asks {bundle_cpus} Ray CPUs, a pod has {cpus}")
        gpus = _quantity(c, GPU)
        want = ecfg.tp_size * ecfg.pp_size
        num_gpus = (group.get("rayStartParams") or {}).get("num-gpus")
        if gpus:
            if gpus != want:
                errs.append(f"{gw}: {GPU} {gpus} != {role}.tp_size x pp_size = {want}")
            if num_gpus is not None and Decimal(str(num_gpus)) != gpus:
                errs.append(f"{gw}: rayStartParams num-gpus {num_gpus} != {GPU} {gpus}")
            if _env(c).get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") != "1":
                errs.append(f"{gw}: set RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (engine actors reserve no Ray "
                            f"GPUs, and Ray hides all GPUs from such actors)")
            if cfg.backend != "vllm":
                errs.append(f"{gw}: GPU pods with the {cfg.backend} backend would leave the GPUs idle")
        else:
            if num_gpus not in (None, "0"):
                errs.append(f"{gw}: rayStartParams num-gpus {num_gpus} without {GPU} in the pod")
            if cfg.backend == "vllm" and cfg.dtype != "float32":
                errs.append(f"{gw}: vLLM on CPU pods needs dtype float32, got {cfg.dtype}")
        if "UCX_TLS" not in _env(c):
            errs.append(f"{gw}: set UCX_TLS (NIXL/UCX transports between pods)")
        mounts = {m.get("mountPath"): m for m in c.get("volumeMounts") or []}
        volumes = {v.get("name"): v for v in ((group.get("template") or {}).get("spec") or {}).get("volumes") or []}
        shm = mounts.get("/dev/shm")
        if not shm or (volumes.get(shm.get("name"), {}).get("emptyDir") or {}).get("medium") != "Memory":
            errs.append(f"{gw}: mount an emptyDir with medium Memory at /dev/shm (Ray object store, UCX shared memory)")
        if cfg.backend == "vllm" and cfg.model.startswith("/"):
            if not any(cfg.model == mp or cfg.model.startswith(mp.rstrip("/") + "/") for mp in mounts if mp):
                errs.append(f"{gw}: model folder {cfg.model} is on no volume mounted in the pod")
        probe = c.get("readinessProbe") or {}
        get = probe.get("httpGet") or {}
        if get.get("path") != "/health" or named_port(c, get.get("port")) != serve_port:
            errs.append(f"{gw}: readinessProbe must be httpGet /health on the Serve port {serve_port}")
    for name in groups:
        if name not in ROLES:
            errs.append(f"worker group {name!r}: raypd places engines only on 'prefill' and 'decode' groups")
    return errs


def bench_argv(doc: dict) -> list[str]:
    """The argv of a RayJob's entrypoint, unwrapped from `bash -c '[exec] ...'` (which defers
    environment expansion to the job's head, see k8s/rayjob-bench.yaml)."""
    argv = shlex.split(str((doc.get("spec") or {}).get("entrypoint", "")))
    if argv[:2] in (["bash", "-c"], ["sh", "-c"]) and len(argv) >= 3:
        argv = shlex.split(argv[2])
        argv = argv[1:] if argv[:1] == ["exec"] else argv
    return argv


def _bench_job_errors(doc: dict) -> list[str]:
    try:
        argv = bench_argv(doc)
    except ValueError as exc:
        return [f"spec.entrypoint: not a shell command: {exc}"]
    if argv[:2] != ["raypd", "bench"]:
        return []  # not a raypd bench job: nothing raypd-specific to check
    from serving.cli.main import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv[1:])
    except SystemExit:
        return [f"spec.entrypoint: `raypd bench` refuses its arguments: {stderr.getvalue().strip()}"]
    errs = []
    if args.overhead:
        errs.append("spec.entrypoint: --overhead starts its own local cluster; a job benchmarks a deployed service")
    from urllib.parse import urlparse

    url = urlparse(args.url)
    if url.scheme not in ("http", "https") or not url.hostname:
        errs.append(f"spec.entrypoint: --url {args.url!r} is not an http(s) URL")
    if args.api_key is not None and not args.api_key.startswith("$"):
        errs.append("spec.entrypoint: --api-key is a literal key in the RayJob; expand it from the environment "
                    f"(e.g. \"${{{API_KEYS_ENV}%%,*}}\" inside bash -c '...', the variable from a Secret)")
    return errs


def bench_url(doc: dict) -> str:
    """The --url of a `raypd bench` RayJob."""
    from serving.cli.main import build_parser

    return build_parser().parse_args(bench_argv(doc)[1:]).url


# ------------------------------------------------------------------------------ all
def validate(doc: Any, crd_dir: str | None = None) -> list[str]:
    """Every per-document check for one manifest."""
    if isinstance(doc, dict) and doc.get("kind") in POLICY_KINDS:
        return document_errors(doc)
    errs = crd_errors(doc, crd_dir)
    errs += core_errors(doc)
    if not errs:  # the other checks assume a well-formed manifest
        errs += security_errors(doc) + document_errors(doc) + raypd_errors(doc)
    return errs


def validate_all(docs: list[Any], crd_dir: str | None = None) -> list[str]:
    """Every document, then the documents against each other (what `validate.py FILE...` checks)."""
    errs = [f"{_label(d)}: {e}" for d in docs for e in validate(d, crd_dir)]
    return errs + release_errors(docs)


def _label(doc: Any) -> str:
    return f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"


def iter_documents(paths: list[str]) -> Iterator[tuple[str, Any]]:
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for i, doc in enumerate(yaml.safe_load_all(text)):
            if doc is not None and not (isinstance(doc, dict) and doc.get("kind") == "Kustomization"):
                yield f"{path}#{i}", doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="manifests ('-' = stdin)")
    p.add_argument("--crds", default=None, help="directory of KubeRay CRD YAML/JSON files (default: k8s/kuberay_crds, vendored)")
    args = p.parse_args(argv)
    bad, docs = 0, []
    for where, doc in iter_documents(args.files):
        docs.append(doc)
        errs = validate(doc, args.crds)
        kind = doc.get("kind") if isinstance(doc, dict) else "?"
        level = document_security_level(doc) if not errs else None
        note = f"; Pod Security level: {level[0]}" if level else ""
        print(f"{where} ({kind}): " + ("ok" + note if not errs else f"{len(errs)} problem(s)"))
        for e in errs:
            print(f"  - {e}")
        for reason in (level[1] if level else []):
            print(f"    ({reason})")
        bad += bool(errs)
    across = release_errors(docs)
    if across:
        print(f"across the {len(docs)} documents: {len(across)} problem(s)")
        for e in across:
            print(f"  - {e}")
    return 1 if bad or across else 0


if __name__ == "__main__":
    sys.exit(main())
