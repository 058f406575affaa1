"""The KubeRay manifests' security posture and metrics scraping (k8s/security, k8s/monitoring).

Same documents as tests/unit/test_k8s_manifests.py (shipped files and k8s/render.py outputs):
Ray token auth, pod hardening, API keys from a Secret, the NetworkPolicies (only the Serve
port from outside the release; everything inside it; the dashboard only for the KubeRay
operator), the Pod Security level each variant needs, the PodMonitors, and the validators
(k8s/posture.py, k8s/policies.py, k8s/release_fit.py) refusing manifests that break any of it.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from test_k8s_manifests import BASE, BENCH, CPU, DOCS, K8S, RENDERS, SERVICES, cluster_of, ids, load

import posture  # noqa: E402  (k8s/posture.py, on sys.path via test_k8s_manifests)
import release_fit  # noqa: E402
import render  # noqa: E402
import validate  # noqa: E402

SECURITY = K8S / "security" / "networkpolicy.yaml"
MONITORING = K8S / "monitoring" / "podmonitor.yaml"
BENCH_POLICY = K8S / "rayjob-bench-networkpolicy.yaml"
RELEASE = {"app.kubernetes.io/name": "raypd", "app.kubernetes.io/instance": "raypd"}
RDMA_CONTAINERS = {("base", "prefill"), ("base", "decode")}


def load_all(path):
    return list(yaml.safe_load_all(path.read_text()))


def pods(doc):
    """(group, pod spec) of every pod the document makes, the RayJob's submitter included."""
    return list(posture.pod_specs(doc))


def containers(doc):
    return [(g, c) for g, spec in pods(doc) for _, c in posture.containers(spec)]


def bundle(service):
    return load_all(SECURITY) + [service] + load_all(MONITORING)


BUNDLES = [("base", bundle(load(BASE))), ("overlay-cpu", bundle(load(CPU)))] + [
    (f"render-{rid}", render.render_release(accel, monitoring=True, **opts)) for rid, accel, opts in RENDERS]
POLICIES = [d for d in load_all(SECURITY) if d["kind"] == "NetworkPolicy"]


def templates(service):
    cluster = cluster_of(service)
    return [("head", cluster["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]


# ------------------------------------------------------------- Ray token auth
@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_ray_token_authentication_is_on(name, doc):
    assert cluster_of(doc)["authOptions"] == {"mode": "token"}


@pytest.mark.parametrize("name, doc", SERVICES, ids=ids(SERVICES))
def test_head_service_is_not_exposed(name, doc):
    head = cluster_of(doc)["headGroupSpec"]
    assert (head.get("serviceType", "ClusterIP"), head.get("enableIngress", False)) == ("ClusterIP", False)


# ------------------------------------------------------------- pod hardening
@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_every_container_drops_all_capabilities(name, doc):
    assert all("ALL" in c["securityContext"]["capabilities"]["drop"] for _, c in containers(doc))


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_only_rdma_engine_containers_add_a_capability_and_it_is_ipc_lock(name, doc):
    added = {(g, cap) for g, c in containers(doc) for cap in c["securityContext"]["capabilities"].get("add", [])}
    expected = {(g, "IPC_LOCK") for g, c in containers(doc) if posture.uses_rdma(c)}
    assert added == expected


def test_rdma_is_used_only_by_the_gpu_engine_pods():
    rdma = {(name, g) for name, doc in DOCS[:3] for g, c in containers(doc) if posture.uses_rdma(c)}
    assert rdma == RDMA_CONTAINERS


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_no_container_is_privileged_or_can_escalate(name, doc):
    contexts = [c["securityContext"] for _, c in containers(doc)]
    assert all(sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False for sc in contexts)


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_pods_run_as_the_image_ray_user(name, doc):
    contexts = [spec["securityContext"] for _, spec in pods(doc)]
    assert all((sc["runAsNonRoot"], sc["runAsUser"], sc["runAsGroup"]) == (True, 1000, 100) for sc in contexts)


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_pods_use_the_runtime_default_seccomp_profile(name, doc):
    assert all(spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"} for _, spec in pods(doc))


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_root_filesystem_is_read_only_and_tmp_is_an_emptydir(name, doc):
    def tmp_volume(spec, c):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        return volume

    checked = [(c["securityContext"]["readOnlyRootFilesystem"], "emptyDir" in tmp_volume(spec, c))
               for _, spec in pods(doc) for _, c in posture.containers(spec)]
    assert set(checked) == {(True, True)}


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_pods_get_no_service_account_token(name, doc):
    assert all(spec["automountServiceAccountToken"] is False for _, spec in pods(doc))


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_no_pod_shares_the_nodes_namespaces(name, doc):
    assert not any(spec.get(k) for _, spec in pods(doc) for k in ("hostNetwork", "hostPID", "hostIPC"))


@pytest.mark.parametrize("path, level", [(BASE, "privileged"), (CPU, "restricted"), (BENCH, "restricted")])
def test_pod_security_level_of_each_variant(path, level):
    assert posture.document_security_level(load(path))[0] == level


def test_gpu_pods_without_rdma_meet_restricted():
    """IPC_LOCK (for RDMA) is the only thing that keeps the GPU variant out of `restricted`."""
    doc = load(BASE)
    for group in cluster_of(doc)["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        c["securityContext"]["capabilities"].pop("add")
        next(e for e in c["env"] if e["name"] == "UCX_TLS")["value"] = "tcp,cuda_copy"
    assert posture.document_security_level(doc)[0] == "restricted"


def test_a_pod_without_run_as_non_root_falls_out_of_restricted():
    """checkov's CKV_K8S_23 takes runAsUser 1000 for non-root; a `restricted` namespace still refuses it."""
    doc = load(CPU)
    cluster_of(doc)["headGroupSpec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot")
    assert posture.document_security_level(doc) == ("baseline", [
        "head: containers[0]: runAsNonRoot is not true"])


# ------------------------------------------------------------------ API keys
@pytest.mark.parametrize("name, doc", SERVICES, ids=ids(SERVICES))
def test_api_keys_reach_every_ray_container_from_a_secret(name, doc):
    refs = {(c["name"], str(next(e for e in c["env"] if e["name"] == "RAYPD_API_KEYS").get("valueFrom")))
            for _, c in containers(doc)}
    secret = doc["metadata"]["name"] + "-api-keys"
    expected = str({"secretKeyRef": {"name": secret, "key": "api-keys"}})
    assert {ref for _, ref in refs} == {expected}


@pytest.mark.parametrize("name, doc", SERVICES, ids=ids(SERVICES))
def test_serve_config_carries_no_api_keys(name, doc):
    parsed = json.dumps(yaml.safe_load(doc["spec"]["serveConfigV2"]))  # the config, without its comments
    assert not [word for word in ("api_keys", "RAYPD_API_KEYS") if word in parsed]


def test_bench_job_takes_the_api_key_from_the_secret_on_its_head():
    job = load(BENCH)
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    key_source = next(e for e in head["env"] if e["name"] == "RAYPD_API_KEYS")["valueFrom"]["secretKeyRef"]
    argv = validate.bench_argv(job)
    assert (argv[argv.index("--api-key") + 1], key_source["name"]) == ("${RAYPD_API_KEYS%%,*}", "raypd-api-keys")


# ------------------------------------------------------------ NetworkPolicies
def _rules():
    return [(np["metadata"]["name"], rule) for np in POLICIES for rule in np["spec"]["ingress"]]


def test_ingress_from_outside_the_release_admits_exactly_the_serve_port():
    from_anyone = [rule.get("ports") for _, rule in _rules() if not rule.get("from")]
    assert from_anyone == [[{"protocol": "TCP", "port": 8000}]]


def test_release_pods_reach_each_other_on_every_port():
    internal = [rule for _, rule in _rules() if rule.get("from") == [{"podSelector": {"matchLabels": RELEASE}}]]
    assert [rule.get("ports") for rule in internal] == [None]


def test_dashboard_is_admitted_only_to_the_kuberay_operator_on_the_head():
    (np,) = [np for np in POLICIES if any(p["port"] == 8265 for r in np["spec"]["ingress"] for p in r.get("ports", []))]
    (rule,) = np["spec"]["ingress"]
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}
    assert (np["spec"]["podSelector"]["matchLabels"], rule) == (
        {**RELEASE, "app.kubernetes.io/component": "head"}, {"from": [peer], "ports": [{"protocol": "TCP", "port": 8265}]})


@pytest.mark.parametrize("name, service", SERVICES[:2], ids=ids(SERVICES[:2]))
def test_every_release_pod_is_under_an_ingress_policy(name, service):
    covered = {g for g, t in templates(service) for np in POLICIES
               if release_fit.selects(np["spec"]["podSelector"], t["metadata"]["labels"])}
    assert covered == {g for g, _ in templates(service)}


def test_bench_pods_admit_only_each_other_and_the_operator_on_the_dashboard():
    job, (np,) = load(BENCH), load_all(BENCH_POLICY)
    labels = {g: t["metadata"]["labels"] for g, t in posture.pod_templates(job)}
    selected = {g for g, lab in labels.items() if release_fit.selects(np["spec"]["podSelector"], lab)}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "kuberay-operator"}}}
    assert (selected, np["spec"]["ingress"]) == ({"head", "submitter"}, [
        {"from": [{"podSelector": np["spec"]["podSelector"]}]},
        {"from": [operator], "ports": [{"protocol": "TCP", "port": 8265}]}])


def test_bench_pods_are_outside_the_release():
    job = load(BENCH)
    labels = [t["metadata"]["labels"] for t in (job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"],
                                                job["spec"]["submitterPodTemplate"])]
    assert not any(release_fit.selects(np["spec"]["podSelector"], lab) for np in POLICIES for lab in labels)


# ----------------------------------------------------------------- monitoring
def test_every_ray_pod_exports_ray_metrics_on_port_8080():
    found = {(g, t["metadata"]["annotations"]["prometheus.io/port"], str(validate.named_port(
        t["spec"]["containers"][0], "metrics"))) for _, s in SERVICES for g, t in templates(s)}
    assert {(port, named) for _, port, named in found} == {("8080", "8080")}


def test_podmonitors_scrape_the_metrics_port_everywhere_and_serve_metrics_on_the_head():
    monitors = [d for d in load_all(MONITORING) if d["kind"] == "PodMonitor"]
    seen = {(tuple(sorted(m["spec"]["selector"]["matchLabels"].items())), ep["port"], ep["path"])
            for m in monitors for ep in m["spec"]["podMetricsEndpoints"]}
    head = tuple(sorted({**RELEASE, "app.kubernetes.io/component": "head"}.items()))
    assert seen == {(tuple(sorted(RELEASE.items())), "metrics", "/metrics"), (head, "serve", "/metrics")}


def test_prometheus_may_reach_only_the_metrics_port():
    (np,) = [d for d in load_all(MONITORING) if d["kind"] == "NetworkPolicy"]
    (rule,) = np["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]


# -------------------------------------------------------- releases as a whole
@pytest.mark.parametrize("name, docs", BUNDLES, ids=ids(BUNDLES))
def test_release_validates_as_a_whole(name, docs):
    assert validate.validate_all(docs) == []


def test_render_release_renames_what_selects_the_release():
    docs = render.render_release("gpu", name="llama-pd", monitoring=True)
    selected = {str(d["spec"].get("podSelector", d["spec"].get("selector"))["matchLabels"]["app.kubernetes.io/instance"])
                for d in docs if d["kind"] != "RayService"}
    assert selected == {"llama-pd"}


def test_render_release_points_the_pods_at_the_renamed_secret():
    (service,) = [d for d in render.render_release("cpu", name="llama-pd") if d["kind"] == "RayService"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for _, c in containers(service) for e in c["env"]
            if e["name"] == "RAYPD_API_KEYS"}
    assert refs == {"llama-pd-api-keys"}


def test_render_release_sets_the_operator_and_prometheus_namespaces():
    docs = render.render_release("gpu", monitoring=True, kuberay_namespace="ray-system",
                                 prometheus_namespace="observability")
    named = {d["metadata"]["name"]: peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
             for d in docs if d["kind"] == "NetworkPolicy" for r in d["spec"]["ingress"] for peer in r.get("from", [])
             if "namespaceSelector" in peer}
    assert named == {"raypd-dashboard": "ray-system", "raypd-metrics": "observability"}


# ----------------------------------------------------- the validators say no
def _service(docs):
    return next(d for d in docs if d["kind"] == "RayService")


def _worker(docs, i=0):
    return cluster_of(_service(docs))["workerGroupSpecs"][i]["template"]["spec"]


def _head(docs):
    return cluster_of(_service(docs))["headGroupSpec"]["template"]["spec"]


def _named(docs, name):
    return next(d for d in docs if d["metadata"]["name"] == name)


def _env(container, name):
    return next(e for e in container["env"] if e["name"] == name)


def _add_api_keys(docs):
    service = _service(docs)
    service["spec"]["serveConfigV2"] = service["spec"]["serveConfigV2"].replace(
        "num_replicas: 2 ", "num_replicas: 2\n        api_keys: [sk-inline] ")  # 8: the block's own indent


BROKEN = [
    ("auth off", lambda d: cluster_of(_service(d)).pop("authOptions"), "set mode: token"),
    ("auth disabled", lambda d: cluster_of(_service(d))["authOptions"].update(mode="disabled"), "set mode: token"),
    ("k8s token auth on a RayService", lambda d: cluster_of(_service(d))["authOptions"].update(enableK8sTokenAuth=True),
     "RayCluster only"),
    ("token auth on old Ray", lambda d: cluster_of(_service(d)).update(rayVersion="2.50.0"), "needs Ray >= 2.52.0"),
    ("SYS_ADMIN added", lambda d: _worker(d)["containers"][0]["securityContext"]["capabilities"].update(
        add=["IPC_LOCK", "SYS_ADMIN"]), "only IPC_LOCK"),
    ("IPC_LOCK on the head", lambda d: _head(d)["containers"][0]["securityContext"]["capabilities"].update(
        add=["IPC_LOCK"]), "IPC_LOCK without an RDMA transport"),
    ("runs as root", lambda d: _worker(d)["securityContext"].update(runAsUser=0), "uid 0"),
    ("read-only root without /tmp", lambda d: _head(d)["containers"][0].update(volumeMounts=[
        m for m in _head(d)["containers"][0]["volumeMounts"] if m["mountPath"] != "/tmp"]), "emptyDir at /tmp"),
    ("API keys as a literal", lambda d: _env(_worker(d)["containers"][0], "RAYPD_API_KEYS").update(
        value="sk-1", valueFrom=None) or _env(_worker(d)["containers"][0], "RAYPD_API_KEYS").pop("valueFrom"),
     "literal value"),
    ("API keys missing on a worker", lambda d: _worker(d, 1)["containers"][0].update(env=[
        e for e in _worker(d, 1)["containers"][0]["env"] if e["name"] != "RAYPD_API_KEYS"]), "set RAYPD_API_KEYS"),
    ("API keys inline", _add_api_keys, "inline API keys (http.api_keys) are not accepted"),
    ("head Service LoadBalancer", lambda d: cluster_of(_service(d))["headGroupSpec"].update(serviceType="LoadBalancer"),
     "exposes the GCS"),
    ("dashboard ingress", lambda d: cluster_of(_service(d))["headGroupSpec"].update(enableIngress=True),
     "would expose the dashboard"),
    ("Serve port closed", lambda d: _named(d, "raypd")["spec"]["ingress"][1]["ports"][0].update(port=8001),
     "ports open to anyone are [8001]"),
    ("dashboard open to all", lambda d: _named(d, "raypd")["spec"]["ingress"].append(
        {"ports": [{"protocol": "TCP", "port": 8265}]}), "ports open to anyone are [8000, 8265]"),
    ("every port from every namespace", lambda d: _named(d, "raypd")["spec"]["ingress"].append(
        {"from": [{"namespaceSelector": {}}]}), "admits every port from outside the release"),
    ("dashboard to a whole namespace", lambda d: _named(d, "raypd-dashboard")["spec"]["ingress"][0]["from"][0].pop(
        "podSelector"), "whole namespace"),
    ("no rule inside the release", lambda d: _named(d, "raypd")["spec"]["ingress"].pop(0),
     "no rule admits the release's own pods"),
    ("policy for another release", lambda d: _named(d, "raypd")["spec"]["podSelector"]["matchLabels"].update(
        {"app.kubernetes.io/instance": "other"}), "selects no Ray pod"),
    ("monitor on a missing port", lambda d: _named(d, "raypd-serve-metrics")["spec"]["podMetricsEndpoints"][0].update(
        port="http"), "no container port named 'http'"),
    ("metrics port not scraped", lambda d: d.remove(_named(d, "raypd-ray-metrics")),
     "no PodMonitor scrapes the metrics port"),
    ("metrics port not declared", lambda d: _worker(d)["containers"][0].update(ports=[
        p for p in _worker(d)["containers"][0]["ports"] if p["name"] != "metrics"]), "is not a container port"),
    ("annotation on the wrong port", lambda d: cluster_of(_service(d))["headGroupSpec"]["template"]["metadata"][
        "annotations"].update({"prometheus.io/port": "9090"}), "annotation prometheus.io/port"),
    ("policy field typo", lambda d: _named(d, "raypd")["spec"].update(ingres=[]), "'ingres' was unexpected"),
    ("bad CIDR", lambda d: _named(d, "raypd")["spec"]["ingress"].append({"from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}),
     "ipBlock"),
    ("policy port out of range", lambda d: _named(d, "raypd")["spec"]["ingress"][1]["ports"][0].update(port=70000),
     "out of range"),
    ("monitor interval", lambda d: _named(d, "raypd-ray-metrics")["spec"]["podMetricsEndpoints"][0].update(
        interval="15"), "does not match"),
    ("secret not base64", lambda d: d.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "raypd-api-keys"},
                                             "data": {"api-keys": "not base64!"}}), "not base64"),
    ("secret with an empty key", lambda d: d.append({"apiVersion": "v1", "kind": "Secret",
                                                    "metadata": {"name": "raypd-api-keys"},
                                                    "stringData": {"api-keys": "sk-1,,sk-2"}}), "non-empty API keys"),
]


@pytest.mark.parametrize("what, breaks, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_release_breaking_the_posture_is_refused(what, breaks, message):
    docs = copy.deepcopy(BUNDLES[0][1])
    breaks(docs)
    errors = validate.validate_all(docs)
    assert any(message in e for e in errors), errors


def test_a_bench_job_without_a_hardened_submitter_is_refused():
    job = load(BENCH)
    job["spec"].pop("submitterPodTemplate")
    assert any("spec.submitterPodTemplate" in e for e in validate.validate(job))


def test_networkpolicies_validate_against_the_kubernetes_api_schema():
    import kubernetes_validate as kv  # a dev dependency: the Kubernetes OpenAPI schemas, strict
    version = kv.latest_version()
    for doc in load_all(SECURITY) + load_all(BENCH_POLICY) + [
            d for d in load_all(MONITORING) if d["kind"] == "NetworkPolicy"]:
        kv.validate(doc, version, strict=True)
        assert validate.validate(doc) == []
