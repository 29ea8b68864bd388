"""The shared vocabulary every seam exchanges: turns, trajectories, provenance, datums, loss I/O.

Plugins exchange these dataclasses, never loose dicts. The contract, in one paragraph: a
:class:`Trajectory` is a list of :class:`Turn` s; each turn records the exact prompt token ids the
sampler saw and the completion token ids it produced, with the behaviour policy's log-prob of every
sampled token. Every token has a :class:`TokenSource`. A trajectory ends for one
:class:`StopReason`, which is either *terminated* (the episode is over: nothing to bootstrap) or
*truncated* (a budget cut it: the value of the last state may be bootstrapped). The
:class:`PolicyVersion` says which weights, tokenizer/template and sampling distribution produced it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Callable

import torch

__all__ = [
    "TokenSource",
    "StopReason",
    "LogprobSource",
    "SamplingSettings",
    "PolicyVersion",
    "RewardComponent",
    "ToolCall",
    "Turn",
    "Trajectory",
    "TrajectoryReport",
    "TrajectoryError",
    "Datum",
    "AggregationMode",
    "KLEstimator",
    "ImportanceSamplingMode",
    "MismatchStats",
    "ImportanceWeights",
    "AdvantageInput",
    "AdvantageOutput",
    "PolicyLossInput",
    "PolicyLossStats",
    "PolicyLossOutput",
    "ValueLossOutput",
    "MicroBatch",
    "PackPlan",
    "PLACEHOLDER_LOGPROB",
]

PLACEHOLDER_LOGPROB = 0.0
"""Behaviour log-prob stored at non-action datum positions. Never read: the action mask zeroes it."""


class TokenSource(enum.IntEnum):
    """Where a token came from. Integer-valued so a datum can carry it as a tensor."""

    PROMPT = 0
    """System/user messages and the chat-template header of the first prompt."""
    ACTION = 1
    """A token the policy sampled: it has a behaviour log-prob and is trained."""
    OBSERVATION = 2
    """Tool output (stdout, traceback, ...) fed back to the model: context, never trained."""
    GLUE = 3
    """Chat-template tokens appended by the rollout (closing a turn, opening a tool message)."""


class StopReason(enum.StrEnum):
    """Why a trajectory ended. ``is_terminated`` and ``is_truncated`` partition the members."""

    FINAL_ANSWER = "final_answer"
    """Terminated: the model gave a final answer (e.g. a ``\\boxed{}`` line) and no tool call."""
    NO_TOOL_CALL = "no_tool_call"
    """Terminated: the turn ended naturally with neither a tool call nor a final answer."""
    INVALID_ACTION = "invalid_action"
    """Terminated: a malformed tool call, several calls, or text after the call."""
    TURN_LENGTH = "turn_length"
    """Truncated: the last turn hit its ``max_new_tokens`` before a stop token."""
    TOKEN_BUDGET = "token_budget"
    """Truncated: the trajectory's total token budget was used up."""
    MAX_TURNS = "max_turns"
    """Truncated: the maximum number of assistant turns was reached."""
    MAX_TOOL_CALLS = "max_tool_calls"
    """Truncated: the maximum number of tool calls was reached."""
    ENVIRONMENT_ERROR = "environment_error"
    """The world failed, not the policy: a tool or its sandbox failed (set-up, crash, plugin exception,
    host resources), as opposed to the model's code raising. ``Trajectory.error`` says what."""
    VERIFIER_ERROR = "verifier_error"
    """The world failed, not the policy: a reward component raised or timed out while scoring it.
    ``Trajectory.error`` names the component and the exception."""
    CANCELLED = "cancelled"
    """The world failed, not the policy: the run was interrupted (Ctrl-C, SIGTERM, a cancelled task)
    while the trajectory was still running."""

    @property
    def is_terminated(self) -> bool:
        """True when the episode really ended (bootstrap value 0)."""
        return self in _TERMINATED

    @property
    def is_world_failure(self) -> bool:
        """True when the infrastructure, not the policy, ended or spoiled the episode: no training signal."""
        return self in _WORLD_FAILURES

    @property
    def is_truncated(self) -> bool:
        """True when a budget cut the episode short (the last state's value may be bootstrapped).

        Terminated, truncated and world failure partition the members."""
        return not self.is_terminated and not self.is_world_failure


_TERMINATED = frozenset({StopReason.FINAL_ANSWER, StopReason.NO_TOOL_CALL, StopReason.INVALID_ACTION})
_WORLD_FAILURES = frozenset({StopReason.ENVIRONMENT_ERROR, StopReason.VERIFIER_ERROR, StopReason.CANCELLED})


class LogprobSource(enum.StrEnum):
    """Which distribution the stored behaviour log-probs were taken from."""

    TEMPERATURE_SCALED = "temperature_scaled"
    """``log_softmax(logits / temperature)`` over the full vocabulary, before top-p/top-k."""
    RAW = "raw"
    """``log_softmax(logits)`` at temperature 1, whatever temperature was used to sample."""
    PROCESSED = "processed"
    """After every logit processor, top-p/top-k truncation included (vLLM's ``processed_logprobs``)."""


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling parameters that define the behaviour distribution."""

    temperature: float = 1.0
    """Softmax temperature used to sample."""
    top_p: float = 1.0
    """Nucleus threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k cut-off (0 = off)."""
    min_p: float = 0.0
    """Min-p threshold (0.0 = off)."""
    repetition_penalty: float = 1.0
    """Repetition penalty (1.0 = off)."""


@dataclass(frozen=True)
class PolicyVersion:
    """Which policy produced a trajectory; immutable and attached to every trajectory."""

    step: int
    """Optimizer step of the weights that sampled (0 = before any update)."""
    tokenizer_digest: str
    """Digest of the tokenizer vocabulary and chat template; a mismatch with the trainer's is an error."""
    weights_digest: str | None = None
    """Optional digest of the weights, when the step alone is not enough (e.g. after a reload)."""
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    """Sampling settings of the rollout."""
    logprob_source: LogprobSource = LogprobSource.TEMPERATURE_SCALED
    """Distribution the behaviour log-probs were taken from."""


@dataclass(frozen=True)
class RewardComponent:
    """One named reward term; the trajectory's reward is the weighted sum of its components."""

    name: str
    """Component name, e.g. ``"correct"``; logged as ``reward/<name>``."""
    value: float
    """Unweighted value."""
    weight: float = 1.0
    """Weight in the total."""


@dataclass
class ToolCall:
    """A tool call an assistant turn made, and what came back."""

    name: str
    """Tool name as the model wrote it."""
    arguments: dict
    """Parsed arguments."""
    output: str = ""
    """Text returned to the model (before tokenisation and tail-truncation)."""
    ok: bool = False
    """True when the tool ran and succeeded (e.g. the code exited 0)."""
    timed_out: bool = False
    """True when the tool hit its time limit."""
    output_truncated: bool = False
    """True when the response was cut to ``max_tool_response_tokens`` (the tail is kept)."""
    latency_s: float = 0.0
    """Wall time of the call, seconds."""
    infra_error: str | None = None
    """Set when the tool itself failed (not the model's code): the trajectory ended with ``environment_error``."""


@dataclass
class Turn:
    """One assistant turn: the exact prompt the sampler saw and what it sampled.

    For turn ``i > 0`` the prompt is everything before plus the new tokens ``D_i`` (tool output and
    template glue): ``prompt_ids[i] == prompt_ids[i-1] + completion_ids[i-1] + D_i``.
    """

    prompt_ids: list[int]
    """Full prompt token ids fed to the sampler for this turn."""
    completion_ids: list[int]
    """Token ids sampled in this turn (a sampled closing token such as ``<|im_end|>`` included)."""
    completion_logprobs: list[float]
    """Behaviour log-prob of each completion token; ``nan`` at tokens whose source is not ACTION."""
    text: str = ""
    """Decoded completion text."""
    prompt_sources: list[TokenSource] | None = None
    """Provenance of the tokens this turn's prompt adds (the whole prompt for the first turn).
    ``None`` when the producer did not record it: reported as PROMPT for the first turn and
    OBSERVATION for later ones."""
    completion_sources: list[TokenSource] | None = None
    """Provenance of the completion tokens; ``None`` means all ACTION. Producers that splice tool
    output into the completion (TRL's tool loop does) mark those tokens OBSERVATION/GLUE."""
    truncated: bool = False
    """True when generation stopped at ``max_new_tokens`` rather than at a stop token."""
    generation_s: float = 0.0
    """Wall time of the sampler call that produced this turn, seconds (shared with the turns batched with it)."""
    queue_s: float = 0.0
    """Wall time this turn waited for the sampler before its call started, seconds."""
    tool_s: float = 0.0
    """Wall time spent running the tool call this turn made, seconds (0 if none)."""
    tool_call: ToolCall | None = None
    """The tool call this turn made and its result, if any."""

    def sources(self) -> list[TokenSource]:
        """Provenance of each completion token."""
        if self.completion_sources is None:
            return [TokenSource.ACTION] * len(self.completion_ids)
        return list(self.completion_sources)


@dataclass
class Trajectory:
    """A multi-turn episode: turns, outcome and provenance."""

    turns: list[Turn]
    """Assistant turns in order."""
    question_id: str = ""
    """Identifier of the task/question."""
    group_id: int = 0
    """Group (same prompt) for group-relative advantages."""
    sample_index: int = 0
    """Slot of this sample within its group."""
    stop_reason: StopReason | None = None
    """Why it ended; ``None`` while it is still running."""
    reward_components: list[RewardComponent] = field(default_factory=list)
    """Named reward terms, stored separately."""
    advantage: float | None = None
    """Scalar advantage, set by the advantage estimator."""
    policy_version: PolicyVersion | None = None
    """Which policy sampled it."""
    error: str | None = None
    """What failed in the world when the stop reason is a world failure (tool or component, exception)."""

    @property
    def reward(self) -> float:
        """Weighted sum of the reward components (0.0 when there are none)."""
        return float(sum(c.weight * c.value for c in self.reward_components))

    def reward_component(self, name: str) -> RewardComponent:
        """The component called ``name``; raises ``KeyError`` listing the names present."""
        for c in self.reward_components:
            if c.name == name:
                return c
        raise KeyError(f"no reward component {name!r}; have {[c.name for c in self.reward_components]}")

    @property
    def terminated(self) -> bool:
        """True when the stop reason is a termination."""
        return self.stop_reason is not None and self.stop_reason.is_terminated

    @property
    def truncated(self) -> bool:
        """True when the stop reason is a truncation."""
        return self.stop_reason is not None and self.stop_reason.is_truncated

    @property
    def world_failure(self) -> bool:
        """True when the infrastructure (a tool, a verifier) failed it: it carries no training signal."""
        return self.stop_reason is not None and self.stop_reason.is_world_failure

    @property
    def num_tool_calls(self) -> int:
        """Tool calls made (run or not)."""
        return sum(t.tool_call is not None for t in self.turns)

    @property
    def num_tokens(self) -> int:
        """Length of the whole episode: last prompt plus last completion."""
        return len(self.turns[-1].prompt_ids) + len(self.turns[-1].completion_ids) if self.turns else 0

    @property
    def num_action_tokens(self) -> int:
        """Sampled (trainable) tokens over all turns."""
        return sum(s == TokenSource.ACTION for t in self.turns for s in t.sources())


@dataclass(frozen=True)
class TrajectoryReport:
    """What :func:`trl_plugins.rollout.validate.validate_trajectory` found in a valid trajectory."""

    bootstrap_mask: int
    """0 when terminated (nothing to bootstrap), 1 when truncated."""
    num_turns: int
    """Number of turns."""
    num_action_tokens: int
    """Sampled tokens over all turns."""


class TrajectoryError(ValueError):
    """A trajectory breaks the contract; the message names the turn and token."""


@dataclass
class Datum:
    """One training sample built from one trajectory (or one prefix-consistent run of its turns).

    All per-position arrays have length ``T = len(full) - 1`` and are aligned on the *target*:
    position ``t`` predicts ``target_ids[t] = full[t + 1]`` from ``input_ids[: t + 1]``.
    """

    input_ids: list[int]
    """``full[:-1]``: what the model reads."""
    target_ids: list[int]
    """``full[1:]``: the token scored at each position."""
    behaviour_logprobs: list[float]
    """Behaviour log-prob of ``target_ids[t]`` where ``action_mask[t] == 1``; a placeholder elsewhere."""
    advantages: list[float]
    """Advantage at each position; 0.0 where ``action_mask[t] == 0``."""
    action_mask: list[int]
    """1 where ``target_ids[t]`` was sampled by the policy, else 0. The one mask every consumer uses."""
    sources: list[TokenSource]
    """Provenance of ``target_ids[t]``."""
    trajectory_index: int = 0
    """Index of the source trajectory in the batch it was built from."""
    group_id: int = 0
    """Group of the source trajectory."""
    bootstrap_mask: int = 0
    """0 when the source trajectory terminated, 1 when truncated (only the last datum of a split)."""
    ref_logprobs: list[float] | None = None
    """Reference-model log-prob of ``target_ids[t]`` (same temperature as the behaviour ones), filled
    once per rollout batch when a reference KL is on; None otherwise."""
    old_logprobs: list[float] | None = None
    """The trainer's own log-prob of ``target_ids[t]`` under the sampling weights (a no-grad forward
    before the first update on the batch), filled when the sampler/trainer mismatch correction applies:
    the PPO ratio is then ``pi / pi_old`` and ``pi_old / pi_behaviour`` the importance weight. None
    otherwise (the ratio is ``pi / pi_behaviour``)."""
    old_values: list[float] | None = None
    """Critic value of the state before ``target_ids[t]`` at rollout time (actor-critic runs)."""
    returns: list[float] | None = None
    """Value targets at each position, 0 off the action mask (actor-critic runs)."""

    @property
    def num_tokens(self) -> int:
        """Model input length ``T`` (after the shift); what packers and context limits measure."""
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Positions that contribute to the policy loss."""
        return sum(self.action_mask)


class AggregationMode(enum.StrEnum):
    """How per-token losses become one scalar; every mode takes explicit global denominators."""

    TOKEN_MEAN = "token_mean"
    """Sum over all loss tokens / global number of loss tokens (DAPO)."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Mean over sequences of each sequence's token mean (original GRPO)."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Mean over sequences of each sequence's token sum."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"
    """Token sum / (global sequences x a constant length), Dr. GRPO."""


class KLEstimator(enum.StrEnum):
    """Per-token estimators of KL(policy || reference) from samples of the policy (Schulman 2020)."""

    K1 = "k1"
    """``log p - log q``: unbiased, high variance, can be negative."""
    K2 = "k2"
    """``0.5 (log p - log q)^2``: biased, low variance, non-negative."""
    K3 = "k3"
    """``q/p - 1 - log(q/p)``: unbiased, low variance, non-negative."""


class ImportanceSamplingMode(enum.StrEnum):
    """How the sampler/trainer importance weight ``w = pi_old / pi_sampler`` is bounded (TRL's
    ``vllm_importance_sampling_mode``; verl's rollout correction). ``[C_min, C_max]`` are the bounds."""

    TOKEN_TRUNCATE = "token_truncate"
    """Per-token ratio clamped to ``[C_min, C_max]`` (truncated IS, TIS)."""
    TOKEN_MASK = "token_mask"
    """Per-token ratio, 0 where it leaves ``[C_min, C_max]`` (masked IS, MIS)."""
    SEQUENCE_TRUNCATE = "sequence_truncate"
    """One ratio per sequence (product over its action tokens), clamped, on every token of it."""
    SEQUENCE_MASK = "sequence_mask"
    """One ratio per sequence; a sequence whose ratio leaves ``[C_min, C_max]`` gets weight 0."""

    @property
    def is_sequence(self) -> bool:
        """True for the sequence-level modes."""
        return self in (ImportanceSamplingMode.SEQUENCE_TRUNCATE, ImportanceSamplingMode.SEQUENCE_MASK)

    @property
    def is_mask(self) -> bool:
        """True for the masking modes (out-of-bounds weights become 0 instead of the bound)."""
        return self in (ImportanceSamplingMode.TOKEN_MASK, ImportanceSamplingMode.SEQUENCE_MASK)


@dataclass
class MismatchStats:
    """Detached, additive statistics of the sampler/trainer mismatch over the action tokens of a batch.

    ``r = pi_old / pi_sampler`` per token; "unit" = token (token modes) or sequence (sequence modes).
    Sums, counts and extremes, so micro-batches and ranks combine exactly with :meth:`merge`.
    """

    num_tokens: torch.Tensor
    """Action tokens counted."""
    log_ratio_sum: torch.Tensor
    """Sum of ``log r``; minus its mean is the k1 estimate of KL(sampler || trainer)."""
    k3_sum: torch.Tensor
    """Sum of ``r - 1 - log r``: the k3 estimate of KL(sampler || trainer) from sampler tokens."""
    abs_log_ratio_sum: torch.Tensor
    """Sum of ``|log pi_old - log pi_sampler|`` (TRL's ``sampling_logp_difference``)."""
    weight_sum: torch.Tensor
    """Sum of the weights applied to the tokens (after truncation or masking)."""
    bounded_tokens: torch.Tensor
    """Tokens whose unit's ratio left ``[C_min, C_max]`` (truncated or masked)."""
    ratio_min: torch.Tensor
    """Smallest unit ratio before bounding (``+inf`` when no token)."""
    ratio_max: torch.Tensor
    """Largest unit ratio before bounding (``-inf`` when no token)."""
    weight_min: torch.Tensor
    """Smallest applied token weight (``+inf`` when no token)."""
    weight_max: torch.Tensor
    """Largest applied token weight (``-inf`` when no token)."""

    MINIMA = ("ratio_min", "weight_min")
    MAXIMA = ("ratio_max", "weight_max")

    def merge(self, other: "MismatchStats") -> "MismatchStats":
        """Combine two micro-batches' statistics (sums add, extremes take min/max)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            out[f.name] = torch.minimum(a, b) if f.name in self.MINIMA else torch.maximum(a, b) if f.name in self.MAXIMA else a + b
        return MismatchStats(**out)

    def summary(self, mode: "ImportanceSamplingMode | str") -> dict[str, float]:
        """Means, fractions and extremes as floats, keyed by metric name (for logging only)."""
        n = max(float(self.num_tokens), 1.0)
        bounded = "is_masked_frac" if ImportanceSamplingMode(mode).is_mask else "is_truncated_frac"
        return {
            "is_mismatch_kl": float(self.k3_sum) / n,
            "is_mismatch_k1": -float(self.log_ratio_sum) / n,
            "is_logprob_gap": float(self.abs_log_ratio_sum) / n,
            "is_ratio_min": float(self.ratio_min),
            "is_ratio_max": float(self.ratio_max),
            "is_weight_mean": float(self.weight_sum) / n,
            "is_weight_min": float(self.weight_min),
            "is_weight_max": float(self.weight_max),
            bounded: float(self.bounded_tokens) / n,
        }


@dataclass
class ImportanceWeights:
    """Sampler/trainer importance weights of a batch and their statistics."""

    weights: torch.Tensor
    """``(B, T)`` detached weight of each token's loss; 0 off the action mask."""
    stats: MismatchStats
    """Detached statistics."""


@dataclass
class AdvantageInput:
    """Everything an advantage estimator may read. Shapes: ``N`` trajectories, ``T`` positions.

    Outcome estimators (``group``, ``rloo``) read ``rewards`` and ``group_ids``; ``gae`` also reads
    the token-level fields, aligned with datum positions.
    """

    rewards: torch.Tensor
    """``(N,)`` total reward of each trajectory."""
    group_ids: torch.Tensor
    """``(N,)`` integer group of each trajectory."""
    action_mask: torch.Tensor | None = None
    """``(N, T)`` datum action mask (gae)."""
    values: torch.Tensor | None = None
    """``(N, T)`` critic value of the state before each position's target (gae)."""
    bootstrap_mask: torch.Tensor | None = None
    """``(N,)`` 1 for truncated trajectories whose last state may be bootstrapped (gae)."""
    bootstrap_values: torch.Tensor | None = None
    """``(N,)`` value of the state after the last token, used where ``bootstrap_mask`` is 1 (gae)."""
    token_rewards: torch.Tensor | None = None
    """``(N, T)`` extra per-token rewards, e.g. ``-beta * KL`` to a reference (gae)."""
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Sums a tensor over the data-parallel ranks, for batch statistics that must be global (e.g.
    whitening); None in one process. Every rank calls the estimator, so every rank must call it alike."""


@dataclass
class AdvantageOutput:
    """Advantages and, for critic-based estimators, value targets."""

    advantages: torch.Tensor
    """``(N,)`` per trajectory (outcome estimators) or ``(N, T)`` per position (gae, 0 off-mask)."""
    returns: torch.Tensor | None = None
    """``(N, T)`` value-function targets (gae), 0 off-mask."""


@dataclass
class PolicyLossInput:
    """Everything a policy loss may read; all ``(B, T)`` and aligned with datum positions."""

    logprobs: torch.Tensor
    """Current policy log-probs of the targets (carries the gradient)."""
    behaviour_logprobs: torch.Tensor
    """Log-probs of the PPO "old" policy, the ratio's anchor: the sampler's behaviour log-probs, or the
    trainer's own forward of the sampling weights when the mismatch correction applies."""
    advantages: torch.Tensor
    """Per-position advantages (0 off-mask)."""
    action_mask: torch.Tensor
    """1 on sampled tokens."""
    ref_logprobs: torch.Tensor | None = None
    """Reference-model log-probs, for a KL term in the loss."""
    entropy: torch.Tensor | None = None
    """Per-position entropy of the current policy, for an entropy bonus."""
    is_weights: torch.Tensor | None = None
    """Detached sampler/trainer importance weights ``pi_old / pi_sampler`` (truncated or masked) that
    multiply the policy-gradient term, when the mismatch correction applies (the trainer passes them
    only to a loss that declares ``supports_is_weights``); None otherwise."""


@dataclass
class PolicyLossStats:
    """Detached, additive statistics of a policy loss over the masked tokens of one micro-batch.

    Sums and counts (not means) so that micro-batches and ranks combine exactly with :meth:`merge`.
    """

    num_tokens: torch.Tensor
    """Masked tokens counted."""
    clipped_low: torch.Tensor
    """Tokens with negative advantage whose ratio fell below ``1 - clip_low`` (gradient cut)."""
    clipped_high: torch.Tensor
    """Tokens with positive advantage whose ratio rose above ``1 + clip_high`` (gradient cut)."""
    dual_clipped: torch.Tensor
    """Tokens where the dual clip bound the loss."""
    approx_kl_sum: torch.Tensor
    """Sum of the k3 estimate of KL(behaviour || current)."""
    abs_log_ratio_sum: torch.Tensor
    """Sum of ``|log pi_current - log pi_behaviour|``: the behaviour-vs-trainer log-prob gap."""
    ratio_sum: torch.Tensor
    """Sum of importance ratios."""
    ratio_min: torch.Tensor
    """Smallest ratio (``+inf`` when no token)."""
    ratio_max: torch.Tensor
    """Largest ratio (``-inf`` when no token)."""

    def merge(self, other: "PolicyLossStats") -> "PolicyLossStats":
        """Combine two micro-batches' statistics."""
        return PolicyLossStats(
            num_tokens=self.num_tokens + other.num_tokens,
            clipped_low=self.clipped_low + other.clipped_low,
            clipped_high=self.clipped_high + other.clipped_high,
            dual_clipped=self.dual_clipped + other.dual_clipped,
            approx_kl_sum=self.approx_kl_sum + other.approx_kl_sum,
            abs_log_ratio_sum=self.abs_log_ratio_sum + other.abs_log_ratio_sum,
            ratio_sum=self.ratio_sum + other.ratio_sum,
            ratio_min=torch.minimum(self.ratio_min, other.ratio_min),
            ratio_max=torch.maximum(self.ratio_max, other.ratio_max),
        )

    def summary(self) -> dict[str, float]:
        """Fractions and means as floats, keyed by metric name (for logging only)."""
        n = max(float(self.num_tokens), 1.0)
        return {
            "clip_frac_low": float(self.clipped_low) / n,
            "clip_frac_high": float(self.clipped_high) / n,
            "dual_clip_frac": float(self.dual_clipped) / n,
            "approx_kl": float(self.approx_kl_sum) / n,
            "behaviour_logprob_gap": float(self.abs_log_ratio_sum) / n,
            "ratio_mean": float(self.ratio_sum) / n,
            "ratio_min": float(self.ratio_min),
            "ratio_max": float(self.ratio_max),
        }


@dataclass
class PolicyLossOutput:
    """A policy loss before aggregation."""

    per_token_loss: torch.Tensor
    """``(B, T)`` loss at every position (masked positions hold 0)."""
    stats: PolicyLossStats
    """Detached statistics."""


@dataclass
class ValueLossOutput:
    """A value loss before aggregation."""

    per_token_loss: torch.Tensor
    """``(B, T)`` loss at every position (masked positions hold 0)."""
    clipped: torch.Tensor
    """Detached count of masked tokens where the clipped branch was the larger."""


@dataclass
class MicroBatch:
    """Datums collated into right-padded ``(B, T)`` tensors, ``T`` = longest datum in the batch.

    Padding positions have ``attention_mask == 0`` and ``action_mask == 0``. A *dummy* micro-batch
    (a rank with fewer micro-batches than the others) has ``weight == 0``.

    *Padding-free* (``position_ids`` set): the model sees the datums' real tokens concatenated into one
    ``(1, N)`` sequence (``input_ids[attention_mask == 1]``, row after row) with positions restarting at
    0 for each datum, and attends within each datum only; its per-token outputs are put back into the
    ``(B, T)`` layout (:func:`trl_plugins.modeling.micro_batch_logprobs`), so the loss side is the same in
    both layouts.
    """

    input_ids: torch.Tensor
    """``(B, T)`` long."""
    attention_mask: torch.Tensor
    """``(B, T)`` long, 1 on real tokens."""
    target_ids: torch.Tensor
    """``(B, T)`` long; pad id on padding."""
    behaviour_logprobs: torch.Tensor
    """``(B, T)`` float."""
    advantages: torch.Tensor
    """``(B, T)`` float, 0 off the action mask."""
    action_mask: torch.Tensor
    """``(B, T)`` float, 1 on sampled tokens."""
    datum_indices: list[int]
    """Indices of the datums in the list they were collated from (row order)."""
    ref_logprobs: torch.Tensor | None = None
    """``(B, T)`` float reference log-probs when the datums carry them (0 on padding)."""
    old_logprobs: torch.Tensor | None = None
    """``(B, T)`` float trainer log-probs of the sampling weights when the datums carry them (0 on padding)."""
    old_values: torch.Tensor | None = None
    """``(B, T)`` float rollout-time critic values when the datums carry them."""
    returns: torch.Tensor | None = None
    """``(B, T)`` float value targets when the datums carry them."""
    weight: float = 1.0
    """1.0 for real micro-batches, 0.0 for dummies."""
    position_ids: torch.Tensor | None = None
    """Padding-free only: ``(1, N)`` long, each datum's positions ``0..n-1`` one after the other."""

    @property
    def num_padded_tokens(self) -> int:
        """Tokens the forward pass processes: ``B * T`` (the padded area), or ``N`` padding-free."""
        return int(self.input_ids.numel()) if self.position_ids is None else int(self.position_ids.numel())


@dataclass
class PackPlan:
    """A partition of item indices into micro-batches, per data-parallel rank.

    ``ranks[r][k]`` is the list of item indices in rank ``r``'s ``k``-th micro-batch. Every rank has
    the same number of micro-batches; an empty list is a *dummy* that the trainer runs with zero
    weight so that all ranks issue the same number of forward/backward passes.
    """

    ranks: list[list[list[int]]]
    """rank -> micro-batch -> item indices."""

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (dummies included); the same on every rank."""
        return len(self.ranks[0]) if self.ranks else 0

    def num_dummies(self) -> int:
        """Empty micro-batches over all ranks."""
        return sum(not mb for rank in self.ranks for mb in rank)

    def rank_padded_area(self, lengths: "list[int]") -> list[int]:
        """Per rank, the sum over its micro-batches of ``len(mb) * max length in mb``."""
        return [sum(len(mb) * max((lengths[i] for i in mb), default=0) for mb in rank) for rank in self.ranks]
