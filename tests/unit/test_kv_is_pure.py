"""actors.kv must stay importable without Ray or vLLM (DESIGN: the heart has no heavy deps)."""

import ast
import pathlib

KV = pathlib.Path(__file__).resolve().parents[2] / "actors" / "kv"


def test_kv_imports_neither_ray_nor_vllm():
    offenders = []
    for path in KV.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("ray", "vllm")]
    assert not offenders, offenders
    assert len(list(KV.glob("*.py"))) >= 4
