"""Every command of the token-analysis example block (docs/analysis.md) runs and produces its output."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "docs" / "analysis.md").read_text()
    block = text.split("<!-- analysis examples: a test runs every command in this block -->", 1)[1]
    block = block.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_analysis_examples_run(tmp_path):
    cmds = _readme_commands()
    assert [c.split()[1] for c in cmds] == ["tiny-model", "tiny-model", "analyze", "compare", "view"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    for cmd in cmds:
        argv = [a.replace("/tmp/", f"{tmp_path}/") for a in shlex.split(cmd)]
        assert argv[0] == "verl-tokensel"
        res = subprocess.run([sys.executable, "-m", "verl_tokensel.cli.main", *argv[1:]], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    report = json.loads((tmp_path / "tokensel_report" / "report.json").read_text())
    assert report and any(re.search("entropy", k) for k in report)
    assert list((tmp_path / "tokensel_compare").glob("*.json"))
    page = (tmp_path / "tokensel_view.html").read_text()
    assert page.count('class="tok') > 100
