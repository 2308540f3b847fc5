"""The tree stays lint-clean and formatted with the pinned ruff
(requirements/test.txt), so formatting never drifts between sessions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["vllm_br", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    ruff = Path(sys.executable).with_name("ruff")
    proc = subprocess.run(
        [str(ruff), *command, *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
