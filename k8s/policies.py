"""NetworkPolicy, PodMonitor and Secret documents, and how they fit the Ray pods they are for.

No CRD describes these here, so each kind has a small schema of our own (OpenAPI v3 subsets,
checked like the CRDs: unknown fields are errors, so a typo cannot silently drop a rule):

  networking.k8s.io/v1 NetworkPolicy   podSelector, policyTypes, ingress/egress rules (peers:
                                       podSelector, namespaceSelector, ipBlock; ports: protocol,
                                       port, endPort); rules: a peer is an ipBlock or selectors,
                                       ports 1..65535 or IANA names, endPort >= port, CIDRs parse.
  monitoring.coreos.com/v1 PodMonitor  the spec and endpoint fields of prometheus-operator v0.91's
                                       CRD (nested auth/TLS/relabel objects only type-checked; a
                                       newer field needs adding here); an endpoint names its port.
  v1 Secret                            type, data (base64), stringData, immutable; key names.

`release_errors(docs)` checks documents against each other, for every RayService/RayCluster
in the set: when NetworkPolicies are present, every Ray pod is selected, the ports open to
anyone are exactly the Serve port, the release's pods reach each other on every port, and any
other source is a named namespace limited to the Serve, metrics or (operator pods only)
dashboard port; when PodMonitors are present, every Ray pod's metrics port is scraped and every
endpoint names a port the pods declare; a Secret in the set that the API-key variable names
holds non-empty keys. Each policy/monitor must select some Ray pod of the set.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Any, Iterator

from crd import schema_errors
from kube_rules import _IANA_SVC, _LABEL_VALUE, _metadata_errors, _qualified_key
from posture import API_KEYS_ENV

STR = {"type": "string"}
STR_MAP = {"type": "object", "additionalProperties": STR}
LIST_OF_STR = {"type": "array", "items": STR}
OBJECT = {"type": "object"}
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
LABEL_SELECTOR = {"type": "object", "properties": {
    "matchLabels": STR_MAP,
    "matchExpressions": {"type": "array", "items": {"type": "object", "required": ["key", "operator"], "properties": {
        "key": STR, "operator": {"type": "string", "enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
        "values": LIST_OF_STR}}},
}}
METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": STR, "namespace": STR, "labels": STR_MAP, "annotations": STR_MAP}}


def _document(api_version: str, kind: str, **fields: Any) -> dict:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata"], "properties": {
        "apiVersion": {"type": "string", "enum": [api_version]}, "kind": {"type": "string", "enum": [kind]},
        "metadata": METADATA, **fields}}


_NP_PORT = {"type": "object", "properties": {
    "protocol": {"type": "string", "enum": ["TCP", "UDP", "SCTP"]},
    "port": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "endPort": {"type": "integer", "format": "int32"}}}
_NP_PEER = {"type": "object", "properties": {
    "podSelector": LABEL_SELECTOR, "namespaceSelector": LABEL_SELECTOR,
    "ipBlock": {"type": "object", "required": ["cidr"], "properties": {"cidr": STR, "except": LIST_OF_STR}}}}
NETWORK_POLICY = _document("networking.k8s.io/v1", "NetworkPolicy", spec={
    "type": "object", "required": ["podSelector"], "properties": {
        "podSelector": LABEL_SELECTOR,
        "policyTypes": {"type": "array", "items": {"type": "string", "enum": ["Ingress", "Egress"]}},
        "ingress": {"type": "array", "items": {"type": "object", "properties": {
            "from": {"type": "array", "items": _NP_PEER}, "ports": {"type": "array", "items": _NP_PORT}}}},
        "egress": {"type": "array", "items": {"type": "object", "properties": {
            "to": {"type": "array", "items": _NP_PEER}, "ports": {"type": "array", "items": _NP_PORT}}}}}})
_ENDPOINT = {"type": "object", "properties": {  # PodMetricsEndpoint of prometheus-operator v0.91
    "port": STR, "portNumber": {"type": "integer", "minimum": 1, "maximum": 65535},
    "targetPort": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "path": STR,
    "scheme": {"type": "string", "enum": ["http", "https", "HTTP", "HTTPS"]}, "interval": DURATION,
    "scrapeTimeout": DURATION, "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
    "trackTimestampsStaleness": {"type": "boolean"}, "filterRunning": {"type": "boolean"},
    "followRedirects": {"type": "boolean"}, "enableHttp2": {"type": "boolean"},
    "proxyUrl": {"type": "string", "pattern": "^(http|https|socks5)://.+$"}, "noProxy": STR,
    "proxyFromEnvironment": {"type": "boolean"}, "proxyConnectHeader": OBJECT,
    "params": {"type": "object", "additionalProperties": LIST_OF_STR},
    "relabelings": {"type": "array", "items": OBJECT}, "metricRelabelings": {"type": "array", "items": OBJECT},
    "authorization": OBJECT, "basicAuth": OBJECT, "bearerTokenSecret": OBJECT, "oauth2": OBJECT, "tlsConfig": OBJECT}}
_INT = {"type": "integer", "minimum": 0}
_BOOL = {"type": "boolean"}
POD_MONITOR = _document("monitoring.coreos.com/v1", "PodMonitor", spec={
    "type": "object", "required": ["selector"], "properties": {
        "selector": LABEL_SELECTOR,
        "namespaceSelector": {"type": "object", "properties": {"any": _BOOL, "matchNames": LIST_OF_STR}},
        "podMetricsEndpoints": {"type": "array", "items": _ENDPOINT},
        "jobLabel": STR, "podTargetLabels": LIST_OF_STR, "sampleLimit": _INT, "targetLimit": _INT,
        "labelLimit": _INT, "labelNameLengthLimit": _INT, "labelValueLengthLimit": _INT, "keepDroppedTargets": _INT,
        "attachMetadata": {"type": "object", "properties": {"node": _BOOL}},
        "scrapeProtocols": LIST_OF_STR, "fallbackScrapeProtocol": STR, "scrapeClass": STR, "bodySizeLimit": STR,
        "selectorMechanism": {"type": "string", "enum": ["RelabelConfig", "RoleSelector"]},
        "scrapeClassicHistograms": _BOOL, "scrapeNativeHistograms": _BOOL, "convertClassicHistogramsToNHCB": _BOOL,
        "nativeHistogramBucketLimit": _INT, "nativeHistogramMinBucketFactor": {"anyOf": [{"type": "integer"}, STR]}}})
POD_MONITOR["required"].append("spec")
SECRET = _document("v1", "Secret", type=STR, data=STR_MAP, stringData=STR_MAP, immutable={"type": "boolean"})
SCHEMAS = {("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY,
           ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR, ("v1", "Secret"): SECRET}
KINDS = {kind for _, kind in SCHEMAS}
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
DASHBOARD_PORT = 8265


# --------------------------------------------------------------- one document
def _selector_errors(sel: Any, where: str) -> list[str]:
    errs = []
    for key, value in ((sel or {}).get("matchLabels") or {}).items():
        if not _qualified_key(key) or not _LABEL_VALUE.match(str(value)) or len(str(value)) > 63:
            errs.append(f"{where}.matchLabels: invalid label {key}={value}")
    for i, e in enumerate((sel or {}).get("matchExpressions") or []):
        has_values = bool(e.get("values"))
        if e.get("operator") in ("In", "NotIn") and not has_values:
            errs.append(f"{where}.matchExpressions[{i}]: {e['operator']} needs values")
        if e.get("operator") in ("Exists", "DoesNotExist") and has_values:
            errs.append(f"{where}.matchExpressions[{i}]: {e['operator']} takes no values")
    return errs


def _np_port_errors(port: dict, where: str) -> list[str]:
    value, end = port.get("port"), port.get("endPort")
    if isinstance(value, int) and not 1 <= value <= 65535:
        return [f"{where}.port: {value} out of range 1..65535"]
    if isinstance(value, str) and (len(value) > 15 or not _IANA_SVC.match(value)):
        return [f"{where}.port: {value!r} is not a port name"]
    if end is not None and (not isinstance(value, int) or end < value):
        return [f"{where}.endPort: needs a numeric port <= endPort"]
    return []


def _peer_errors(peer: dict, where: str) -> list[str]:
    if not peer:
        return [f"{where}: an empty peer (give podSelector, namespaceSelector or ipBlock)"]
    if "ipBlock" in peer:
        if len(peer) > 1:
            return [f"{where}: ipBlock cannot be combined with selectors"]
        try:
            net = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
            for ex in peer["ipBlock"].get("except") or []:
                if not ipaddress.ip_network(ex, strict=False).subnet_of(net):
                    return [f"{where}.ipBlock.except: {ex} is not inside {net}"]
        except (ValueError, TypeError) as exc:
            return [f"{where}.ipBlock: {exc}"]
        return []
    return [e for key in ("podSelector", "namespaceSelector") if key in peer
            for e in _selector_errors(peer[key], f"{where}.{key}")]


def scrape_errors(doc: dict) -> list[str]:
    """A Ray pod's metrics: `metrics-export-port` is a declared container port, and prometheus.io
    annotations name a declared port and an absolute path."""
    errs = []
    if doc.get("kind") not in ("RayService", "RayCluster"):
        return errs
    for group, template, params in _ray_pods(doc):
        numbers = set(_ports(template).values())
        metrics = params.get("metrics-export-port")
        if metrics is not None and (not str(metrics).isdigit() or int(metrics) not in numbers):
            errs.append(f"{group}: rayStartParams metrics-export-port {metrics} is not a container port of the "
                        f"Ray container (declare it, named e.g. 'metrics')")
        notes = (template.get("metadata") or {}).get("annotations") or {}
        if notes.get("prometheus.io/scrape", "false") not in ("true", "false"):
            errs.append(f"{group}: annotation prometheus.io/scrape must be \"true\" or \"false\"")
        if notes.get("prometheus.io/scrape") == "true":
            port = notes.get("prometheus.io/port", "")
            if not port.isdigit() or int(port) not in numbers:
                errs.append(f"{group}: annotation prometheus.io/port {port!r} is not a container port")
            if not notes.get("prometheus.io/path", "/metrics").startswith("/"):
                errs.append(f"{group}: annotation prometheus.io/path must start with '/'")
    return errs


def document_errors(doc: Any) -> list[str]:
    """Schema + rules for a NetworkPolicy, PodMonitor or Secret; the metrics port of Ray pods."""
    if isinstance(doc, dict) and doc.get("kind") in ("RayService", "RayCluster"):
        return scrape_errors(doc)
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS:
        return []
    schema = SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        known = ", ".join(f"{a} {k}" for a, k in SCHEMAS)
        return [f"apiVersion {doc.get('apiVersion')!r} kind {doc.get('kind')!r} is not one of: {known}"]
    errs = schema_errors(schema, doc)
    if errs:
        return errs
    meta = doc["metadata"]
    if len(meta["name"]) > 253 or not _DNS1123_SUBDOMAIN.match(meta["name"]):
        errs.append(f"metadata.name: {meta['name']!r} is not a DNS-1123 subdomain")
    errs += _metadata_errors(meta, "metadata")
    spec = doc.get("spec") or {}
    if doc["kind"] == "NetworkPolicy":
        errs += _selector_errors(spec.get("podSelector"), "spec.podSelector")
        for direction, peers_key in (("ingress", "from"), ("egress", "to")):
            for i, rule in enumerate(spec.get(direction) or []):
                for j, peer in enumerate(rule.get(peers_key) or []):
                    errs += _peer_errors(peer, f"spec.{direction}[{i}].{peers_key}[{j}]")
                for j, port in enumerate(rule.get("ports") or []):
                    errs += _np_port_errors(port, f"spec.{direction}[{i}].ports[{j}]")
    elif doc["kind"] == "PodMonitor":
        errs += _selector_errors(spec.get("selector"), "spec.selector")
        for i, ep in enumerate(spec.get("podMetricsEndpoints") or []):
            if not any(k in ep for k in ("port", "portNumber", "targetPort")):
                errs.append(f"spec.podMetricsEndpoints[{i}]: name the port (port or portNumber)")
    else:
        for field in ("data", "stringData"):
            for key, value in (doc.get(field) or {}).items():
                if not _SECRET_KEY.match(key):
                    errs.append(f"{field}: key {key!r} may hold only letters, digits, '-', '_' and '.'")
                if field == "data":
                    try:
                        base64.b64decode(value, validate=True)
                    except (binascii.Error, ValueError):
                        errs.append(f"data[{key}]: not base64 (use stringData for plain text)")
    return errs


# ------------------------------------------------------------ across documents
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


def _ray_pods(doc: dict) -> Iterator[tuple[str, dict, dict]]:
    """(group name, pod template, rayStartParams) of a RayService/RayCluster."""
    spec = doc.get("spec") or {}
    cluster = spec.get("rayClusterConfig") if doc.get("kind") == "RayService" else spec
    head = (cluster or {}).get("headGroupSpec") or {}
    yield "head", head.get("template") or {}, head.get("rayStartParams") or {}
    for g in (cluster or {}).get("workerGroupSpecs") or []:
        yield str(g.get("groupName")), g.get("template") or {}, g.get("rayStartParams") or {}


def _labels(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def _ports(template: dict) -> dict[str, int]:
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
    for group, template, params in _ray_pods(doc):
        labels, ports = _labels(template), _ports(template)
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
    for group, template, params in _ray_pods(doc):
        labels, ports = _labels(template), _ports(template)
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
    for group, template, _ in _ray_pods(doc):
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
            if rays and not any(selects((pol.get("spec") or {}).get(key), _labels(t))
                                for r in rays if _same_namespace(r, pol) for _, t, _ in _ray_pods(r)):
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
