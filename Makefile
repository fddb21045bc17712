# Two entry points; each creates .venv in the repo root, installs what it needs, and is safe to re-run.
#   make demo   train a small Llama with plain torch.compile and with fxoffload, side by side
#   make test   the linter (ruff), then the test suite (CI runs this, slow tests included)
# CI also runs `make test-compat`: the fast suite and the Inductor numerics tests (marked compat) on
# the other torch releases we support, each in a venv of its own.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-compat compat-venvs test-torch-2.11.0 test-torch-2.14.1 clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch 2.13.0 first and explicitly: a bare "torch>=2.13" would pull a multi-GB CUDA build here.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_llama.py

# Two workers (pytest-xdist): the suite's tests are independent, each in a worker process of its own.
# --durations: each run names its 25 slowest tests, where CI's time goes (DEVELOPING, "CI's time").
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --durations=25

# torch 2.14.1: installed as a user installs the package (pip install -e, its entry point included);
# pip takes the CUDA build from this machine's disk, and it runs on the CPU.
.venv-torch-2.14.1/.installed: pyproject.toml
	test -x .venv-torch-2.14.1/bin/python || python3 -m venv .venv-torch-2.14.1
	.venv-torch-2.14.1/bin/python -m pip install -q torch==2.14.1
	.venv-torch-2.14.1/bin/python -m pip install -q -e '.[test]'
	touch $@

# torch 2.11.0: as on the lent GPU machine, where nothing installs: the package's dependencies only,
# and the tests import this checkout through PYTHONPATH (no entry point, no editable install).
# A CUDA build from the registry (about 4.6 GB in the venv), run on the CPU.
.venv-torch-2.11.0/.installed: pyproject.toml
	test -x .venv-torch-2.11.0/bin/python || python3 -m venv .venv-torch-2.11.0
	.venv-torch-2.11.0/bin/python -m pip install -q torch==2.11.0
	.venv-torch-2.11.0/bin/python -m pip install -q $$(python3 .ci/requirements.py test)
	touch $@

COMPAT_TESTS := -m "not slow or compat" -p no:cacheprovider --durations=15

# The two releases are independent: `make -j2 -O test-compat` (as .ci/run does) runs them side by side.
test-compat: test-torch-2.11.0 test-torch-2.14.1

# Their venvs alone: .ci/run installs them while the full suite runs.
compat-venvs: .venv-torch-2.11.0/.installed .venv-torch-2.14.1/.installed

test-torch-2.11.0: .venv-torch-2.11.0/.installed
	PYTHONPATH=. .venv-torch-2.11.0/bin/python -m pytest -q $(COMPAT_TESTS)

test-torch-2.14.1: .venv-torch-2.14.1/.installed
	.venv-torch-2.14.1/bin/python -m pytest -q $(COMPAT_TESTS)

clean:
	rm -rf $(VENV) .venv-torch-2.11.0 .venv-torch-2.14.1
