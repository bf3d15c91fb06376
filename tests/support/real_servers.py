"""What the tests of the real servers share (tests only): each server's venv beside .venv,
why it cannot run here, and failing (make test) or skipping without it."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ServerVenv:
    """A real server's environment: ``$<venv_env>``, else ROOT/<default> (built by make's target)."""

    default: str  # ".venv-vllm"
    venv_env: str  # "MOETRACE_VLLM_VENV"
    require_env: str  # "MOETRACE_REQUIRE_VLLM_SERVER": fail, not skip, without it
    make_target: str  # "vllm-venv"

    def path(self) -> Path:
        return Path(os.environ.get(self.venv_env) or ROOT / self.default)

    def missing(self) -> str | None:
        """Why the environment cannot run here, or None."""
        py, cli = self.path() / "bin" / "python", self.path() / "bin" / "moetrace"
        if not py.exists() or not cli.exists():
            return f"no environment at {self.path()} (make test builds it: the Makefile's {self.make_target} target)"
        return None

    def require(self, result: dict) -> dict:
        """The job's result, or fail (require_env=1) / skip when it could not run."""
        why = result.get("missing")
        if why:
            if os.environ.get(self.require_env) == "1":
                pytest.fail(f"{self.require_env}=1 but {why}")
            pytest.skip(why)
        return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
