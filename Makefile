# Two entry points; each creates .venv in the repo root, installs what it needs, and is safe to re-run.
#   make demo   train a small Llama with plain torch.compile and with fxoffload, side by side
#   make test   the test suite (CI runs this, slow tests included)

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch 2.13.0 first and explicitly: a bare "torch>=2.13" would pull a multi-GB CUDA build here.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_llama.py

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
