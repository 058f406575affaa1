#!/usr/bin/env python3
"""Validate raypd's KubeRay manifests without a cluster; every check returns messages, [] = valid.

    python k8s/validate.py k8s/base/rayservice.yaml k8s/rayjob-bench.yaml
    python k8s/render.py --prefill-replicas 4 | python k8s/validate.py -

Three layers (tests/unit/test_k8s_manifests.py runs all of them):

crd_errors    the KubeRay CRD's OpenAPI v3 schema for the document's apiVersion/kind
              (`spec.versions[name=v1].schema.openAPIV3Schema` of ../shared/kuberay-crds/*.yaml),
              with jsonschema. Like `kubectl apply` (server-side field validation Strict),
              unknown fields are errors; int32/int64 ranges and the uniqueness that
              x-kubernetes-list-type/-list-map-keys imply are checked. CEL rules
              (x-kubernetes-validations: only `managedBy`/GCS-FT immutability here) and the
              other x-kubernetes-* keys are ignored.
core_errors   what the CRD schema cannot say about the embedded pod templates, i.e. the
              core Kubernetes rules the API server applies to the Pods KubeRay creates
              (kubernetes-validate is not a dependency): names, images, resource
              quantities, requests <= limits, extended resources, ports, probes, volumes,
              env; plus the KubeRay operator's own checks (ray-operator
              controllers/ray/utils/validation.go): name length, min/max replicas, ...
raypd_errors  the raypd deployment inside a RayService: Ray Serve's schema for
              serveConfigV2, import_path == serving.app:build_app (imported and called:
              it validates the args with DeploymentConfig and builds the Serve app),
              and the manifest <-> config consistency: replicas == <role>.count with one
              engine per pod (custom resources), GPUs == tp_size, engine CPUs fit,
              ports, /health readiness on the engine pods (never on the head), the
              model folder on a volume, /dev/shm, UCX. For a RayJob: its `raypd bench`
              entrypoint parses with raypd's own CLI parser.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import os
import re
import shlex
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterable, Iterator

import yaml

K8S_DIR = Path(__file__).resolve().parent
REPO = K8S_DIR.parent
if str(REPO) not in sys.path:  # raypd (serving.*) for the raypd layer
    sys.path.insert(0, str(REPO))
if str(K8S_DIR) not in sys.path:
    sys.path.insert(0, str(K8S_DIR))

from render import IMPORT_PATH, ROLES, parse_ray_resources_param  # noqa: E402

GPU = "nvidia.com/gpu"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are ~1 MB each
MAX_NAME = {"RayService": 47, "RayJob": 47, "RayCluster": 53}  # KubeRay validation.go


# ----------------------------------------------------------------------------- CRDs
def crd_dir_candidates() -> list[Path]:
    env = os.environ.get("RAYPD_KUBERAY_CRDS")
    return ([Path(env)] if env else []) + [REPO.parent / "shared" / "kuberay-crds", Path("/work/shared/kuberay-crds")]


def find_crd_dir() -> Path:
    for cand in crd_dir_candidates():
        if cand.is_dir() and any(cand.glob("*.yaml")):
            return cand
    raise FileNotFoundError("KubeRay CRDs not found; looked in " + ", ".join(map(str, crd_dir_candidates()))
                            + " (set RAYPD_KUBERAY_CRDS)")


def _strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema where objects with `properties` refuse unknown fields
    (unless x-kubernetes-preserve-unknown-fields) and `nullable` admits null."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if "not" in out:
        out["not"] = _strict(out["not"])
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _k8s_validator_class():
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def list_map_keys(validator, keys, instance, schema):
        if not validator.is_type(instance, "array"):
            return
        props = (schema.get("items") or {}).get("properties") or {}
        seen: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
            if key in seen:
                yield ValidationError(f"duplicate entries [{seen[key]}] and [{i}] for key "
                                      f"{dict(zip(keys, key))} (x-kubernetes-list-type: map)")
            seen.setdefault(key, i)

    def list_type(validator, kind, instance, schema):
        if kind == "set" and validator.is_type(instance, "array"):
            for i, item in enumerate(instance):
                if item in instance[:i]:
                    yield ValidationError(f"duplicate item {item!r} (x-kubernetes-list-type: set)")

    return jsonschema.validators.extend(jsonschema.Draft7Validator, {
        "x-kubernetes-list-map-keys": list_map_keys,
        "x-kubernetes-list-type": list_type,
    })


def _format_checker():
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name, bits in (("int32", 32), ("int64", 64)):
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        checker.checks(name)(lambda v, lo=lo, hi=hi: not isinstance(v, int) or lo <= v <= hi)
    return checker


@functools.lru_cache(maxsize=None)
def crd_validators(crd_dir: str | None = None) -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a jsonschema validator, for every served version of every CRD."""
    directory = Path(crd_dir) if crd_dir else find_crd_dir()
    cls, checker = _k8s_validator_class(), _format_checker()
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served", True):
                    schema = _strict(version["schema"]["openAPIV3Schema"])
                    out[(f"{group}/{version['name']}", kind)] = cls(schema, format_checker=checker)
    return out


def _path(parts: Iterable[Any]) -> str:
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text or "(root)"


def crd_errors(doc: Any, crd_dir: str | None = None) -> list[str]:
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    validators = crd_validators(crd_dir)
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in validators:
        known = ", ".join(f"{a} {k}" for a, k in sorted(validators))
        return [f"no KubeRay CRD serves apiVersion {key[0]!r} kind {key[1]!r} (known: {known})"]
    errors = sorted(validators[key].iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]


# ------------------------------------------------------------------ core Kubernetes
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_IANA_SVC = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$")
_SUFFIX = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10 ** 3, "M": 10 ** 6,
           "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30,
           "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}
_STANDARD_RESOURCES = {"cpu", "memory", "ephemeral-storage", "storage"}
_VOLUME_SOURCES = {
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
    "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs",
    "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim", "photonPersistentDisk", "portworxVolume",
    "projected", "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume",
}


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ("500m", "16Gi", 2, "1e3") as a Decimal; ValueError if malformed."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"quantity {value!r} must be a string or an integer")
    m = _QUANTITY.match(str(value).strip() if isinstance(value, int) else value)
    if not m:
        raise ValueError(f"quantity {value!r} does not parse (e.g. 500m, 2, 16Gi)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    try:
        amount = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the regex already guarantees a number
        raise ValueError(f"quantity {value!r}: {exc}") from None
    scale = Decimal(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") else Decimal(_SUFFIX[suffix])
    return (-1 if sign == "-" else 1) * amount * scale


def _qualified_key(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return bool(name) and len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def _metadata_errors(meta: Any, where: str) -> list[str]:
    errs = []
    if not isinstance(meta, dict):
        return [f"{where}: must be a mapping"] if meta is not None else []
    for key, value in (meta.get("labels") or {}).items():
        if not _qualified_key(str(key)):
            errs.append(f"{where}.labels: invalid key {key!r}")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errs.append(f"{where}.labels[{key}]: invalid label value {value!r}")
    for key in (meta.get("annotations") or {}):
        if not _qualified_key(str(key)):
            errs.append(f"{where}.annotations: invalid key {key!r}")
    ns = meta.get("namespace")
    if ns is not None and (not isinstance(ns, str) or len(ns) > 63 or not _DNS1123_LABEL.match(ns)):
        errs.append(f"{where}.namespace: {ns!r} is not a DNS-1123 label")
    return errs


def _resources_errors(res: Any, where: str) -> list[str]:
    if res is None:
        return []
    errs: list[str] = []
    parsed: dict[str, dict[str, Decimal]] = {"requests": {}, "limits": {}}
    for kind in ("requests", "limits"):
        for name, value in ((res or {}).get(kind) or {}).items():
            if not _qualified_key(name):
                errs.append(f"{where}.{kind}: invalid resource name {name!r}")
            try:
                parsed[kind][name] = q = parse_quantity(value)
            except ValueError as exc:
                errs.append(f"{where}.{kind}[{name}]: {exc}")
                continue
            if q < 0:
                errs.append(f"{where}.{kind}[{name}]: must not be negative")
            if name not in _STANDARD_RESOURCES and not name.startswith("hugepages-") and q != q.to_integral_value():
                errs.append(f"{where}.{kind}[{name}]: extended resources must be whole numbers, got {value!r}")
    req, lim = parsed["requests"], parsed["limits"]
    for name, q in req.items():
        extended = name not in _STANDARD_RESOURCES and not name.startswith("hugepages-")
        if name in lim and q > lim[name]:
            errs.append(f"{where}: requests[{name}] {q} exceeds limits[{name}] {lim[name]}")
        if extended and name not in lim:
            errs.append(f"{where}: extended resource {name} needs a limit (it cannot be overcommitted)")
        if extended and name in lim and q != lim[name]:
            errs.append(f"{where}: extended resource {name}: requests ({q}) must equal limits ({lim[name]})")
    return errs


def _probe_errors(probe: Any, where: str, port_names: set[str]) -> list[str]:
    if probe is None:
        return []
    errs = []
    handlers = [h for h in ("httpGet", "tcpSocket", "exec", "grpc") if h in probe]
    if len(handlers) != 1:
        errs.append(f"{where}: needs exactly one of httpGet/tcpSocket/exec/grpc, has {handlers or 'none'}")
    for h in ("httpGet", "tcpSocket"):
        if h in probe:
            port = probe[h].get("port")
            if isinstance(port, int):
                if not 1 <= port <= 65535:
                    errs.append(f"{where}.{h}.port: {port} out of range 1..65535")
            elif port not in port_names:
                errs.append(f"{where}.{h}.port: {port!r} names no port of this container ({sorted(port_names)})")
    path = (probe.get("httpGet") or {}).get("path")
    if path is not None and not str(path).startswith("/"):
        errs.append(f"{where}.httpGet.path: {path!r} must start with '/'")
    return errs


def _container_errors(c: dict, where: str, volumes: set[str]) -> list[str]:
    errs = []
    name = c.get("name")
    if not isinstance(name, str) or len(name) > 63 or not _DNS1123_LABEL.match(name):
        errs.append(f"{where}.name: {name!r} is not a DNS-1123 label")
    image = c.get("image")
    if not isinstance(image, str) or not image.strip() or image != image.strip() or " " in image:
        errs.append(f"{where}.image: required, a non-empty image reference without spaces (got {image!r})")
    if c.get("imagePullPolicy") not in (None, "Always", "IfNotPresent", "Never"):
        errs.append(f"{where}.imagePullPolicy: {c.get('imagePullPolicy')!r} is not Always/IfNotPresent/Never")
    port_names: set[str] = set()
    for i, p in enumerate(c.get("ports") or []):
        pw = f"{where}.ports[{i}]"
        cp = p.get("containerPort")
        if not isinstance(cp, int) or isinstance(cp, bool) or not 1 <= cp <= 65535:
            errs.append(f"{pw}.containerPort: {cp!r} must be an integer in 1..65535")
        if p.get("protocol", "TCP") not in ("TCP", "UDP", "SCTP"):
            errs.append(f"{pw}.protocol: {p.get('protocol')!r} is not TCP/UDP/SCTP")
        pn = p.get("name")
        if pn is not None:
            if (not isinstance(pn, str) or len(pn) > 15 or not _IANA_SVC.match(pn) or "--" in pn
                    or not re.search("[a-z]", pn)):
                errs.append(f"{pw}.name: {pn!r} is not an IANA service name (<= 15 chars, a-z0-9-, one letter)")
            elif pn in port_names:
                errs.append(f"{pw}.name: duplicate port name {pn!r}")
            port_names.add(str(pn))
    env_names = set()
    for i, e in enumerate(c.get("env") or []):
        en = e.get("name")
        if not isinstance(en, str) or not _ENV_NAME.match(en):
            errs.append(f"{where}.env[{i}].name: {en!r} is not a valid environment variable name")
        if en in env_names:
            errs.append(f"{where}.env[{i}]: duplicate variable {en!r}")
        env_names.add(en)
        if "value" in e and "valueFrom" in e:
            errs.append(f"{where}.env[{i}]: value and valueFrom are exclusive")
        if "value" in e and not isinstance(e["value"], str):
            errs.append(f"{where}.env[{i}].value: must be a string, got {e['value']!r}")
    errs += _resources_errors(c.get("resources"), f"{where}.resources")
    mounts = set()
    for i, m in enumerate(c.get("volumeMounts") or []):
        if m.get("name") not in volumes:
            errs.append(f"{where}.volumeMounts[{i}]: volume {m.get('name')!r} is not in the pod's volumes")
        mp = m.get("mountPath")
        if not isinstance(mp, str) or not mp.startswith("/"):
            errs.append(f"{where}.volumeMounts[{i}].mountPath: {mp!r} must be an absolute path")
        if mp in mounts:
            errs.append(f"{where}.volumeMounts[{i}]: mountPath {mp!r} used twice")
        mounts.add(mp)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        errs += _probe_errors(c.get(probe), f"{where}.{probe}", port_names)
    caps = ((c.get("securityContext") or {}).get("capabilities") or {})
    for cap in (caps.get("add") or []) + (caps.get("drop") or []):
        if not re.match(r"^[A-Z][A-Z0-9_]*$", str(cap)) or str(cap).startswith("CAP_"):
            errs.append(f"{where}.securityContext.capabilities: {cap!r} (use names like IPC_LOCK, no CAP_ prefix)")
    return errs


def pod_template_errors(template: Any, where: str) -> list[str]:
    """Core Kubernetes rules for one PodTemplateSpec."""
    if not isinstance(template, dict):
        return [f"{where}: a pod template is required"]
    errs = _metadata_errors(template.get("metadata"), f"{where}.metadata")
    spec = template.get("spec") or {}
    volumes: set[str] = set()
    for i, v in enumerate(spec.get("volumes") or []):
        vn = v.get("name")
        if not isinstance(vn, str) or len(vn) > 63 or not _DNS1123_LABEL.match(vn):
            errs.append(f"{where}.spec.volumes[{i}].name: {vn!r} is not a DNS-1123 label")
        if vn in volumes:
            errs.append(f"{where}.spec.volumes[{i}]: duplicate volume name {vn!r}")
        volumes.add(vn)
        sources = [k for k in v if k in _VOLUME_SOURCES]
        if len(sources) != 1 or set(v) - _VOLUME_SOURCES - {"name"}:
            errs.append(f"{where}.spec.volumes[{i}] ({vn}): needs exactly one volume source, "
                        f"has {sorted(set(v) - {'name'})}")
        if "emptyDir" in v and (v["emptyDir"] or {}).get("medium") not in (None, "", "Memory", "HugePages"):
            errs.append(f"{where}.spec.volumes[{i}].emptyDir.medium: {(v['emptyDir'] or {}).get('medium')!r}")
    containers = spec.get("containers") or []
    if not containers:
        errs.append(f"{where}.spec.containers: at least one container is required")
    names = set()
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            errs += _container_errors(c, f"{where}.spec.{field}[{i}]", volumes)
            if c.get("name") in names:
                errs.append(f"{where}.spec.{field}[{i}]: duplicate container name {c.get('name')!r}")
            names.add(c.get("name"))
    for i, t in enumerate(spec.get("tolerations") or []):
        if t.get("operator", "Equal") not in ("Equal", "Exists"):
            errs.append(f"{where}.spec.tolerations[{i}].operator: {t.get('operator')!r}")
        if t.get("operator") == "Exists" and t.get("value"):
            errs.append(f"{where}.spec.tolerations[{i}]: operator Exists takes no value")
        if t.get("effect") not in (None, "", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            errs.append(f"{where}.spec.tolerations[{i}].effect: {t.get('effect')!r}")
    if spec.get("restartPolicy") not in (None, "Always", "OnFailure", "Never"):
        errs.append(f"{where}.spec.restartPolicy: {spec.get('restartPolicy')!r}")
    return errs


def _object_store_errors(group: dict, where: str) -> list[str]:
    """Ray puts its object store in /dev/shm: a memory emptyDir there must hold it."""
    value = (group.get("rayStartParams") or {}).get("object-store-memory")
    spec = (group.get("template") or {}).get("spec") or {}
    containers = spec.get("containers") or [{}]
    mount = next((m for m in containers[0].get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    volume = next((v for v in spec.get("volumes") or [] if mount and v.get("name") == mount.get("name")), {})
    limit = (volume.get("emptyDir") or {}).get("sizeLimit")
    if value is None or limit is None:
        return []
    try:
        store, shm = Decimal(str(value)), parse_quantity(limit)
    except (InvalidOperation, ValueError) as exc:
        return [f"{where}.rayStartParams[object-store-memory]: {exc}"]
    if store > shm:
        return [f"{where}: object-store-memory {value} does not fit the /dev/shm emptyDir ({limit})"]
    return []


def _cluster_spec_errors(cluster: Any, where: str) -> list[str]:
    """KubeRay's ValidateRayClusterSpec plus core rules for every pod template."""
    if not isinstance(cluster, dict):
        return [f"{where}: required"]
    errs = []
    head = cluster.get("headGroupSpec") or {}
    errs += pod_template_errors(head.get("template"), f"{where}.headGroupSpec.template")
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    groups = cluster.get("workerGroupSpecs") or []
    seen = set()
    for label, group in [("headGroupSpec", head)] + [(f"workerGroupSpecs[{i}]", g) for i, g in enumerate(groups)]:
        gw = f"{where}.{label}"
        params = group.get("rayStartParams") or {}
        if "labels" in params:
            errs.append(f"{gw}.rayStartParams: 'labels' is not supported (use the group's labels field)")
        if group.get("resources") and any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")):
            errs.append(f"{gw}: resources set both in rayStartParams and in the group's resources field")
        if params.get("resources"):
            try:
                for k, v in parse_ray_resources_param(params["resources"]).items():
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                        errs.append(f"{gw}.rayStartParams.resources[{k}]: {v!r} must be a non-negative number")
            except ValueError as exc:
                errs.append(f"{gw}.rayStartParams.resources: {exc}")
        for key in ("num-cpus", "num-gpus"):
            if key in params:
                try:
                    if float(params[key]) < 0:
                        raise ValueError
                except (TypeError, ValueError):
                    errs.append(f"{gw}.rayStartParams[{key}]: {params[key]!r} is not a non-negative number")
        errs += _object_store_errors(group, gw)
        for key, value in (group.get("labels") or {}).items():
            if not _qualified_key(str(key)) or not _LABEL_VALUE.match(str(value)):
                errs.append(f"{gw}.labels: invalid label {key}={value}")
    for i, g in enumerate(groups):
        gw = f"{where}.workerGroupSpecs[{i}]"
        name = g.get("groupName")
        if not isinstance(name, str) or len(name) > 63 or not _DNS1123_LABEL.match(name):
            errs.append(f"{gw}.groupName: {name!r} is not a DNS-1123 label")
        if name in seen:
            errs.append(f"{gw}.groupName: duplicate group {name!r}")
        seen.add(name)
        lo, hi, n = g.get("minReplicas"), g.get("maxReplicas"), g.get("replicas")
        if not autoscaling and (lo is None or hi is None):
            errs.append(f"{gw} ({name}): minReplicas and maxReplicas are required without autoscaling")
        if isinstance(lo, int) and isinstance(hi, int):
            if lo < 0 or hi < 0 or lo > hi:
                errs.append(f"{gw} ({name}): need 0 <= minReplicas <= maxReplicas, got {lo}..{hi}")
            elif isinstance(n, int) and not lo <= n <= hi:
                errs.append(f"{gw} ({name}): replicas {n} outside minReplicas..maxReplicas {lo}..{hi}")
        errs += pod_template_errors(g.get("template"), f"{gw}.template")
    return errs


def core_errors(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    kind = doc.get("kind")
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    errs = []
    limit = MAX_NAME.get(kind, 63)
    if not isinstance(name, str) or len(name) > limit or not _DNS1035_LABEL.match(name):
        errs.append(f"metadata.name: {name!r} must be a DNS-1035 label of at most {limit} characters")
    errs += _metadata_errors(meta, "metadata")
    spec = doc.get("spec") or {}
    if kind == "RayService":
        errs += _cluster_spec_errors(spec.get("rayClusterConfig"), "spec.rayClusterConfig")
        head_service = (spec.get("rayClusterConfig") or {}).get("headGroupSpec", {}).get("headService") or {}
        if (head_service.get("metadata") or {}).get("name"):
            errs.append("spec.rayClusterConfig.headGroupSpec.headService.metadata.name must not be set")
    elif kind == "RayCluster":
        errs += _cluster_spec_errors(spec, "spec")
    elif kind == "RayJob":
        selector = spec.get("clusterSelector") or {}
        if bool(spec.get("rayClusterSpec")) == bool(selector):
            errs.append("spec: exactly one of rayClusterSpec and clusterSelector is needed")
        if spec.get("rayClusterSpec"):
            errs += _cluster_spec_errors(spec["rayClusterSpec"], "spec.rayClusterSpec")
        if spec.get("submitterPodTemplate"):
            errs += pod_template_errors(spec["submitterPodTemplate"], "spec.submitterPodTemplate")
        interactive = spec.get("submissionMode", "K8sJobMode") == "InteractiveMode"
        if not interactive and not str(spec.get("entrypoint", "")).strip():
            errs.append("spec.entrypoint: required (outside InteractiveMode)")
        ttl = spec.get("ttlSecondsAfterFinished", 0)
        if ttl < 0:
            errs.append("spec.ttlSecondsAfterFinished: must not be negative")
        if ttl > 0 and not spec.get("shutdownAfterJobFinishes"):
            errs.append("spec.ttlSecondsAfterFinished needs shutdownAfterJobFinishes: true")
        if spec.get("suspend") and not spec.get("shutdownAfterJobFinishes"):
            errs.append("spec.suspend needs shutdownAfterJobFinishes: true")
        if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
            errs.append("spec.activeDeadlineSeconds: must be positive")
        if spec.get("backoffLimit") is not None and spec["backoffLimit"] < 0:
            errs.append("spec.backoffLimit: must not be negative")
    return errs


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
        import serving.app

        if builder is not serving.app.build_app:
            return errs + [f"import_path {app.get('import_path')!r} does not resolve to serving.app.build_app"]
        cfg = serving.app.resolve_config(app.get("args"))  # what build_app does with its args
        application = builder(app.get("args"))
    except ConfigError as exc:
        return errs + [f"serveConfigV2 args: {exc}"]
    except (ImportError, AttributeError, ValueError) as exc:
        return errs + [f"import_path {app.get('import_path')!r} does not resolve: {exc}"]
    from ray.serve.deployment import Application

    if not isinstance(application, Application):
        errs.append(f"{app['import_path']}(args) returned {type(application).__name__}, not a Serve Application")
    return errs + _consistency_errors(doc, serve_config, cfg)


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
        bundle_cpus = max(ecfg.num_cpus, 0.01)  # the engine's placement-group bundle (serving/launcher.py)
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
            if "IPC_LOCK" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []):
                errs.append(f"{gw}: GPU pods need the IPC_LOCK capability (memory registration for RDMA)")
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


def _bench_job_errors(doc: dict) -> list[str]:
    entry = str((doc.get("spec") or {}).get("entrypoint", ""))
    try:
        argv = shlex.split(entry)
    except ValueError as exc:
        return [f"spec.entrypoint: not a shell command: {exc}"]
    if argv[:2] != ["raypd", "bench"]:
        return []  # not a raypd bench job: nothing raypd-specific to check
    from serving.cli import build_parser

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
    return errs


def bench_url(doc: dict) -> str:
    """The --url of a `raypd bench` RayJob."""
    from serving.cli import build_parser

    return build_parser().parse_args(shlex.split(doc["spec"]["entrypoint"])[1:]).url


# ------------------------------------------------------------------------------ all
def validate(doc: Any, crd_dir: str | None = None) -> list[str]:
    errs = crd_errors(doc, crd_dir)
    errs += core_errors(doc)
    if not errs:  # raypd checks assume a well-formed manifest
        errs += raypd_errors(doc)
    return errs


def iter_documents(paths: list[str]) -> Iterator[tuple[str, Any]]:
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for i, doc in enumerate(yaml.safe_load_all(text)):
            if doc is not None and not (isinstance(doc, dict) and doc.get("kind") == "Kustomization"):
                yield f"{path}#{i}", doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="manifests ('-' = stdin)")
    p.add_argument("--crds", default=None, help="directory of KubeRay CRD YAML files (default: ../shared/kuberay-crds)")
    args = p.parse_args(argv)
    bad = 0
    for where, doc in iter_documents(args.files):
        errs = validate(doc, args.crds)
        kind = doc.get("kind") if isinstance(doc, dict) else "?"
        print(f"{where} ({kind}): " + ("ok" if not errs else f"{len(errs)} problem(s)"))
        for e in errs:
            print(f"  - {e}")
        bad += bool(errs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
