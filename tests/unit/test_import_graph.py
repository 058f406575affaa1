"""The project's own import graph has no cycle, and no source file grows past 400 lines.

Every import statement counts, wherever it stands (module level, inside a function, under
TYPE_CHECKING): a lazy import hides a cycle, it does not remove it. Folders open with a
docstring saying their one job (an `__init__.py` docstring or a README). The seams between
layers hold: routing never imports the control plane, the front never vLLM's engine side.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "serving", "benchmarks", "k8s")
MAX_LINES = 400  # the size limit (docs/design.md): a file past this is split by job


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for cand in candidates:  # every name: `from a import b, c` is an edge to a.b and to a.c
            found = _resolve(cand, name, modules)
            if found and found != name:
                targets.add(found)
    return targets


def _resolve(cand: str, importer: str, modules: dict[str, Path]) -> str | None:
    """The module `cand` names (`from a.b import c`: a.b.c if a module, else a.b). A benchmark script
    runs with benchmarks/ on its path, so its `pdbench.x` / `cpbench.x` is `benchmarks.pdbench.x`."""
    prefixes = ["", "benchmarks."] if importer.startswith("benchmarks") else [""]
    for prefix in prefixes:
        c = prefix + cand
        while c and c not in modules:
            c = c.rpartition(".")[0]
        if c and c != "benchmarks":
            return c
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_graph_sees_lazy_imports_and_the_benchmarks_packages(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from actors.protocol.request import TokenChunk\n    return TokenChunk\n")
    modules = _modules()
    assert _imports(lazy, "x.lazy", modules) == {"actors.protocol.request"}  # an import inside a function is an edge
    graph = _graph()
    # the benchmark scripts import their packages as `pdbench` / `cpbench` (benchmarks/ on the path)
    assert {"benchmarks.pdbench.setups", "benchmarks.pdbench.report"} <= graph["benchmarks.pd_vs_vllm"]
    assert "benchmarks.cpbench.fleet" in graph["benchmarks.control_plane"]
    assert "benchmarks.pdbench.summary" in graph["benchmarks.pdbench.plot"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _edges_from(package: str, graph: dict[str, set[str]], forbidden: str) -> dict[str, list[str]]:
    """The modules of `package` that import `forbidden` or a module under it, with those imports."""
    found = {name: sorted(t for t in targets if t == forbidden or t.startswith(forbidden + "."))
             for name, targets in graph.items() if name == package or name.startswith(package + ".")}
    return {name: targets for name, targets in found.items() if targets}


def test_the_seams_hold():
    """Routers read the coordinator's state through the wire types (`actors.prefix_wire`,
    `actors.routes`), never the coordinator's modules; the front asks about resumed requests
    through `actors.decode_caps`, never vLLM's engine side."""
    graph = _graph()
    assert any(name.startswith("serving.routing.") for name in graph)  # the packages are seen at all
    assert any(name.startswith("serving.front.") for name in graph)
    assert _edges_from("serving.routing", graph, "actors.control") == {}
    assert _edges_from("serving.front", graph, "actors.engine.vllm") == {}
    assert _edges_from("a", {"a.b": {"c.d", "e"}, "a.c": {"e"}, "f": {"c"}}, "c") == {"a.b": ["c.d"]}


def test_no_source_file_past_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_folder_says_its_job():
    silent = []
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            if folder.name in ("__pycache__", "results", "configs") or not any(folder.glob("*.py")):
                continue
            init, readme = folder / "__init__.py", folder / "README.md"
            has_doc = init.exists() and ast.get_docstring(ast.parse(init.read_text()))
            if not has_doc and not readme.exists():
                silent.append(str(folder.relative_to(ROOT)))
    assert silent == []


def _layout_block() -> list[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Layout"):]
    return section[section.index("```") + 3:section.index("```", section.index("```") + 3)].splitlines()


def test_the_docs_layout_matches_the_tree():
    """Every path the layout names exists, and every code folder of actors/ and serving/ is named."""
    named: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in _layout_block():
        if not line.strip() or not line.lstrip()[0].isalnum():
            continue
        indent = len(line) - len(line.lstrip())
        token = line.split()[0]
        if not (token.endswith("/") or token.endswith(".py")):
            continue  # a continuation line of a description
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(p for _, p in stack) + token
        named.append(path)
        if token.endswith("/"):
            stack.append((indent, token))
    missing = [p for p in named if not (ROOT / p.split(" ")[0]).exists()]
    assert missing == []
    folders = {str(p.relative_to(ROOT)) + "/" for pkg in ("actors", "serving")
               for p in (ROOT / pkg).rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    assert sorted(folders - set(named)) == []
