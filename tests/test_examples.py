"""The example pair, end to end, exactly as `make demo` runs it."""

import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.timeout(150)
def test_demo_pair_verifies_everything():
    result = subprocess.run([sys.executable, "examples/demo.py"], cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert "2048/2048 chunks (0 bad)" in summary and "192 blocks (0 bad)" in summary and summary.endswith("OK")
