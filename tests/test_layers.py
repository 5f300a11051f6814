"""The package's layers point down: every import (top-level or inside a function; imports
for type annotations only, under ``if TYPE_CHECKING:``, never run and are left out) goes to
a module of the same layer or a lower one, and no modules import each other in a cycle.

The layers are those of docs/architecture.md ("Layers"); this test is what enforces them. A
new module belongs to the layer of the longest prefix listed in ``LAYERS``; a module no
prefix covers fails the test, so every module has a stated place.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kakeya_lab"

# Bottom to top. A name is a module or a package (covering everything inside it).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "errors",
            "linear_kernels",
            "inputs",
            "durable",
            "resume",
            "blas",
            "sampling",
            "chat",
            "data",
            "results",
            "notebook_format",
            "settings",
        ),
    ),
    (
        "tensors",
        (
            "models",
            "native",
            "linear",
            "linear_auto",
            "backends",
            "reference",
            "tree",
            "verifier",
        ),
    ),
    ("proposers", ("proposers",)),
    # the events a generation yields and the session errors: the decoder emits them too
    ("decoding", ("cost_model", "speculative", "session.events", "session.errors")),
    ("sessions", ("session",)),
    ("serving", ("serve",)),
    ("studies", ("bench", "align", "plots")),
    ("apps", ("widgets", "experiments", "evidence", "notebook_html")),
    ("entry points", ("cli", "cli_args", "chat_command", "evidence_command", "*.command")),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for p in PACKAGE.rglob("*.py")
        if "proto" not in p.parts  # generated gRPC code
    }


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a module (``""`` is the package's own ``__init__``)."""
    if module == "":
        return len(LAYERS) - 1  # the package's __init__ re-exports lazily from every layer
    if module.split(".")[-1] == "command":
        return len(LAYERS) - 1
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"kakeya_lab.{module} is in no layer: add it to LAYERS")
    return found


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports, wherever the import statement is."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # ``if TYPE_CHECKING:`` imports never run: annotations only
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(["kakeya_lab", *base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            # ``from pkg import sub`` imports the module pkg.sub; ``from mod import name`` mod
            names = [
                f"{target}.{a.name}"
                if f"{target}.{a.name}".removeprefix("kakeya_lab.") in modules
                else target
                for a in node.names
            ]
        for name in names:
            if name != "kakeya_lab" and not name.startswith("kakeya_lab."):
                continue
            inner = name.removeprefix("kakeya_lab").lstrip(".")
            while inner and inner not in modules:
                inner = inner.rpartition(".")[0]
            if inner != module:
                found.add(inner)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_import_points_down_or_across():
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            if layer_of(target) > layer_of(module):
                upward.append(
                    f"kakeya_lab.{module} ({LAYERS[layer_of(module)][0]}) imports "
                    f"kakeya_lab.{target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "imports reaching up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = {m: {t for t in targets if t} for m, targets in _graph().items() if m}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"modules importing each other: {cycles}"


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """Controls: the graph finds imports inside functions, and the layer table ranks a
    low module under a high one (so the two tests above can fail)."""
    graph = _graph()
    assert "experiments.ray_executor" in graph["experiments.sweeps"]  # inside run_sweep
    assert layer_of("inputs") < layer_of("proposers.registry") < layer_of("session")
    assert layer_of("bench.long_run.served") > layer_of("serve.client") > layer_of("session")
    assert layer_of("models.command") == len(LAYERS) - 1


def test_the_architecture_page_states_these_layers():
    """docs/architecture.md's "Layers" table names the same modules per layer, in order."""
    import re

    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    documented = []
    for row in rows[1:]:  # the header row names the columns
        name, modules = (cell.strip() for cell in row.strip("|").split("|"))
        names = {
            re.sub(r"\.py$", "", m).rstrip("/").replace("/", ".")
            for m in re.findall(r"`([^`]+)`", modules)
        }
        documented.append((name.split(" (")[0], names - {"command"}))
    assert documented == [(name, set(prefixes)) for name, prefixes in LAYERS]
