"""Tiny trainer runs: the config and dataset most trainer tests start from, and the toy rewards, rollouts and tools
they (and tests/dist_trainer_run.py) name."""

from __future__ import annotations

import json

import torch

from trl_plugins.rollout.backends import BackendBase
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.types import Trajectory


class TokenReward:
    """A test reward that depends on what was sampled (so advantages are not all zero)."""

    def __call__(self, trajectory: Trajectory, example) -> float:
        return (sum(trajectory.turns[-1].completion_ids) % 7) / 7.0


class SampleIndexReward:
    """A test reward that differs between a group's samples whatever they sampled (``0.1 x`` the sample's index), so
    that every group has an advantage to train on."""

    def __call__(self, trajectory: Trajectory, example) -> float:
        return 0.1 * trajectory.sample_index


class ConstantReward:
    """A reward of 1.0 whatever was sampled."""

    def __call__(self, trajectory: Trajectory, example) -> float:
        return 1.0


def tiny_config(tmp_path, **overrides):
    """The two-step CPU config most trainer tests start from, with ``overrides`` on top."""
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=5e-3,
        rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 12, "max_trajectory_tokens": 600},
        reward_components=["length"],
        max_padded_tokens_per_micro_batch=4000,
        max_items_per_micro_batch=2,
        seed=0,
        disable_tqdm=True,
        bf16=False,
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


def tiny_dataset(n=4):
    """``n`` rows of 'What is i + i?' with their answers."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)])


class _PerRowSeedBackend(BackendBase):
    """Samples every row on its own, seeded by its prompt (and its place among identical prompts):
    a trajectory's tokens no longer depend on which rank or batch it was sampled in."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sampling, self.logprob_source = inner.sampling, inner.logprob_source

    def session(self):
        return self.inner.session()

    def generate(self, prompts, max_new_tokens, *, seeds):
        from collections import Counter

        from trl_plugins.rollout import derive_seed

        seen, out = Counter(), []
        for prompt, budget in zip(prompts, max_new_tokens):
            key = tuple(prompt)
            out += self.inner.generate([prompt], [budget], seeds=[derive_seed(len(prompt), sum(prompt), seen[key])])
            seen[key] += 1
        return out


class BrokenWorldRollout:
    """multi_turn whose world fails every trajectory, as an agent that cannot reach its endpoint does."""

    def __init__(self, **kwargs) -> None:
        from trl_plugins.rollout import MultiTurnRollout

        self.inner = MultiTurnRollout(**kwargs)
        self.token_budget = self.inner.token_budget

    def __call__(self, request):
        from trl_plugins.types import StopReason

        result = self.inner(request)
        for traj in result.trajectories:
            traj.stop_reason, traj.error = (
                StopReason.ENVIRONMENT_ERROR,
                "ConnectionRefusedError: 404 on /v1/chat/completions",
            )
        return result


class RankBrokenWorldRollout(BrokenWorldRollout):
    """multi_turn whose world fails unevenly over 2 ranks (tests/dist_trainer_run.py --broken_world): on rank 1 every
    trajectory, as an agent posting to a URL of its own does; on rank 0 only the first, with another error."""

    def __call__(self, request):
        import os

        from trl_plugins.types import StopReason

        result = self.inner(request)
        rank = int(os.environ.get("RANK", "0"))
        for i, traj in enumerate(result.trajectories):
            if rank == 1:
                traj.stop_reason = StopReason.ENVIRONMENT_ERROR
                traj.error = (
                    f"the agent failed: NotFoundError: Error code: 404 - no such endpoint '/q{i}/chat/completions'"
                )
            elif i == 0:
                traj.stop_reason, traj.error = StopReason.ENVIRONMENT_ERROR, "the agent ran past agent_time_limit_s=1.0"
        return result


class PerRowSeedRollout:
    """multi_turn with a per-row-seeded backend (for comparing runs across world sizes)."""

    def __init__(self, **kwargs) -> None:
        from trl_plugins.rollout import MultiTurnRollout

        self.inner = MultiTurnRollout(**kwargs)
        self.token_budget = self.inner.token_budget

    def __call__(self, request):
        request.backend = _PerRowSeedBackend(request.backend)
        return self.inner(request)


class ScriptedToolRollout:
    """A rollout plugin whose policy always calls the tool once, then answers \\boxed{<number>} with a number
    that depends on the sample (so groups have different rewards). Generation is scripted; the trainer
    still updates the tiny model on those tokens."""

    token_budget = 600
    code = "print(1)"
    """The code of every call."""

    def __init__(self, **kwargs):
        from trl_plugins.rollout import MultiTurnRollout

        self.inner = MultiTurnRollout(max_turns=3, max_assistant_tokens=40, max_trajectory_tokens=600, tool_retries=0)

    def __call__(self, request):
        from trl_plugins.rollout import ScriptedBackend

        tok = request.chat.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")

        def script(prompt, seed):
            # The answer comes from the turn's seed, not from a call counter: turns reach the backend in the
            # order their tools finish, which timing decides.
            text = tok.decode(prompt)
            if "<tool_response>" not in text:
                call = {"name": "code_interpreter", "arguments": {"code": self.code}}
                body = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            else:
                body = f"\\boxed{{{seed % 3}}}"
            return tok(body, add_special_tokens=False)["input_ids"] + [end]

        request.backend = ScriptedBackend(script, stop_token_ids=request.chat.stop_token_ids, with_seed=True)
        return self.inner(request)


class SlowToolRollout(ScriptedToolRollout):
    """ScriptedToolRollout whose calls take a second in the real sandbox (so a signal finds calls in flight)."""

    code = "import time\ntime.sleep(1.0)\nprint(1)"

    def __init__(self, **kwargs):
        from trl_plugins.rollout import MultiTurnRollout

        self.inner = MultiTurnRollout(max_turns=3, max_assistant_tokens=120, max_trajectory_tokens=600, tool_retries=0)


class FlakyCodeTool:
    """A code interpreter stand-in whose every 3rd call fails in the infrastructure."""

    name = "code_interpreter"

    def __init__(self):
        self.calls = 0

    def schema(self):
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        return CodeInterpreter().schema()

    async def __call__(self, arguments):
        from trl_plugins.tools.base import ToolOutput

        self.calls += 1
        if self.calls % 3 == 0:
            return ToolOutput(text="", ok=False, infra_error="SandboxError: could not start")
        return ToolOutput(text="1\n", ok=True)


class PickyVerifier:
    """Scores the boxed digit; raises on answer 2 (a verifier bug); hangs on answer 1 of question 0."""

    def __call__(self, trajectory, example):
        import time

        digit = int(trajectory.turns[-1].text.split("\\boxed{")[1][0])
        if digit == 2:
            raise ValueError("cannot parse answer")
        if digit == 1 and trajectory.group_id == 0:
            time.sleep(5)
        return float(digit)


def tiny_trainer(tmp_path, n_rows=8, **overrides):
    """A seeded tiny-model trainer over ``n_rows`` of the tiny dataset, 8 rows per device unless overridden."""
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    torch.manual_seed(0)
    model = build_tiny_model(tok)
    overrides.setdefault("per_device_train_batch_size", 8)  # 4 questions x 2 per step: 2 steps per epoch of 8 rows
    trainer = MultiTurnGRPOTrainer(
        model,
        tiny_config(tmp_path, **overrides),
        train_dataset=tiny_dataset(n_rows),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )
    return trainer
