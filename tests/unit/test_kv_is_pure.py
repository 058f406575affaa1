"""actors.kv must stay importable without Ray or vLLM (DESIGN: the heart has no heavy deps)."""

import ast
import pathlib

KV = pathlib.Path(__file__).resolve().parents[2] / "actors" / "kv"


def test_kv_imports_neither_ray_nor_vllm():
    offenders = []
    for path in KV.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(KV)}: {n}" for n in names if n.split(".")[0] in ("ray", "vllm")]
    assert not offenders, offenders
    assert len(list(KV.rglob("*.py"))) >= 4
    assert {"plan", "lease", "nixl"} <= {p.parent.name for p in KV.rglob("*.py")}  # the stages are walked
