"""raypd's own security rules for Ray pods, and the Pod Security Standards level a pod meets.

`security_errors(doc)` checks a RayService / RayCluster / RayJob (every pod template KubeRay
turns into Pods, the RayJob's submitter pod included) for what generic checks cannot know:

  cluster    authOptions.mode token (Ray token authentication; KubeRay's own rules: Ray >= 2.52,
             enableK8sTokenAuth only on a standalone RayCluster, with mode token and without
             secretName); the head Service not exposed (no LoadBalancer/NodePort, no ingress);
             a RayJob's submitter pod given (KubeRay's default one has no securityContext).
  container  no uid 0; capabilities add at most IPC_LOCK, and only where UCX_TLS names an RDMA
             transport (memory registration); a read-only root has an emptyDir at /tmp (Ray's
             session dir).
  API keys   (RayService, RayCluster) every Ray container gets RAYPD_API_KEYS from a Secret
             (secretKeyRef), never as a literal value.

The generic hardening (no host namespaces, non-root, seccomp, not privileged, no privilege
escalation, capabilities dropped, read-only root, no service-account token) is checkov's
(checkov_scan.py; the mapping is in docs/kubernetes.md).

`pod_security_level(pod_spec)` is the Pod Security Standards profile (kubernetes.io/docs/
concepts/security/pod-security-standards) the pod meets: "restricted", "baseline" or
"privileged"; `pss_violations` says why. validate.py prints it per document, since the
namespace's `pod-security.kubernetes.io/enforce` label must allow the least strict pod.
"""

from __future__ import annotations

from typing import Any, Iterator

# Baseline: capabilities beyond these are refused (IPC_LOCK is not among them).
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
BASELINE_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
RESTRICTED_VOLUME_SOURCES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
})
RDMA_TRANSPORTS = ("rc", "ud", "dc", "ib")  # UCX_TLS names (rc_x, ud_verbs, dc_mlx5, ... share the prefix)
ALLOWED_CAPABILITY = "IPC_LOCK"
API_KEYS_ENV = "RAYPD_API_KEYS"
MIN_TOKEN_AUTH_RAY = (2, 52, 0)
MIN_K8S_TOKEN_AUTH_RAY = (2, 55, 0)


# ------------------------------------------------------------------ helpers
def containers(spec: dict) -> Iterator[tuple[str, dict]]:
    """(`field[i]`, container) for every container, init and ephemeral container of a pod spec."""
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(field) or []):
            yield f"{field}[{i}]", c


def _sc(obj: dict) -> dict:
    return obj.get("securityContext") or {}


def env_value(container: dict, name: str) -> str | None:
    return next((e.get("value") for e in container.get("env") or [] if e.get("name") == name), None)


def uses_rdma(container: dict) -> bool:
    """Does the container's UCX_TLS let UCX use InfiniBand/RoCE verbs?"""
    tls = (env_value(container, "UCX_TLS") or "").strip()
    if not tls:
        return False  # no NIXL settings: not an engine pod (raypd's engine pods set UCX_TLS)
    if tls == "all" or tls.startswith("^"):
        return True   # every transport UCX finds, RDMA included
    return any(t.strip().split("_")[0] in RDMA_TRANSPORTS for t in tls.split(","))


def _version(text: str) -> tuple[int, ...] | None:
    parts = str(text).split(".")
    try:
        return tuple(int(p) for p in parts[:3]) + (0,) * (3 - len(parts[:3]))
    except ValueError:
        return None


# ---------------------------------------------------- Pod Security Standards
def pss_violations(spec: dict) -> dict[str, list[str]]:
    """What keeps a pod spec out of each profile: {"baseline": [...], "restricted": [...]}.

    "restricted" lists only the rules restricted adds; a pod meets restricted when both are empty.
    """
    base, restr = [], []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            base.append(f"{field}: true")
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if "hostPath" in kinds:
            base.append(f"volume {v.get('name')!r} is a hostPath")
        elif kinds - RESTRICTED_VOLUME_SOURCES:
            restr.append(f"volume {v.get('name')!r} is a {sorted(kinds)[0]} (not an allowed volume type)")
    pod_sc = _sc(spec)
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            base.append(f"sysctl {sysctl.get('name')} is not in the safe set")
    scopes = [("pod", pod_sc)] + [(w, _sc(c)) for w, c in containers(spec)]
    for where, sc in scopes:
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            base.append(f"{where}: seccompProfile Unconfined")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            base.append(f"{where}: appArmorProfile Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in BASELINE_SELINUX_TYPES or se.get("user") or se.get("role"):
            base.append(f"{where}: seLinuxOptions {se}")
        if sc.get("runAsUser") == 0:
            restr.append(f"{where}: runAsUser 0")
    non_root_pod = pod_sc.get("runAsNonRoot") is True
    seccomp_pod = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for where, c in containers(spec):
        sc, caps = _sc(c), (_sc(c).get("capabilities") or {})
        if sc.get("privileged"):
            base.append(f"{where}: privileged")
        added = set(caps.get("add") or [])
        if added - BASELINE_CAPABILITIES:
            base.append(f"{where}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if sc.get("procMount", "Default") != "Default":
            base.append(f"{where}: procMount {sc.get('procMount')}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            base.append(f"{where}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            restr.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot") is False or (not non_root_pod and sc.get("runAsNonRoot") is not True):
            restr.append(f"{where}: runAsNonRoot is not true")
        if not seccomp_pod and (sc.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            restr.append(f"{where}: no RuntimeDefault/Localhost seccompProfile")
        if "ALL" not in (caps.get("drop") or []):
            restr.append(f"{where}: does not drop ALL capabilities")
        if added - {"NET_BIND_SERVICE"}:
            restr.append(f"{where}: adds {sorted(added - {'NET_BIND_SERVICE'})}")
    return {"baseline": base, "restricted": restr}


def pod_security_level(spec: dict) -> str:
    found = pss_violations(spec)
    return "restricted" if not any(found.values()) else "baseline" if not found["baseline"] else "privileged"


# ------------------------------------------------------------- raypd's posture
def pod_posture_errors(spec: dict, where: str) -> list[str]:
    """raypd's own container rules (the generic hardening is checkov's: checkov_scan.py)."""
    errs = []
    pod_sc = _sc(spec)
    for cw, c in containers(spec):
        cwhere, sc = f"{where}.{cw} ({c.get('name')})", _sc(c)
        if 0 in (pod_sc.get("runAsUser"), sc.get("runAsUser")):
            errs.append(f"{cwhere}: must not run as uid 0")
        added = set((sc.get("capabilities") or {}).get("add") or [])
        if added - {ALLOWED_CAPABILITY}:
            errs.append(f"{cwhere}: adds {sorted(added - {ALLOWED_CAPABILITY})}; only {ALLOWED_CAPABILITY} "
                        f"(RDMA memory registration) may be added")
        if ALLOWED_CAPABILITY in added and not uses_rdma(c):
            errs.append(f"{cwhere}: {ALLOWED_CAPABILITY} without an RDMA transport in UCX_TLS "
                        f"(only RDMA memory registration needs it)")
        if sc.get("readOnlyRootFilesystem") is True and not _tmp_is_writable(spec, c):
            errs.append(f"{cwhere}: a read-only root needs an emptyDir at /tmp (Ray's session dir)")
    return errs


def _tmp_is_writable(spec: dict, container: dict) -> bool:
    mount = next((m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/tmp"), None)
    volume = next((v for v in spec.get("volumes") or [] if mount and v.get("name") == mount.get("name")), {})
    return "emptyDir" in volume and not mount.get("readOnly")


def api_key_errors(spec: dict, where: str) -> list[str]:
    """Every Ray container of a serving cluster reads the API keys from a Secret."""
    errs = []
    for cw, c in containers(spec):
        if cw.startswith("initContainers"):
            continue
        var = next((e for e in c.get("env") or [] if e.get("name") == API_KEYS_ENV), None)
        cwhere = f"{where}.{cw} ({c.get('name')})"
        if var is None:
            errs.append(f"{cwhere}: set {API_KEYS_ENV} from the API-key Secret (any pod may host an ingress replica)")
        elif "value" in var:
            errs.append(f"{cwhere}: {API_KEYS_ENV} is a literal value; take it from a Secret (valueFrom.secretKeyRef)")
        elif not ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name"):
            errs.append(f"{cwhere}: {API_KEYS_ENV} must come from valueFrom.secretKeyRef")
    return errs


def auth_errors(cluster: dict, where: str, kind: str) -> list[str]:
    """Ray token authentication on, and KubeRay's own authOptions rules (utils/validation.go)."""
    auth = cluster.get("authOptions") or {}
    errs = []
    if auth.get("mode") != "token":  # explicit: KubeRay enables token auth only for mode token
        errs.append(f"{where}.authOptions: set mode: token (Ray token authentication; without it anyone "
                    f"reaching the GCS or the dashboard can run code)")
        if auth.get("enableK8sTokenAuth"):
            errs.append(f"{where}.authOptions.enableK8sTokenAuth needs mode: token")
        return errs
    version = _version(cluster.get("rayVersion", ""))
    if version is None or version < MIN_TOKEN_AUTH_RAY:
        errs.append(f"{where}.rayVersion: token authentication needs Ray >= 2.52.0, got {cluster.get('rayVersion')!r}")
    if auth.get("enableK8sTokenAuth"):
        if kind != "RayCluster":
            errs.append(f"{where}.authOptions.enableK8sTokenAuth: KubeRay supports it on a RayCluster only, not a {kind}")
        if auth.get("secretName"):
            errs.append(f"{where}.authOptions: enableK8sTokenAuth and secretName are exclusive")
        if version is not None and version < MIN_K8S_TOKEN_AUTH_RAY:
            errs.append(f"{where}.authOptions.enableK8sTokenAuth needs Ray >= 2.55.0")
    return errs


def _templates(cluster: dict, where: str) -> Iterator[tuple[str, dict]]:
    """(where, pod spec) of every group."""
    head = cluster.get("headGroupSpec") or {}
    yield f"{where}.headGroupSpec.template.spec", (head.get("template") or {}).get("spec") or {}
    for i, g in enumerate(cluster.get("workerGroupSpecs") or []):
        yield f"{where}.workerGroupSpecs[{i}].template.spec", (g.get("template") or {}).get("spec") or {}


def cluster_security_errors(cluster: Any, where: str, kind: str, *, serving: bool) -> list[str]:
    if not isinstance(cluster, dict):
        return []
    errs = auth_errors(cluster, where, kind)
    head = cluster.get("headGroupSpec") or {}
    if head.get("serviceType") not in (None, "ClusterIP"):
        errs.append(f"{where}.headGroupSpec.serviceType: {head['serviceType']} exposes the GCS and the dashboard "
                    f"beyond the cluster; keep ClusterIP")
    if head.get("enableIngress"):
        errs.append(f"{where}.headGroupSpec.enableIngress: would expose the dashboard; reach it with kubectl "
                    f"port-forward")
    for twhere, spec in _templates(cluster, where):
        errs += pod_posture_errors(spec, twhere)
        if serving:
            errs += api_key_errors(spec, twhere)
    return errs


def security_errors(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return []
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    if kind == "RayService":
        return cluster_security_errors(spec.get("rayClusterConfig"), "spec.rayClusterConfig", kind, serving=True)
    if kind == "RayCluster":
        return cluster_security_errors(spec, "spec", kind, serving=True)
    if kind == "RayJob":
        errs = cluster_security_errors(spec.get("rayClusterSpec"), "spec.rayClusterSpec", kind, serving=False)
        submitter = spec.get("submitterPodTemplate")
        if spec.get("submissionMode", "K8sJobMode") == "K8sJobMode" and spec.get("rayClusterSpec"):
            if not submitter:
                errs.append("spec.submitterPodTemplate: give the submitter pod the same hardening (KubeRay's default "
                            "one has no securityContext)")
            else:
                errs += pod_posture_errors(submitter.get("spec") or {}, "spec.submitterPodTemplate.spec")
        return errs
    return []


def pod_templates(doc: Any) -> Iterator[tuple[str, dict]]:
    """(group name, pod template) of every Pod KubeRay makes from a Ray document (head, worker
    groups, a RayJob's submitter)."""
    if not isinstance(doc, dict):
        return
    spec = doc.get("spec") or {}
    cluster = {"RayService": spec.get("rayClusterConfig"), "RayCluster": spec,
               "RayJob": spec.get("rayClusterSpec")}.get(doc.get("kind"))
    if isinstance(cluster, dict):
        head = cluster.get("headGroupSpec") or {}
        yield "head", head.get("template") or {}
        for g in cluster.get("workerGroupSpecs") or []:
            yield str(g.get("groupName")), g.get("template") or {}
    if doc.get("kind") == "RayJob" and spec.get("submitterPodTemplate"):
        yield "submitter", spec["submitterPodTemplate"]


def pod_specs(doc: Any) -> Iterator[tuple[str, dict]]:
    """(group name, pod spec) of every pod a Ray document makes (for the Pod Security level)."""
    for name, template in pod_templates(doc):
        yield name, template.get("spec") or {}


def document_security_level(doc: Any) -> tuple[str, list[str]] | None:
    """The least strict Pod Security level among the document's pods and what causes it (None: no pods)."""
    specs = list(pod_specs(doc))
    if not specs:
        return None
    order = ["restricted", "baseline", "privileged"]
    levels = [(name, pod_security_level(s), pss_violations(s)) for name, s in specs]
    worst = max(levels, key=lambda x: order.index(x[1]))[1]
    reasons = []
    for name, level, found in levels:
        if level == worst and worst != "restricted":
            reasons += [f"{name}: {r}" for r in found["baseline" if worst == "privileged" else "restricted"]]
    return worst, reasons
