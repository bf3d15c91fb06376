# Two entry points: `make demo` (the main job on synthetic data) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SGLANG_VERSION ?= 0.5.23
SGLANG_KT_VERSION ?= 0.7.2
# The KT fork installs the import package `sglang` too: kept in a side folder.
SGLANG_KT_DIR := $(VENV)/side/sglang-kt

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# CPU torch only when none is present: never replace a user's torch.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# SGLang without its GPU dependencies: tests run its own hook manager.
	$(PIP) install -q --no-deps sglang==$(SGLANG_VERSION)
	# The fork beside it (tests run its dynamic expert update; tests/support/sglang_parts.py).
	$(PIP) install -q --no-deps --target $(SGLANG_KT_DIR) sglang-kt==$(SGLANG_KT_VERSION)
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/moetrace demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
