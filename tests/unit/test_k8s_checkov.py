"""checkov's Kubernetes checks over the Pods KubeRay makes from raypd's manifests (k8s/checkov_scan.py).

The release bundles of tests/unit/test_k8s_security.py (shipped files and k8s/render.py outputs,
with their NetworkPolicies and PodMonitors) and the bench RayJob with its NetworkPolicy are
written out as Pods, and checkov (its own venv, made by scripts/setup.sh) runs once over all
of them: no check fails but those of k8s/checkov_skips.yaml, and each skip is still needed.
A second run over broken pods shows that checkov refuses what raypd's validators no longer
check themselves (the mapping of docs/kubernetes.md).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_k8s_manifests import BENCH, K8S, load
from test_k8s_security import BUNDLES, load_all

import checkov_scan  # noqa: E402  (k8s/checkov_scan.py, on sys.path via test_k8s_manifests)

BENCH_POLICY = K8S / "rayjob-bench-networkpolicy.yaml"
SKIPS = checkov_scan.load_skips()


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> tuple[checkov_scan.Report, set[str]]:
    """checkov without skips over every bundle; (report, the Pods written)."""
    directory = tmp_path_factory.mktemp("checkov-shipped")
    sets = [(name, docs) for name, docs in BUNDLES] + [("bench", load_all(BENCH_POLICY) + [load(BENCH)])]
    written = [d for name, docs in sets for d in checkov_scan.write_documents(docs, directory, name, f"{name}-")]
    pods = {f"Pod.{d['metadata'].get('namespace', 'default')}.{d['metadata']['name']}"
            for d in written if d["kind"] == "Pod"}
    return checkov_scan.run_checkov(directory, skips={}), pods


def test_skips_have_one_line_of_reason_each():
    assert all(k.startswith("CKV") and len(v.splitlines()) == 1 and len(v) > 40 for k, v in SKIPS.items())


def test_checkov_reads_every_pod_kuberay_makes(shipped):
    report, pods = shipped
    assert pods - report.checked == set()


def test_no_checkov_check_fails_but_the_skipped_ones(shipped):
    report, _ = shipped
    assert sorted({f"{f.check_id} {f.resource}" for f in report.failed if f.check_id not in SKIPS}) == []


def test_every_skipped_check_still_fails_somewhere(shipped):
    report, _ = shipped
    assert set(SKIPS) - {f.check_id for f in report.failed} == set()


def test_the_command_line_passes_the_cpu_release(capsys):
    files = [str(K8S / "security" / "networkpolicy.yaml"), str(K8S / "overlays" / "cpu" / "rayservice.yaml")]
    assert (checkov_scan.main(files), capsys.readouterr().out.count("FAILED")) == (0, 0)


# ------------------------------------------------- checkov says no (the mapping)
def _pod(docs: list, group: str) -> dict:
    return next(d for d in checkov_scan.as_pods(docs) if d["kind"] == "Pod" and d["metadata"]["name"].endswith(group))


def _c(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


def _sc(pod: dict) -> dict:
    return _c(pod)["securityContext"]


BROKEN = [  # (what, group, break, the checkov check that must fail)
    ("privileged", "prefill", lambda p: _sc(p).update(privileged=True), "CKV_K8S_16"),
    ("privilege escalation", "head", lambda p: _sc(p).update(allowPrivilegeEscalation=True), "CKV_K8S_20"),
    ("capabilities kept", "head", lambda p: _sc(p)["capabilities"].update(drop=[]), "CKV_K8S_37"),
    ("runs as root", "head", lambda p: [p["spec"]["securityContext"].pop(k) for k in ("runAsNonRoot", "runAsUser")],
     "CKV_K8S_23"),
    ("seccomp unconfined", "head", lambda p: p["spec"]["securityContext"].update(seccompProfile={"type": "Unconfined"}),
     "CKV_K8S_31"),
    ("writable root", "head", lambda p: _sc(p).update(readOnlyRootFilesystem=False), "CKV_K8S_22"),
    ("host network", "prefill", lambda p: p["spec"].update(hostNetwork=True), "CKV_K8S_19"),
    ("host PID", "decode", lambda p: p["spec"].update(hostPID=True), "CKV_K8S_17"),
    ("host IPC", "decode", lambda p: p["spec"].update(hostIPC=True), "CKV_K8S_18"),
    ("service account token", "prefill", lambda p: p["spec"].pop("automountServiceAccountToken"), "CKV_K8S_38"),
    ("SYS_ADMIN added", "prefill", lambda p: _sc(p)["capabilities"].update(add=["IPC_LOCK", "SYS_ADMIN"]),
     "CKV_K8S_39"),
]


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> checkov_scan.Report:
    directory: Path = tmp_path_factory.mktemp("checkov-broken")
    base = copy.deepcopy(BUNDLES[0][1])
    policies = [d for d in base if d["kind"] == "NetworkPolicy"]
    for i, (_, group, breaks, _) in enumerate(BROKEN):
        pod = copy.deepcopy(_pod(base, group))
        pod["metadata"]["name"] = f"broken-{i}"
        breaks(pod)
        checkov_scan.write_documents(policies + [pod], directory, f"broken-{i}")
    return checkov_scan.run_checkov(directory)  # with the skips, as CI runs it


@pytest.mark.parametrize("i, what, check_id", [(i, b[0], b[3]) for i, b in enumerate(BROKEN)],
                         ids=[b[0] for b in BROKEN])
def test_checkov_refuses_a_broken_pod(i, what, check_id, broken):
    assert check_id in {f.check_id for f in broken.failed if f.resource == f"Pod.default.broken-{i}"}
