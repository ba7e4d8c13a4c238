"""The tokensel actor workers: verl's actor worker classes whose ``TrainingWorker`` runs the selection's worker-side
steps (the pre-pass, the weight versions, the no-graph entropy, the hidden-state passes:
:func:`~verl_tokensel.verl_glue.prepass.install_prepass`).

Installed without editing verl: :func:`tokensel_worker_class` sets verl's ``actor_worker_cls`` on a subclass of the
actor worker class, so the steps are there in every Ray worker; the trainers (V1: ``install``, v0: ``v0``) swap the
classes of their ``role_worker_mapping`` with :func:`use_tokensel_workers` when a selector is on.
"""

from __future__ import annotations

from verl.workers.engine_workers import TrainingWorker

from verl_tokensel.verl_glue.prepass import install_prepass


class TokenselTrainingWorker(TrainingWorker):
    """verl's ``TrainingWorker`` with the selection's worker-side steps installed
    (:func:`~verl_tokensel.verl_glue.prepass.install_prepass`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        install_prepass(self)


_WORKER_CLASSES: dict[type, type] = {}


def tokensel_worker_class(base: type) -> type:
    """A subclass of the actor worker class ``base`` whose actor ``TrainingWorker`` is a
    :class:`TokenselTrainingWorker`.

    ``base``: ``ActorRolloutRefWorker`` or a subclass of it (verl's separate-async trainer swaps in
    ``DetachActorWorker``); a Ray actor class (``ray.remote(...)``) is unwrapped. Only the class attribute
    ``actor_worker_cls`` changes, so every registered RPC of ``base`` stays as it is. Cached per base;
    the class is not a module attribute, so Ray ships it by value to the worker processes.
    """
    base = getattr(base, "__ray_actor_class__", base)
    if getattr(base, "_tokensel_prepass", False):
        return base
    if base not in _WORKER_CLASSES:
        inner = base.actor_worker_cls
        if inner is TrainingWorker:
            inner = TokenselTrainingWorker
        elif not issubclass(inner, TokenselTrainingWorker):  # a custom actor TrainingWorker: keep it, add the wrap
            inner = type(f"Tokensel{inner.__name__}", (TokenselTrainingWorker, inner), {"__module__": __name__})
        _WORKER_CLASSES[base] = type(
            f"Tokensel{base.__name__}",
            (base,),
            {"actor_worker_cls": inner, "_tokensel_prepass": True, "__module__": __name__,
             "__doc__": f"verl's {base.__name__} whose actor runs the token-selection pre-pass each mini-batch."},
        )
    return _WORKER_CLASSES[base]


def use_tokensel_workers(role_worker_mapping: dict) -> None:
    """Swap, in place, every actor worker class of a trainer's ``role_worker_mapping`` for its tokensel twin.

    Called after verl (or a trainer subclass such as separate-async) filled the mapping, so it composes
    with whatever class is there. Roles whose class has no ``actor_worker_cls`` (critic) are left alone.
    """
    import ray

    for role, remote_cls in list(role_worker_mapping.items()):
        cls = getattr(remote_cls, "__ray_actor_class__", remote_cls)
        if hasattr(cls, "actor_worker_cls") and not getattr(cls, "_tokensel_prepass", False):
            role_worker_mapping[role] = ray.remote(tokensel_worker_class(cls))


def selection_uses_tokensel_workers(config) -> bool:
    """Whether the (OmegaConf) trainer config selects at all: then the actor workers are the tokensel twins
    (the pre-pass for ``score_source=prepass``, the no-graph entropy for every selector)."""
    from verl_tokensel.verl_glue.actor_config import actor_selection

    return actor_selection(config) is not None


__all__ = [
    "TokenselTrainingWorker",
    "selection_uses_tokensel_workers",
    "tokensel_worker_class",
    "use_tokensel_workers",
]
