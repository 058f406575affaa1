#!/usr/bin/env python3
"""Run checkov's Kubernetes checks over the Pods KubeRay makes from raypd's manifests.

    python k8s/checkov_scan.py k8s/base/rayservice.yaml k8s/security/networkpolicy.yaml
    python k8s/render.py --cpu | python k8s/checkov_scan.py -

checkov reads no RayService, RayCluster or RayJob, so each is written out as the Pods KubeRay
creates from it (head, every worker group, a RayJob's submitter: the pod template's metadata and
spec), beside the other documents given (NetworkPolicies, ...). checkov runs in its own venv
(scripts/setup.sh makes `.venv-checkov`: its pins clash with Ray's), with the checks of
`checkov_skips.yaml` skipped, each there with its reason. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posture import pod_templates

K8S_DIR = Path(__file__).resolve().parent
SKIPS_FILE = K8S_DIR / "checkov_skips.yaml"
CHECKOV_VENV = ".venv-checkov"
RAY_KINDS = ("RayService", "RayCluster", "RayJob")


class CheckovMissing(RuntimeError):
    """No checkov executable found (run scripts/setup.sh, or set RAYPD_CHECKOV)."""


class CheckovFailed(RuntimeError):
    """checkov ran but gave no report (a crash or a parse error in what it read)."""


@dataclass(frozen=True)
class Finding:
    """One failed check on one resource."""

    check_id: str
    check_name: str
    resource: str
    file: str


@dataclass(frozen=True)
class Report:
    failed: tuple[Finding, ...]
    passed: int
    skipped: int
    checked: frozenset[str]  # every resource a check ran on ("Pod.default.raypd-head", ...)


def load_skips(path: Path = SKIPS_FILE) -> dict[str, str]:
    """check id -> why it is skipped."""
    skips = yaml.safe_load(path.read_text()) or {}
    bad = [k for k, v in skips.items() if not isinstance(v, str) or not v.strip() or "\n" in v]
    if bad:
        raise ValueError(f"{path.name}: give each skipped check one line of reason: {bad}")
    return {str(k): v for k, v in skips.items()}


def as_pods(docs: list[Any], prefix: str = "") -> list[dict]:
    """The documents checkov should read: Ray documents become their Pods, others stay as they are."""
    out = []
    for doc in docs:
        if not isinstance(doc, dict):
            continue
        if doc.get("kind") not in RAY_KINDS:
            out.append(doc)
            continue
        meta = doc.get("metadata") or {}
        for group, template in pod_templates(doc):
            pod_meta = {**(template.get("metadata") or {}), "name": f"{prefix}{meta.get('name')}-{group}"}
            if meta.get("namespace"):
                pod_meta["namespace"] = meta["namespace"]
            out.append({"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": template.get("spec") or {}})
    return out


def find_checkov() -> Path:
    """$RAYPD_CHECKOV, else .venv-checkov beside the repository or beside the running venv, else PATH."""
    if os.environ.get("RAYPD_CHECKOV"):
        return Path(os.environ["RAYPD_CHECKOV"])
    for root in (K8S_DIR.parent, Path(sys.prefix).parent):
        candidate = root / CHECKOV_VENV / "bin" / "checkov"
        if candidate.is_file():
            return candidate
    found = shutil.which("checkov")
    if found:
        return Path(found)
    raise CheckovMissing(f"no checkov: run scripts/setup.sh (it makes {CHECKOV_VENV}/) or set RAYPD_CHECKOV")


def run_checkov(directory: Path, skips: dict[str, str] | None = None, timeout_s: float = 300) -> Report:
    """checkov's `kubernetes` framework over every YAML file under `directory`, offline."""
    skips = load_skips() if skips is None else skips
    argv = [str(find_checkov()), "-d", str(directory), "--framework", "kubernetes", "--output", "json",
            "--compact", "--skip-download"]
    if skips:
        argv += ["--skip-check", ",".join(sorted(skips))]
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    try:
        data = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise CheckovFailed(f"checkov exited {done.returncode} without a JSON report: "
                            f"{(done.stderr or done.stdout)[-2000:]}") from None
    reports = data if isinstance(data, list) else [data]
    failed, passed, skipped, checked = [], 0, 0, set()
    for r in reports:
        if "results" not in r:  # checkov's summary-only answer when it found nothing to check
            continue
        summary, results = r["summary"], r["results"]
        if summary.get("parsing_errors"):
            raise CheckovFailed(f"checkov could not parse: {results.get('parsing_errors')}")
        failed += [Finding(c["check_id"], c["check_name"], c["resource"], c.get("file_path", ""))
                   for c in results.get("failed_checks") or []]
        passed += summary.get("passed", 0)
        skipped += summary.get("skipped", 0)
        checked |= {c["resource"] for c in (results.get("passed_checks") or []) + (results.get("failed_checks") or [])}
    return Report(tuple(failed), passed, skipped, frozenset(checked))


def write_documents(docs: list[Any], directory: Path, name: str, prefix: str = "") -> list[dict]:
    """`docs`, as checkov should read them (Pod names prefixed), into directory/name.yaml."""
    written = as_pods(docs, prefix)
    (directory / f"{name}.yaml").write_text(yaml.safe_dump_all(written, sort_keys=False))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="checkov_scan.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="manifests ('-' = stdin)")
    args = p.parse_args(argv)
    docs = [d for f in args.files
            for d in yaml.safe_load_all(sys.stdin.read() if f == "-" else Path(f).read_text()) if d is not None]
    with tempfile.TemporaryDirectory(prefix="raypd-checkov-") as tmp:
        write_documents(docs, Path(tmp), "release")
        report = run_checkov(Path(tmp))
    for f in report.failed:
        print(f"FAILED {f.check_id} {f.resource}: {f.check_name}")
    print(f"checkov: {report.passed} passed, {len(report.failed)} failed, {report.skipped} skipped "
          f"over {len(report.checked)} resources ({len(load_skips())} checks skipped, k8s/checkov_skips.yaml)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
