"""Print the package's dependencies (and those of the extras named as arguments) from pyproject.toml,
for a venv that runs this checkout without installing it (Makefile, test-compat)."""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
wanted = list(project["dependencies"])
for extra in sys.argv[1:]:
    wanted += project["optional-dependencies"][extra]
print(" ".join(wanted))  # no spaces in a requirement here: the shell splits on them
