"""The package's import graph. No module imports one that imports it back: a circle makes the
order of imports matter and hides which part sits below which. And the slim parts stay slim:
``shared/`` never imports torch, and the API, env, corrector and controller services start
without it (only the policy and the trainer need it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "accelerate", "vllm")


def _modules() -> dict[str, Path]:
    out = {}
    for path in [*ROOT.glob("shared/**/*.py"), *ROOT.glob("services/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_only(tree: ast.AST) -> set[int]:
    """Nodes inside ``if TYPE_CHECKING:`` blocks: imports for annotations, never run."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imported(path: Path, modules: set[str] | None = None) -> set[str]:
    """Every module an import that runs in ``path`` names, at any depth (a function's import
    runs too, later). ``from a import b`` names ``a.b`` when ``modules`` holds it, and ``a``
    unless every name it takes is such a submodule."""
    tree = ast.parse(path.read_text())
    skip, names = _type_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & (modules or set())
            names |= subs if len(subs) == len(node.names) else {node.module, *subs}
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: (_imported(path, set(modules)) & modules.keys()) - {name}
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_checker_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = _graph()
    assert "services.policy.checkpoint" in graph["services.policy.service"]  # the graph is real
    assert cycles(graph) == []


def test_shared_never_imports_torch() -> None:
    heavy = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in ROOT.glob("shared/**/*.py")
        for name in _imported(path)
        if name.split(".")[0] in HEAVY
    }
    assert heavy == set()


def _module_level(path: Path, modules: set[str]) -> set[str]:
    """What importing ``path`` imports at once: its top-level imports (also under a top-level
    ``if``/``try``, never under ``if TYPE_CHECKING``), and the packages above each of them."""
    tree = ast.parse(path.read_text())
    skip, names = _type_only(tree), set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if id(node) in skip:
            continue
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    return {n for n in names | parents if n in modules or n.split(".")[0] in HEAVY}


def test_the_light_services_start_without_torch() -> None:
    """Importing any module of shared/ or of the API, env, corrector and controller services
    reaches no torch (nor transformers, peft, ...) through imports that run at once."""
    modules = _modules()
    direct = {name: _module_level(path, set(modules)) for name, path in modules.items()}
    light = ("shared", "services.api", "services.env", "services.corrector", "services.controller")
    found = {}
    for start in [m for m in modules if m.startswith(light)]:
        seen, todo = {start}, [start]
        while todo:
            for name in direct.get(todo.pop(), ()):
                if name.split(".")[0] in HEAVY:
                    found[start] = name
                elif name not in seen:
                    seen.add(name)
                    todo.append(name)
    assert found == {}


# The layers, lowest first: a module imports its own package and the layers below it, never one
# above nor a sibling of its own layer (the trainer and the corrector know nothing of each other).
LAYERS = (
    ("shared",),
    ("services.env",),
    ("services.policy",),
    ("services.trainer", "services.corrector"),
    ("services.controller",),
    ("services.study",),
    ("services.api",),
    ("services.cli", "services"),
)


def _layer(module: str) -> tuple[int, str]:
    """(layer index, package) of a module: the longest package of ``LAYERS`` it belongs to."""
    best = (-1, "")
    for i, packages in enumerate(LAYERS):
        for p in packages:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best[1]):
                best = (i, p)
    assert best[0] >= 0, f"{module} is in no layer: add its package to LAYERS"
    return best


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package from a higher layer or a sibling of its own, as "a -> b"."""
    out = []
    for a, names in graph.items():
        (la, pa) = _layer(a)
        for b in names:
            (lb, pb) = _layer(b)
            if pb != pa and lb >= la:
                out.append(f"{a} -> {b}")
    return sorted(out)


def test_the_checker_finds_an_upward_import() -> None:
    graph = {
        "shared.x": {"services.api.app"},  # the core reaching into a service
        "services.corrector.a": {"services.trainer.b", "services.env.c", "shared.x"},
        "services.api.app": {"services.controller.cli"},
        "services.controller.cli": set(),
    }
    assert upward(graph) == [
        "services.corrector.a -> services.trainer.b",
        "shared.x -> services.api.app",
    ]


def test_no_module_imports_one_above_it() -> None:
    """Also imports inside functions: they run too, later."""
    assert upward(_graph()) == []


MAX_SERVICE_LINES = 300  # the run driver reads as the stages of an update, in a page
MAX_CLASS_LINES = 350


def test_the_run_driver_and_every_class_stay_small() -> None:
    """``services/controller/service.py`` ≤ 300 lines; no class in ``services/`` over 350: a
    class past that holds more than one concern (split it into collaborators)."""
    driver = ROOT / "services/controller/service.py"
    assert len(driver.read_text().splitlines()) <= MAX_SERVICE_LINES
    big = []
    for path in ROOT.glob("services/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(ROOT)}::{node.name} ({n} lines)")
    assert big == []


def test_the_study_scheduler_and_report_reach_no_trainer_code() -> None:
    """What the study's scheduler and report need of the warm start (the env it plays in) lives
    below both, in shared/: neither reaches into the trainer package, where torch is."""
    graph = _graph()
    for name in ("services.study.service", "services.study.report", "services.study.schemas"):
        assert not {m for m in graph[name] if m.startswith("services.trainer")}, name
    assert "shared.warmenv" in graph["services.study.service"]
