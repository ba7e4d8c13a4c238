"""Your own ``token_selector`` preset: a named selection rule, available in every process of a run.

A preset is a registered rule plus values of its knobs (``token_selection.*``, README "Knobs") under one name:
here the ranked gradient mask (rule ``gradient_mask``) with its ranking's values. For a one-off run the
knobs alone do it (``token_selector=forking token_selection.ratio=0.1``); a preset is for a rule you share
by name across recipes. This one, ``entropy_top10``: the top 10% current-policy entropy tokens of each
micro-batch, with the paper formula's denominator (all valid tokens) instead of ``forking``'s mean over
the selected ones.

verl converts the actor config in the driver, the TaskRunner and every actor worker, so the
registration must run in each of them, before the config is read. Two ways:

1. ``VERL_USE_EXTERNAL_MODULES``: ``import verl`` imports the modules it lists, in every process that gets
   the variable (an import error stops that process, so a broken module is seen at once). From a checkout
   root on one machine (Ray's workers inherit the driver's environment and working directory)::

       VERL_USE_EXTERNAL_MODULES=examples.custom_preset TOKENSEL_SELECTOR=entropy_top10 bash examples/run_dapo.sh

   On a cluster, the module must be importable on every node (image, or the job's working dir) and the
   variable must reach the workers through Ray's runtime env: add the override
   ``++ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=<module>``
   (``trainer.device=cpu`` forwards the variable itself).

2. A ``verl.plugins`` entry point in your own installed package (how verl-tokensel itself loads), in its
   ``pyproject.toml``; verl loads every such entry point on ``import verl``, in every process, on every
   node the package is installed on (verl logs a failing plugin only at debug level: an unknown preset on
   the driver is then the symptom)::

       [project.entry-points."verl.plugins"]
       my_presets = "custom_preset"

``python examples/custom_preset.py`` registers the preset and prints the rule the actor config resolves to.
"""

from __future__ import annotations

from verl_tokensel.core.config import resolve_selection
from verl_tokensel.rules import register_preset

NAME = "entropy_top10"

# Names are global to the process and cannot be overwritten (register_preset refuses): pick your own.
register_preset(NAME, rule="gradient_mask", score="entropy", ratio=0.1, direction="top", scope="micro_batch",
                normaliser="all")


if __name__ == "__main__":
    # what every process derives from actor_rollout_ref.actor.token_selector=entropy_top10 (validated: a bad
    # score, scope or ratio would raise here, naming the knob)
    print(f"token_selector={NAME} -> {resolve_selection(NAME)}")
