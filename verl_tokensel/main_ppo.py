"""``python -m verl_tokensel.main_ppo``: verl's PPO entry point with the token-selection config.

A thin wrapper over verl's own ``run_ppo``: same Hydra CLI (``--cfg job`` prints the composed
config), config ``tokensel_trainer`` (or ``--config-name=tokensel_megatron_trainer``; verl's names ``ppo_trainer`` and
``ppo_megatron_trainer``, as verl's example scripts pass them, compose these two, saying so on stderr), and both
drivers: ``trainer.use_v1=true`` runs verl's TaskRunnerV1 with the ``tokensel_sync`` trainer;
``trainer.use_v1=false`` runs verl's v0 TaskRunner with the hooks that install the selecting loss
and select on the driver (all fenced in :mod:`verl_tokensel.verl_glue.v0`).

Refusals: a config we refuse (a token-selection value, a conflict of ``trainer.device=cpu``) is one line on stderr
and exit 2, before Hydra creates its run folder or prints the config (:func:`preflight`, for a run and for ``--cfg
job`` alike) and before verl's trainer modules are imported (:func:`check`).

Imports: composing (``--cfg job``) needs only Hydra, our configs and the token-selection checks; verl's trainer,
checkpoint and rollout modules are imported when a run starts, after a check that names, in one line, any package
they import that ``pip install verl`` does not bring (uvicorn, fastapi, TransferQueue, cachetools: verl's
``verl-core`` extra), with its install command (exit 2; :func:`verl_tokensel.stack.missing_run_packages`).

Signals: none of ours, so SIGINT / SIGTERM do what they do to verl's own ``run_ppo`` (measured on the CPU
pipeline, Ray 2.60, with the run's Ray instance up and its TaskRunner building workers): SIGINT raises
``KeyboardInterrupt`` in the driver's ``ray.get``, which exits 1 within ~6 s and takes the local Ray instance down
with it; SIGTERM ends the driver within ~3 s (killed by SIGABRT in Ray's core worker) and the Ray processes follow
within 30 s. Neither is a clean stop of a job on a shared cluster: ``verl-tokensel demo`` and
``python -m verl_tokensel_cpu.launch`` end the whole run themselves (its process group and marked processes).

CPU: ``trainer.device=cpu`` runs the whole pipeline (Ray, vLLM-CPU rollout, FSDP2 update, or Megatron with
``model_engine=megatron``) on CPU; it fills every CPU setting and refuses conflicting ones
(the CPU distribution ``verl-tokensel-cpu``, found through its entry point only then; manual: ``docs/cpu.md``).

Example::

    python -m verl_tokensel.main_ppo actor_rollout_ref.actor.token_selector=gmts \\
        data.train_files=$DATA/train.parquet actor_rollout_ref.model.path=$MODEL ...
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a known-broken stack gets one line naming the fix, before verl's imports crash on it
    from verl_tokensel.stack import exit_if_broken

    exit_if_broken(cpu_rollout="trainer.device=cpu" in sys.argv[1:])

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from verl_tokensel.switches import CPU_PLATFORM, SwitchConflictError, device_port, wants_cpu  # noqa: E402


def check(config: DictConfig, environ: dict | None = None) -> None:
    """The driver's refusals of a composed config, one line each and exit 2 (a usage error), before Ray and before
    verl's run modules are imported (their import resolves verl's platform, which logs two warnings on a host without
    a GPU): the CPU switch, which fills the CPU settings in ``config`` and refuses conflicting ones (``environ``: the
    environment it updates, default this process's), then the token-selection keys."""
    from verl_tokensel.verl_glue.install import selection_error, validate_driver_config

    if wants_cpu(config):  # the one CPU switch, trainer.device=cpu: fill CPU settings before Ray starts
        try:  # the CPU port is its own distribution, found by its entry point (none installed: the install line)
            port = device_port(CPU_PLATFORM)
            if environ is None:
                port(config)
            else:
                port(config, environ=environ)
        except SwitchConflictError as err:  # every conflict, one per line, without a traceback
            print(err, file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    try:  # a bad token-selection key is named first, before verl's own checks
        validate_driver_config(config)
    except Exception as exc:
        err = selection_error(exc)
        if err is None:
            raise
        print(f"verl-tokensel: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def run(config: DictConfig) -> None:
    """Validate on the driver (:func:`check`), then hand over to verl's ``run_ppo``."""
    from verl_tokensel.stack import exit_if_missing_run_packages

    check(config)
    # what verl imports to run but `pip install verl` does not install: one line, before any traceback
    exit_if_missing_run_packages(use_v1=bool(config.trainer.use_v1))
    # TaskRunnerV1 (and the V1 trainer package behind it) only on the V1 path: verl's announced branch without
    # it (use_v1 false by default) keeps the v0 route whole
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from verl_tokensel.verl_glue.install import register_v1_trainers

    if config.trainer.use_v1:
        register_v1_trainers()
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.trainer.use_v1:
        from verl.trainer.main_ppo import TaskRunnerV1

        run_ppo(config, task_runner_class=TaskRunnerV1)
    else:
        from verl_tokensel.verl_glue.v0 import v0_task_runner

        run_ppo(config, task_runner_class=v0_task_runner())


KNOB_PREFIX = "actor_rollout_ref.actor.token_selection."


def unknown_knob_line(args: list[str]) -> str | None:
    """One line for a command-line override of a token-selection knob that no registered rule, shaping or shared key
    reads (Hydra would stop on it with "Key '...' is not in struct"), naming the closest knob; None when every such
    override names one. The knobs are those of our actor node (``config/tokensel/actor.yaml``) and, for a key it does
    not declare, those of the rules registered by the modules of ``VERL_USE_EXTERNAL_MODULES`` (a user's rule: its
    knobs are command-line keys too, given Hydra's ``+`` by :func:`~verl_tokensel.verl_glue.routes.our_config_args`)."""
    keys = [a.lstrip("+~").split("=", 1)[0][len(KNOB_PREFIX):].split(".")[0] for a in args
            if a.lstrip("+~").startswith(KNOB_PREFIX)]
    if not keys:
        return None
    import importlib
    import os

    from verl_tokensel.core.errors import suggest
    from verl_tokensel.verl_glue.routes import declared_knobs

    knobs = sorted(declared_knobs() - {"_target_"})
    if all(key in knobs for key in keys):
        return None
    for module in filter(None, (m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","))):
        importlib.import_module(module)  # a user's rules register their knobs (verl imports them the same way)
    from verl_tokensel.core.config import knob_sources

    knobs = sorted({*knobs, *knob_sources()})
    for key in keys:
        if key not in knobs:
            near = suggest(key, knobs)
            return (f"verl-tokensel: {KNOB_PREFIX}{key} is not a token-selection knob of any registered rule"
                    + (f" (did you mean {near}?)" if near else "") + f"; valid knobs: {', '.join(knobs)}.")
    return None


@hydra.main(config_path="config", config_name="tokensel_trainer", version_base=None)
def main(config: DictConfig) -> None:
    run(config)


def preflight(argv: list[str]) -> None:
    """:func:`check` on the config Hydra is about to compose from ``argv``, before Hydra creates its run folder
    (``outputs/<date>/<time>/``) or prints the config (``--cfg job`` / ``all``): a refused run leaves no folder, and
    ``--cfg job`` prints no config that a run would refuse; both exit 2 with the line a run prints. Composed as
    ``hydra.main`` composes it (same arguments, search path and config); the CPU switch fills a copy of the
    environment. Multirun, ``--help``, ``--info``, ``--cfg hydra`` and a config Hydra itself cannot compose are left
    to Hydra (each job of a multirun is checked by :func:`run`)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (create_automatic_config_search_path,
                                       detect_calling_file_or_module_from_task_function, detect_task_name,
                                       get_args_parser)
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:  # Hydra's parser says what is wrong when main() parses the same
        return
    if (args.help or args.hydra_help or args.multirun or args.info or args.shell_completion
            or args.cfg not in (None, "job", "all")):
        return
    try:
        calling_file, calling_module = detect_calling_file_or_module_from_task_function(main)
        search_path = create_automatic_config_search_path(calling_file, calling_module,
                                                          args.config_path or "config")
        if args.config_dir is not None:
            from hydra.core.config_search_path import SearchPathQuery

            search_path.prepend(provider="command-line", path=f"file://{os.path.abspath(args.config_dir)}",
                                anchor=SearchPathQuery(provider="schema"))
        hydra_app = Hydra.create_main_hydra2(task_name=detect_task_name(calling_file, calling_module),
                                             config_search_path=search_path)
        config = hydra_app.compose_config(config_name=args.config_name or "tokensel_trainer",
                                          overrides=list(args.overrides), run_mode=RunMode.RUN,
                                          with_log_configuration=False)
        HydraConfig.instance().set_config(config)  # the CPU switch reads the command line's keys from it
        with open_dict(config):
            del config["hydra"]
        OmegaConf.set_struct(config, True)
    except Exception:  # noqa: BLE001  (Hydra reports it, its own way, when main() composes)
        return
    finally:
        GlobalHydra.instance().clear()
    try:
        check(config, environ=dict(os.environ))
    except Exception:  # noqa: BLE001  (not a refusal of ours, e.g. verl's own check: the run raises it as before,
        return  # and --cfg prints the config as Hydra composed it)
    if args.cfg is None:  # a run (--cfg composes without verl's run packages)
        from verl_tokensel.stack import exit_if_missing_run_packages

        exit_if_missing_run_packages(use_v1=bool(config.trainer.use_v1))


if __name__ == "__main__":
    # verl's example scripts name verl's config (--config-path=config --config-name=ppo_megatron_trainer): ours
    # compose it, so a script swaps only the module. Rewritten before Hydra parses: a file of ours named like
    # verl's would shadow the one our configs list in their defaults.
    from verl_tokensel.verl_glue.routes import our_config_args

    sys.argv[1:], swapped = our_config_args(sys.argv[1:])
    if swapped:
        print(swapped, file=sys.stderr, flush=True)
    unknown = unknown_knob_line(sys.argv[1:])
    if unknown:  # exit 2: a usage error, before Hydra composes
        print(unknown, file=sys.stderr, flush=True)
        raise SystemExit(2)
    preflight(sys.argv[1:])
    main()
