"""A tiny third-party plugin distribution, discovered through its entry points in tests."""

from dataclasses import dataclass


@dataclass
class LengthPenalty:
    """A reward component: minus ``coef`` per completion token."""

    coef: float = 0.01

    def __call__(self, num_tokens: int) -> float:
        return -self.coef * num_tokens


def one_per_batch(lengths, *, max_items, max_padded_tokens, world_size=1):
    """A packer that puts every item in its own micro-batch (round-robin over ranks)."""
    from trl_plugins.types import PackPlan

    ranks = [[] for _ in range(world_size)]
    for i in range(len(lengths)):
        ranks[i % world_size].append([i])
    most = max(len(r) for r in ranks)
    return PackPlan(ranks=[r + [[]] * (most - len(r)) for r in ranks])
