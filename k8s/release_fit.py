"""How NetworkPolicies, PodMonitors and Secrets fit the Ray pods of a release (across documents).

`release_errors(docs)` checks, for every RayService/RayCluster in the set: when NetworkPolicies
are present, every Ray pod is selected, the ports open to anyone are exactly the Serve port,
the release's pods reach each other on every port, and any other source is a named namespace
limited to the Serve, metrics or (operator pods only) dashboard port; when PodMonitors are
present, every Ray pod's metrics port is scraped and every endpoint names a port the pods
declare; a Secret in the set that the API-key variable names holds non-empty keys. Each
policy/monitor must select some Ray pod of the set.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Iterator

from posture import API_KEYS_ENV

DASHBOARD_PORT = 8265


def selects(selector: dict | None, labels: dict) -> bool:
    """Kubernetes label-selector semantics ({} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}.get(op, False):
            return False
    return True


def ray_pods(doc: dict) -> Iterator[tuple[str, dict, dict]]:
    """(group name, pod template, rayStartParams) of a RayService/RayCluster."""
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterConfig") if doc.get("kind") == "RayService" else spec
    head = (cluster or {}).get("headGroupSpec") or {}
    yield "head", head.get("template") or {}, head.get("rayStartParams") or {}
    for g in (cluster or {}).get("workerGroupSpecs") or []:
        yield str(g.get("groupName")), g.get("template") or {}, g.get("rayStartParams") or {}


def pod_labels(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def pod_ports(template: dict) -> dict[str, int]:
    c = (((template.get("spec") or {}).get("containers")) or [{}])[0]
    return {p.get("name"): p.get("containerPort") for p in c.get("ports") or [] if p.get("name")}


def _serve_port(doc: dict) -> int:
    import yaml

    text = (doc.get("spec") or {}).get("serveConfigV2")
    try:
        config = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        config = None
    return int(((config or {}).get("http_options") or {}).get("port", 8000))


def _same_namespace(a: dict, b: dict) -> bool:
    return (a.get("metadata") or {}).get("namespace") == (b.get("metadata") or {}).get("namespace")


def _peer_kind(peer: dict, release: dict) -> str:
    """'release' (the release's own pods), 'namespace' (a namespace named by
    kubernetes.io/metadata.name, optionally narrowed to some pods) or 'anyone'."""
    ns, pods = peer.get("namespaceSelector"), peer.get("podSelector")
    if "ipBlock" in peer:
        return "anyone"
    if ns is None:
        wanted = (pods or {}).get("matchLabels") or {}
        return "release" if wanted and all(release.get(k) == v for k, v in wanted.items()) \
            and set(release) <= set(wanted) else "anyone"
    named = (ns.get("matchLabels") or {}).get("kubernetes.io/metadata.name")
    return "namespace" if named else "anyone"


def _rule_ports(rule: dict, ports: dict[str, int]) -> set[int] | None:
    """The TCP port numbers a rule admits (None: every port)."""
    if not rule.get("ports"):
        return None
    out: set[int] = set()
    for p in rule["ports"]:
        value = ports.get(p.get("port"), p.get("port")) if isinstance(p.get("port"), str) else p.get("port")
        if value is None:
            return None
        out |= set(range(value, (p.get("endPort") or value) + 1)) if isinstance(value, int) else set()
    return out


def _network_errors(doc: dict, nps: list[dict], release_keys: tuple[str, ...]) -> list[str]:
    errs, serve = [], _serve_port(doc)
    name = (doc.get("metadata") or {}).get("name")
    for group, template, params in ray_pods(doc):
        labels, ports = pod_labels(template), pod_ports(template)
        release = {k: labels[k] for k in release_keys if k in labels}
        metrics = int(params.get("metrics-export-port", 8080))
        covering = [np for np in nps if selects(np["spec"].get("podSelector"), labels)
                    and "Ingress" in (np["spec"].get("policyTypes") or ["Ingress"])]
        if not covering:
            errs.append(f"{name}/{group}: no NetworkPolicy selects these pods (labels {labels}): ingress is open")
            continue
        open_ports: set[int] = set()
        internal = False
        for np in covering:
            for rule in np["spec"].get("ingress") or []:
                admitted = _rule_ports(rule, ports)
                kinds = {_peer_kind(p, release) for p in rule.get("from") or []} or {"anyone"}
                where = f"NetworkPolicy {np['metadata']['name']} -> {name}/{group}"
                if kinds == {"release"}:
                    internal = internal or admitted is None
                    continue
                if admitted is None:
                    errs.append(f"{where}: admits every port from outside the release")
                    continue
                if "anyone" in kinds:
                    open_ports |= admitted
                    continue
                extra = admitted - {serve, metrics} - ({DASHBOARD_PORT} if group == "head" else set())
                if extra:
                    errs.append(f"{where}: a namespace peer may reach only the Serve, metrics or (head) "
                                f"dashboard port, not {sorted(extra)}")
                if DASHBOARD_PORT in admitted and any(p.get("podSelector") is None for p in rule.get("from") or []):
                    errs.append(f"{where}: the dashboard is admitted to a whole namespace; name the operator's pods")
        if open_ports != {serve}:
            errs.append(f"{name}/{group}: ports open to anyone are {sorted(open_ports)}; must be exactly the Serve "
                        f"port [{serve}]")
        if not internal:
            errs.append(f"{name}/{group}: no rule admits the release's own pods on every port (GCS, raylets, "
                        f"NIXL/UCX between pods would be blocked)")
    return errs


def _monitor_errors(doc: dict, monitors: list[dict]) -> list[str]:
    errs, name = [], (doc.get("metadata") or {}).get("name")
    for group, template, params in ray_pods(doc):
        labels, ports = pod_labels(template), pod_ports(template)
        metrics = int(params.get("metrics-export-port", 8080))
        metrics_names = {n for n, p in ports.items() if p == metrics}
        scraped = False
        for pm in monitors:
            if not selects(pm["spec"].get("selector"), labels):
                continue
            for ep in pm["spec"].get("podMetricsEndpoints") or []:
                if "port" in ep and ep["port"] not in ports:
                    errs.append(f"PodMonitor {pm['metadata']['name']} -> {name}/{group}: no container port "
                                f"named {ep['port']!r} (ports {sorted(ports)})")
                scraped = scraped or ep.get("port") in metrics_names or ep.get("portNumber") == metrics
        if not scraped:
            errs.append(f"{name}/{group}: no PodMonitor scrapes the metrics port {metrics} (a container port "
                        f"named for it, e.g. 'metrics')")
    return errs


def _secret_errors(doc: dict, secrets: dict[str, dict]) -> list[str]:
    errs = []
    for group, template, _ in ray_pods(doc):
        for c in (template.get("spec") or {}).get("containers") or []:
            for e in c.get("env") or []:
                ref = ((e.get("valueFrom") or {}).get("secretKeyRef") or {})
                secret = secrets.get(ref.get("name"))
                if e.get("name") != API_KEYS_ENV or secret is None:
                    continue
                data = secret.get("stringData") or {}
                raw = data.get(ref.get("key"))
                if raw is None and ref.get("key") in (secret.get("data") or {}):
                    try:
                        raw = base64.b64decode(secret["data"][ref["key"]], validate=True).decode("utf-8", "replace")
                    except (binascii.Error, ValueError):
                        continue  # document_errors reports the encoding
                keys = [k.strip() for k in (raw or "").split(",")]
                if raw is None or not all(keys):
                    errs.append(f"Secret {ref.get('name')}: key {ref.get('key')!r} must hold comma-separated, "
                                f"non-empty API keys ({group} reads it as {API_KEYS_ENV})")
    return sorted(set(errs))


def release_errors(docs: list[Any], release_keys: tuple[str, ...] = (
        "app.kubernetes.io/name", "app.kubernetes.io/instance")) -> list[str]:
    docs = [d for d in docs if isinstance(d, dict)]
    rays = [d for d in docs if d.get("kind") in ("RayService", "RayCluster")]
    errs = []
    for kind in ("NetworkPolicy", "PodMonitor"):
        for pol in (d for d in docs if d.get("kind") == kind):
            key = "podSelector" if kind == "NetworkPolicy" else "selector"
            if rays and not any(selects((pol.get("spec") or {}).get(key), pod_labels(t))
                                for r in rays if _same_namespace(r, pol) for _, t, _ in ray_pods(r)):
                errs.append(f"{kind} {(pol.get('metadata') or {}).get('name')}: selects no Ray pod of "
                            f"{[(r.get('metadata') or {}).get('name') for r in rays]}")
    for ray in rays:
        peers = [d for d in docs if _same_namespace(d, ray)]
        nps = [d for d in peers if d.get("kind") == "NetworkPolicy"]
        monitors = [d for d in peers if d.get("kind") == "PodMonitor"]
        if nps:
            errs += _network_errors(ray, nps, release_keys)
        if monitors:
            errs += _monitor_errors(ray, monitors)
        errs += _secret_errors(ray, {(d.get("metadata") or {}).get("name"): d
                                     for d in peers if d.get("kind") == "Secret"})
    return errs
