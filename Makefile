# Quick start: `make demo` (set up the core, then run the main job) and `make test` (set up the core and the test
# extras, then run the tests).
# TORCH picks the torch build; torch==2.13.0 resolves to a CPU build where the package index offers one.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# Test workers (pytest-xdist): two keep a 2-core machine busy while multi-rank tests wait on their peers.
TEST_WORKERS ?= 2

.PHONY: demo test setup setup-test clean

# What the demo needs: torch and ThunderEP with its core dependencies (no transformers: the demo trains
# ThunderEP's own byte-level model).
$(VENV)/.core: pyproject.toml $(wildcard setup.py)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

# What the tests add: pytest, transformers and safetensors (the `hf` extra), Triton's CPU interpreter, accelerate
# and compressed-tensors (the `dev` extra).
$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.core

setup-test: $(VENV)/.test

demo: $(VENV)/.core
	$(VENV)/bin/thunderep demo

test: $(VENV)/.test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info
