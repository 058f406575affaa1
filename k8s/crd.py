"""KubeRay CRD schemas and the jsonschema machinery that checks documents against them.

`crd_errors(doc)` validates a RayService / RayCluster / RayJob against the OpenAPI v3 schema of
its CRD (`spec.versions[name=v1].schema.openAPIV3Schema` of k8s/kuberay_crds/, KubeRay's CRDs vendored
by k8s/vendor_crds.py; RAYPD_KUBERAY_CRDS names another folder of CRD YAML or JSON files) the
way `kubectl apply` with strict field validation does: unknown fields are errors, int32/int64
ranges and the uniqueness x-kubernetes-list-type/-list-map-keys imply are checked. CEL rules
(x-kubernetes-validations) and other x-kubernetes-* keys are ignored. `schema_errors(schema, doc)`
runs the same validator over raypd's own small schemas (policies.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Iterable

import yaml

K8S_DIR = Path(__file__).resolve().parent
REPO = K8S_DIR.parent
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are ~1 MB each

VENDORED = K8S_DIR / "kuberay_crds"  # k8s/vendor_crds.py writes it


def crd_dir_candidates() -> list[Path]:
    env = os.environ.get("RAYPD_KUBERAY_CRDS")
    return ([Path(env)] if env else []) + [VENDORED]


def _crd_files(directory: Path) -> list[Path]:
    return sorted([*directory.glob("*.yaml"), *directory.glob("*.json")])


def load_crds(directory: Path) -> list[dict]:
    """Every CustomResourceDefinition in the folder's YAML and JSON files (JSON is YAML)."""
    return [crd for path in _crd_files(directory) for crd in yaml.load_all(path.read_text(), Loader=_LOADER)
            if crd and crd.get("kind") == "CustomResourceDefinition"]


def find_crd_dir() -> Path:
    for cand in crd_dir_candidates():
        if cand.is_dir() and _crd_files(cand):
            return cand
    raise FileNotFoundError("KubeRay CRDs not found; looked in " + ", ".join(map(str, crd_dir_candidates()))
                            + " (set RAYPD_KUBERAY_CRDS)")


def _strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema where objects with `properties` refuse unknown fields
    (unless x-kubernetes-preserve-unknown-fields) and `nullable` admits null."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    if "not" in out:
        out["not"] = _strict(out["not"])
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _k8s_validator_class():
    import jsonschema
    from jsonschema.exceptions import ValidationError

    def list_map_keys(validator, keys, instance, schema):
        if not validator.is_type(instance, "array"):
            return
        props = (schema.get("items") or {}).get("properties") or {}
        seen: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
            if key in seen:
                yield ValidationError(f"duplicate entries [{seen[key]}] and [{i}] for key "
                                      f"{dict(zip(keys, key))} (x-kubernetes-list-type: map)")
            seen.setdefault(key, i)

    def list_type(validator, kind, instance, schema):
        if kind == "set" and validator.is_type(instance, "array"):
            for i, item in enumerate(instance):
                if item in instance[:i]:
                    yield ValidationError(f"duplicate item {item!r} (x-kubernetes-list-type: set)")

    return jsonschema.validators.extend(jsonschema.Draft7Validator, {
        "x-kubernetes-list-map-keys": list_map_keys,
        "x-kubernetes-list-type": list_type,
    })


def _format_checker():
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name, bits in (("int32", 32), ("int64", 64)):
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        checker.checks(name)(lambda v, lo=lo, hi=hi: not isinstance(v, int) or lo <= v <= hi)
    return checker


@functools.lru_cache(maxsize=None)
def crd_validators(crd_dir: str | None = None) -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a jsonschema validator, for every served version of every CRD."""
    directory = Path(crd_dir) if crd_dir else find_crd_dir()
    cls, checker = _k8s_validator_class(), _format_checker()
    out = {}
    for crd in load_crds(directory):
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                schema = _strict(version["schema"]["openAPIV3Schema"])
                out[(f"{group}/{version['name']}", kind)] = cls(schema, format_checker=checker)
    return out


def _path(parts: Iterable[Any]) -> str:
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text or "(root)"


def crd_errors(doc: Any, crd_dir: str | None = None) -> list[str]:
    if not isinstance(doc, dict):
        return ["the document is not a mapping"]
    validators = crd_validators(crd_dir)
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in validators:
        known = ", ".join(f"{a} {k}" for a, k in sorted(validators))
        return [f"no KubeRay CRD serves apiVersion {key[0]!r} kind {key[1]!r} (known: {known})"]
    errors = sorted(validators[key].iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]


def schema_errors(schema: dict, doc: Any) -> list[str]:
    """`doc` against an OpenAPI v3 schema of our own, with the same strictness as the CRDs."""
    validator = _k8s_validator_class()(_strict(schema), format_checker=_format_checker())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
