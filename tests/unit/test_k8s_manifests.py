"""KubeRay manifests (k8s/): valid for the KubeRay CRDs, for core Kubernetes, and for raypd.
(Their security posture, NetworkPolicies and PodMonitors: tests/unit/test_k8s_security.py.)

No cluster: the RayService / RayJob documents (the shipped files and k8s/render.py
outputs for several sizes) are checked with k8s/validate.py against the CRDs'
OpenAPI v3 schemas vendored in k8s/kuberay_crds/ (jsonschema), against the core
Kubernetes API schemas for the embedded pod templates (kubernetes-validate, strict) and
validate.py's own checks, and the Serve config inside each
RayService is loaded with raypd's DeploymentConfig and built with
serving.cluster.app:build_app. The last tests break manifests on purpose: the same
validators must refuse them.
"""

from __future__ import annotations

import copy
import json
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
sys.path.insert(0, str(K8S))

import crd as crd_schemas  # noqa: E402  (k8s/crd.py)
import render  # noqa: E402  (k8s/render.py)
import validate  # noqa: E402  (k8s/validate.py)

from serving.config import DeploymentConfig  # noqa: E402

BASE = K8S / "base" / "rayservice.yaml"
CPU = K8S / "overlays" / "cpu" / "rayservice.yaml"
BENCH = K8S / "rayjob-bench.yaml"
GPU = "nvidia.com/gpu"

# (id, accel, render options)
RENDERS = [
    ("gpu-default", "gpu", {}),
    ("gpu-2p3d-tp2-tp4", "gpu", dict(prefill_replicas=2, decode_replicas=3, prefill_tp=2, decode_tp=4)),
    ("gpu-4p1d-tp1-tp8", "gpu", dict(prefill_replicas=4, decode_replicas=1, prefill_tp=1, decode_tp=8,
                                     worker_cpus="16", worker_memory="128Gi")),
    ("gpu-0p2d-decode-only", "gpu", dict(prefill_replicas=0, decode_replicas=2, decode_tp=2)),
    ("gpu-named", "gpu", dict(name="llama-pd", namespace="serving", image="registry.example/raypd:1.0",
                              model="/models/Llama-3.1-70B-Instruct", ingress_replicas=3)),
    ("cpu-default", "cpu", {}),
    ("cpu-3p2d-tp2-tp4", "cpu", dict(prefill_replicas=3, decode_replicas=2, prefill_tp=2, decode_tp=4)),
    ("cpu-vllm", "cpu", dict(backend="vllm", decode_replicas=2)),
]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def rendered(accel: str, options: dict) -> dict:
    """What `python k8s/render.py` prints, parsed back (exercises the YAML output too)."""
    return yaml.safe_load(render.to_yaml(render.render(accel, **options)))


def all_documents() -> list[tuple[str, dict]]:
    docs = [("base", load(BASE)), ("overlay-cpu", load(CPU)), ("rayjob-bench", load(BENCH))]
    return docs + [(f"render-{rid}", rendered(accel, opts)) for rid, accel, opts in RENDERS]


DOCS = all_documents()
SERVICES = [(i, d) for i, d in DOCS if d["kind"] == "RayService"]


def ids(items):
    return [i for i, _ in items]


def cluster_of(doc: dict) -> dict:
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]["rayClusterSpec"]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    cluster = cluster_of(doc)
    out = [("head", cluster["headGroupSpec"]["template"])]
    return out + [(g["groupName"], g["template"]) for g in cluster.get("workerGroupSpecs") or []]


def args_of(doc: dict) -> dict:
    return validate.raypd_app(validate.load_serve_config(doc))["args"]


def group(doc: dict, name: str) -> dict:
    return next(g for g in cluster_of(doc)["workerGroupSpecs"] if g["groupName"] == name)


# --------------------------------------------------------------- the CRD schemas
@pytest.fixture(scope="module")
def crds() -> dict[str, dict]:
    directory = crd_schemas.find_crd_dir()  # k8s/kuberay_crds/ (vendored): fails, never skips, when missing
    return {crd["spec"]["names"]["kind"]: crd for crd in crd_schemas.load_crds(directory)}


def test_crds_serve_v1_with_an_openapi_schema(crds):
    assert {"RayService", "RayJob", "RayCluster"} <= set(crds)
    for kind, crd in crds.items():
        (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        assert v1["served"] and v1["storage"], kind
        schema = v1["schema"]["openAPIV3Schema"]
        assert schema["properties"]["spec"]["type"] == "object"
        import jsonschema

        jsonschema.Draft7Validator.check_schema(crd_schemas._strict(schema))  # the schema we validate with is sound


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_kind_and_api_version_match_a_crd(name, doc, crds):
    crd = crds[doc["kind"]]
    assert doc["apiVersion"] == f"{crd['spec']['group']}/v1"
    assert doc["kind"] == crd["spec"]["names"]["kind"]


@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_manifest_validates_against_its_kuberay_crd(name, doc):
    assert validate.crd_errors(doc) == []


# ------------------------------------------------------------- core Kubernetes
@pytest.mark.parametrize("name, doc", DOCS, ids=ids(DOCS))
def test_pod_templates_and_kuberay_rules(name, doc):
    assert validate.core_errors(doc) == []
    for group_name, template in pod_templates(doc):
        for c in template["spec"]["containers"]:
            assert c["name"] and c["image"], group_name
            for kind in ("requests", "limits"):
                for value in (c.get("resources") or {}).get(kind, {}).values():
                    validate.parse_quantity(value)
            assert all(isinstance(p["containerPort"], int) for p in c.get("ports") or [])


def test_pod_templates_validate_against_the_kubernetes_api_schema():
    import kubernetes_validate as kv  # a dev dependency: the Kubernetes OpenAPI schemas, strict
    version = kv.latest_version()
    for name, doc in DOCS:
        for group_name, template in pod_templates(doc):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"raypd-{group_name}"},
                   "spec": template["spec"]}
            kv.validate(pod, version, strict=True)


def test_quantities_parse_like_kubernetes():
    assert validate.parse_quantity("500m") == Decimal("0.5")
    assert validate.parse_quantity("16Gi") == 16 * 2 ** 30
    assert validate.parse_quantity(2) == 2
    assert validate.parse_quantity("1e3") == 1000
    assert validate.parse_quantity("1.5G") == Decimal("1.5e9")
    for bad in ("16 Gi", "16GB", "", "two", "1.2.3", True, 1.5):
        with pytest.raises(ValueError):
            validate.parse_quantity(bad)


def test_ray_resources_param_round_trips_through_the_shell():
    value = render.ray_resources_param({"prefill": 1})
    assert value == '"{\\"prefill\\": 1}"'  # what KubeRay's docs write as '"{\"prefill\": 1}"'
    assert render.parse_ray_resources_param(value) == {"prefill": 1}
    assert group(load(BASE), "prefill")["rayStartParams"]["resources"] == value


# ---------------------------------------------------------- raypd's own config
@pytest.mark.parametrize("name, doc", SERVICES, ids=ids(SERVICES))
def test_serve_config_loads_with_raypd_config_model(name, doc):
    serve_config = validate.load_serve_config(doc)
    app = validate.raypd_app(serve_config)
    assert app["import_path"] == "serving.cluster.app:build_app" and app["route_prefix"] == "/"
    import serving.cluster.app

    assert validate.resolve_import_path(app["import_path"]) is serving.cluster.app.build_app
    cfg = DeploymentConfig.from_dict(app["args"])
    assert cfg.http.host == "0.0.0.0" and cfg.http.port == serve_config["http_options"]["port"]
    assert dict(cfg.prefill.resources) == {"prefill": 1} and dict(cfg.decode.resources) == {"decode": 1}
    assert validate.raypd_errors(doc) == []  # Serve schema, build_app(args), manifest <-> config consistency


@pytest.mark.parametrize("name, doc", SERVICES, ids=ids(SERVICES))
def test_engines_land_on_their_own_worker_groups(name, doc):
    cfg = DeploymentConfig.from_dict(args_of(doc))
    head = cluster_of(doc)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert not validate.group_ray_resources(head)
    for role in ("prefill", "decode"):
        g = group(doc, role)
        assert validate.group_ray_resources(g) == {role: 1}
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == getattr(cfg, role).count
        c = validate.ray_container(g)
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "serve"}
        assert "livenessProbe" not in c  # KubeRay's own (the raylet's health); /health is readiness only
        assert validate.named_port(c, "serve") == cfg.http.port
    assert "readinessProbe" not in validate.ray_container(head)


def test_base_has_the_cluster_settings_nixl_needs():
    doc = load(BASE)
    cfg = DeploymentConfig.from_dict(args_of(doc))
    assert cfg.backend == "vllm" and cfg.model.startswith("/models/")
    for role in ("prefill", "decode"):
        g = group(doc, role)
        c = validate.ray_container(g)
        tp = getattr(cfg, role).tp_size
        assert c["resources"]["limits"][GPU] == c["resources"]["requests"][GPU] == tp
        assert g["rayStartParams"]["num-gpus"] == str(tp)
        assert c["resources"]["limits"]["rdma/hca"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {"UCX_TLS", "UCX_NET_DEVICES"} <= set(env) and "tcp" in env["UCX_TLS"].split(",")
        volumes = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/models"]]["persistentVolumeClaim"]["readOnly"] is True
        assert c["image"] == "ghcr.io/your-org/raypd:latest"


def test_cpu_overlay_has_no_gpus_rdma_or_ipc_lock():
    doc = load(CPU)
    text = json.dumps(doc)  # the manifest without its comments
    assert GPU not in text and "rdma" not in text and "IPC_LOCK" not in text and "num-gpus" not in text
    cfg = DeploymentConfig.from_dict(args_of(doc))
    assert cfg.backend == "synthetic"
    for _, template in pod_templates(doc):
        limits = template["spec"]["containers"][0]["resources"]["limits"]
        assert validate.parse_quantity(limits["memory"]) <= 2 * 2 ** 30


# -------------------------------------------------------------------- render.py
def _serve_config_parsed(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["spec"]["serveConfigV2"] = yaml.safe_load(doc["spec"]["serveConfigV2"])
    return doc


@pytest.mark.parametrize("accel, path", [("gpu", BASE), ("cpu", CPU)])
def test_render_without_options_is_the_template(accel, path):
    assert _serve_config_parsed(rendered(accel, {})) == _serve_config_parsed(load(path))


@pytest.mark.parametrize("rid, accel, options", RENDERS, ids=[r[0] for r in RENDERS])
def test_render_sizes_show_up_everywhere(rid, accel, options):
    doc = rendered(accel, options)
    template = load(BASE if accel == "gpu" else CPU)
    args, targs = args_of(doc), args_of(template)
    for role in ("prefill", "decode"):
        g, tg = group(doc, role), group(template, role)
        n = options.get(f"{role}_replicas", tg["replicas"])
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == args[role]["count"] == n
        tp = options.get(f"{role}_tp", targs[role]["tp_size"])
        assert args[role]["tp_size"] == tp
        c = validate.ray_container(g)
        if accel == "gpu":
            assert c["resources"]["requests"][GPU] == c["resources"]["limits"][GPU] == tp
            assert g["rayStartParams"]["num-gpus"] == str(tp)
        else:
            assert GPU not in json.dumps(doc)
        if "worker_cpus" in options:
            assert c["resources"]["limits"]["cpu"] == options["worker_cpus"]
            assert g["rayStartParams"]["num-cpus"] == options["worker_cpus"]
            assert args[role]["num_cpus"] == int(options["worker_cpus"])
        if "worker_memory" in options:
            assert c["resources"]["limits"]["memory"] == options["worker_memory"]
    if "name" in options:
        assert doc["metadata"]["name"] == args["name"] == validate.raypd_app(validate.load_serve_config(doc))["name"]
        assert doc["metadata"]["namespace"] == options["namespace"]
    if "image" in options:
        assert {c["image"] for _, t in pod_templates(doc) for c in t["spec"]["containers"]} == {options["image"]}
    if "ingress_replicas" in options:
        assert args["http"]["num_replicas"] == options["ingress_replicas"]
    assert validate.validate(doc) == []


def test_render_scales_prefill_and_decode_independently():
    base = rendered("gpu", {})
    more_prefill = rendered("gpu", dict(prefill_replicas=5, prefill_tp=4))
    more_decode = rendered("gpu", dict(decode_replicas=6, decode_tp=8))
    assert group(more_prefill, "decode") == group(base, "decode")
    assert args_of(more_prefill)["decode"] == args_of(base)["decode"]
    assert group(more_decode, "prefill") == group(base, "prefill")
    assert args_of(more_decode)["prefill"] == args_of(base)["prefill"]
    assert cluster_of(more_decode)["headGroupSpec"] == cluster_of(base)["headGroupSpec"]


def test_render_cpu_vllm_uses_the_embedded_model_and_cpu_settings():
    args = args_of(rendered("cpu", dict(backend="vllm")))
    cfg = DeploymentConfig.from_dict(args)
    assert (cfg.backend, cfg.model, cfg.dtype) == ("vllm", "smollm2", "float32")
    assert cfg.prefill.block_size is None  # vLLM's CPU default (multiples of 32), not the synthetic 16
    assert "synthetic" not in args


def test_render_cli_writes_yaml_to_stdout(capsys):
    assert render.main(["--prefill-replicas", "2", "--decode-replicas", "3", "--prefill-tp", "2",
                        "--decode-tp", "4", "--gpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# rendered by: python k8s/render.py --prefill-replicas 2")
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "NetworkPolicy", "RayService"]
    doc = docs[-1]
    assert (group(doc, "prefill")["replicas"], group(doc, "decode")["replicas"]) == (2, 3)
    assert "serveConfigV2: |" in out  # the Serve config stays a readable block
    assert validate.validate_all(docs) == []


@pytest.mark.parametrize("argv, message", [
    (["--prefill-tp", "3", "--decode-tp", "2"], "must divide one another"),
    (["--decode-replicas", "0"], "--decode-replicas must be an integer >= 1"),
    (["--prefill-replicas", "-1"], "--prefill-replicas must be an integer >= 0"),
    (["--cpu", "--backend", "vllm", "--decode-tp", "2"], "tp_size 1 only"),
    (["--name", "Not_A_Name"], "DNS-1035"),
    (["--cpu", "--model", "/models/x"], "--model needs the vllm backend"),
    (["--worker-cpus", "500m"], "at least one whole CPU"),
])
def test_render_cli_refuses_bad_sizes(argv, message, capsys):
    assert render.main(argv) == 2
    assert message in capsys.readouterr().err


def test_render_gpu_with_the_synthetic_backend_is_flagged():
    doc = rendered("gpu", dict(backend="synthetic"))
    assert any("leave the GPUs idle" in e for e in validate.validate(doc))


# ---------------------------------------------------------------- RayJob bench
def test_bench_job_targets_the_rayservice_serve_service():
    job, service = load(BENCH), load(BASE)
    from urllib.parse import urlparse

    url = urlparse(validate.bench_url(job))
    assert url.hostname == f"{service['metadata']['name']}-serve-svc"  # the Service KubeRay creates
    assert url.port == DeploymentConfig.from_dict(args_of(service)).http.port
    assert job["spec"]["shutdownAfterJobFinishes"] and "rayClusterSpec" in job["spec"]
    assert validate.raypd_errors(job) == []


def test_bench_job_entrypoint_parses_with_raypd_cli():
    from serving.cli.main import build_parser

    job = load(BENCH)
    argv = validate.bench_argv(job)  # unwrapped from bash -c '...'
    args = build_parser().parse_args(argv[1:])
    assert argv[0] == "raypd" and args.command == "bench" and not args.overhead
    assert args.concurrency == "1,4,16" and args.requests > 0


def test_kustomizations_list_existing_files():
    for kustomization in K8S.rglob("kustomization.yaml"):
        data = load(kustomization)
        assert data["kind"] == "Kustomization"
        for resource in data["resources"]:
            target = kustomization.parent / resource
            assert target.is_file() or (target / "kustomization.yaml").is_file(), resource


# ------------------------------------------------- the validators can say no
def _worker(doc, i=0):
    return cluster_of(doc)["workerGroupSpecs"][i]


def _container(doc, i=0):
    return _worker(doc, i)["template"]["spec"]["containers"][0]


def _head_container(doc):
    return cluster_of(doc)["headGroupSpec"]["template"]["spec"]["containers"][0]


def _set_env(container, name, value):
    (var,) = [e for e in container["env"] if e["name"] == name]
    var["value"] = value


def _edit_serve(doc, old, new):
    assert old in doc["spec"]["serveConfigV2"]
    doc["spec"]["serveConfigV2"] = doc["spec"]["serveConfigV2"].replace(old, new)


BROKEN = [
    # KubeRay CRD schema
    ("wrong kind", lambda d: d.update(kind="RayServce"), "no KubeRay CRD serves"),
    ("wrong apiVersion", lambda d: d.update(apiVersion="ray.io/v2"), "no KubeRay CRD serves"),
    ("unknown field (typo)", lambda d: _worker(d).update(rayStartParam={}), "'rayStartParam' was unexpected"),
    ("replicas not an integer", lambda d: _worker(d).update(replicas="two"), "is not of type 'integer'"),
    ("replicas beyond int32", lambda d: _worker(d).update(replicas=2 ** 31), "is not a 'int32'"),
    ("rayStartParams value not a string", lambda d: _worker(d)["rayStartParams"].update({"num-gpus": 2}),
     "is not of type 'string'"),
    ("serveConfigV2 not a string", lambda d: d["spec"].update(serveConfigV2={"applications": []}),
     "is not of type 'string'"),
    ("worker group without template", lambda d: _worker(d).pop("template"), "'template' is a required property"),
    ("duplicate env var", lambda d: _container(d)["env"].append({"name": "UCX_TLS", "value": "tcp"}),
     "duplicate entries"),
    # core Kubernetes
    ("container without image", lambda d: _container(d).pop("image"), "image: required"),
    ("container name not a label", lambda d: _container(d).update(name="Ray_Worker"), "not a DNS-1123 label"),
    ("bad memory quantity", lambda d: _container(d)["resources"]["limits"].update(memory="64 GiB"),
     "does not parse"),
    ("requests above limits", lambda d: _container(d)["resources"]["requests"].update(cpu="16"),
     "exceeds limits[cpu]"),
    ("GPU requests != limits", lambda d: _container(d)["resources"]["requests"].update({GPU: 1}),
     "must equal limits"),
    ("fractional GPUs", lambda d: [_container(d)["resources"][k].update({GPU: "1.5"}) for k in ("requests", "limits")],
     "whole numbers"),
    ("port out of range", lambda d: _container(d)["ports"][0].update(containerPort=70000), "1..65535"),
    ("port name too long", lambda d: _container(d)["ports"][0].update(name="serve-http-port-x"), "IANA"),
    ("probe on an unknown port", lambda d: _container(d)["readinessProbe"]["httpGet"].update(port="http"),
     "names no port"),
    ("mount of a missing volume", lambda d: _container(d)["volumeMounts"].append({"name": "cache", "mountPath": "/c"}),
     "is not in the pod's volumes"),
    ("capability with CAP_ prefix",
     lambda d: _container(d)["securityContext"]["capabilities"].update(add=["CAP_IPC_LOCK"]), "no CAP_ prefix"),
    ("name too long for KubeRay", lambda d: d["metadata"].update(name="r" * 48), "at most 47"),
    ("min > max replicas", lambda d: _worker(d).update(minReplicas=2, maxReplicas=1), "minReplicas <= maxReplicas"),
    ("no maxReplicas without autoscaler", lambda d: _worker(d).pop("maxReplicas"), "minReplicas and maxReplicas"),
    ("object store beyond /dev/shm",
     lambda d: _worker(d)["rayStartParams"].update({"object-store-memory": str(32 * 2 ** 30)}),
     "does not fit the /dev/shm emptyDir"),
    ("bad rayStartParams resources", lambda d: _worker(d)["rayStartParams"].update(resources='{"prefill": 1'),
     "rayStartParams.resources"),
    # raypd
    ("invalid raypd args", lambda d: _edit_serve(d, "tp_size: 4", "tp_size: 3"), "must divide one another"),
    ("unknown raypd field", lambda d: _edit_serve(d, "max_model_len: 8192", "max_model_len: 8192\n      max_len: 1"),
     "max_len"),
    ("wrong import path", lambda d: _edit_serve(d, "serving.cluster.app:build_app", "serving.cluster.app:build"),
     "not raypd's builder"),
    ("invalid Serve config", lambda d: _edit_serve(d, "proxy_location: EveryNode", "proxy_location: Everywhere"),
     "not a valid Ray Serve config"),
    ("engine count != replicas", lambda d: _worker(d).update(replicas=2, maxReplicas=2),
     "must all equal prefill.count"),
    ("GPUs != tp", lambda d: [_container(d, 1)["resources"][k].update({GPU: 2}) for k in ("requests", "limits")],
     "!= decode.tp_size"),
    ("engines without their resource", lambda d: _edit_serve(d, "resources: {prefill: 1}", "resources: {}"),
     "prefill.resources is empty"),
    ("pod fits two engines",
     lambda d: _worker(d)["rayStartParams"].update(resources=render.ray_resources_param({"prefill": 2})),
     "exactly one prefill engine"),
    ("head takes engines", lambda d: cluster_of(d)["headGroupSpec"]["rayStartParams"].update({"num-cpus": "4"}),
     "num-cpus must be \"0\""),
    ("head /health probe",
     lambda d: _head_container(d).update(readinessProbe={"httpGet": {"path": "/health", "port": "serve"}}),
     "no /health readinessProbe"),
    ("engine pod without readiness", lambda d: _container(d).pop("readinessProbe"),
     "readinessProbe must be httpGet /health"),
    ("liveness on readiness", lambda d: _container(d).update(livenessProbe={"httpGet": {"path": "/health",
                                                                                       "port": "serve"}}),
     "no livenessProbe on /health"),
    ("loopback host", lambda d: _edit_serve(d, "host: 0.0.0.0           #", "host: 127.0.0.1         #"), "0.0.0.0"),
    ("model not on a volume", lambda d: _edit_serve(d, "/models/Llama-3.1-8B-Instruct", "/data/llama"), "on no volume"),
    ("GPUs hidden by Ray",
     lambda d: _container(d).update(env=[e for e in _container(d)["env"]
                                         if e["name"] != "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]),
     "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"),
    ("IPC_LOCK on a pod without RDMA", lambda d: _set_env(_container(d), "UCX_TLS", "tcp,cuda_copy"),
     "IPC_LOCK without an RDMA transport"),
    ("engine needs more CPUs than the pod", lambda d: _worker(d)["rayStartParams"].update({"num-cpus": "4"}),
     "asks 8.0 Ray CPUs"),
    ("engine with 0 CPUs on a 0-CPU pod", lambda d: [_edit_serve(d, "num_cpus: 8", "num_cpus: 0"),
                                                     _worker(d)["rayStartParams"].update({"num-cpus": "0"})],
     "asks 0.01 Ray CPUs"),
    ("small /dev/shm", lambda d: _container(d).update(volumeMounts=[m for m in _container(d)["volumeMounts"]
                                                                   if m["mountPath"] != "/dev/shm"]), "/dev/shm"),
]


@pytest.mark.parametrize("what, breaks, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_manifest_is_refused(what, breaks, message):
    doc = load(BASE)
    assert validate.validate(doc) == []
    breaks(doc)
    errors = validate.validate(doc)
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize("entrypoint, message", [
    ("raypd bench --url http://raypd-serve-svc:8000 --concurency 4", "refuses its arguments"),
    ("raypd bench --url http://raypd-serve-svc:8000 --requests many", "refuses its arguments"),
    ("raypd bench --overhead", "--overhead"),
    ("raypd bench --url raypd-serve-svc", "not an http(s) URL"),
    ("raypd bench --url http://raypd-serve-svc:8000 --api-key sk-in-the-manifest", "literal key"),
    ("bash -c 'exec raypd bench --url http://raypd-serve-svc:8000 --requests many'", "refuses its arguments"),
])
def test_a_broken_bench_job_is_refused(entrypoint, message):
    job = load(BENCH)
    job["spec"]["entrypoint"] = entrypoint
    assert any(message in e for e in validate.validate(job))


def test_a_broken_bench_job_cluster_is_refused():
    job = load(BENCH)
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["resources"]["limits"]["cpu"] = "x"
    job["spec"]["shutdownAfterJobFinishes"] = False
    errors = validate.validate(job)
    assert any("limits.cpu" in e for e in errors), errors
    assert any("needs shutdownAfterJobFinishes" in e for e in errors), errors


def test_vendoring_drops_description_keywords_not_fields_named_description():
    from k8s.vendor_crds import without_descriptions

    schema = {"type": "object", "description": "a doc string",
              "properties": {"description": {"type": "string", "description": "a field's doc"},
                             "items": {"type": "array", "items": {"type": "string", "description": "x"}}}}
    assert without_descriptions(schema) == {"type": "object", "properties": {
        "description": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}}}}
