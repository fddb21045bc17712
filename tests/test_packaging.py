"""The graph passes install as ``fxoffload.passes``: nothing named ``passes`` lands in a user's
site-packages, and an uninstalled checkout imports them under the same name."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _sources(into: Path) -> Path:
    """What `pip install .` builds from, copied (a build writes build/ and *.egg-info beside the
    sources, and a stale build/ would leak into the wheel)."""
    for folder in ("fxoffload", "passes"):
        shutil.copytree(ROOT / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, into / name)
    return into


def test_the_wheel_installs_the_passes_under_fxoffload_only(tmp_path):
    # What `pip install .` installs is this wheel's contents; built offline.
    source = _sources(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("fxoffload-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    (dist_info,) = {t for t in top_level if t.endswith(".dist-info")}
    assert top_level == {"fxoffload", dist_info}, top_level
    passes = {Path(name).name for name in names if name.startswith("fxoffload/passes/")}
    assert passes == {p.name for p in (ROOT / "passes").glob("*.py")}, "a stage module missing from the wheel"
    ours = {name for name in names if name.endswith(".py") and not name.startswith("fxoffload/passes/")}
    rooms = {p.relative_to(ROOT).as_posix() for p in (ROOT / "fxoffload").rglob("*.py")}
    assert ours == rooms, f"missing from the wheel: {sorted(rooms - ours)}; not ours: {sorted(ours - rooms)}"


@pytest.mark.compat  # release-sensitive, kept in the compat runs though 7 s or more here
@pytest.mark.parametrize("editable", [False, True], ids=["nothing-installed", "beside-an-editable-install"])
def test_a_checkout_serves_its_own_passes_folder_as_fxoffload_passes(tmp_path, editable):
    """Run from a checkout, fxoffload.passes is the passes/ folder beside that checkout's fxoffload/:
    with nothing installed (a GPU machine), and from a second checkout (a worktree) while this one is
    installed editable, where the install's mapping would otherwise serve this checkout's passes."""
    if editable and not any("editable" in str(getattr(f, "__module__", f)) for f in sys.meta_path):
        pytest.skip("no editable install of this checkout on this interpreter (make test installs one)")
    _sources(tmp_path)
    script = (
        "import sys\n"
        + ("" if editable else  # leave out the editable install's finder, as where nothing is installed
           "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', f))]\n")
        + f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import fxoffload, fxoffload.passes.planning as planning\n"
        "assert 'passes' not in sys.modules, 'a top-level passes module was imported'\n"
        "print(fxoffload.__file__); print(planning.__file__); print(fxoffload.BudgetInfeasibleError.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         cwd=tmp_path).stdout.split()
    assert out == [str(tmp_path / "fxoffload" / "__init__.py"), str(tmp_path / "passes" / "planning.py"),
                   "fxoffload.passes.plan"]


def test_a_checkout_without_an_entry_point_compiles_with_the_backend_name(tmp_path):
    """Where nothing installs (the lent GPU machine), ``PYTHONPATH=<checkout>`` is all there is: no
    entry point names ``"fxoffload"``, and importing fxoffload registers the name with dynamo."""
    _sources(tmp_path)
    script = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in str(getattr(f, '__module__', f))]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import torch\n"
        "from torch._dynamo.backends import registry\n"
        "registry._lazy_import()  # entry points discovered, then the installed one forgotten: none is there\n"
        "registry._BACKENDS.pop('fxoffload', None); registry._COMPILER_FNS.pop('fxoffload', None)\n"
        "import fxoffload\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n"
        "x = torch.randn(4, 8)\n"
        "compiled = torch.compile(model, backend='fxoffload', options={'inner': 'eager', 'min_bytes': 0})\n"
        "compiled(x).sum().backward()\n"
        "print(fxoffload.__file__, len(fxoffload.named_backend(inner='eager', min_bytes=0).records))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                         cwd=tmp_path).stdout.split()
    assert out == [str(tmp_path / "fxoffload" / "__init__.py"), "1"]
