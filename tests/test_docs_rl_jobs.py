"""docs/rl-jobs.md does not rot: every code block on the page is Python, and each one runs as
a script from outside the repository (so it uses only what an installed AsyncFlow offers)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "rl-jobs.md"
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", PAGE.read_text(), re.S | re.M)
SNIPPETS = [code for lang, code in BLOCKS if lang == "python"]


def test_every_code_block_on_the_page_is_python() -> None:
    """A block in another language would be skipped by the test below, and could rot."""
    assert [lang for lang, _ in BLOCKS] == ["python"] * len(BLOCKS)
    assert len(SNIPPETS) >= 4  # the whole job, the config, the loss check, the tasks


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_the_snippet_runs_as_a_script(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"snippet_{index}.py"
    script.write_text(SNIPPETS[index])
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, f"snippet {index}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
