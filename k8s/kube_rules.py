"""Core Kubernetes rules for what the CRD schemas cannot say: the pod templates KubeRay turns into
Pods (names, images, quantities, requests <= limits, extended resources, ports, probes, volumes,
env), and the KubeRay operator's own checks (ray-operator controllers/ray/utils/validation.go:
name length, min/max replicas, rayStartParams, ...).

validate.py needs only PyYAML and jsonschema, so these run without kubernetes-validate; the test
suite also checks every pod template against the Kubernetes API schemas with it (a dev
dependency). Pod hardening is checkov's (checkov_scan.py), not these rules'.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from render import parse_ray_resources_param

MAX_NAME = {"RayService": 47, "RayJob": 47, "RayCluster": 53}  # KubeRay validation.go
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
