"""PPO-family maths: advantages, policy/value losses, KL estimators, aggregation, sampler/trainer
importance weights, dynamic sampling's choice of groups. Pure functions.

This package imports only torch, numpy, the standard library and ``trl_plugins.types`` /
``trl_plugins.registry`` (a test enforces it).
"""

from trl_plugins.algos.advantages import (
    DrGRPOAdvantage,
    GAEAdvantage,
    GroupAdvantage,
    OnPolicyDistillationAdvantage,
    RLOOAdvantage,
    TurnGroupAdvantage,
    gae_advantages,
    group_advantages,
    masked_whiten,
    rloo_advantages,
    teacher_advantages,
    turn_group_advantages,
)
from trl_plugins.algos.aggregation import aggregate, local_denominators
from trl_plugins.algos.dynamic_sampling import choose_groups, draw_rows, informative_groups, rank_share, refill_size
from trl_plugins.algos.losses import (
    GeneralizedJSDLoss,
    PPOClipLoss,
    clipped_value_loss,
    kl_estimate,
    kl_gradient_problem,
    ppo_clip_loss,
)
from trl_plugins.algos.mismatch import importance_weights
from trl_plugins.algos.span_losses import GSPOLoss, TurnPPOLoss, span_ratio_loss
from trl_plugins.algos.stats import importance_ratios, quantiles

__all__ = [
    "DrGRPOAdvantage",
    "GAEAdvantage",
    "GroupAdvantage",
    "RLOOAdvantage",
    "gae_advantages",
    "group_advantages",
    "masked_whiten",
    "rloo_advantages",
    "TurnGroupAdvantage",
    "turn_group_advantages",
    "OnPolicyDistillationAdvantage",
    "teacher_advantages",
    "aggregate",
    "local_denominators",
    "choose_groups",
    "draw_rows",
    "informative_groups",
    "rank_share",
    "refill_size",
    "PPOClipLoss",
    "GeneralizedJSDLoss",
    "clipped_value_loss",
    "kl_estimate",
    "kl_gradient_problem",
    "ppo_clip_loss",
    "GSPOLoss",
    "TurnPPOLoss",
    "span_ratio_loss",
    "importance_weights",
    "importance_ratios",
    "quantiles",
]
