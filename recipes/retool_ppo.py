"""ReTool PPO recipe (placeholder until the recipe issue lands).

    accelerate launch recipes/retool_ppo.py

What is coming: multi-turn tool-call rollouts against a local Python sandbox, outcome rewards with
group-relative advantages and an asymmetric-clip PPO loss (ratio in [0.8, 1.28]), on an embedded
tiny model so the command runs on a CPU-only machine with no network.

Until then this script checks the core that is already here on synthetic trajectories: it builds
prefix-merged datums, packs them, and computes one exact token-mean PPO loss on a tiny locally-built
model, printing what it did. It does not train.
"""

from __future__ import annotations

import random

import torch

from trl_plugins.algos import aggregate, group_advantages, local_denominators, ppo_clip_loss
from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.packing import pack
from trl_plugins.types import StopReason, TokenSource, Trajectory, Turn, validate_trajectory


def synthetic_trajectory(rng: random.Random, group: int, slot: int) -> Trajectory:
    prompt = [rng.randrange(3, 200) for _ in range(rng.randint(4, 12))]
    turns, history = [], []
    for i in range(rng.randint(1, 3)):
        new = prompt if i == 0 else [1] + [rng.randrange(3, 200) for _ in range(rng.randint(2, 8))] + [2]
        sources = None if i == 0 else [TokenSource.GLUE] + [TokenSource.OBSERVATION] * (len(new) - 2) + [TokenSource.GLUE]
        completion = [rng.randrange(3, 200) for _ in range(rng.randint(2, 10))]
        turns.append(Turn(history + new, completion, [-rng.uniform(0.1, 2.0) for _ in completion], prompt_sources=sources))
        history = history + new + completion
    return Trajectory(turns=turns, group_id=group, sample_index=slot, stop_reason=StopReason.FINAL_ANSWER)


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    print("trl-plugins: the ReTool recipe is not here yet (see the open issues); checking the core instead.")
    rng = random.Random(0)
    trajs = [synthetic_trajectory(rng, g, s) for g in range(4) for s in range(4)]
    for t in trajs:
        validate_trajectory(t)
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in trajs])
    adv = group_advantages(rewards, torch.tensor([t.group_id for t in trajs]))
    datums = [build_datum(t, advantage=float(a), trajectory_index=i) for i, (t, a) in enumerate(zip(trajs, adv))]
    batches = pack([d.num_tokens for d in datums], strategy="optimal", max_items=4, max_padded_tokens=256)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    n_tok, n_seq = local_denominators(full.action_mask)
    total = 0.0
    for idx in batches:
        mb = collate(datums, idx, pad_token_id=0)
        logp = token_logprobs(model, mb.input_ids, mb.attention_mask, mb.target_ids)
        out = ppo_clip_loss(logp, mb.behaviour_logprobs, mb.advantages, mb.action_mask)
        loss = aggregate(out.per_token_loss, mb.action_mask, "token_mean", num_tokens=n_tok, num_sequences=n_seq)
        loss.backward()
        total += float(loss.detach())
    print(f"{len(trajs)} trajectories -> {len(datums)} datums, {int(n_tok)} loss tokens, "
          f"{len(batches)} micro-batches; token-mean PPO loss {total:.4f} (gradient accumulated, no update).")


if __name__ == "__main__":
    main()
