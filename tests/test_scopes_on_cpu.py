"""core.ranking.scopes is the one home of scopes (and the sources that fill them), directions, the budget and the
world size: select, dist_topk, the shared config and the rules read them from there, and neither selection module
imports the other for them."""

from __future__ import annotations

import subprocess
import sys

from verl_tokensel.core.ranking import dist_topk, scopes, select
from verl_tokensel.core.resolve import selection
from verl_tokensel.core.seam import knobs as base
from verl_tokensel.core.seam import rule


def test_one_home_for_scopes_directions_budget():
    assert selection.SCOPES is scopes.SCOPES and base.DIRECTIONS is scopes.DIRECTIONS
    assert selection.SOURCE_SCOPES is scopes.SOURCE_SCOPES and rule.SOURCE_SCOPES is scopes.SOURCE_SCOPES
    # the config's errors and select_tokens' guard share one check of the names
    assert select.invalid_rule_arg is scopes.invalid_rule_arg and base.invalid_rule_arg is scopes.invalid_rule_arg
    assert select.budget is scopes.budget and dist_topk.budget is scopes.budget
    assert dist_topk.world_size is scopes.world_size


def test_budget_and_world_size_without_a_process_group():
    assert [scopes.budget(0.2, n) for n in (0, 1, 5, 10, 11)] == [0, 1, 1, 2, 3]
    assert scopes.budget(0.07, 100) == 7
    assert scopes.world_size(None) == 1


def test_dist_topk_does_not_import_select():
    code = ("import sys, verl_tokensel.core.ranking.dist_topk\n"
            "assert 'verl_tokensel.core.ranking.select' not in sys.modules, sorted(sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
