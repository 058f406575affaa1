"""NetworkPolicy, PodMonitor and Secret documents, one at a time, and the Ray pods' metrics port.

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

How these documents fit the Ray pods they are for is `release_fit.py`.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Any

from crd import schema_errors
from kube_rules import _IANA_SVC, _LABEL_VALUE, _metadata_errors, _qualified_key
from release_fit import pod_ports, ray_pods

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
    for group, template, params in ray_pods(doc):
        numbers = set(pod_ports(template).values())
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
