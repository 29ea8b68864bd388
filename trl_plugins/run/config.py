"""The configuration of a run (and of :class:`~trl_plugins.trainers.multi_turn_trainer.MultiTurnGRPOTrainer`): TRL's
``GRPOConfig`` plus the plugins, each field checked once, when the config is built (``__post_init__``): our own
fields for their types and ranges, TRL's fields honoured, mapped onto the plugins' settings or refused
(:mod:`~trl_plugins.run.trl_fields`). What needs the plugins built is checked by :func:`trl_plugins.run.resolve_run`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from trl_plugins.algos.losses import kl_gradient_problem
from trl_plugins.run.parallelism import take_over_parallelism_config
from trl_plugins.run.plugins import SettingError, plugin_params
from trl_plugins.run.settings import (
    AsyncRollouts,
    Distillation,
    DynamicSampling,
    Features,
    LongTrajectories,
    MismatchCorrection,
)
from trl_plugins.run.trl_fields import apply_trl_fields
from trl_plugins.types import AggregationMode, KLEstimator

__all__ = ["MultiTurnGRPOConfig"]


_REENTRANT = (
    "shared_prefix=True needs non-reentrant activation checkpointing (the prefix's key/value states must carry "
    "the branches' gradient back): set activation_checkpointing_kwargs={'use_reentrant': False} (TRL forces "
    "reentrant for PEFT under ZeRO-3), activation_checkpointing=False, or shared_prefix=False."
)


def _as_dict(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{name} must be a JSON object (e.g. '{{\"max_turns\": 4}}'), got {value!r}: {exc}"
            ) from exc
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping, got {type(value).__name__}.")
    return value


@dataclass
class MultiTurnGRPOConfig(GRPOConfig):
    """GRPOConfig plus the plugins of a multi-turn tool-calling run.

    ``num_generations`` is the group size: each question is rolled out that many times on one rank.
    ``per_device_train_batch_size`` counts trajectories per rank per step and must be a multiple of
    it. One step is one rollout batch and one optimizer update (``gradient_accumulation_steps`` and
    ``steps_per_generation`` stay 1; ``num_iterations > 1`` reuses a rollout for more updates).
    The ``*_kwargs`` fields take a dict or a JSON string (for the command line).
    """

    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing (transformers 5). Unset with "
            "activation_checkpointing unset: activation checkpointing is on (TRL's default), set under its "
            "new name so that transformers does not warn."
        },
    )
    rollout: str = field(default="multi_turn", metadata={"help": "Rollout plugin (registry name or 'pkg.mod:attr')."})
    rollout_kwargs: dict | str | None = field(default=None, metadata={"help": "Rollout budgets, e.g. max_turns."})
    tools: list[str] = field(default_factory=lambda: ["code_interpreter"], metadata={"help": "Tool plugins."})
    tool_kwargs: dict | str | None = field(default=None, metadata={"help": "Per-tool settings: {tool: {...}}."})
    reward_components: list[str] = field(default_factory=list, metadata={"help": "Reward-component plugins."})
    reward_component_weights: list[float] | None = field(default=None, metadata={"help": "Weights (default 1 each)."})
    reward_component_kwargs: dict | str | None = field(default=None, metadata={"help": "Per-component settings."})
    advantage: str = field(default="group", metadata={"help": "Advantage estimator plugin."})
    advantage_kwargs: dict | str | None = field(default=None, metadata={"help": "Advantage settings."})
    policy_loss: str = field(default="ppo_clip", metadata={"help": "Policy-loss plugin."})
    policy_loss_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Policy-loss settings (clip_low, clip_high, ...)."}
    )
    aggregation: str = field(default="token_mean", metadata={"help": "Loss aggregation mode."})
    norm_length: float | None = field(default=None, metadata={"help": "Constant length for seq_mean_token_sum_norm."})
    packer: str = field(default="optimal", metadata={"help": "Micro-batch packer."})
    max_items_per_micro_batch: int = field(default=32, metadata={"help": "Rows per micro-batch."})
    max_padded_tokens_per_micro_batch: int = field(default=64_000, metadata={"help": "Padded area per micro-batch."})
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Micro-batches without padding: a micro-batch's datums are concatenated into one sequence with "
            "positions restarting per datum, and attention stays within each datum; "
            "max_padded_tokens_per_micro_batch then budgets tokens. None (auto): on when the policy's "
            "attention is flash-attention's variable-length kernel (flash_attention_2/3), off for "
            "sdpa/eager, whose block-diagonal mask costs the square of the packed length (measured slower on "
            "CPU: docs/benchmarks.md). Checked once per model at the first update (attention that ignores "
            "packed positions is refused). False: right-padded micro-batches, budgeted by padded area."
        },
    )
    shared_prefix: bool | None = field(
        default=None,
        metadata={
            "help": "Forward each prefix that datums share (the prompt of a group's trajectories) once per "
            "micro-batch: the prefix's key/value states are kept and each datum's remaining tokens attend to "
            "them, gradients flowing back into the prefix; the packer keeps a group together (packers that "
            "declare supports_prefix_trees; others are called as before and sharing is found within their "
            "micro-batches). Log-probs, values and gradients equal the padded layout's "
            "(tests/test_shared_prefix.py). None (auto): on for sdpa and eager attention with right-padded "
            "micro-batches (measured faster on CPU: docs/benchmarks.md), off with padding_free, "
            "flash-attention or reentrant activation checkpointing. Checked once per model at the first "
            "update (a model whose forward ignores the states is refused). True keeps padding_free's auto "
            "off (the two layouts are exclusive); True with padding_free=True, or with reentrant activation "
            "checkpointing, is refused."
        },
    )
    rebalance_ranks: bool = field(
        default=False,
        metadata={
            "help": "Gather every rank's datums and plan them across ranks with the packer ('balanced' is made for it)."
        },
    )
    max_context_tokens: int | None = field(
        default=None, metadata={"help": "Training context limit (default: rollout budget)."}
    )
    truncated_policy: str = field(
        default="wrong",
        metadata={
            "help": "Truncated trajectories: 'wrong' (an outcome: scored by the reward components, which treat them "
            "as wrong; with a critic their return is that reward, nothing bootstrapped), 'mask' (no "
            "advantage, left out of group statistics and the loss) or 'bootstrap' (a time limit, not an "
            "outcome: with a critic only, their outcome reward is not counted and GAE bootstraps from the "
            "critic's value of the state after their last token)."
        },
    )
    reward_time_limit_s: float | None = field(
        default=30.0,
        metadata={
            "help": "Time limit of one reward component on one trajectory; past it the trajectory is a "
            "verifier_error (None: no limit)."
        },
    )
    max_verifier_error_rate: float = field(
        default=0.5,
        metadata={
            "help": "Stop the run when more than this share of a step's trajectories (all ranks) fail a reward "
            "component: a broken verifier must not train silently."
        },
    )
    max_environment_error_rate: float = field(
        default=0.5,
        metadata={
            "help": "Stop the run when more than this share of a step's trajectories (all ranks; cancelled ones not "
            "counted) end environment_error: the rollout's world (an agent, a tool, a sandbox) looks broken, "
            "so the run stops on every rank, naming the most common error over the ranks and its usual "
            "cause, instead of skipping every step (1.0: never)."
        },
    )
    max_steps_without_update: int = field(
        default=20,
        metadata={
            "help": "Stop the run after this many steps in a row that made no policy update (constant rewards, every "
            "trajectory left out, every group filtered; a critic's warm-up does not count). 0: never stop "
            "for it. Either way, a run that reaches its end without one update raises NoPolicyUpdate after "
            "it (the recipe: exits 1 after its final save and summary). docs/training.md."
        },
    )
    min_valid_group_fraction: float = field(
        default=0.5,
        metadata={
            "help": "A group in which fewer than this share of members survived the infrastructure (no "
            "environment_error / verifier_error) is left out whole."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: a group whose members trained on all got the same "
            "dynamic_sampling_metric (all right, all wrong) is dropped, and fresh groups (rows drawn at "
            "random from the training set) are rolled out until the step holds its number of groups, or "
            "dynamic_sampling_max_groups is reached (the step then trains on the groups it kept). The choice "
            "is global over the ranks. docs/training.md."
        },
    )
    dynamic_sampling_metric: str = field(
        default="reward",
        metadata={
            "help": "What dynamic sampling compares within a group: 'reward' (the weighted total) or the name of one "
            "reward component (e.g. 'correct', DAPO's accuracy)."
        },
    )
    dynamic_sampling_max_groups: float = field(
        default=3.0,
        metadata={
            "help": "The most groups dynamic sampling rolls out in a step, as a multiple of the step's groups (the "
            "first round included; >= 1)."
        },
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "On-policy distillation: a local teacher model (folder or checkpoint), loaded once and placed "
            "like the reference model, or an OpenAI-compatible server's base URL (http://host:port/v1) that returns "
            "prompt log-probs (vLLM); it must use the student's tokenizer. Its log-prob of each sampled action token "
            "is the student's per-token signal through the 'opd' advantage estimator, or its whole next-token "
            "distribution through the 'jsd' loss (a local teacher) (docs/training.md)."
        },
    )
    teacher_route_field: str | None = field(
        default=None,
        metadata={
            "help": "Several teachers: teacher_model_name_or_path as a mapping {value: teacher} (JSON) and this, the "
            "dataset row's field whose value picks each row's teacher (verl routes by data_source)."
        },
    )
    teacher_privileged_field: str | None = field(
        default=None,
        metadata={
            "help": "Self-distillation: the dataset row's field (e.g. 'answer') the teacher is shown and the student "
            "is not: the teacher scores the student's tokens under a first prompt whose last user message holds it "
            "(teacher_privileged_template); the teacher is typically the student's own starting model."
        },
    )
    teacher_privileged_template: str = field(
        default="{content}\n\n(Reference answer, for the teacher only: {value})",
        metadata={"help": "How teacher_privileged_field joins the teacher's last user message ({content}, {value})."},
    )
    teacher_request_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "A server teacher: the deadline of each request for prompt log-probs (seconds); a request past "
            "it fails the step naming the server."
        },
    )
    vllm_importance_sampling_mode: str | None = field(
        default=None,
        metadata={
            "help": "How the importance weights of the sampler/trainer mismatch correction are bounded: "
            "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's modes). None: TRL's "
            "sequence_mask, or token_truncate with async_rollouts' decoupled objective (a per-token weight, "
            "as AReaL's: a whole sequence's ratio after an update is often outside the bounds)."
        },
    )
    async_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Roll out the next steps' batches while this one trains: a generation replica of the policy (a "
            "process of its own, weights pushed after each update) samples up to max_staleness optimizer "
            "steps behind the weights being updated; the update corrects for it (off_policy_objective). 1 "
            "process, DDP or ZeRO-2/3, one machine or several, full or LoRA; HF generate or continuous "
            "batching on the CPU, or a vLLM server (no replica: rollouts on threads against it); the rest is "
            "refused at start-up. docs/training.md."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "async_rollouts: the most optimizer steps between the weights that sampled a token and the "
            "weights it trains (the replica waits rather than exceed it; nothing is dropped). 0: the "
            "synchronous loop, bit for bit."
        },
    )
    off_policy_objective: str = field(
        default="decoupled",
        metadata={
            "help": "async_rollouts: 'decoupled' - the PPO ratio against the proximal policy (the weights at the "
            "start of this update, recomputed by a forward) and the behaviour policy only in a truncated "
            "importance weight pi_prox / pi_behaviour (the vllm_importance_sampling_* bounds); 'behaviour' - "
            "the ratio against the behaviour log-probs directly (no forward; the clip then bounds the whole "
            "drift). docs/reference_equivalence.md."
        },
    )
    async_streaming: bool | None = field(
        default=None,
        metadata={
            "help": "async_rollouts: the replica rolls out every batch it may (up to max_staleness ahead) at once, "
            "so a batch's trajectories start while the one before finishes its stragglers and throughput "
            "follows the average trajectory, not the longest; weights pushed during a rollout are loaded "
            "between generate calls and each turn records the step that sampled it. False: one batch after "
            "another (overlap with the update only). None: on with HF generate; continuous batching runs one "
            "batch at a time (True is refused there)."
        },
    )
    async_probe_tolerance: float | None = field(
        default=None,
        metadata={
            "help": "async_rollouts tripwire: after each weight push the replica's log-probs of a fixed probe "
            "sequence must match the trainer's within this (max abs difference per token); beyond it the run "
            "stops. None: 1e-3 for fp32 weights, 5e-2 for bf16/fp16. A negative value turns the check off."
        },
    )
    async_max_logprob_gap: float | None = field(
        default=2.0,
        metadata={
            "help": "async_rollouts tripwire (decoupled objective): the run stops when a step's mean |log pi_prox - "
            "log pi_behaviour| over its trained tokens (all ranks) exceeds this. None: off."
        },
    )
    async_min_importance_ess: float | None = field(
        default=0.2,
        metadata={
            "help": "async_rollouts tripwire (decoupled objective): the run stops when the effective sample size of "
            "a step's untruncated importance weights pi_prox / pi_behaviour, (sum w)^2 / (n sum w^2) over "
            "its trained tokens (all ranks), falls below this share. None: off."
        },
    )
    async_replica_threads: int | None = field(
        default=None,
        metadata={
            "help": "async_rollouts: torch threads of the generation replica process (None: half the cores, at least "
            "1)."
        },
    )
    drop_zero_advantage: bool = field(
        default=True,
        metadata={
            "help": "Skip the forward/backward of datums whose advantage is 0 (they still count in the loss "
            "denominators, so the gradient is unchanged; off automatically when a KL or entropy term is in "
            "the loss)."
        },
    )
    logprob_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Positions per chunk of the output projection when log-probs and entropies are computed (every "
            "pass: update, old/reference/proximal log-probs, replay): the forward stops at the final hidden "
            "states and at most this many positions' vocabulary-wide logits exist at once (recomputed per "
            "chunk in the backward). None: chosen from the vocabulary so a chunk's float32 tensors take "
            "about logprob_chunk_memory_mb. docs/training.md, long trajectories."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ranks one datum's tokens are split over in the policy update's forward and backward "
            "(DeepSpeed's Ulysses attention: each rank of a group of consecutive ranks forwards 1/N of the "
            "positions, the attention 1/N of the heads over all of them); data parallelism over the world "
            "size / N groups. Also set by TRL's parallelism_config=ParallelismConfig(sp_size=N, "
            "sp_backend='deepspeed') or an accelerate config's parallelism_config. Needs DeepSpeed, a world "
            "size that N divides, attention and key/value heads that split over N, sdpa or flash attention "
            "and a token-level policy loss (checked before the model loads). The update then packs one datum "
            "per micro-batch; the no-gradient passes, the critic, the evaluation and the rollouts run whole "
            "on each rank. 1: off. docs/training.md, long trajectories."
        },
    )
    logprob_chunk_memory_mb: int = field(
        default=256,
        metadata={
            "help": "With logprob_chunk_size=None: the memory (MiB) one chunk's vocabulary-wide float32 tensors may "
            "take (4 copies of chunk x vocabulary); Qwen2.5's vocabulary gives 110 positions."
        },
    )
    kl_estimator: str = field(
        default="k3", metadata={"help": "Estimator of KL(policy || reference) when beta > 0: k1, k2 or k3."}
    )
    mismatch_correction_scope: str = field(
        default="foreign",
        metadata={
            "help": "Which rollout batches get the sampler/trainer mismatch correction (TRL's "
            "vllm_importance_sampling_correction, on by default): 'foreign' - batches with trajectories "
            "whose log-probs are not the trainer's own (logprob_source other than temperature_scaled, e.g. "
            "vLLM's processed); 'all' - every batch, HF generate included (old log-probs from a trainer "
            "forward). docs/training.md."
        },
    )
    kl_penalty: str = field(
        default="loss",
        metadata={
            "help": "Where the reference KL (beta > 0) enters: 'loss' (GRPO: beta * KL per action token, aggregated "
            "like the policy loss) or 'reward' (classic PPO: a 'kl_penalty' reward component -sum_t KL_t "
            "with weight beta)."
        },
    )
    critic_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": "Learning rate of the critic's own AdamW (critic-based advantages such as 'gae'; default: "
            "learning_rate)."
        },
    )
    critic_optim: str = field(
        default="adamw", metadata={"help": "Optimizer of the critic: 'adamw' or 'sgd' (weight_decay applies to both)."}
    )
    critic_warmup_steps: int = field(
        default=0, metadata={"help": "First steps in which only the critic learns (the policy update is skipped)."}
    )
    vf_clip: float = field(
        default=0.2,
        metadata={
            "help": "Clip of the value loss: values move at most this far from their rollout-time values per update."
        },
    )
    vf_coef: float = field(
        default=1.0,
        metadata={"help": "Value-loss coefficient (scales the critic's loss; the critic has its own optimizer)."},
    )
    vllm_max_concurrent_requests: int = field(
        default=64,
        metadata={
            "help": "vllm_mode='server': turns each rank has in flight at the server at once (each turn is its own "
            "request; the server batches them)."
        },
    )
    continuous_batching_keep_cache: bool = field(
        default=False,
        metadata={
            "help": "use_transformers_continuous_batching: keep the paged KV cache (and on a GPU its captured CUDA "
            "graphs) allocated between rollouts - faster rollouts, less memory left for training. Off: freed "
            "after each rollout."
        },
    )
    stop_tokens: list[str] | None = field(
        default=None,
        metadata={
            "help": "Token strings that end a turn (default: from the chat template: eos, the token ending a call "
            "turn such as <|im_end|>, <|observation|> or <|call|>, and the one ending a final answer)."
        },
    )
    system_prompt: str | None = field(default=None, metadata={"help": "System message put before every question."})
    final_answer_pattern: str | None = field(
        default=None,
        metadata={
            "help": "Regular expression that marks a final answer in an assistant turn without a tool call (e.g. "
            "'\\\\boxed\\{'); such a turn that does not match ends the trajectory as no_tool_call. None: "
            "every turn without a tool call is the final answer."
        },
    )
    progress_rollout: bool = field(
        default=True, metadata={"help": "Progress bar of trajectories within a rollout (off with disable_tqdm)."}
    )
    trajectory_table_steps: int = field(
        default=10, metadata={"help": "Log a W&B table of sample trajectories every N steps (0: never)."}
    )
    trajectory_table_rows: int = field(default=8, metadata={"help": "Trajectories per table."})
    replay_every_steps: int = field(
        default=0,
        metadata={
            "help": "Every N steps recompute, with the weights that sampled them, the log-probs of up to 2 of each "
            "rank's trajectories sampled at this step and log the gap to their behaviour log-probs "
            "(replay/logprob_gap_max, replay/logprob_gap_mean, over all ranks): a tripwire for "
            "sampler/trainer drift. 0: off. docs/replay.md."
        },
    )
    viewer_steps: int = field(
        default=10,
        metadata={
            "help": "Every N steps write a trajectory viewer page: output_dir/trajectories/step-<N>.html (a "
            "self-contained HTML page, each token coloured by provenance with its log-prob, advantage and "
            "loss mask on hover) and step-<N>.json (the saved batch: trajectories and their datums; 'python "
            "-m trl_plugins.viewer' draws it again), also logged to W&B as HTML when W&B is on (0: never). "
            "docs/viewer.md."
        },
    )
    viewer_trajectories: int = field(
        default=8,
        metadata={
            "help": "Trajectories per viewer page: the first N of the main process's batch (whole groups when N is a "
            "multiple of num_generations)."
        },
    )
    resume_fallback: bool = field(
        default=False,
        metadata={
            "help": "When the checkpoint to resume from is damaged (a truncated or missing file, found before "
            "anything loads), resume from the previous complete checkpoint instead (the damaged one is moved "
            "to damaged-checkpoint-N-<time>/). Off: refuse, naming the damaged file."
        },
    )
    skip_startup_checks: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Plugins whose contract check the recipe does not run at start-up (before any model loads, on a "
            "pickled copy): reward components, the advantage or the policy loss by their configured names, "
            "or 'all'. For an expensive or sampled check: a remote or model judge."
        },
    )
    console_metrics: str = field(
        default="compact",
        metadata={
            "help": "What each logging step prints: 'compact' (one line: step, reward, components, tool calls, loss, "
            "KL, tokens/s, step time, memory) or 'full' (the HF Trainer's dict of every metric). "
            "metrics.jsonl and the loggers get every metric either way."
        },
    )

    def __post_init__(self) -> None:
        if not hasattr(self, "activation_checkpointing"):  # transformers < 5.20 (vLLM's interpreter): the old name
            if self.gradient_checkpointing is None:
                self.gradient_checkpointing = True  # TRL's default
        elif self.gradient_checkpointing is None and self.activation_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default; its old name would raise a FutureWarning
        take_over_parallelism_config(self)  # before TRL's, which refuses sequence parallelism
        super().__post_init__()
        self.rollout_kwargs = _as_dict(self.rollout_kwargs, "rollout_kwargs")
        self.tool_kwargs = _as_dict(self.tool_kwargs, "tool_kwargs")
        self.chat_template_kwargs = _as_dict(self.chat_template_kwargs, "chat_template_kwargs") or None
        self.reward_component_kwargs = _as_dict(self.reward_component_kwargs, "reward_component_kwargs")
        self.advantage_kwargs = _as_dict(self.advantage_kwargs, "advantage_kwargs")
        self.policy_loss_kwargs = _as_dict(self.policy_loss_kwargs, "policy_loss_kwargs")
        AggregationMode(self.aggregation)
        if self.max_steps == 0:
            raise SettingError(
                "max_steps",
                "0 steps would train none, yet transformers would train one; give the number "
                "of steps (or -1 to train num_train_epochs).",
            )
        if self.truncated_policy not in ("wrong", "mask", "bootstrap"):
            raise ValueError(f"truncated_policy must be 'wrong', 'mask' or 'bootstrap', got {self.truncated_policy!r}.")
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(
                f"per_device_train_batch_size ({self.per_device_train_batch_size}) counts trajectories per rank and "
                f"must be a multiple of num_generations ({self.num_generations}), so that every group is rolled out "
                f"on one rank."
            )
        if self.reward_component_weights is None:
            self.reward_component_weights = [1.0] * len(self.reward_components)
        if len(self.reward_component_weights) != len(self.reward_components):
            raise ValueError(
                f"{len(self.reward_components)} reward_components but {len(self.reward_component_weights)} "
                f"reward_component_weights; give one weight per component."
            )
        if not self.reward_components:
            raise ValueError("reward_components is empty: name at least one reward-component plugin.")
        for name in ("max_items_per_micro_batch", "max_padded_tokens_per_micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.vllm_max_concurrent_requests < 1:
            raise ValueError(f"vllm_max_concurrent_requests must be >= 1, got {self.vllm_max_concurrent_requests}.")
        if self.vllm_max_concurrent_requests != 64 and not (self.use_vllm and self.vllm_mode == "server"):
            raise ValueError(
                f"vllm_max_concurrent_requests={self.vllm_max_concurrent_requests} is set but only server mode "
                f"uses it: set use_vllm=True and vllm_mode='server', or drop it."
            )
        self._map_kl_and_entropy()
        async_rollouts = AsyncRollouts.from_config(self)  # None: off, or max_staleness=0 (the synchronous loop)
        if self.vllm_importance_sampling_mode is None:
            decoupled = async_rollouts is not None and async_rollouts.decoupled
            truncate = decoupled and self.vllm_importance_sampling_correction
            self.vllm_importance_sampling_mode = "token_truncate" if truncate else "sequence_mask"
        mismatch_correction = MismatchCorrection.from_config(self, async_rollouts)
        self._check_continuous_batching()
        if self.shared_prefix and self.padding_free:
            raise ValueError(
                "shared_prefix=True and padding_free=True are two layouts of a micro-batch: set one of them "
                "(shared_prefix forwards each shared prompt once; padding_free drops the padding)."
            )
        if self.shared_prefix and self.reentrant_checkpointing():
            raise ValueError(_REENTRANT)
        if self.padding_free:
            from trl_plugins.packing import supports_padding_free

            if not supports_padding_free(self.packer):
                raise ValueError(
                    f"padding_free=True, but packer {self.packer!r} budgets padded area only (it does not "
                    f"declare supports_padding_free): use ffd, optimal or balanced, or set padding_free=False."
                )
        if not all(
            0.0 <= x <= 1.0
            for x in (self.max_verifier_error_rate, self.max_environment_error_rate, self.min_valid_group_fraction)
        ):
            raise ValueError(
                f"max_verifier_error_rate, max_environment_error_rate and min_valid_group_fraction are shares in "
                f"[0, 1]; got {self.max_verifier_error_rate}, {self.max_environment_error_rate}, "
                f"{self.min_valid_group_fraction}."
            )
        if self.max_steps_without_update < 0:
            raise ValueError(
                f"max_steps_without_update must be >= 0 (0: never stop for it), got {self.max_steps_without_update}."
            )
        features = Features(
            async_rollouts=async_rollouts,
            dynamic_sampling=DynamicSampling.from_config(self),
            mismatch_correction=mismatch_correction,
            long_trajectories=LongTrajectories.from_config(self),
            distillation=Distillation.from_config(self),
        )
        self.__dict__["_features"] = features  # a property's value: no field, so no flag and no TRL field to map
        if self.reward_time_limit_s is not None and self.reward_time_limit_s <= 0:
            raise ValueError(f"reward_time_limit_s must be > 0 or None, got {self.reward_time_limit_s}.")
        if self.replay_every_steps < 0:
            raise ValueError(f"replay_every_steps must be >= 0 (0: off), got {self.replay_every_steps}.")
        if self.viewer_steps < 0 or self.viewer_trajectories < 0:
            raise ValueError(
                f"viewer_steps and viewer_trajectories must be >= 0 (viewer_steps=0 writes no pages), got "
                f"{self.viewer_steps} and {self.viewer_trajectories}."
            )
        if self.viewer_steps and not self.viewer_trajectories:
            raise ValueError(
                f"viewer_steps={self.viewer_steps} asks for a trajectory page every {self.viewer_steps} steps, "
                f"but viewer_trajectories=0 would put none on it: set viewer_trajectories >= 1, or "
                f"viewer_steps=0 to write no pages."
            )
        if self.console_metrics not in ("compact", "full"):
            raise ValueError(f"console_metrics must be 'compact' or 'full', got {self.console_metrics!r}.")
        if not self.learning_rate > 0:
            raise ValueError(
                f"learning_rate must be > 0, got {self.learning_rate} (it would otherwise fail only when the "
                f"optimizer is built, after the model loaded)."
            )
        if self.critic_learning_rate is not None and self.critic_learning_rate <= 0:
            raise ValueError(f"critic_learning_rate must be > 0, got {self.critic_learning_rate}.")
        from trl_plugins.registry import PACKERS
        from trl_plugins.run.checks import check_skip_names

        check_skip_names(self)
        _lookup(PACKERS, self.packer, "packer")  # an unknown packer is refused with "did you mean"
        apply_trl_fields(self)  # every other TRL field: honoured, mapped or refused

    def resolve_padding_free(self, model: Any) -> bool:
        """Settle ``padding_free=None`` (auto) for ``model``: on for flash-attention's variable-length kernels, and
        only when the packer can budget tokens and ``shared_prefix=True`` did not ask for the other layout; an
        explicit value is kept. Returns (and stores) the choice."""
        if self.padding_free is None:
            from trl_plugins.packing import supports_padding_free

            impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
            self.padding_free = (
                "flash_attention" in impl and supports_padding_free(self.packer) and self.shared_prefix is not True
            )
        return self.padding_free

    def reentrant_checkpointing(self) -> bool:
        """Whether the policy's activation checkpointing is reentrant (``use_reentrant=True`` in its kwargs; TRL sets it
        for PEFT under ZeRO-3): it computes a layer's key/value states without a gradient, so the shared-prefix
        layout cannot train through them."""
        on = getattr(self, "activation_checkpointing", None) or self.gradient_checkpointing
        newer = getattr(self, "activation_checkpointing_kwargs", None)  # absent before transformers 5.20
        kwargs = {**(self.gradient_checkpointing_kwargs or {}), **(newer or {})}
        return bool(on) and bool(kwargs.get("use_reentrant", False))

    def resolve_shared_prefix(self, model: Any) -> bool:
        """Settle ``shared_prefix=None`` (auto) for ``model``, after :meth:`resolve_padding_free`: on for sdpa and eager
        attention in right-padded micro-batches without reentrant activation checkpointing; an explicit value is kept
        (True is refused where it cannot work: reentrant checkpointing that TRL switched on after the config).
        Returns (and stores) the choice."""
        if self.shared_prefix is None:
            self._shared_prefix_auto = True  # the first forward's layout check may still turn it off (micro_batches.py)
            impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
            self.shared_prefix = (
                impl in ("sdpa", "eager")
                and not self.padding_free
                and not self.reentrant_checkpointing()
                and self.sequence_parallel_size == 1
            )
        elif self.shared_prefix and self.reentrant_checkpointing():
            raise ValueError(_REENTRANT)
        return self.shared_prefix

    def _map_kl_and_entropy(self) -> None:
        """TRL's ``beta``, ``use_bias_correction_kl`` and ``entropy_coef`` set the policy loss's ``kl_coef``,
        ``kl_estimator``, ``kl_importance_weight`` and ``entropy_coef``.

        ``beta > 0`` makes TRL build the reference model, so it is the one switch of the reference KL:
        a ``kl_coef`` given in ``policy_loss_kwargs`` without it, or different from it, is refused.
        Idempotent (``__post_init__`` may run again on a copy).
        """
        if self.beta < 0:
            raise ValueError(f"beta={self.beta}: the reference-KL coefficient must be >= 0.")
        KLEstimator(self.kl_estimator)
        if self.kl_penalty not in ("loss", "reward"):
            raise ValueError(f"kl_penalty must be 'loss' or 'reward', got {self.kl_penalty!r}.")
        from trl_plugins.registry import POLICY_LOSSES

        params = plugin_params(_lookup(POLICY_LOSSES, self.policy_loss, "policy_loss"))
        accepted = None if params is None else set(params)
        kwargs = self.policy_loss_kwargs
        given = float(kwargs.get("kl_coef", 0.0) or 0.0)
        want = self.beta if self.kl_penalty == "loss" else 0.0
        if "kl_coef" in kwargs and given != want:
            raise ValueError(
                f"policy_loss_kwargs sets kl_coef={given}, but the reference-KL coefficient is TRL's beta "
                f"(beta > 0 is what builds the reference model): pass --beta {given or self.beta} "
                f"{'and --kl_penalty loss ' if self.kl_penalty != 'loss' else ''}and drop kl_coef from "
                "policy_loss_kwargs."
            )
        if self.beta > 0 and self.kl_penalty == "loss":
            problem = kl_gradient_problem(self.kl_estimator, self.use_bias_correction_kl)
            if problem:
                fix = (
                    "--use_bias_correction_kl false (unweighted k2's gradient is the reverse KL's)"
                    if KLEstimator(self.kl_estimator) == KLEstimator.K2
                    else "--use_bias_correction_kl true"
                )
                raise ValueError(
                    f"kl_estimator={self.kl_estimator!r} in the loss: {problem}. Pass {fix}, use "
                    f"--kl_estimator k3, or put the KL in the reward (--kl_penalty reward)."
                )
            needed = {"kl_coef", "kl_estimator"} | ({"kl_importance_weight"} if self.use_bias_correction_kl else set())
            if accepted is not None and not needed <= accepted:
                raise ValueError(
                    f"beta={self.beta} with kl_penalty='loss' needs a policy loss that takes {sorted(needed)} "
                    f"(kl_importance_weight for use_bias_correction_kl=True, TRL's default); "
                    f"policy_loss {self.policy_loss!r} does not. Use policy_loss='ppo_clip', or kl_penalty='reward'."
                )
            if "kl_estimator" in kwargs and KLEstimator(kwargs["kl_estimator"]) != KLEstimator(self.kl_estimator):
                raise ValueError(
                    f"policy_loss_kwargs sets kl_estimator={kwargs['kl_estimator']!r} but kl_estimator is "
                    f"{self.kl_estimator!r}; set only --kl_estimator."
                )
            if "kl_importance_weight" in kwargs and bool(kwargs["kl_importance_weight"]) != self.use_bias_correction_kl:
                raise ValueError(
                    f"policy_loss_kwargs sets kl_importance_weight={kwargs['kl_importance_weight']} but "
                    f"use_bias_correction_kl is {self.use_bias_correction_kl}; set only --use_bias_correction_kl."
                )
            kwargs["kl_coef"] = self.beta
            kwargs["kl_estimator"] = str(KLEstimator(self.kl_estimator))
            if accepted is None or "kl_importance_weight" in accepted:
                kwargs["kl_importance_weight"] = self.use_bias_correction_kl
        if self.entropy_coef:
            if accepted is not None and "entropy_coef" not in accepted:
                raise ValueError(
                    f"entropy_coef={self.entropy_coef} needs a policy loss that takes entropy_coef; policy_loss "
                    f"{self.policy_loss!r} does not. Use policy_loss='ppo_clip' or set entropy_coef=0."
                )
            if float(kwargs.get("entropy_coef", self.entropy_coef)) != self.entropy_coef:
                raise ValueError(
                    f"entropy_coef={self.entropy_coef} and policy_loss_kwargs entropy_coef={kwargs['entropy_coef']} "
                    f"disagree; set one of them."
                )
            kwargs["entropy_coef"] = self.entropy_coef

    @property
    def features(self) -> Features:
        """Each feature's settings as one typed object (:mod:`trl_plugins.run.settings`), built from the flat fields
        when the config was checked; a feature that is off is None."""
        return self.__dict__["_features"]

    def _check_continuous_batching(self) -> None:
        # TRL's __post_init__ has already turned the deprecated use_transformers_paged into the new switch.
        if not self.use_transformers_continuous_batching:
            for name in ("transformers_continuous_batching_config", "continuous_batching_keep_cache"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name} is set but use_transformers_continuous_batching is off: set "
                        f"use_transformers_continuous_batching=True to generate with continuous batching, "
                        f"or drop {name}."
                    )
            return
        if self.use_vllm:
            raise ValueError("use_transformers_continuous_batching and use_vllm both choose the sampler: pick one.")
        if self.repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty} is refused with continuous batching (its logits "
                "processors see only the last token of each sequence): use 1.0, or HF generate."
            )
        from trl_plugins.rollout.continuous_batching import continuous_batching_config

        continuous_batching_config(self.transformers_continuous_batching_config)  # raises on a bad key or value


def _lookup(registry: Any, name: str, setting: str) -> Any:
    """``registry.get(name)``; an unknown name is refused naming ``setting`` (with the registry's "did you mean")."""
    try:
        return registry.get(name)
    except LookupError as exc:
        raise SettingError(setting, str(exc)) from None
