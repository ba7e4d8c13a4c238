"""core.scopes is the one home of scopes, directions, the budget and the world size: select, dist_topk and
config read them from there, and neither selection module imports the other for them."""

from __future__ import annotations

import subprocess
import sys

from verl_tokensel.core import config, dist_topk, pools, select


def test_one_home_for_scopes_directions_budget():
    assert config.SCOPES is pools.SCOPES and config.DIRECTIONS is pools.DIRECTIONS
    # the config's errors and select_tokens' guard share one check of the names
    assert select.invalid_rule_arg is pools.invalid_rule_arg and config.invalid_rule_arg is pools.invalid_rule_arg
    assert select.budget is pools.budget and dist_topk.budget is pools.budget
    assert dist_topk.world_size is pools.world_size


def test_budget_and_world_size_without_a_process_group():
    assert [pools.budget(0.2, n) for n in (0, 1, 5, 10, 11)] == [0, 1, 1, 2, 3]
    assert pools.budget(0.07, 100) == 7
    assert pools.world_size(None) == 1


def test_dist_topk_does_not_import_select():
    code = ("import sys, verl_tokensel.core.dist_topk\n"
            "assert 'verl_tokensel.core.select' not in sys.modules, sorted(sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
