"""Contract checks of the pure seams: advantage estimators, policy losses and packers."""

from __future__ import annotations

import pickle
import random
from typing import Any, Mapping

from trl_plugins.contracts._base import BATCH_ROWS, BATCH_WIDTH, check, check_pickles, read_declarations, resolve_plugin
from trl_plugins.contracts.fakes import plan_violations, tree_plan_violations
from trl_plugins.protocols import as_advantage, as_policy_loss
from trl_plugins.types import AdvantageInput, AdvantageOutput, PolicyLossInput, PolicyLossOutput

__all__ = ["check_advantage_contract", "check_policy_loss_contract", "check_packer_contract", "turns_of"]


def turns_of(mask: Any) -> Any:
    """``(B, T)`` turn ids of a ``(B, T)`` action mask whose every run of 1s is one turn: 0, 1, ... along each row,
    -1 off the mask (the layout of ``PolicyLossInput.turn_ids``)."""
    import torch

    on = mask.bool()
    starts = on & ~torch.nn.functional.pad(on, (1, 0))[:, :-1]
    return torch.where(on, starts.long().cumsum(1) - 1, torch.full_like(mask, -1, dtype=torch.long))


def check_advantage_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """An advantage estimator: ``(N,)`` or ``(N, T)`` finite advantages, zero off the action mask, picklable.

    Estimators that declare ``needs_values`` get critic values and bootstrap fields on the input; every estimator
    gets turn ids and the behaviour and teacher log-probs (on-policy distillation) too.
    """
    import torch

    from trl_plugins.registry import ADVANTAGES

    label, est = resolve_plugin(ADVANTAGES, plugin, kwargs)
    read_declarations(as_advantage, est, label)  # needs_values, needs_groups: bools
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g) < 0.6).float()
    mask[:, -1] = 1
    inp = AdvantageInput(
        rewards=torch.randn(BATCH_ROWS, generator=g),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        action_mask=mask,
        values=torch.randn(BATCH_ROWS, BATCH_WIDTH, generator=g),
        bootstrap_mask=torch.tensor([0, 1, 0, 0, 1, 0]),
        bootstrap_values=torch.randn(BATCH_ROWS, generator=g),
        token_rewards=torch.zeros(BATCH_ROWS, BATCH_WIDTH),
        turn_ids=turns_of(mask),
        turn_state_ids=torch.where(mask.bool(), turns_of(mask) + 10 * torch.tensor([0, 0, 1, 0, 1, 2])[:, None], -1),
        behaviour_logprobs=-torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g, dtype=torch.float64) * mask,
        teacher_logprobs=-torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g, dtype=torch.float64) * 3 * mask,
    )
    out = est(inp)
    check(isinstance(out, AdvantageOutput), label, f"returned {type(out).__name__}, not AdvantageOutput")
    check(
        tuple(out.advantages.shape) in {(BATCH_ROWS,), (BATCH_ROWS, BATCH_WIDTH)},
        label,
        f"advantages of shape {tuple(out.advantages.shape)}",
    )
    check(bool(torch.isfinite(out.advantages).all()), label, "non-finite advantages")
    if out.advantages.dim() == 2:
        check(bool((out.advantages[mask == 0] == 0).all()), label, "non-zero advantage off the action mask")
    check_pickles(est, label)


def check_policy_loss_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """A policy loss: ``(B, T)`` finite per-token loss, 0 and zero-gradient off the mask, picklable. One that
    declares ``teacher_divergence`` gets a per-token divergence too, and its gradient may reach the action tokens
    through either input."""
    import torch

    from trl_plugins.registry import POLICY_LOSSES

    label, loss_fn = resolve_plugin(POLICY_LOSSES, plugin, kwargs)
    declared = read_declarations(
        as_policy_loss, loss_fn, label
    )  # needs_ref_logprobs, needs_entropy: bools; supports_is_weights optional
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g) < 0.5).float()
    logp = (-torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g) * 3).requires_grad_(True)
    inp = PolicyLossInput(
        logprobs=logp,
        behaviour_logprobs=logp.detach() + 0.3 * torch.randn(BATCH_ROWS, BATCH_WIDTH, generator=g),
        advantages=torch.randn(BATCH_ROWS, BATCH_WIDTH, generator=g) * mask,
        action_mask=mask,
        ref_logprobs=logp.detach() + 0.1,
        entropy=torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g),
        turn_ids=turns_of(mask),
    )
    divergence = None
    if declared.teacher_divergence is not None:
        divergence = (torch.rand(BATCH_ROWS, BATCH_WIDTH, generator=g) * mask).requires_grad_(True)
        inp.teacher_divergence = divergence
    out = loss_fn(inp)
    check(isinstance(out, PolicyLossOutput), label, f"returned {type(out).__name__}, not PolicyLossOutput")
    loss = out.per_token_loss
    check(
        tuple(loss.shape) == (BATCH_ROWS, BATCH_WIDTH) and bool(torch.isfinite(loss).all()),
        label,
        "per-token loss not a finite (B, T) tensor",
    )
    check(bool((loss[mask == 0] == 0).all()), label, "non-zero loss off the action mask")
    loss.sum().backward()
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (logp, divergence) if x is not None]
    check(all(bool((grad[mask == 0] == 0).all()) for grad in grads), label, "masked tokens receive gradient")
    check(sum(float(grad[mask == 1].abs().sum()) for grad in grads) > 0, label, "no gradient on the action tokens")
    check_pickles(loss_fn, label)


def check_packer_contract(plugin: Any) -> None:
    """A packer: a valid partition within both limits, the same micro-batch count on every rank; one that declares
    ``supports_prefix_trees``, also with ``prefix_trees=``: the shared-prefix layout's area within the budget and every
    tree that fits one micro-batch kept together."""
    from trl_plugins.registry import PACKERS

    label = f"packer {plugin!r}" if isinstance(plugin, str) else f"packer {plugin.__name__}"
    packer = PACKERS.get(plugin) if isinstance(plugin, str) else plugin
    rng = random.Random(2)
    for world_size in (1, 3):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(0, 60))]
        plan = packer(lengths, max_items=7, max_padded_tokens=1500, world_size=world_size)
        problems = plan_violations(plan, lengths, 7, 1500, world_size)
        check(not problems, label, f"world_size {world_size}: {problems}")
    declared = getattr(packer, "supports_prefix_trees", False)
    check(isinstance(declared, bool), label, f"declares supports_prefix_trees={declared!r}; it must be a bool")
    if declared:
        # Groups of 1-6 items sharing 5-40 leading tokens, and lone items; budgets that cut some trees.
        from trl_plugins.packing import prefix_trees

        for world_size in (1, 3):
            rows = []
            for _ in range(rng.randint(0, 12)):
                shared = [rng.randrange(3, 50) for _ in range(rng.randint(5, 40))]
                rows += [
                    shared + [rng.randrange(3, 50) for _ in range(rng.randint(1, 60))] for _ in range(rng.randint(1, 6))
                ]
            trees = prefix_trees(rows)
            plan = packer(
                [len(r) for r in rows], max_items=7, max_padded_tokens=300, world_size=world_size, prefix_trees=trees
            )
            problems = tree_plan_violations(plan, rows, trees, 7, 300, world_size)
            check(not problems, label, f"with prefix_trees, world_size {world_size}: {problems}")
    check(
        pickle.loads(pickle.dumps(packer)) is packer, label, "does not pickle by reference (define it at module level)"
    )
