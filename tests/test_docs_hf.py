"""docs/train-your-hf-model.md runs as written: its blocks, in order, in one empty folder
outside the repository (Python blocks as scripts, shell blocks with bash), with the tiny
random model the page makes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "train-your-hf-model.md"
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_the_page_runs_start_to_end(tmp_path: Path) -> None:
    assert [lang for lang, _ in BLOCKS] == ["python", "bash", "python"]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for i, (lang, code) in enumerate(BLOCKS):
        script = tmp_path / f"block_{i}.{'py' if lang == 'python' else 'sh'}"
        script.write_text(code)
        command = [sys.executable, str(script)] if lang == "python" else ["bash", str(script)]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, f"block {i}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert (tmp_path / "runs" / "demo" / "policy" / "model.safetensors").is_file()
