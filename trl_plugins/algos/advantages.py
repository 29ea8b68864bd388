"""Advantage estimators: pure functions plus the registered plugins that call them.

Every plugin has one call contract: ``estimator(AdvantageInput) -> AdvantageOutput``; its own
settings are constructor arguments. Outcome estimators return ``(N,)`` per-trajectory advantages;
``gae`` returns ``(N, T)`` per-position advantages and value targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from trl_plugins.registry import ADVANTAGES
from trl_plugins.types import AdvantageInput, AdvantageOutput

__all__ = [
    "group_advantages",
    "rloo_advantages",
    "gae_advantages",
    "masked_whiten",
    "GroupAdvantage",
    "DrGRPOAdvantage",
    "RLOOAdvantage",
    "GAEAdvantage",
    "turn_group_advantages",
    "TurnGroupAdvantage",
    "teacher_advantages",
    "OnPolicyDistillationAdvantage",
]


def _group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (sum, count, all-equal flag) and each trajectory's compacted group index, in float64.

    float64, and the all-equal flag from ``max == min``, because a float32 mean of equal rewards such
    as -0.9 leaves a ~1e-8 residue that the std division would blow up to a same-sign advantage.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(0, inverse, rewards)
    counts = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    inf = torch.full((num_groups,), float("inf"), dtype=torch.float64, device=rewards.device)
    hi = (-inf).scatter_reduce(0, inverse, rewards, reduce="amax")
    lo = inf.scatter_reduce(0, inverse, rewards, reduce="amin")
    return sums, counts, hi == lo, inverse


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-relative advantages (Shao et al. 2024, eq. 3).

    ``A_i = r_i - mean_g(r)``, divided by ``std_g(r) + eps`` (unbiased std) when ``scale_by_std``;
    Dr. GRPO (Liu et al. 2025) drops the division. A group whose rewards are all equal (a group of one
    included) gets exactly 0, whatever the values and dtype: computed in float64, then returned in
    ``rewards.dtype``.

    Args:
        rewards: ``(N,)`` float.
        group_ids: ``(N,)`` integer group of each trajectory (any labels, any order).

    Returns:
        ``(N,)`` advantages.
    """
    sums, counts, equal, g = _group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    centred = r - (sums / counts)[g]
    if scale_by_std:
        sq = torch.zeros_like(sums).index_add_(0, g, centred.pow(2))
        var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1), torch.zeros_like(sq))
        centred = centred / (var.sqrt()[g] + eps)
    return torch.where(equal[g], torch.zeros_like(centred), centred).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i in g} r_j``.

    Equals ``n/(n-1) * (r_i - mean_g(r))``. A group whose rewards are all equal (a group of one
    included) gets exactly 0; computed in float64, returned in ``rewards.dtype``.

    Returns:
        ``(N,)`` advantages.
    """
    sums, counts, equal, g = _group_stats(rewards, group_ids)
    r = rewards.to(torch.float64)
    n = counts[g]
    baseline = (sums[g] - r) / (n - 1).clamp(min=1)
    adv = torch.where((n > 1) & ~equal[g], r - baseline, torch.zeros_like(r))
    return adv.to(rewards.dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normalise ``x`` to zero mean, unit variance over positions where ``mask`` is 1; 0 elsewhere.

    With ``all_reduce`` (a function that sums a tensor over data-parallel ranks), the mean and the
    variance are those of the masked positions of *every* rank, so a batch split across ranks is
    whitened exactly as the whole batch would be in one process. Computed in float64.
    """
    m = mask.to(torch.float64)
    xd = torch.where(mask.bool(), x.to(torch.float64), torch.zeros_like(m))  # whatever sits off the mask is never read
    reduce = all_reduce or (lambda t: t)
    n, total = reduce(torch.stack([m.sum(), (xd * m).sum()])).unbind()
    n = n.clamp(min=1)
    mean = total / n
    var = reduce((xd - mean).pow(2).mul(m).sum().reshape(1))[0] / n
    out = (xd - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(x.dtype)


def gae_advantages(
    values: torch.Tensor,
    action_mask: torch.Tensor,
    rewards: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap_mask: torch.Tensor | None = None,
    bootstrap_values: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the *action* positions of multi-turn datums.

    (Schulman et al. 2016, eq. 16.) Only positions with ``action_mask == 1`` are steps of the MDP:
    the recursion skips prompt, tool-output and glue positions, carrying the running advantage and
    the next state's value across them unchanged, so credit does not decay through tool output. The
    outcome reward sits on the last action position of each row; a truncated row bootstraps from
    ``bootstrap_values`` where ``bootstrap_mask`` is 1, a terminated row from 0::

        delta_t = r_t + gamma * V(next action) - V_t
        A_t     = delta_t + gamma * lam * A(next action)

    Args:
        values: ``(N, T)`` critic values ``V_t`` aligned with datum positions.
        action_mask: ``(N, T)`` 1 on sampled tokens.
        rewards: ``(N,)`` outcome reward per row.
        bootstrap_mask: ``(N,)`` 1 to bootstrap (truncated), else 0. Default all 0.
        bootstrap_values: ``(N,)`` value after the last token. Default 0.
        token_rewards: ``(N, T)`` extra per-position rewards (e.g. ``-beta * KL``); read on action
            positions only.

    Returns:
        ``(advantages, returns)``, both ``(N, T)`` and 0 off-mask; ``returns = advantages + values``.
    """
    n, t_len = values.shape
    mask = action_mask.to(torch.bool)
    values = values.detach()
    r = torch.zeros_like(values) if token_rewards is None else token_rewards.detach().to(values.dtype).clone()
    has_action = mask.any(dim=1)
    last = torch.where(
        has_action,
        t_len - 1 - mask.flip(1).to(torch.long).argmax(dim=1),
        torch.zeros_like(has_action, dtype=torch.long),
    )
    rows = torch.arange(n, device=values.device)[has_action]
    r[rows, last[has_action]] += rewards.to(values.dtype)[has_action]
    next_value = torch.zeros(n, dtype=values.dtype, device=values.device)
    if bootstrap_mask is not None and bootstrap_values is not None:
        boot = bootstrap_mask.to(torch.bool)
        next_value = torch.where(boot, bootstrap_values.to(values.dtype).detach(), torch.zeros_like(next_value))
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in range(t_len - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        running = torch.where(m, candidate, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = torch.where(m, candidate, torch.zeros_like(candidate))
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


@ADVANTAGES.register("group")
@dataclass
class GroupAdvantage:
    """GRPO: reward minus group mean, divided by the group std when ``scale_by_std``."""

    needs_values: ClassVar[bool] = False
    """Capability: reads critic values (``AdvantageInput.values``)."""
    needs_groups: ClassVar[bool] = True
    """Capability: compares the members of a group (needs ``num_generations >= 2``)."""

    scale_by_std: bool = True
    """Divide by the group's (unbiased) std; False gives Dr. GRPO."""
    eps: float = 1e-6
    """Added to the std."""

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        return AdvantageOutput(
            advantages=group_advantages(inp.rewards, inp.group_ids, scale_by_std=self.scale_by_std, eps=self.eps)
        )


@ADVANTAGES.register("dr_grpo")
@dataclass
class DrGRPOAdvantage(GroupAdvantage):
    """Dr. GRPO: reward minus group mean, no std scaling (pair with ``seq_mean_token_sum_norm``)."""

    scale_by_std: bool = False


@ADVANTAGES.register("rloo")
@dataclass
class RLOOAdvantage:
    """REINFORCE leave-one-out baseline."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        return AdvantageOutput(advantages=rloo_advantages(inp.rewards, inp.group_ids))


@ADVANTAGES.register("gae")
@dataclass
class GAEAdvantage:
    """GAE over action positions (needs ``values`` and ``action_mask`` on the input)."""

    needs_values: ClassVar[bool] = True
    needs_groups: ClassVar[bool] = False

    gamma: float = 1.0
    """Discount per action token."""
    lam: float = 0.95
    """GAE lambda."""
    whiten: bool = True
    """Whiten advantages over the action tokens of the whole batch, every rank's (returns stay raw)."""

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        if inp.values is None or inp.action_mask is None:
            raise ValueError(
                "the 'gae' advantage estimator needs critic values and the action mask "
                "(AdvantageInput.values, .action_mask); enable the critic or choose 'group'/'rloo'."
            )
        adv, ret = gae_advantages(
            inp.values,
            inp.action_mask,
            inp.rewards,
            gamma=self.gamma,
            lam=self.lam,
            bootstrap_mask=inp.bootstrap_mask,
            bootstrap_values=inp.bootstrap_values,
            token_rewards=inp.token_rewards,
        )
        if self.whiten:
            adv = masked_whiten(adv, inp.action_mask, all_reduce=inp.all_reduce)
        return AdvantageOutput(advantages=adv, returns=ret)


def turn_group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    action_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    turn_state_ids: torch.Tensor,
    *,
    step_weight: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Turn-level credit with step groups of identical states (GiGPO: Feng et al. 2025, "Group-in-Group Policy
    Optimization for LLM Agent Training", with gamma = 1 and the outcome reward as every step's return).

    ``A(i, k) = A_episode(i) + step_weight * A_step(i, k)`` on the tokens of turn ``k`` of trajectory ``i``:
    ``A_episode`` is the group advantage of :func:`group_advantages`; ``A_step`` the same formula over the *step
    group* of the turn, every turn of the trajectory's group taken from the same state (``turn_state_ids``: equal token
    prefixes). A step group of one turn, or whose returns are all equal, gets 0: a turn is credited beyond its
    episode only against other turns made from where it stood. (The first turns of a group share the prompt, so
    they form one step group with the episode's: ``(1 + step_weight) A_episode``.)

    Returns:
        ``(N, T)`` advantages, 0 off the action mask (float64 inside, returned in ``rewards.dtype``).
    """
    n, width = action_mask.shape
    episode = group_advantages(rewards, group_ids, scale_by_std=scale_by_std, eps=eps).to(torch.float64)
    on = action_mask.bool() & (turn_ids >= 0)
    rows, cols = on.nonzero(as_tuple=True)
    adv = torch.zeros(n, width, dtype=torch.float64, device=rewards.device)
    adv[rows, cols] = episode[rows]
    if rows.numel():
        # One entry per (row, turn) span: its row and its state; the step group is (group, state).
        spans, span_of = torch.unique(torch.stack([rows, turn_ids[rows, cols]]), dim=1, return_inverse=True)
        span_rows = spans[0]
        first = torch.full((spans.shape[1],), width, dtype=torch.long, device=rows.device).scatter_reduce(
            0, span_of, cols, reduce="amin"
        )
        state = turn_state_ids[span_rows, first]
        step_keys = torch.stack([group_ids.to(torch.long)[span_rows], state])
        _, step_group = torch.unique(step_keys, dim=1, return_inverse=True)
        step = group_advantages(rewards.to(torch.float64)[span_rows], step_group, scale_by_std=scale_by_std, eps=eps)
        adv[rows, cols] += step_weight * step[span_of]
    return adv.to(rewards.dtype)


@ADVANTAGES.register("turn_group")
@dataclass
class TurnGroupAdvantage:
    """Turn-level credit (GiGPO-style): the group advantage plus ``step_weight`` times a step-level one among the
    group's turns taken from the same state (:func:`turn_group_advantages`)."""

    needs_values: ClassVar[bool] = False
    needs_groups: ClassVar[bool] = True
    needs_turn_ids: ClassVar[bool] = True
    """Capability: reads ``AdvantageInput.turn_ids`` and ``turn_state_ids``."""

    step_weight: float = 1.0
    """Weight of the step-level advantage (GiGPO's omega)."""
    scale_by_std: bool = True
    """Divide by the (episode or step) group's std, as ``group`` does."""
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.step_weight < 0:
            raise ValueError(
                f"turn_group: step_weight must be >= 0 (0 is the group advantage), got {self.step_weight}."
            )

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        if inp.turn_ids is None or inp.turn_state_ids is None or inp.action_mask is None:
            raise ValueError(
                "turn_group needs AdvantageInput.action_mask, turn_ids and turn_state_ids (the trainer "
                "passes them to an estimator that declares needs_turn_ids)."
            )
        return AdvantageOutput(
            advantages=turn_group_advantages(
                inp.rewards,
                inp.group_ids,
                inp.action_mask,
                inp.turn_ids,
                inp.turn_state_ids,
                step_weight=self.step_weight,
                scale_by_std=self.scale_by_std,
                eps=self.eps,
            )
        )


def teacher_advantages(
    behaviour_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    discount: float = 0.0,
) -> torch.Tensor:
    """On-policy distillation's per-token advantage: the negative single-sample estimate of the reverse KL,
    ``log pi_teacher(x_t) - log pi_student(x_t)`` at each sampled action token (the student's log-prob is the one it
    sampled the token with), 0 elsewhere. With ``discount`` gamma > 0, each action token's advantage is the discounted
    sum of that estimate over itself and the action tokens after it in its row, gamma counted per action token
    (prompt, tool-output and template tokens are skipped, not discounted over); gamma 0 (the default) is the
    per-token estimate alone, as Thinking Machines' and tinker-cookbook's recipes train.

    Args:
        behaviour_logprobs, teacher_logprobs: ``(N, T)`` log-probs of the sampled tokens.
        action_mask: ``(N, T)`` 1 at action tokens.

    Returns:
        ``(N, T)`` float64, 0 off the mask.
    """
    mask = action_mask.to(torch.float64)
    per_token = (teacher_logprobs.to(torch.float64) - behaviour_logprobs.to(torch.float64)) * mask
    if not discount:
        return per_token
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"the teacher advantage's discount is a factor in [0, 1], got {discount}.")
    out = torch.zeros_like(per_token)
    running = torch.zeros(per_token.shape[0], dtype=torch.float64, device=per_token.device)
    for t in range(per_token.shape[1] - 1, -1, -1):
        m = mask[:, t] > 0
        running = torch.where(m, per_token[:, t] + discount * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


@ADVANTAGES.register("opd")
@dataclass
class OnPolicyDistillationAdvantage:
    """On-policy distillation, alone or with the outcome reward: ``A = reward_weight * A_group + coef * A_teacher``
    per action token, where ``A_group`` is GRPO's group advantage of the trajectory's reward (:func:`group_advantages`)
    and ``A_teacher`` the teacher's per-token signal (:func:`teacher_advantages`). ``coef`` 0 is plain RL (no teacher
    forward is asked for), ``reward_weight`` 0 plain OPD. The run's teacher is ``teacher_model_name_or_path``
    (docs/training.md, "On-policy distillation")."""

    needs_values: ClassVar[bool] = False

    coef: float = 1.0
    """Weight of the teacher's signal (lambda)."""
    reward_weight: float = 1.0
    """Weight of the outcome reward's group advantage."""
    discount: float = 0.0
    """Discount of the teacher's signal over the following action tokens (0: per token)."""
    scale_by_std: bool = True
    """The group advantage divides by the group's std, as ``group`` does."""
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.coef < 0 or self.reward_weight < 0 or not (self.coef or self.reward_weight):
            raise ValueError(
                f"opd: coef and reward_weight are weights >= 0, not both 0 (coef=0 is plain RL: advantage 'group'; "
                f"reward_weight=0 plain distillation); got coef={self.coef}, reward_weight={self.reward_weight}."
            )
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"opd: discount is a factor in [0, 1], got {self.discount}.")
        self._metrics: dict[str, float] = {}

    @property
    def needs_groups(self) -> bool:
        """Group-relative when the reward counts (then ``num_generations >= 2``)."""
        return self.reward_weight > 0

    @property
    def needs_teacher_logprobs(self) -> bool:
        """The teacher's forward is asked for only when its signal counts."""
        return self.coef > 0

    def __call__(self, inp: AdvantageInput) -> AdvantageOutput:
        if inp.action_mask is None:
            raise ValueError("opd needs AdvantageInput.action_mask (the trainer passes it to every opd estimator).")
        mask = inp.action_mask.to(torch.float64)
        adv = torch.zeros_like(mask)
        if self.reward_weight:
            group = group_advantages(
                inp.rewards.to(torch.float64), inp.group_ids, scale_by_std=self.scale_by_std, eps=self.eps
            )
            adv = adv + self.reward_weight * group[:, None] * mask
        if self.coef:
            if inp.teacher_logprobs is None or inp.behaviour_logprobs is None:
                raise ValueError(
                    "opd needs AdvantageInput.teacher_logprobs and behaviour_logprobs: the run has no teacher; set "
                    "teacher_model_name_or_path."
                )
            teacher = teacher_advantages(inp.behaviour_logprobs, inp.teacher_logprobs, mask, discount=self.discount)
            adv = adv + self.coef * teacher
            kl = (inp.behaviour_logprobs.to(torch.float64) - inp.teacher_logprobs.to(torch.float64)) * mask
            tokens = float(mask.sum())
            self._metrics = {
                "teacher_kl": float(kl.sum()) / max(tokens, 1.0),
                "teacher_kl_above_1_share": float(((kl > 1.0) & (mask > 0)).sum()) / max(tokens, 1.0),
            }
        return AdvantageOutput(advantages=adv.to(inp.rewards.dtype if inp.rewards.is_floating_point() else adv.dtype))

    def step_metrics(self) -> dict[str, float]:
        """Per step, over this rank's action tokens (the mean over ranks is logged): ``teacher_kl``, the mean of the
        per-token reverse-KL estimate ``log pi_student - log pi_teacher``, and ``teacher_kl_above_1_share``, the share
        of action tokens where it exceeds 1 nat (the student gave its token more than e times the teacher's
        probability: where the teacher disagrees most)."""
        out, self._metrics = self._metrics, {}
        return out
