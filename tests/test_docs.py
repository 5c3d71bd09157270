"""Every ```python block in README.md and docs/*.md runs as written and exits 0.

Each block runs alone in a fresh interpreter (``sys.executable -c``, cwd = the repository root,
``UCX_NET_DEVICES=lo``, 60 s).  A block guarded by ``if __name__ == "__main__":`` is a script for
``multiprocessing``'s spawn start method, whose children re-import the parent's main *file*
(``-c`` has none), so it runs from a temporary file instead.  Blocks that are deliberately not
runnable are fenced ```text or ```py-norun (those only have to compile).  The configuration
reference in docs/configuration.md must match ``omni-async config docs``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from omni_async.cli import _BEGIN_MARK, _END_MARK, config_reference

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 60
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)



class Block(NamedTuple):
    where: str  # "docs/x.md:LINE"
    lang: str
    code: str


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(f"{path.relative_to(ROOT)}:{line}", match.group(1), match.group(2)))
    return found


def runnable() -> list[pytest.param]:
    params = []
    for block in blocks():
        if block.lang != "python":
            continue
        params.append(pytest.param(block, id=block.where))
    return params


@pytest.mark.parametrize("block", runnable())
@pytest.mark.timeout(TIMEOUT_S + 15)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    if re.search(r"^if __name__ == [\"']__main__[\"']:", block.code, re.M):
        script = tmp_path / "block.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    else:
        argv = [sys.executable, "-c", block.code]
    try:
        result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.where} did not finish within {TIMEOUT_S}s\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"{block.where} exited {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_norun_blocks_still_compile() -> None:
    for block in blocks():
        if block.lang == "py-norun":
            compile(block.code, block.where, "exec")


def test_configuration_reference_is_current() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    start, end = text.index(_BEGIN_MARK) + len(_BEGIN_MARK), text.index(_END_MARK)
    assert text[start:end].strip() == config_reference().strip(), (
        "docs/configuration.md is out of date: run `omni-async config docs --write docs/configuration.md`"
    )
