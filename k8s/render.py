#!/usr/bin/env python3
"""Render a raypd release (its NetworkPolicies and KubeRay RayService) for given sizes; YAML on
stdout. Helm-free: Python + PyYAML.

    python k8s/render.py --prefill-replicas 2 --decode-replicas 3 --prefill-tp 2 --decode-tp 4 > raypd.yaml
    python k8s/render.py --cpu --prefill-replicas 2 | kubectl apply -f -
    python k8s/render.py --name llama-pd --monitoring | kubectl apply -f -   # + PodMonitors

The shape comes from a template, read as is: `k8s/base/rayservice.yaml` (--gpu, the
default) or `k8s/overlays/cpu/rayservice.yaml` (--cpu). The options change only
sizes and names, and they change each size everywhere it appears, so prefill and
decode scale independently and stay consistent:

  --<role>-replicas N  worker group replicas/minReplicas/maxReplicas and <role>.count
                       in the raypd args (one engine per pod)
  --<role>-tp T        <role>.tp_size in the args and, with --gpu, the pod's
                       nvidia.com/gpu (requests and limits) and rayStartParams num-gpus
  --worker-cpus C      pod cpu (requests and limits), rayStartParams num-cpus and the
                       engines' num_cpus
  --worker-memory M    pod memory (requests and limits)

  --name N             the release: RayService, Serve app and raypd deployment name, the
                       pods' app.kubernetes.io/instance label (what the NetworkPolicies and
                       PodMonitors select), their names, and the API-key Secret `N-api-keys`
  --kuberay-namespace  where the KubeRay operator runs (the dashboard policy admits it)
  --monitoring         also the PodMonitors of k8s/monitoring (and their NetworkPolicy;
                       --prometheus-namespace says where Prometheus runs)

The NetworkPolicies come from k8s/security/networkpolicy.yaml (always printed, before the
RayService), the monitors from k8s/monitoring/podmonitor.yaml. Anything else (UCX
settings, volumes, probes, router/transfer settings) is edited in the template. tests/unit/test_k8s_manifests.py validates renders against the
KubeRay CRDs and raypd's own config model; `python k8s/validate.py FILE` does the
same for any file.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

K8S_DIR = Path(__file__).resolve().parent
TEMPLATES = {
    "gpu": K8S_DIR / "base" / "rayservice.yaml",
    "cpu": K8S_DIR / "overlays" / "cpu" / "rayservice.yaml",
}
SECURITY = K8S_DIR / "security" / "networkpolicy.yaml"
MONITORING = K8S_DIR / "monitoring" / "podmonitor.yaml"
TEMPLATE_RELEASE = "raypd"  # the release name the shipped files use
INSTANCE_LABEL = "app.kubernetes.io/instance"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
ROLES = ("prefill", "decode")
GPU = "nvidia.com/gpu"
IMPORT_PATH = "serving.cluster.app:build_app"
CPU_VLLM_MEMORY = "6Gi"  # vLLM (CPU) with SmolLM2: ~4 GB RSS per engine (notes/vllm-cpu-facts.md)
CPU_VLLM_CPUS = "2"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # namespace names


class RenderError(ValueError):
    """Sizes or names that cannot make a valid raypd RayService."""


# ------------------------------------------------------------------ helpers
def ray_resources_param(resources: dict[str, float]) -> str:
    """rayStartParams `resources` value: JSON, quoted for the shell KubeRay runs `ray start` in."""
    return '"' + json.dumps(resources).replace('"', '\\"') + '"'


def parse_ray_resources_param(value: str) -> dict[str, float]:
    """Inverse of `ray_resources_param` (also accepts unquoted JSON)."""
    words = shlex.split(value)
    if len(words) != 1:
        raise ValueError(f"rayStartParams resources {value!r} is not one shell word")
    data = json.loads(words[0])
    if not isinstance(data, dict):
        raise ValueError(f"rayStartParams resources {value!r} is not a JSON object")
    return data


def serve_app(serve_config: dict) -> dict:
    """The raypd application (import_path serving.cluster.app:build_app) of a Serve config."""
    apps = [a for a in serve_config.get("applications") or [] if a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise RenderError(f"expected one application with import_path {IMPORT_PATH}, found {len(apps)}")
    return apps[0]


def worker_group(cluster: dict, name: str) -> dict:
    for group in cluster.get("workerGroupSpecs") or []:
        if group.get("groupName") == name:
            return group
    raise RenderError(f"the template has no worker group {name!r}")


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _all_containers(cluster: dict) -> list[dict]:
    groups = [cluster["headGroupSpec"], *(cluster.get("workerGroupSpecs") or [])]
    return [c for g in groups for c in _containers(g)]


def _set_resource(container: dict, name: str, value: Any) -> None:
    res = container.setdefault("resources", {})
    for kind in ("requests", "limits"):
        res.setdefault(kind, {})[name] = value


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise RenderError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _cpu_count(cpus: str) -> int:
    """Whole CPUs for Ray from a k8s cpu quantity ("2", "1500m" -> 1)."""
    text = str(cpus)
    value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    if value < 1:
        raise RenderError(f"--worker-cpus must give at least one whole CPU, got {cpus!r}")
    return int(value)


# ------------------------------------------------------------------- render
def load_template(accel: str) -> dict:
    if accel not in TEMPLATES:
        raise RenderError(f"accel must be one of {sorted(TEMPLATES)}, got {accel!r}")
    return yaml.safe_load(TEMPLATES[accel].read_text())


def render(accel: str = "gpu", *, prefill_replicas: int | None = None, decode_replicas: int | None = None,
           prefill_tp: int | None = None, decode_tp: int | None = None, backend: str | None = None,
           model: str | None = None, worker_cpus: str | None = None, worker_memory: str | None = None,
           ingress_replicas: int | None = None, image: str | None = None, name: str | None = None,
           namespace: str | None = None, template: dict | None = None) -> dict:
    """The RayService as a dict. None keeps the template's value."""
    _positive("--prefill-replicas", prefill_replicas, 0)
    _positive("--decode-replicas", decode_replicas, 1)
    _positive("--prefill-tp", prefill_tp)
    _positive("--decode-tp", decode_tp)
    _positive("--ingress-replicas", ingress_replicas)
    if name is not None and (not _DNS1035.match(name) or len(name) > 47):
        raise RenderError(f"--name must be a DNS-1035 label of at most 47 characters, got {name!r}")
    doc = copy.deepcopy(template) if template is not None else load_template(accel)
    spec = doc["spec"]
    cluster = spec["rayClusterConfig"]
    serve_config = yaml.safe_load(spec["serveConfigV2"])
    app = serve_app(serve_config)
    args = app.setdefault("args", {})
    if "config_path" in args:
        raise RenderError("the template's args use config_path; render needs the deployment inline")

    if backend is not None and backend != args.get("backend", "vllm"):
        _switch_backend(args, backend, accel)
    if model is not None:
        if args.get("backend", "vllm") != "vllm":
            raise RenderError("--model needs the vllm backend")
        args["model"] = model
    if accel == "cpu" and args.get("backend", "vllm") == "vllm":  # vLLM (CPU) wants more than the template's pods
        worker_cpus = CPU_VLLM_CPUS if worker_cpus is None else worker_cpus
        worker_memory = CPU_VLLM_MEMORY if worker_memory is None else worker_memory

    sizes = {"prefill": (prefill_replicas, prefill_tp), "decode": (decode_replicas, decode_tp)}
    for role, (replicas, tp) in sizes.items():
        group = worker_group(cluster, role)
        engine = args.setdefault(role, {})
        if replicas is not None:
            group["replicas"] = group["minReplicas"] = group["maxReplicas"] = replicas
            engine["count"] = replicas
        if tp is not None:
            engine["tp_size"] = tp
            if accel == "gpu":
                gpus = tp * int(engine.get("pp_size", 1))
                for container in _containers(group)[:1]:  # the Ray container
                    _set_resource(container, GPU, gpus)
                group.setdefault("rayStartParams", {})["num-gpus"] = str(gpus)
            elif args.get("backend", "vllm") == "vllm" and tp > 1:
                raise RenderError("vLLM on CPU pods is rendered with tp_size 1 only (TP on CPU needs explicit "
                                  "core binding; the embedded SmolLM2 has 9 heads): use --gpu or --backend synthetic")
        if worker_cpus is not None:
            for container in _containers(group)[:1]:
                _set_resource(container, "cpu", str(worker_cpus))
            group.setdefault("rayStartParams", {})["num-cpus"] = str(_cpu_count(worker_cpus))
            engine["num_cpus"] = _cpu_count(worker_cpus)
        if worker_memory is not None:
            for container in _containers(group)[:1]:
                _set_resource(container, "memory", str(worker_memory))
    _check_tp(args)

    if ingress_replicas is not None:
        args.setdefault("http", {})["num_replicas"] = ingress_replicas
    if image is not None:
        for container in _all_containers(cluster):
            container["image"] = image
    if name is not None:
        doc["metadata"]["name"] = name
        args["name"] = name
        app["name"] = name
        _rename_release(doc, name)
    if namespace is not None:
        doc["metadata"]["namespace"] = namespace
    spec["serveConfigV2"] = yaml.dump(serve_config, Dumper=_Dumper, sort_keys=False)
    return doc


def _rename_release(node: Any, name: str) -> None:
    """The release's instance labels/selectors and its API-key Secret reference, in place."""
    if isinstance(node, dict):
        if node.get(INSTANCE_LABEL) == TEMPLATE_RELEASE:
            node[INSTANCE_LABEL] = name
        ref = node.get("secretKeyRef")
        if isinstance(ref, dict) and ref.get("name") == f"{TEMPLATE_RELEASE}-api-keys":
            ref["name"] = f"{name}-api-keys"
        for value in node.values():
            _rename_release(value, name)
    elif isinstance(node, list):
        for item in node:
            _rename_release(item, name)


def _set_peer_namespace(policy: dict, namespace: str) -> None:
    for rule in policy["spec"].get("ingress") or []:
        for peer in rule.get("from") or []:
            labels = (peer.get("namespaceSelector") or {}).get("matchLabels") or {}
            if NAMESPACE_LABEL in labels:
                labels[NAMESPACE_LABEL] = namespace


def render_release(accel: str = "gpu", *, monitoring: bool = False, kuberay_namespace: str | None = None,
                   prometheus_namespace: str | None = None, **options: Any) -> list[dict]:
    """NetworkPolicies, the RayService and (monitoring) the PodMonitors of one release."""
    for flag, ns in (("--kuberay-namespace", kuberay_namespace), ("--prometheus-namespace", prometheus_namespace)):
        if ns is not None and (not _DNS1123_LABEL.match(ns) or len(ns) > 63):
            raise RenderError(f"{flag} must be a namespace name, got {ns!r}")
    service = render(accel, **options)
    name, namespace = service["metadata"]["name"], service["metadata"].get("namespace")
    policies = list(yaml.safe_load_all(SECURITY.read_text()))
    monitors = list(yaml.safe_load_all(MONITORING.read_text())) if monitoring else []
    for doc in policies + monitors:
        doc["metadata"]["name"] = name + doc["metadata"]["name"][len(TEMPLATE_RELEASE):]
        if namespace is not None:
            doc["metadata"]["namespace"] = namespace
        _rename_release(doc, name)
        if doc["kind"] == "NetworkPolicy":
            wanted = prometheus_namespace if doc in monitors else kuberay_namespace
            if wanted is not None:
                _set_peer_namespace(doc, wanted)
    return policies + [service] + monitors


def _switch_backend(args: dict, backend: str, accel: str) -> None:
    if backend == "synthetic":
        args["backend"] = "synthetic"
        args.setdefault("synthetic", {"model_id": "synthetic-tiny", "num_layers": 4, "num_kv_heads": 4,
                                      "head_size": 32})
        for key in ("model", "dtype"):
            args.pop(key, None)
    elif backend == "vllm":
        name = args.get("name")
        rest = {k: v for k, v in args.items() if k not in ("name", "backend", "synthetic", "model", "dtype",
                                                         "max_model_len")}
        args.clear()
        if name is not None:
            args["name"] = name
        args.update({
            "backend": "vllm",
            "model": "smollm2",  # the embedded model; a model folder needs a volume in the template
            "dtype": "float32" if accel == "cpu" else "bfloat16",
            "max_model_len": 2048,
        })
        args.update(rest)
        for role in ROLES:
            group = args.get(role, {})
            group.pop("synthetic", None)  # the synthetic backend's KV cache
            if accel == "cpu":
                group.pop("block_size", None)  # vLLM's CPU attention wants multiples of 32: use its default
    else:
        raise RenderError(f"--backend must be vllm or synthetic, got {backend!r}")


def _check_tp(args: dict) -> None:
    """raypd's rule (serving/config.py): prefill and decode tp_size divide one another."""
    p, d = int(args.get("prefill", {}).get("tp_size", 1)), int(args.get("decode", {}).get("tp_size", 1))
    if args.get("prefill", {}).get("count", 1) and max(p, d) % min(p, d):
        raise RenderError(f"prefill tp {p} and decode tp {d} must divide one another")


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (serveConfigV2), keys in template order."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str)


def to_yaml(doc: dict | list[dict], header: str | None = None) -> str:
    docs = doc if isinstance(doc, list) else [doc]
    text = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100) for d in docs)
    return (f"# {header}\n" if header else "") + text


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    accel = p.add_mutually_exclusive_group()
    accel.add_argument("--gpu", dest="accel", action="store_const", const="gpu",
                       help="GPU pods (k8s/base/rayservice.yaml; the default)")
    accel.add_argument("--cpu", dest="accel", action="store_const", const="cpu",
                       help="CPU-only pods for kind/minikube (k8s/overlays/cpu/rayservice.yaml)")
    p.set_defaults(accel="gpu")
    p.add_argument("--prefill-replicas", type=int, help="prefill pods = prefill engines (>= 0)")
    p.add_argument("--decode-replicas", type=int, help="decode pods = decode engines (>= 1)")
    p.add_argument("--prefill-tp", type=int, help="tensor-parallel size of each prefill engine (= GPUs per pod)")
    p.add_argument("--decode-tp", type=int, help="tensor-parallel size of each decode engine (= GPUs per pod)")
    p.add_argument("--backend", choices=["vllm", "synthetic"],
                   help="engine backend (templates: gpu vllm, cpu synthetic)")
    p.add_argument("--model", help="vllm: a model folder inside the pods (e.g. /models/<name>) or smollm2")
    p.add_argument("--worker-cpus", help=f"cpu of each prefill/decode pod, e.g. 8 (--cpu --backend vllm: "
                                         f"default {CPU_VLLM_CPUS})")
    p.add_argument("--worker-memory", help=f"memory of each prefill/decode pod, e.g. 64Gi "
                                           f"(--cpu --backend vllm: default {CPU_VLLM_MEMORY})")
    p.add_argument("--ingress-replicas", type=int, help="Ray Serve ingress replicas (http.num_replicas)")
    p.add_argument("--image", help="container image of every pod (template: ghcr.io/your-org/raypd:latest)")
    p.add_argument("--name", help="RayService name (also the raypd deployment and Serve app name)")
    p.add_argument("--namespace", help="metadata.namespace of every document")
    p.add_argument("--kuberay-namespace", help="namespace of the KubeRay operator (template: default)")
    p.add_argument("--monitoring", action="store_true", help="also print the PodMonitors (k8s/monitoring)")
    p.add_argument("--prometheus-namespace", help="namespace of Prometheus, with --monitoring (template: monitoring)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k != "accel"}
    try:
        docs = render_release(args.accel, **options)
    except RenderError as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 2
    header = "rendered by: python k8s/render.py " + " ".join(shlex.quote(a) for a in argv)
    sys.stdout.write(to_yaml(docs, header.rstrip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
