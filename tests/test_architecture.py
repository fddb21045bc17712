"""docs/architecture.md stays true to the code: its import table is every module's real imports."""

import ast
import importlib
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the package it is installed as (pyproject.toml maps passes/ to fxoffload.passes).
FOLDERS = {"passes": "fxoffload.passes", "fxoffload": "fxoffload"}


def _module_name(path: Path) -> str:
    package = FOLDERS[path.parent.name]
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def _imports(statements, known: set[str], package: str) -> set[str]:
    """Our modules named by ``import`` statements: ``from a import b`` counts as ``a.b`` when that is
    a module of ours, else as ``a``; a relative import is resolved from ``package``, the importer's."""
    found = set()
    for node in statements:
        if isinstance(node, ast.ImportFrom) and (node.level or node.module):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            if module.split(".")[0] == "fxoffload":
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                          for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "fxoffload"}
    return found


def actual_imports() -> dict[str, tuple[set[str], set[str]]]:
    """Module -> (module-level imports, imports made only inside functions or classes)."""
    files = {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.py"))}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        package = FOLDERS[path.parent.name]
        top = _imports(tree.body, set(files), package) - {name}
        every = _imports(ast.walk(tree), set(files), package) - {name}
        graph[name] = (top, every - top)
    return graph


def documented_imports() -> dict[str, tuple[set[str], set[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```imports\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```imports block"
    graph = {}
    for line in block.group(1).strip().splitlines():
        name, _, rest = line.partition(":")
        top, _, lazy = rest.partition("; lazy:")
        graph[name.strip()] = tuple({m.strip() for m in part.split(",") if m.strip()} for part in (top, lazy))
    return graph


def test_the_documented_import_table_is_the_code_s():
    actual, documented = actual_imports(), documented_imports()
    assert sorted(documented) == sorted(actual), "modules missing from, or extra in, docs/architecture.md"
    wrong = {name: {"code": actual[name], "docs": documented[name]}
             for name in actual if actual[name] != documented[name]}
    assert not wrong, f"docs/architecture.md's imports differ from the code's: {wrong}"


def test_fxoffload_reaches_the_passes_through_their_face_only():
    """``fxoffload/`` imports the stages through ``fxoffload.passes`` (its ``__init__``), never a stage
    module, at module level or inside a function: the stages may move and split behind it."""
    reaching = {name: sorted(dep for dep in top | lazy if dep.startswith("fxoffload.passes."))
                for name, (top, lazy) in actual_imports().items() if not name.startswith("fxoffload.passes")}
    assert not {name: deps for name, deps in reaching.items() if deps}, reaching


def test_no_private_name_is_imported_from_another_module_of_ours():
    """A name with a leading underscore stays in its module (tests may reach in; the package may not)."""
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.py"))]
    private = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fxoffload")):
                private += [f"{path.parent.name}/{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, private


def test_imports_have_no_cycle_even_through_imports_inside_functions():
    graph = nx.DiGraph((name, dep) for name, (top, lazy) in actual_imports().items() for dep in top | lazy)
    assert nx.is_directed_acyclic_graph(graph), next(iter(nx.simple_cycles(graph)))


# The pipeline's stages in order; a module may import only modules of its own or an earlier stage.
# Rank 0: shared by every stage (the ops, the user's marks, the solvers, the replay core, the split of
# a step's budget).
STAGE_ORDER = {
    "fxoffload.passes.ops": 0, "fxoffload.passes.policies": 0,
    "fxoffload.passes.solvers": 0, "fxoffload.passes.replay": 0, "fxoffload.passes.shares": 0,
    "fxoffload.passes.analysis": 1, "fxoffload.passes.sizes": 1, "fxoffload.passes.memory": 1,
    "fxoffload.passes.cost_model": 2,
    "fxoffload.passes.candidates": 3,
    "fxoffload.passes.eligibility": 4, "fxoffload.passes.plan": 4, "fxoffload.passes.formulation": 4,
    "fxoffload.passes.planning": 4,
    "fxoffload.passes.scheduling": 5, "fxoffload.passes.digest": 5,
    "fxoffload.passes.simulator": 6, "fxoffload.passes.step": 6, "fxoffload.passes.rewrite": 6,
    "fxoffload.passes.pipeline": 7,  # the driver
    "fxoffload.passes.strategy": 8,  # strategy auto's search, on the driver
    "fxoffload.passes": 9,  # the namespace
}


def test_stages_import_only_earlier_stages():
    actual = actual_imports()
    stages = {name for name in actual if name == "fxoffload.passes" or name.startswith("fxoffload.passes.")}
    assert stages == set(STAGE_ORDER), "a passes module without a stage, or a stage without a module"
    upward = {(name, dep) for name in stages for dep in actual[name][0] if STAGE_ORDER[dep] > STAGE_ORDER[name]}
    assert not upward, f"modules importing a later stage: {sorted(upward)}"
    # A stage module's docstring names its inputs and outputs.
    unstaged = {"fxoffload.passes", "fxoffload.passes.ops", "fxoffload.passes.policies", "fxoffload.passes.solvers"}
    for name in stages - unstaged:
        doc = importlib.import_module(name).__doc__ or ""
        assert "Inputs:" in doc and ("Outputs:" in doc or "Output:" in doc), name


# Entry points whose callers name their keyword arguments (docs/architecture.md, Rules).
LONG_SIGNATURES = {"passes/pipeline.py:plan_pair", "passes/strategy.py:plan_best_partition"}
MOST_PARAMETERS = 7


def test_no_function_takes_more_than_seven_parameters_but_the_documented_entry_points():
    over = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                    count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                    if count > MOST_PARAMETERS:
                        over[f"{folder}/{path.name}:{node.name}"] = count
    assert set(over) == LONG_SIGNATURES, over
