"""The package's shape: no import cycle, no file over the size budget, defaults only in the config.

The imports are read with ``ast`` (nothing is imported): module-level and function-level ``import`` and
``from ... import`` of megareason modules. ``from megareason.x import name`` is an edge to
``megareason.x.name`` when that is a module, else to ``megareason.x``; a package's ``__init__`` is its own
module (``megareason.x``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megareason"
MAX_LINES = 500
# The layers, lowest first (docs/architecture.md, "Layers"): a module imports only from its own layer or
# lower ones. A module belongs to the longest prefix listed.
LAYERS = (
    ("megareason", "megareason.utils", "megareason.ports", "megareason.logs", "megareason.plotting",
     "megareason.config", "megareason.algorithms"),
    ("megareason.data",),
    ("megareason.models",),
    ("megareason.rollout",),
    ("megareason.rewards",),
    ("megareason.envs", "megareason.raro"),
    ("megareason.settings",),
    ("megareason.evaluation", "megareason.trainer"),
    ("megareason.launch", "megareason.cli"),
)
# Where the whole run configuration (``config.schema.Config``) may be used: the layers below take the
# settings records ``megareason.settings`` builds from it, or their own section of it (``RewardConfig``, ...).
CONFIG_USERS = ("megareason.config", "megareason.settings", "megareason.evaluation", "megareason.trainer",
                "megareason.launch", "megareason.cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The megareason modules that ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import megareason.x.y` names a module; trim attributes
                t = t.rpartition(".")[0]
            if t.startswith("megareason") and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; a cycle exists
    iff this is not empty."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import cycle through ``component[0]``, inside the component: a -> b -> ... -> a."""
    members, start = set(component), component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def test_graph_sees_lazy_and_package_imports():
    graph = import_graph()
    assert "megareason.data.records" in graph["megareason.data"]  # a package's __init__ is a module
    # workers.py imports megatron-core's roles only inside functions: those count too.
    assert "megareason.models.roles" in graph["megareason.trainer.workers"]


def test_find_cycles_reports_the_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert _cycle_path(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in megareason/:\n" + "\n".join(
        " -> ".join(_cycle_path(graph, c)) + f"   (component: {', '.join(c)})" for c in cycles)


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix of ``module`` (the root package only exactly)."""
    matches = [(len(prefix), i) for i, names in enumerate(LAYERS) for prefix in names
               if module == prefix or (prefix != "megareason" and module.startswith(prefix + "."))]
    assert matches, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return max(matches)[1]


def test_imports_go_down_the_layers():
    upward = sorted(f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
                    for m, deps in import_graph().items() for d in deps if layer(d) > layer(m))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_file_over_the_size_budget():
    sizes = {str(p.relative_to(PACKAGE.parent)): len(p.read_text(encoding="utf-8").splitlines())
             for p in PACKAGE.rglob("*.py")}
    over = {p: n for p, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines: {over}"


def _settings_defaults(path: Path) -> list[str]:
    """``Class.field`` for every field default of a ``*Settings`` dataclass in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("Settings")):
            continue
        decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
        if not any(ast.unparse(d).split(".")[-1] == "dataclass" for d in decorators):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
                if "ClassVar" not in ast.unparse(stmt.annotation):
                    out.append(f"{node.name}.{stmt.target.id}")
    return out


def test_settings_declare_no_defaults():
    """Every default lives in ``config/schema.py``; the settings the lower layers take are built from the
    config by ``megareason.settings``."""
    found = {str(p.relative_to(PACKAGE.parent)): d for p in sorted(PACKAGE.rglob("*.py"))
             if PACKAGE / "config" not in p.parents and (d := _settings_defaults(p))}
    assert not found, f"*Settings dataclasses with field defaults (move them to config/schema.py): {found}"


def test_settings_check_sees_defaults(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from dataclasses import dataclass, field\n@dataclass(frozen=True)\nclass XSettings:\n"
                   "    a: int\n    b: int = 1\n    c: dict = field(default_factory=dict)\n"
                   "@dataclass\nclass Other:\n    d: int = 2\n")
    assert _settings_defaults(src) == ["XSettings.b", "XSettings.c"]


def test_only_rollout_imports_the_vllm_engine_module():
    """``rollout/engine.py`` imports vLLM; the rest of the package starts an engine with
    ``rollout.start_engine`` and needs only the records that cross its interface (``rollout/records.py``)."""
    outside = sorted(m for m, deps in import_graph().items()
                     if "megareason.rollout.engine" in deps and not m.startswith("megareason.rollout"))
    assert not outside, f"modules outside megareason.rollout that import rollout/engine.py: {outside}"


def _uses_config(path: Path) -> bool:
    """Whether ``path`` imports the class ``Config`` from megareason.config (its schema or the package)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megareason.config"):
            if any(a.name == "Config" for a in node.names):
                return True
    return False


def test_no_config_below_the_trainer():
    """The layers below the trainer take their settings, not the run's whole configuration."""
    users = sorted(name for name, path in _modules().items()
                   if _uses_config(path) and not any(name == p or name.startswith(p + ".") for p in CONFIG_USERS))
    assert not users, f"modules below the trainer that use config.schema.Config: {users}"


def test_config_check_sees_the_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from megareason.config.schema import RewardConfig\n")
    assert not _uses_config(src)
    src.write_text("def f():\n    from megareason.config import Config, load_config\n")
    assert _uses_config(src)


def test_no_config_crosses_into_the_worker_processes():
    """The trainer's workers receive settings records built on the driver (``workers.WorkerSettings``)."""
    assert not _uses_config(PACKAGE / "trainer" / "workers.py")
