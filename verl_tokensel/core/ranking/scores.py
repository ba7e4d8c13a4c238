"""Per-token scores used to rank response tokens. Pure torch, no verl import.

All tensors are padded ``(batch, response_len)``; entropies are in nats of the
temperature-scaled distribution, exactly as the engine returns them.

Provenance:
- entropy: "Beyond the 80/20 Rule", arXiv 2506.01939, Sec. 3 (forking tokens).
- omega and ``gmts`` = H * |omega|: GMTS, arXiv 2608.30632 (the paper's delta; unlike the released code,
  omega is 0 in verl's dual-clip branch A < 0, r > clip_ratio_c, where verl's loss has no gradient; see the
  docs/fidelity.md, "How each preset differs from its reference").
- ``grad_norm``: the exact norm of the logit gradient of the token's loss,
  ``|omega| * ||e_a - p|| / T``; ``||e_a - p||^2 = (1 - p_a)^2 + sum_{j != a} p_j^2``.

Each score is registered once in :data:`SCORE_REGISTRY`; selectors name a score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

# verl clamps the log-ratio to this value before exp() (core_algos.compute_policy_loss_vanilla);
# beyond it the clamp has zero gradient, so such tokens carry no gradient either.
LOG_RATIO_CLAMP = 20.0


@dataclass
class ScoreInputs:
    """What a score may read. Shapes are ``(batch, response_len)`` unless stated.

    Attributes:
        log_prob: current-policy log p(a_t) (nats).
        response_mask: bool, True on valid response tokens.
        entropy: current (or old) policy entropy, or None when the engine did not compute it.
        old_log_prob: behaviour/old-policy log p(a_t).
        rollout_log_prob: the rollout engine's log p(a_t) (the behaviour policy when verl recomputes
            ``old_log_prob``), or None when the batch has none; read by a score with ``needs_rollout_log_probs``.
        advantages: per-token advantages.
        sum_pi_squared: sum_j p_j^2 of the same distribution, or None.
        logit_grad_norm: ``||e_a - p||`` when the caller measured it exactly (the analysis scorer does, from
            the full distribution); None: derived from ``log_prob`` and ``sum_pi_squared``.
        ref_log_prob: reference-policy log p(a_t) (only read when ``kl_coef`` > 0).
        row_keys: ``(batch,)`` int64 keys identifying each response (for the seeded random score).
        clip_ratio_low / clip_ratio_high / clip_ratio_c: PPO/DAPO clip parameters.
        kl_coef / kl_type: the KL-loss term, when one is on (kl_coef == 0 disables it).
        seed: seed of the ``random`` score.
        external: per-token fields a score declares in ``needs_external`` and that only the glue can
            compute (e.g. ``ref_entropy``, the reference model's entropy, filled on the driver).
    """

    log_prob: torch.Tensor
    response_mask: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    old_log_prob: Optional[torch.Tensor] = None
    rollout_log_prob: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    sum_pi_squared: Optional[torch.Tensor] = None
    logit_grad_norm: Optional[torch.Tensor] = None
    ref_log_prob: Optional[torch.Tensor] = None
    row_keys: Optional[torch.Tensor] = None
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    seed: int = 0
    omega_cache: Optional[torch.Tensor] = None  # filled by omega(); scores and metrics share it
    external: dict[str, torch.Tensor] = field(default_factory=dict)

    def need_entropy(self, name: str) -> torch.Tensor:
        """The entropy (float32, detached) for score ``name``; a clear error where the pass computed none."""
        if self.entropy is None:
            raise ValueError(
                f"score {name!r} needs the policy entropy but the engine returned none: set "
                "actor_rollout_ref.actor.calculate_entropy=True (or token_selection.auto_enable_entropy=True)")
        return self.entropy.detach().float()

    def need_advantages(self, name: str) -> torch.Tensor:
        """The advantages for score ``name``; a clear error where the batch carries none."""
        if self.advantages is None:
            raise ValueError(f"score {name!r} needs the advantages of the batch")
        return self.advantages


def policy_gradient_weight(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> torch.Tensor:
    """omega = r * A * 1[not clipped]: minus the derivative of the PPO/DAPO token loss w.r.t. log p_a.

    The token loss is ``max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`` with the dual clip
    ``min(., -A c)`` for ``A < 0``. Its derivative w.r.t. log p_a is ``-A r`` where the unclipped
    branch is active and 0 where a clipped branch is: ``A > 0, r > 1+eps_high``;
    ``A < 0, r < 1-eps_low``; ``A < 0, r > c`` (dual clip); and ``|log r| > 20`` (verl's clamp).
    Ties (``r`` exactly on a bound) follow torch.maximum's gradient split and are measure-zero.

    Returns a detached tensor of the same shape (no gradient flows through a score).
    """
    with torch.no_grad():
        log_ratio = (log_prob - old_log_prob).float()
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        adv = advantages.float()
        clipped = (adv > 0) & (ratio > 1.0 + clip_ratio_high)
        clipped |= (adv < 0) & (ratio < 1.0 - clip_ratio_low)
        clipped |= (adv < 0) & (ratio > clip_ratio_c)
        clipped |= log_ratio.abs() > LOG_RATIO_CLAMP
        return torch.where(clipped, torch.zeros_like(ratio), ratio * adv)


def kl_gradient_weight(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Minus the derivative of verl's per-token KL penalty w.r.t. log p_a (before kl_coef).

    k1 (``kl``/``k1``): d/dlogp (logp - ref) = 1 -> -1.
    k2 (``mse``/``k2``): d/dlogp 0.5 (logp - ref)^2 = logp - ref -> ref - logp.
    k3 (``low_var_kl``/``k3``): d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - pi_ref/pi
        -> pi_ref/pi - 1 (the GMTS "+ beta * pi_ref/pi - beta" term).
    """
    with torch.no_grad():
        diff = (ref_log_prob - log_prob).float()
        if kl_type in ("kl", "k1"):
            return -torch.ones_like(diff)
        if kl_type in ("mse", "k2"):
            return diff
        if kl_type in ("low_var_kl", "k3"):
            return torch.expm1(torch.clamp(diff, -20.0, 20.0))
        raise ValueError(
            f"kl_loss_type={kl_type!r} has no gradient-weight formula in verl_tokensel; "
            "valid: kl, k1, mse, k2, low_var_kl, k3. Fix: use one of these or a score that does not "
            "need omega (entropy, random)."
        )


def omega(inp: ScoreInputs) -> torch.Tensor:
    """Total gradient weight of a token: policy part plus, when a KL loss is on, the KL part."""
    if inp.omega_cache is not None:
        return inp.omega_cache
    if inp.old_log_prob is None or inp.advantages is None:
        raise ValueError("omega needs old_log_prob and advantages")
    w = policy_gradient_weight(
        inp.log_prob, inp.old_log_prob, inp.advantages, inp.clip_ratio_low, inp.clip_ratio_high, inp.clip_ratio_c
    )
    if inp.kl_coef and inp.ref_log_prob is not None:
        w = w + inp.kl_coef * kl_gradient_weight(inp.log_prob, inp.ref_log_prob, inp.kl_type)
    inp.omega_cache = w
    return w


def logit_grad_norm(log_prob: torch.Tensor, sum_pi_squared: Optional[torch.Tensor]) -> torch.Tensor:
    """||e_a - p||, the norm of d log p_a / d logits (times T), in a cancellation-safe form.

    ``||e_a - p||^2 = (1 - p_a)^2 + sum_{j != a} p_j^2`` with ``1 - p_a = -expm1(log p_a)``
    computed in float64. The second term ``sum p^2 - p_a^2`` is clamped to its exact range
    ``[0, (1 - p_a)^2]`` so rounding in ``sum_pi_squared`` can never push the result outside
    ``[(1 - p_a), sqrt(2) (1 - p_a)]``. Without ``sum_pi_squared`` the lower bound ``1 - p_a``
    is returned (ranking-equivalent within a factor sqrt(2)).
    """
    with torch.no_grad():
        if sum_pi_squared is None:  # expm1 keeps full relative precision in float32
            return -torch.expm1(log_prob.float().clamp(max=0.0))
        lp = log_prob.double().clamp(max=0.0)
        one_minus_pa = -torch.expm1(lp)
        rest = sum_pi_squared.double() - torch.exp(2.0 * lp)
        rest = torch.minimum(rest.clamp(min=0.0), one_minus_pa.square())
        return torch.sqrt(one_minus_pa.square() + rest).float()


def token_grad_norm(inp: ScoreInputs) -> torch.Tensor:
    """``||e_a - p||`` of each token: :attr:`ScoreInputs.logit_grad_norm` when given, else :func:`logit_grad_norm`."""
    if inp.logit_grad_norm is not None:
        return inp.logit_grad_norm.detach().float()
    return logit_grad_norm(inp.log_prob, inp.sum_pi_squared)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic), used for counter-based RNG."""
    x = x ^ (x >> 30) & 0x3FFFFFFFF  # logical shift emulation on the low bits keeps it well mixed
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as signed int64
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * -7723592293110705685  # 0x94D049BB133111EB as signed int64
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return x


def seeded_uniform(row_keys: torch.Tensor, length: int, seed: int) -> torch.Tensor:
    """Uniform [0, 1) draws that depend only on (seed, row key, token position).

    Counter-based, so every data-parallel rank, every micro-batch split and every rerun draws the
    same number for the same token, whatever order the rows arrive in.
    Returns float32 ``(batch, length)``.
    """
    pos = torch.arange(length, device=row_keys.device, dtype=torch.int64)
    key = _mix64(row_keys.to(torch.int64).unsqueeze(-1) * 1000003 + int(seed) * 7919 + 1)
    x = _mix64(key + pos.unsqueeze(0) * 0x9E3779B9)
    return ((x >> 11) & ((1 << 53) - 1)).double().mul(1.0 / (1 << 53)).float()


def row_keys_from_tokens(input_ids_rows: list[torch.Tensor]) -> torch.Tensor:
    """A deterministic int64 key per response from its token ids (independent of the batch order)."""
    if not input_ids_rows:
        return torch.zeros(0, dtype=torch.int64)
    lengths = torch.tensor([r.numel() for r in input_ids_rows], dtype=torch.int64)
    values = torch.cat([r.to(torch.int64).flatten().cpu() for r in input_ids_rows])
    return row_keys_from_packed(values, torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))


def row_keys_from_packed(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """:func:`row_keys_from_tokens` for packed rows: ``values`` (total,) token ids, ``offsets`` (rows + 1,).

    Each token is hashed with its position in its row and the hashes are summed per row (wrapping
    int64), so the key does not depend on where the row sits in the batch. Vectorised: no Python loop.
    """
    values = values.to(torch.int64)
    offsets = offsets.to(device=values.device, dtype=torch.int64)
    lengths = offsets.diff()
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    pos = torch.arange(values.numel(), device=values.device, dtype=torch.int64) - offsets[:-1][row]
    h = _mix64(values + pos * 0x632BE5AB)
    return torch.zeros(lengths.numel(), dtype=torch.int64, device=values.device).index_add_(0, row, h)


ScoreFn = Callable[[ScoreInputs], torch.Tensor]


@dataclass(frozen=True)
class ScoreSpec:
    """A registered score: its function and which inputs it needs."""

    name: str
    fn: ScoreFn
    needs_entropy: bool
    needs_omega: bool
    help: str
    needs_row_keys: bool = False
    needs_external: tuple[str, ...] = ()
    uses_sum_pi_squared: bool = False
    ranks: bool = True
    rule: Optional[str] = None
    needs_rollout_log_probs: bool = False
    reads_policy: bool = True


SCORE_REGISTRY: dict[str, ScoreSpec] = {}


def register_score(
    name: str,
    *,
    needs_entropy: bool,
    needs_omega: bool,
    help: str,
    needs_row_keys: bool = False,
    needs_external: tuple[str, ...] = (),
    uses_sum_pi_squared: bool = False,
    ranks: bool = True,
    rule: Optional[str] = None,
    needs_rollout_log_probs: bool = False,
    reads_policy: bool = True,
):
    """Decorator registering a score ``fn(inp) -> (batch, response_len) tensor`` as ``name``; refuses to overwrite
    an existing name. ``inp`` is a :class:`ScoreInputs` (the padded per-token inputs by name; ``inp.need_entropy(name)``
    and ``inp.need_advantages(name)`` fail clearly where the batch lacks them).

    ``needs_row_keys``: the score reads :attr:`ScoreInputs.row_keys` (one int64 per response).
    ``needs_external``: names of :attr:`ScoreInputs.external` fields the score reads; the core cannot
    compute them, a glue module fills them (only ``score_source=rollout`` knows ``ref_entropy``).
    ``uses_sum_pi_squared``: the score is exact with :attr:`ScoreInputs.sum_pi_squared` (else bounded),
    so the pass that measures it should ask the engine for sum_j p_j^2.
    ``ranks=False``: the score ranks nothing; a rule ranking by it keeps every token of the pool (``all``).
    ``rule``: the registered rule whose own selection reads the score (the covariance rules', STAPO's); any
    other rule refuses it.
    ``needs_rollout_log_probs``: the score reads :attr:`ScoreInputs.rollout_log_prob` (the rollout engine's
    log-probs, a per-token field of the update batch only when the rollout computes them); the driver refuses a
    configuration where they cannot reach the actor.
    ``reads_policy=False``: the score reads nothing of the scored policy (``log_prob``, ``entropy``, sum p^2), only
    fields fixed before the update (``old_log_prob``, ``rollout_log_prob``, the advantages), so the pre-pass takes
    the old-log-prob pass's values instead of running a forward, at any weights.
    """

    def deco(fn: ScoreFn) -> ScoreFn:
        if name in SCORE_REGISTRY:
            raise ValueError(f"score {name!r} is already registered; pick another name")
        SCORE_REGISTRY[name] = ScoreSpec(name, fn, needs_entropy, needs_omega, help, needs_row_keys,
                                         tuple(needs_external), uses_sum_pi_squared, ranks, rule,
                                         needs_rollout_log_probs, reads_policy)
        return fn

    return deco


@register_score("entropy", needs_entropy=True, needs_omega=False, help="H_t, nats (80/20 forking tokens)")
def entropy_score(inp: ScoreInputs) -> torch.Tensor:
    return inp.need_entropy("entropy")


@register_score("gmts", needs_entropy=True, needs_omega=True, help="H_t * |omega_t| (GMTS delta)")
def gmts_score(inp: ScoreInputs) -> torch.Tensor:
    return inp.need_entropy("gmts") * omega(inp).abs()


@register_score(
    "grad_norm",
    needs_entropy=False,
    needs_omega=True,
    help="|omega_t| * ||e_a - p|| (exact with sum_pi_squared, else the (1 - p_a) lower bound)",
    uses_sum_pi_squared=True,
)
def grad_norm_score(inp: ScoreInputs) -> torch.Tensor:
    return omega(inp).abs() * token_grad_norm(inp)


@register_score("random", needs_entropy=False, needs_omega=False, help="seeded uniform draw (control)",
                needs_row_keys=True)
def random_score(inp: ScoreInputs) -> torch.Tensor:
    if inp.row_keys is None:
        raise ValueError("the random score needs row_keys (one int64 per response)")
    return seeded_uniform(inp.row_keys, inp.log_prob.shape[-1], inp.seed).to(inp.log_prob.device)


@register_score("all", needs_entropy=False, needs_omega=False, ranks=False,
                help="no ranking: every valid token is kept (the shaping and update-pass presets)")
def all_score(inp: ScoreInputs) -> torch.Tensor:
    return torch.zeros_like(inp.log_prob, dtype=torch.float32)


@register_score(
    "ref_entropy",
    needs_entropy=False,
    needs_omega=False,
    help="H_ref_t, nats: the reference/base model's entropy at the token (score_source=rollout only)",
    needs_external=("ref_entropy",),
)
def ref_entropy_score(inp: ScoreInputs) -> torch.Tensor:
    # the 80/20 paper reports > 86% overlap of base and RL-trained top-20% positions (Qwen3-14B)
    if "ref_entropy" not in inp.external:
        raise ValueError(
            "the ref_entropy score needs the reference model's per-token entropy, which only the driver "
            "computes (token_selection.score_source=rollout)"
        )
    return inp.external["ref_entropy"].detach().float()


def compute_score(name: str, inp: ScoreInputs) -> torch.Tensor:
    """Evaluate a registered score; returns float32 ``(batch, response_len)``, detached."""
    try:
        spec = SCORE_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown score {name!r}; valid: {sorted(SCORE_REGISTRY)}") from None
    return spec.fn(inp)


def grad_mass(name: str, scores: torch.Tensor, inp: ScoreInputs) -> Optional[torch.Tensor]:
    """Per-token estimate of the logit-gradient norm, ``|omega| * ||e_a - p||`` (the scores themselves for
    ``grad_norm``), for the "share of gradient mass kept" metric; None when the KL type has no
    gradient-weight formula (only possible for scores without omega)."""
    if name == "grad_norm":
        return scores
    try:
        return omega(inp).abs() * token_grad_norm(inp)
    except ValueError:
        return None


def score_params(actor_config: Any) -> dict[str, Any]:
    """Clip and KL parameters of ``actor_rollout_ref.actor`` (an OmegaConf node or verl's dataclass)
    as :class:`ScoreInputs` keyword arguments, resolved like verl's loss (``clip_ratio_low/high``
    fall back to ``clip_ratio``; the KL weight is 0 unless ``use_kl_loss``)."""

    def get(key, default=None):
        value = getattr(actor_config, key, default)
        return default if value is None else value

    clip_ratio = get("clip_ratio", 0.2)
    use_kl = bool(get("use_kl_loss", False))
    return dict(
        clip_ratio_low=float(get("clip_ratio_low", clip_ratio)),
        clip_ratio_high=float(get("clip_ratio_high", clip_ratio)),
        clip_ratio_c=float(get("clip_ratio_c", 3.0)),
        kl_coef=float(get("kl_loss_coef", 0.0)) if use_kl else 0.0,
        kl_type=str(get("kl_loss_type", "low_var_kl")),
    )


__all__ = [
    "LOG_RATIO_CLAMP", "SCORE_REGISTRY", "ScoreInputs", "ScoreSpec", "compute_score", "grad_mass",
    "kl_gradient_weight", "logit_grad_norm", "omega", "policy_gradient_weight",
    "register_score",
    "row_keys_from_packed", "row_keys_from_tokens", "score_params", "seeded_uniform", "token_grad_norm"
]
