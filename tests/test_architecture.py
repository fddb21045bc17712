"""docs/architecture.md stays true to the code: its import table is every module's real imports."""

import ast
import importlib
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def _python_files() -> list[Path]:
    """Every module of ours: ``passes/*.py`` (installed as ``fxoffload.passes``) and ``fxoffload/**/*.py``."""
    return sorted((ROOT / "passes").glob("*.py")) + sorted((ROOT / "fxoffload").rglob("*.py"))


def _package_of(path: Path) -> str:
    """The package a file sits in (pyproject.toml maps passes/ to fxoffload.passes)."""
    folder = path.parent.relative_to(ROOT)
    return "fxoffload.passes" if folder == Path("passes") else ".".join(folder.parts)


def _module_name(path: Path) -> str:
    package = _package_of(path)
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
    files = {_module_name(p): p for p in _python_files()}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        package = _package_of(path)
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
    private = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fxoffload")):
                private += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
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
    "fxoffload.passes.layer_copies": 1,  # fit's joint graph of many layers from a trace of four
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
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
                count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if count > MOST_PARAMETERS:
                    over[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = count
    assert set(over) == LONG_SIGNATURES, over


# fxoffload/'s rooms, in order: a module imports modules of its own room or an earlier one, at module
# level or inside a function (each subpackage's docstring says so in words). The top-level modules
# (config, errors, profiles, explain) are the room "fxoffload"; the package's face (fxoffload/__init__)
# and ``python -m fxoffload`` import from every room.
ROOM_ORDER = {"fxoffload.passes": 0, "fxoffload.runtime": 1, "fxoffload": 2, "fxoffload.backend": 3,
              "fxoffload.tools": 4}
FACES = {"fxoffload", "fxoffload.__main__"}
MOST_MODULES_PER_FOLDER = 12


def _room(module: str) -> str:
    return max((room for room in ROOM_ORDER if module == room or module.startswith(room + ".")), key=len)


def test_rooms_import_only_their_own_or_earlier_rooms():
    actual = actual_imports()
    later = sorted((name, dep) for name, (top, lazy) in actual.items() if name not in FACES
                   for dep in top | lazy if ROOM_ORDER[_room(dep)] > ROOM_ORDER[_room(name)])
    assert not later, f"modules importing a later room: {later}"


def test_no_folder_of_fxoffload_holds_more_than_twelve_modules():
    folders = {p.parent for p in (ROOT / "fxoffload").rglob("*.py")}  # passes/ stays as the design card lays it out
    crowded = {str(f.relative_to(ROOT)): n for f in folders
               if (n := len([p for p in f.glob("*.py") if p.name != "__init__.py"])) > MOST_MODULES_PER_FOLDER}
    assert not crowded, crowded


def test_each_room_says_what_it_owns_and_what_it_may_import():
    rooms = sorted(p.parent for p in (ROOT / "fxoffload").rglob("__init__.py") if p.parent != ROOT / "fxoffload")
    assert {".".join(r.relative_to(ROOT).parts) for r in rooms} == set(ROOM_ORDER) - {"fxoffload", "fxoffload.passes"}
    for room in rooms:
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert "Owns:" in doc and "May import:" in doc, f"{room.relative_to(ROOT)}/__init__.py"


def test_our_modules_are_imported_at_module_level():
    """No module of ours imports another inside a function (a lazy import once hid the cli <-> fit_command
    cycle from this file's cycle test). Imports inside functions are left to optional or heavy third-party
    modules (transformers, matplotlib, Inductor, torch.distributed), each with its reason beside it."""
    lazy = {name: sorted(inside) for name, (_, inside) in actual_imports().items() if inside}
    assert not lazy, lazy


def test_the_backend_asks_the_step_coordinator_and_never_its_parts():
    """One object owns the step's ledger and budget (``StepCoordinator``): the backend imports neither
    part's class, so it cannot write into their dicts."""
    source = (ROOT / "fxoffload" / "backend" / "__init__.py").read_text()
    names = {a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
             for a in node.names}
    assert "StepCoordinator" in names and not names & {"StepLedger", "StepBudget"}, sorted(names)
