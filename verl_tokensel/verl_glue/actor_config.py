"""Actor config classes that declare the token-selection keys.

verl converts ``actor_rollout_ref.actor`` into a frozen dataclass with ``hydra.utils.instantiate``
on the driver (``validate_config``, before Ray starts) and in every worker. Our plugin YAML points
that node's ``_target_`` here, so ``token_selector`` and ``token_selection.*`` are real fields
(no ``+`` needed) and a bad value fails on the driver, before any worker or GPU is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config import FSDPActorConfig, McoreActorConfig

from verl_tokensel.core.config import (
    Selection,
    TokenSelectionConfig,
    resolve_selection,
)
from verl_tokensel.verl_glue.errors import config_error_at


class StockLossGuard(dict):
    """``global_batch_info`` that refuses to serve verl's stock ``ppo_loss`` while a selector is on.

    verl's ``ppo_loss`` writes into ``config.global_batch_info`` on every call. If a token selector is
    configured but the selecting loss was never installed (e.g. the deprecated v0 driver launched
    through ``verl.trainer.main_ppo``), training would silently use all tokens; this guard turns
    that into a loud error on the first micro-batch instead.
    """

    selector: Optional[str] = None
    active: bool = False

    def _refuse_stock_write(self) -> None:
        if self.selector is not None and not self.active:
            raise RuntimeError(
                f"actor_rollout_ref.actor.token_selector={self.selector} is set, but verl's stock ppo_loss is "
                "running: the selecting loss was not installed on the actor workers. This happens with "
                "trainer.use_v1=false under `python -m verl.trainer.main_ppo`, or with a trainer.v1.trainer_mode "
                "that is not a tokensel_* mode. Fix: launch with `python -m verl_tokensel.main_ppo` "
                "(both drivers) or use trainer.use_v1=true with trainer.v1.trainer_mode=tokensel_sync."
            )

    # every way of writing a dict: a stock loss that fills the batch info by update() or clear() + writes, not
    # item by item, is refused as well (dict's C methods do not go through __setitem__)
    def __setitem__(self, key, value):
        self._refuse_stock_write()
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self._refuse_stock_write()
        super().__delitem__(key)

    def update(self, *args, **kwargs):
        self._refuse_stock_write()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._refuse_stock_write()
        return super().setdefault(key, default)

    def __ior__(self, other):
        self._refuse_stock_write()
        return super().__ior__(other)

    def clear(self):
        self._refuse_stock_write()
        super().clear()

    def pop(self, *args):
        self._refuse_stock_write()
        return super().pop(*args)

    def popitem(self):
        self._refuse_stock_write()
        return super().popitem()

    def __reduce__(self):
        return (_rebuild_guard, (dict(self), self.selector))


def _rebuild_guard(items: dict, selector: Optional[str]) -> "StockLossGuard":
    g = StockLossGuard(items)
    g.selector = selector
    return g


def _coerce_overrides(value: Any) -> TokenSelectionConfig:
    """The ``token_selection`` node as :class:`TokenSelectionConfig` (its keys are checked against the chosen rule's
    knobs when the rule is resolved)."""
    if isinstance(value, TokenSelectionConfig):
        return value
    if value is None:
        return TokenSelectionConfig()
    if hasattr(value, "items"):
        return TokenSelectionConfig(**{k: v for k, v in dict(value).items() if k != "_target_"})
    raise config_error_at("actor_rollout_ref.actor.token_selection", value, "a mapping of knobs",
                          "Fix: set its knobs one by one (actor_rollout_ref.actor.token_selection.<knob>=...).")


class _TokenSelectMixin:
    """Shared validation: resolves ``token_selector`` + ``token_selection`` into a :class:`Selection`."""

    def _tokensel_post_init(self) -> None:
        overrides = _coerce_overrides(self.token_selection)
        if overrides is not self.token_selection:
            object.__setattr__(self, "token_selection", overrides)
        selection = resolve_selection(
            self.token_selector,
            overrides,
            loss_agg_mode=self.loss_agg_mode,
            loss_mode=self.policy_loss.get("loss_mode", "vanilla"),
            calculate_entropy=self.calculate_entropy,
            entropy_coeff=self.entropy_coeff,
            use_kl_loss=self.use_kl_loss,
            kl_loss_type=self.kl_loss_type,
        )
        object.__setattr__(self, "_tokensel_selection", selection)
        guard = StockLossGuard(self.global_batch_info)
        guard.selector = self.token_selector if selection is not None else None
        object.__setattr__(self, "global_batch_info", guard)

    @property
    def selection(self) -> Optional[Selection]:
        """The resolved rule, or None for ``token_selector=none``."""
        return self.__dict__.get("_tokensel_selection")

    @property
    def needs_entropy(self) -> bool:
        """The update forward must return entropy: where the scores are measured, or for the entropy shaping
        (the update pass's entropy shifts the advantage)."""
        sel = self.selection
        if sel is None:
            return False
        return sel.shaping_needs_entropy or (sel.score_source == "current" and sel.score_needs_entropy)


@dataclass
class TokenselFSDPActorConfig(_TokenSelectMixin, FSDPActorConfig):
    """verl's ``FSDPActorConfig`` (model_engine=dp) plus the token-selection keys."""

    token_selector: str = "none"
    token_selection: TokenSelectionConfig = field(default_factory=TokenSelectionConfig)

    def __post_init__(self):
        # ours first: a bad token-selection key is named before verl's assertions on the rest of the node
        self._tokensel_post_init()
        super().__post_init__()


@dataclass
class TokenselMcoreActorConfig(_TokenSelectMixin, McoreActorConfig):
    """verl's ``McoreActorConfig`` (model_engine=megatron) plus the token-selection keys."""

    token_selector: str = "none"
    token_selection: TokenSelectionConfig = field(default_factory=TokenSelectionConfig)

    def __post_init__(self):
        # ours first: a bad token-selection key is named before verl's assertions on the rest of the node
        self._tokensel_post_init()
        super().__post_init__()


# Names the YAML's `_target_: ...${model_engine}_actor_config` resolves to.
dp_actor_config = TokenselFSDPActorConfig
megatron_actor_config = TokenselMcoreActorConfig


def _unsupported_engine(name: str):
    def factory(*args, **kwargs):
        raise config_error_at("model_engine", name, "dp, megatron",
                              "verl_tokensel's actor config serves verl's FSDP and Megatron engines. Fix: "
                              "model_engine=dp or model_engine=megatron.")

    return factory


torchtitan_actor_config = _unsupported_engine("torchtitan")
veomni_actor_config = _unsupported_engine("veomni")


_RESOLVED: dict[str, Any] = {}


def resolve_actor_config(config) -> Any:
    """``actor_rollout_ref.actor`` of the (OmegaConf) trainer config as verl's actor dataclass (ours, with
    ``.selection``, the resolved rule), converted once per process for each content of the node.

    The driver's checks, the trainer modes, the pre-pass swap and the loss installation all read the rule
    from here. Keyed by the node's resolved content, so a node changed in place (e.g. ``calculate_entropy``
    turned on by :func:`~verl_tokensel.verl_glue.install.prepare_driver_config`) is converted again.
    """
    from omegaconf import OmegaConf

    from verl.utils.config import omega_conf_to_dataclass

    node = config.actor_rollout_ref.actor
    key = OmegaConf.to_yaml(node, resolve=True)
    if key not in _RESOLVED:
        _RESOLVED[key] = omega_conf_to_dataclass(node)
    return _RESOLVED[key]


def actor_selection(config) -> Optional[Selection]:
    """The resolved selection rule of the trainer config (None for ``token_selector`` none / unset)."""
    from omegaconf import OmegaConf

    if OmegaConf.select(config, "actor_rollout_ref.actor.token_selector", default=None) in (None, "none"):
        return None
    return getattr(resolve_actor_config(config), "selection", None)
