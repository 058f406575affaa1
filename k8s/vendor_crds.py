"""Vendor KubeRay's CRDs into k8s/kuberay_crds/: what `crd.py` validates the manifests against.

    python k8s/vendor_crds.py DIR     # DIR: KubeRay's ray-operator/config/crd/bases (*.yaml)

Each CRD is kept as JSON with what validation reads: group, names, and its `v1` version (the one
raypd's manifests use): name, served/storage flags and OpenAPI v3 schema, with the schema's
`description` texts dropped (they are most of a CRD's megabyte and validate nothing). The files are generated: re-run this on a
KubeRay upgrade instead of editing them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent / "kuberay_crds"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
VERSION = "v1"


def without_descriptions(schema: Any) -> Any:
    """An OpenAPI v3 schema without `description` keywords (fields named "description" stay)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k != "description"}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: without_descriptions(s) for name, s in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = without_descriptions(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [without_descriptions(s) for s in out[key]]
    return out


def slim(crd: dict) -> dict:
    spec = crd["spec"]
    return {
        "apiVersion": crd["apiVersion"], "kind": crd["kind"],
        "metadata": {"name": crd["metadata"]["name"], "annotations": crd["metadata"].get("annotations", {})},
        "spec": {"group": spec["group"], "names": spec["names"], "scope": spec.get("scope"),
                 "versions": [{"name": v["name"], "served": v.get("served", True), "storage": v.get("storage", False),
                               "schema": {"openAPIV3Schema": without_descriptions(v["schema"]["openAPIV3Schema"])}}
                              for v in spec["versions"] if v["name"] == VERSION]},
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    OUT.mkdir(exist_ok=True)
    for path in sorted(Path(argv[0]).glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(), Loader=_LOADER):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                target = OUT / f"{crd['metadata']['name']}.json"
                target.write_text(json.dumps(slim(crd), sort_keys=True, separators=(",", ":")) + "\n")
                print(f"{path.name} -> {target.relative_to(OUT.parent.parent)} ({target.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
