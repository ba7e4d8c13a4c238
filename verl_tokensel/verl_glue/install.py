"""How the selecting loss reaches verl's actor workers, with no verl file edited.

verl 0.9's actor workers bind ``partial(ppo_loss, config=actor_config)`` in ``init_model`` and expose
``set_loss_fn``, an RPC that replaces it on every rank; only the driver can call it. V1 driver (the default):
we register the trainer modes ``tokensel_sync``, ``tokensel_colocate_async`` and ``tokensel_separate_async`` in
verl's ``TRAINER_REGISTRY``: thin subclasses of verl's trainers that call ``set_loss_fn`` in ``on_init_end``, turn
on ``calculate_entropy`` when the score needs it and, for ``score_source=rollout``, select on the driver
(:mod:`~verl_tokensel.verl_glue.rollout_source`). v0 driver: :mod:`~verl_tokensel.verl_glue.v0`.

A worker-side hook cannot do it: verl's ``ppo_loss`` passes neither the entropy nor the dp group to a registered
policy loss, so the whole loss is replaced; :class:`~verl_tokensel.verl_glue.actor_config.StockLossGuard` makes
stock ``ppo_loss`` fail loudly when a selector is configured but the loss was not replaced.
"""

from __future__ import annotations

import logging
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_tokensel.core.errors import TokenSelectionConfigError
from verl_tokensel.core.seam.checks import check_prompt_groups

from verl_tokensel.verl_glue.actor_config import actor_selection, resolve_actor_config
from verl_tokensel.verl_glue.errors import config_error_at
from verl_tokensel.verl_glue.loss import SelectingLoss
from verl_tokensel.verl_glue.vocab import check_vocab_engine
from verl_tokensel.verl_glue.rollout_source import (
    DriverSelector,
    check_bypass_mode,
    prepare_rollout_config,
    validate_rollout_config,
)

logger = logging.getLogger(__name__)

TRAINER_MODE_PREFIX = "tokensel_"
# verl's built-in V1 trainer modes; each gets a tokensel_<mode> twin
BASE_TRAINER_MODES = ("sync", "colocate_async", "separate_async")
#: the v0 driver's checkpoint-engine manager, which installs the selecting loss (:mod:`~verl_tokensel.verl_glue.v0`)
V0_CHECKPOINT_MANAGER = "verl_tokensel.verl_glue.v0.TokenselCheckpointEngineManager"


def selection_error(exc: BaseException) -> Optional[TokenSelectionConfigError]:
    """The token-selection error ``exc`` carries (itself, or the cause Hydra's ``instantiate`` wrapped), or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TokenSelectionConfigError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def validate_driver_config(config: DictConfig) -> None:
    """Driver checks that need keys outside the actor node (run before Ray starts). Each refusal is a
    :class:`~verl_tokensel.core.errors.TokenSelectionConfigError` naming the key, its value, the valid values and
    the fix.

    With a selector on and the V1 driver, ``trainer.v1.trainer_mode`` must be one of our modes, otherwise nothing
    would install the selecting loss; with the v0 driver, ``rollout.checkpoint_manager_class`` must be ours.
    """
    selector = OmegaConf.select(config, "actor_rollout_ref.actor.token_selector", default=None)
    if selector in (None, "none"):
        return
    sel = actor_selection(config)  # resolved once for every check below
    validate_rollout_config(config, sel)
    if sel is not None:
        check_prompt_groups(sel, OmegaConf.select(config, "algorithm.adv_estimator", default=None))
    check_bypass_mode(config, sel)
    _check_fused_kernels(config, selector, sel)
    check_vocab_engine(config, sel)
    _check_rollout_log_probs(config, selector, sel)
    if not OmegaConf.select(config, "trainer.use_v1", default=True):
        check_v0_checkpoint_manager(config)
        return
    mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default=None)
    valid = [TRAINER_MODE_PREFIX + m for m in BASE_TRAINER_MODES]
    if mode not in valid:
        twin = TRAINER_MODE_PREFIX + (mode if mode in BASE_TRAINER_MODES else BASE_TRAINER_MODES[0])
        raise config_error_at(
            "trainer.v1.trainer_mode", mode, ", ".join(valid),
            f"With actor_rollout_ref.actor.token_selector={selector} only these modes install the selecting loss on "
            f"the actor workers (each wraps verl's mode of the same name). Fix: trainer.v1.trainer_mode={twin}")


def check_v0_checkpoint_manager(config: DictConfig) -> None:
    """The v0 driver installs the selecting loss from its checkpoint-engine manager
    (:data:`V0_CHECKPOINT_MANAGER`): refuse another one set in ``actor_rollout_ref.rollout.checkpoint_manager_class``.
    """
    current = OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_manager_class", default=None)
    if current and current != V0_CHECKPOINT_MANAGER:
        raise config_error_at(
            "actor_rollout_ref.rollout.checkpoint_manager_class", current, f"null, {V0_CHECKPOINT_MANAGER}",
            "The v0 driver (trainer.use_v1=false) installs the selecting loss from this manager. Fix: unset "
            "actor_rollout_ref.rollout.checkpoint_manager_class, or use trainer.use_v1=true.")


def _check_fused_kernels(config: DictConfig, selector: str, sel) -> None:
    """verl's fused linear-cross-entropy returns log-probs and entropy, never sum_j p_j^2 (verl raises
    NotImplementedError on a worker for ``calculate_sum_pi_squared`` with fused kernels), nor call the output layer
    (a rule with ``Needs(hidden_states=...)`` reads its input): refuse, on the driver, a rule reading hidden states and
    a pre-pass that would ask for sum p^2 (``score_source=rollout`` is refused by
    :func:`~verl_tokensel.verl_glue.rollout_source.validate_rollout_config`)."""
    if not OmegaConf.select(config, "actor_rollout_ref.model.use_fused_kernels", default=False):
        return
    key = "actor_rollout_ref.model.use_fused_kernels"
    if sel is not None and sel.impl.needs.hidden_states is not None:
        raise config_error_at(
            key, True, "False", f"actor_rollout_ref.actor.token_selector={selector} (rule {sel.rule}) reads the "
            "input of the output layer (lm_head), which verl's fused kernels never call. Fix: "
            f"{key}=False.")
    if sel is None or sel.score_source != "prepass" or not sel.uses_sum_pi_squared:
        return
    raise config_error_at(
        key, True, "False", f"actor_rollout_ref.actor.token_selector={selector} with score_source=prepass: its "
        "scoring pass needs sum_j p_j^2, which verl's fused kernels do not compute. Fix: "
        f"{key}=False, or token_selection.score_source=current (the score then uses its (1 - p_a) lower bound), or "
        "a score without sum p^2 (entropy, gmts).")


def _check_rollout_log_probs(config: DictConfig, selector: str, sel) -> None:
    """A score that reads the rollout engine's log-probs (``ScoreSpec.needs_rollout_log_probs``) needs them in the
    actor's update batch, next to verl's recomputed ``old_log_probs``: the rollout must compute them
    (``rollout.calculate_log_probs``; bypass mode, which makes ``old_log_probs`` the rollout's, is refused by
    :func:`~verl_tokensel.verl_glue.rollout_source.check_bypass_mode`). Refused here, on the driver, rather than a
    score of nothing on the workers."""
    if sel is None or not sel.needs_rollout_log_probs:
        return
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    if not OmegaConf.select(config, key, default=False):
        raise config_error_at(
            key, False, "True", f"actor_rollout_ref.actor.token_selector={selector} compares the rollout engine's "
            "log-probs (rollout_log_probs, the behaviour policy) with verl's recomputed old_log_probs (the proximal "
            "policy); without it the rollout returns no log-probs and the update batch carries no rollout_log_probs. "
            f"Fix: {key}=True.")


def prepare_driver_config(config: DictConfig) -> None:
    """Driver-side adjustments, in place: turn on entropy for the update pass when needed."""
    prepare_rollout_config(config)
    actor = resolve_actor_config(config)
    if getattr(actor, "needs_entropy", False) and not actor.calculate_entropy and actor.entropy_coeff == 0:
        # resolve_selection already refused this combination when auto_enable_entropy is false
        with open_dict(config):
            config.actor_rollout_ref.actor.calculate_entropy = True
        logger.info("verl-tokensel: token_selector=%s needs entropy; set actor.calculate_entropy=True",
                    actor.token_selector)


def build_actor_loss(config: DictConfig) -> SelectingLoss:
    """``SelectingLoss(<actor config dataclass>)`` for ``set_loss_fn`` (the engines call it like
    ``partial(ppo_loss, config=...)``)."""
    return SelectingLoss(resolve_actor_config(config))


def install_actor_loss(actor_wg, config: DictConfig) -> None:
    """Replace the actor loss on every rank of ``actor_wg`` (a no-op for stock configs)."""
    if OmegaConf.select(config, "actor_rollout_ref.actor.token_selector", default=None) is None:
        return
    actor_wg.set_loss_fn(build_actor_loss(config))
    logger.info("verl-tokensel: selecting loss installed on the actor workers")


# ----------------------------------------------------------------------------- V1 driver
def register_v1_trainers() -> None:
    """Register ``tokensel_<mode>`` for each of verl's built-in V1 trainer modes (idempotent)."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    # import verl's built-in trainers so the registry is complete
    import verl.trainer.ppo.v1.trainer_colocate_async  # noqa: F401
    import verl.trainer.ppo.v1.trainer_separate_async  # noqa: F401
    import verl.trainer.ppo.v1.trainer_sync  # noqa: F401

    for base_mode in BASE_TRAINER_MODES:
        base = TRAINER_REGISTRY[base_mode]
        name = TRAINER_MODE_PREFIX + base_mode
        if name in TRAINER_REGISTRY:
            if getattr(TRAINER_REGISTRY[name], "_tokensel_base_mode", None) == base_mode:
                continue
            raise RuntimeError(
                f"verl trainer mode {name!r} is already registered by someone else; refusing to overwrite")
        cls = type(
            f"Tokensel{base.__name__}",
            (_TokenselTrainerMixin, base),
            {"_tokensel_base_mode": base_mode, "__module__": __name__,
             "__doc__": f"verl's {base.__name__} with the selecting actor loss installed."},
        )
        register_trainer(name)(cls)
        globals()[cls.__name__] = cls  # picklable by qualified name


def __getattr__(name: str):
    """``Tokensel<verl trainer>`` classes exist once :func:`register_v1_trainers` ran; a process that unpickles one
    by its qualified name before verl's trainer package was imported gets it registered on the way."""
    if name.startswith("TokenselPPOTrainer"):
        register_v1_trainers()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _TokenselTrainerMixin:
    _tokensel_base_mode = "sync"

    def __init__(self, config: DictConfig, *args, **kwargs):
        with open_dict(config):
            # verl branches on the literal mode name ("sync" vs async) internally
            config.trainer.v1.trainer_mode = self._tokensel_base_mode
        prepare_driver_config(config)
        super().__init__(config, *args, **kwargs)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        # the actor's TrainingWorker runs the selection's worker-side steps (the no-graph entropy of the update
        # pass; score_source=prepass: the selection at the start of each mini-batch); the swap subclasses
        # whatever worker class the base trainer put there (separate_async: DetachActorWorker)
        from verl_tokensel.verl_glue.workers import selection_uses_tokensel_workers, use_tokensel_workers

        if selection_uses_tokensel_workers(self.config):
            use_tokensel_workers(self.role_worker_mapping)

    def on_init_end(self):
        install_actor_loss(self.actor_rollout_wg, self.config)
        return super().on_init_end()

    @property
    def tokensel_selection(self):
        """The resolved rule (None for ``none``), resolved once per trainer: the steps never resolve it again."""
        if "_tokensel_selection" not in self.__dict__:
            self._tokensel_selection = actor_selection(self.config)
        return self._tokensel_selection

    # score_source=rollout: the driver selects over the whole batch (verl_glue.rollout_source)
    @property
    def tokensel_driver(self):
        if "_tokensel_driver" not in self.__dict__:
            self._tokensel_driver = DriverSelector.from_config(self.config, trainer=self)
        return self._tokensel_driver

    def _compute_old_log_prob(self, batch, metrics):
        extra = self.tokensel_driver.old_pass_extra_info() if self.tokensel_driver is not None else {}
        batch.extra_info.update(extra)
        out = super()._compute_old_log_prob(batch, metrics)
        for key in extra:  # only this pass: the ref and update passes must not compute them
            batch.extra_info.pop(key, None)
            out.extra_info.pop(key, None)
        return out

    def _update_actor(self, batch, metrics):
        if self.tokensel_driver is not None:
            batch = self.tokensel_driver.select_v1(batch, metrics)
        from verl_tokensel.core.fields import UPDATE_PASS
        from verl_tokensel.core.resolve.update_passes import run_update_passes, several_passes

        sel = self.tokensel_selection
        if not several_passes(sel):
            return super()._update_actor(batch, metrics)

        def update(n: int) -> dict:  # one whole actor update with the pass number for the loss
            out: dict = {}
            batch.extra_info[UPDATE_PASS] = n
            super(_TokenselTrainerMixin, self)._update_actor(batch, out)
            return out

        try:
            metrics.update(run_update_passes(sel, update))
        finally:
            batch.extra_info.pop(UPDATE_PASS, None)
        return batch
