"""The two routes into a run with token selection, read from a Hydra command line without importing Hydra.

* ``python -m verl_tokensel.main_ppo``: verl's own config names (``ppo_trainer``, ``ppo_megatron_trainer``, as
  verl's example scripts pass them, ``--config-path=config`` included) compose ours instead
  (:func:`our_config_args`, one line on stderr), so a script swaps only the module.
* ``python -m verl.trainer.main_ppo`` with verl's own config cannot take the selection keys (``Key
  'token_selector' is not in struct``); :func:`wrong_route_line` is the one line the plugin prints instead,
  naming the routes that work (:mod:`verl_tokensel.plugin`, at ``import verl``, before Hydra composes).

Stdlib only: the plugin reads it in every process ``import verl`` runs in.
"""

from __future__ import annotations

import os
import sys

#: verl's config names -> ours (verl's + the token-selection node): what each name composes under our entry point
OUR_CONFIG = {"ppo_trainer": "tokensel_trainer", "ppo_megatron_trainer": "tokensel_megatron_trainer"}
#: our configs' package, for ``--config-path`` under verl's entry point
OUR_CONFIG_PATH = "pkg://verl_tokensel.config"
#: the config paths that mean verl's own config folder: verl's example scripts' relative ``config`` (resolved
#: next to the entry point's file), verl's package, a verl checkout's folder
VERL_CONFIG_PATHS = ("config", "pkg://verl.trainer.config", "pkg://verl/trainer/config")
VERL_CONFIG_DIR_SUFFIX = os.path.join("verl", "trainer", "config")
#: the keys of our actor node, as an override spells them (any of Hydra's prefixes +, ++)
SELECTION_KEYS = ("actor_rollout_ref.actor.token_selector", "actor_rollout_ref.actor.token_selection")
VERL_ENTRY_POINT = "verl.trainer.main_ppo"
OUR_ENTRY_POINT = "verl_tokensel.main_ppo"

_OPTIONS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path",
            "--config-dir": "dir", "-cd": "dir"}


def _config_options(args: list[str]) -> dict[str, tuple[str, int, int]]:
    """``{"name" | "path" | "dir": (value, first index, number of items)}`` of Hydra's config options in ``args``
    (``--config-name=x``, ``--config-name x``, ``-cn x``, ``-cn=x``; the last one wins, as in argparse)."""
    out = {}
    i = 0
    while i < len(args):
        opt, eq, value = args[i].partition("=")
        if opt in _OPTIONS:
            if eq:
                out[_OPTIONS[opt]] = (value, i, 1)
            elif i + 1 < len(args):
                out[_OPTIONS[opt]] = (args[i + 1], i, 2)
                i += 1
        i += 1
    return out


def _is_verl_config_path(path: str | None) -> bool:
    if path is None:
        return True
    path = path.strip().strip("'\"")
    path = os.path.normpath(path) if path.rstrip("/") not in VERL_CONFIG_PATHS else path.rstrip("/")
    return path in VERL_CONFIG_PATHS or path == VERL_CONFIG_DIR_SUFFIX or path.endswith(os.sep + VERL_CONFIG_DIR_SUFFIX)


def verl_config_name(args: list[str]) -> str | None:
    """The verl config that ``args`` name: ``ppo_trainer`` or ``ppo_megatron_trainer`` (with or without ``.yaml``;
    ``ppo_trainer`` when no name is given, verl's entry point's default) from verl's own folder (no
    ``--config-path``, or one of :data:`VERL_CONFIG_PATHS`); None for any other config (ours, a user's folder,
    any ``--config-dir``)."""
    opts = _config_options(args)
    if "dir" in opts or not _is_verl_config_path(opts["path"][0] if "path" in opts else None):
        return None
    name = opts["name"][0].strip().strip("'\"").removesuffix(".yaml") if "name" in opts else "ppo_trainer"
    return name if name in OUR_CONFIG else None


#: the actor node's YAML (generated from the knob fields): its ``token_selection`` keys are the declared ones
ACTOR_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config", "tokensel",
                          "actor.yaml")
KNOB_PREFIX = "actor_rollout_ref.actor.token_selection."


def declared_knobs(path: str = ACTOR_YAML) -> set[str]:
    """The keys the ``token_selection`` node of our actor YAML declares (read as text: no YAML parser needed)."""
    keys, inside = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("token_selection:"):
                inside = True
            elif inside and line[:1] not in (" ", "\n", "#", ""):
                break
            elif inside and line.startswith("  ") and not line.startswith("   ") and ":" in line:
                key = line.strip().split(":", 1)[0]
                if not key.startswith("#"):
                    keys.add(key)
    return keys


def open_knob_args(args: list[str]) -> list[str]:
    """``args`` with Hydra's ``+`` before each ``token_selection.<knob>=...`` the YAML does not declare: the knobs of
    a rule registered from user code (``VERL_USE_EXTERNAL_MODULES``). Hydra then adds the key; the resolution checks
    it against the chosen rule's knobs (an unknown one is refused there, naming the rule's knobs)."""
    declared = None
    out = []
    for a in args:
        key = a.split("=", 1)[0]
        if "=" in a and key.startswith(KNOB_PREFIX) and "." not in key[len(KNOB_PREFIX):]:
            declared = declared_knobs() if declared is None else declared
            if key[len(KNOB_PREFIX):] not in declared:
                a = "+" + a
        out.append(a)
    return out


def our_config_args(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` of ``python -m verl_tokensel.main_ppo`` with verl's config name swapped for ours, and the line
    that says so (None when ``args`` name no verl config, or none: they pass through untouched); a knob the YAML
    does not declare gets Hydra's ``+`` (:func:`open_knob_args`)."""
    args = open_knob_args(list(args))
    opts = _config_options(args)
    if "name" not in opts:
        return list(args), None
    verl_name = verl_config_name(args)
    if verl_name is None:
        return list(args), None
    ours = OUR_CONFIG[verl_name]
    drop = {i for key in ("name", "path") if key in opts for i in range(opts[key][1], opts[key][1] + opts[key][2])}
    # our entry point's own folder (config_path="config" of hydra.main) holds ours, which compose verl's
    rewritten = [a for i, a in enumerate(args) if i not in drop] + [f"--config-name={ours}"]
    line = (f"verl-tokensel: --config-name={opts['name'][0]} is verl's config; {OUR_ENTRY_POINT} composes {ours} "
            f"(verl's {verl_name} with the token-selection keys) instead")
    return rewritten, line


def _program(orig_argv: list[str], argv: list[str]) -> str | None:
    """The module (``-m``) or script this interpreter runs, from ``sys.orig_argv`` and ``sys.argv``: the user's
    arguments are the tail both share (``sys.argv[0]`` is ``-m`` or the script while packages import)."""
    if not argv or len(orig_argv) < len(argv):
        return None
    return orig_argv[len(orig_argv) - len(argv)]


def _is_verl_entry_point(program: str | None) -> bool:
    if not program:
        return False
    return program == VERL_ENTRY_POINT or os.path.normpath(program).endswith(os.path.join("verl", "trainer",
                                                                                          "main_ppo.py"))


def selection_overrides(args: list[str]) -> list[str]:
    """The overrides in ``args`` that set a key of our actor node (``+`` / ``++`` prefixed too)."""
    return [a for a in args if a.lstrip("+").split("=", 1)[0].startswith(SELECTION_KEYS)]


def wrong_route_line(orig_argv: list[str] | None = None, argv: list[str] | None = None) -> str | None:
    """The one line for verl's entry point run with verl's own config and a selection key (which that config
    cannot take), naming the two routes that work; None for every other command (stock runs stay stock)."""
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    argv = sys.argv if argv is None else argv
    if not _is_verl_entry_point(_program(orig_argv, argv)):
        return None
    args = list(argv[1:])
    keys = selection_overrides(args)
    verl_name = verl_config_name(args)
    if not keys or verl_name is None:
        return None
    ours = OUR_CONFIG[verl_name]
    plus = "; either way without the + (our config declares the key)" if keys[0].startswith("+") else ""
    key = keys[0].lstrip("+").split("=", 1)[0]
    return (f"verl-tokensel: {key} (`{keys[0]}`) is not a key of verl's {verl_name} config, which "
            f"{VERL_ENTRY_POINT} composes here; run `python -m {OUR_ENTRY_POINT} <the same arguments>` (it takes "
            f"--config-name={verl_name} as {ours}), or give {VERL_ENTRY_POINT} our config: "
            f"--config-path={OUR_CONFIG_PATH} --config-name={ours}{plus}")


__all__ = ["OUR_CONFIG", "OUR_CONFIG_PATH", "SELECTION_KEYS", "declared_knobs", "open_knob_args", "our_config_args",
           "selection_overrides",
           "verl_config_name", "wrong_route_line"]
