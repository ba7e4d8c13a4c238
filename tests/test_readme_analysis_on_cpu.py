"""Every command of the token-analysis example block (docs/analysis.md) runs and produces its output (in this
process, through the command line's ``main``, from the checkout's root)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "docs" / "analysis.md").read_text()
    block = text.split("<!-- analysis examples: a test runs every command in this block -->", 1)[1]
    block = block.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_analysis_examples_run(tmp_path, monkeypatch, capsys, one_torch_thread):
    # each command runs in this process through the command line's main(), the function the `verl-tokensel`
    # console script calls (its parsing, stack check and subcommand included): no interpreter and torch import per
    # command; the checkout's root is the working directory, as a reader of docs/analysis.md has it
    from verl_tokensel.cli.main import main

    cmds = _readme_commands()
    assert [c.split()[1] for c in cmds] == ["tiny-model", "tiny-model", "analyze", "compare", "view"]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)
    for cmd in cmds:
        argv = [a.replace("/tmp/", f"{tmp_path}/") for a in shlex.split(cmd)]
        assert argv[0] == "verl-tokensel"
        rc = main(argv[1:])
        out = capsys.readouterr()
        assert rc == 0, f"{cmd} -> {rc}\n{out.out[-2000:]}\n{out.err[-3000:]}"
    report = json.loads((tmp_path / "tokensel_report" / "report.json").read_text())
    assert report and any(re.search("entropy", k) for k in report)
    assert list((tmp_path / "tokensel_compare").glob("*.json"))
    page = (tmp_path / "tokensel_view.html").read_text()
    assert page.count('class="tok') > 100
