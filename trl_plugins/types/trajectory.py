"""The trajectory contract: where each token came from, why a trajectory stopped, which weights and sampling made
it, its reward components, and the one training datum built from it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "PLACEHOLDER_LOGPROB",
    "TokenSource",
    "StopReason",
    "LeftOutReason",
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
    """Terminated: the turn ended naturally with neither a tool call nor a final answer, or an agent behind the
    endpoint ended the episode after a turn whose calls it did not answer."""
    INVALID_ACTION = "invalid_action"
    """Terminated: a malformed tool call, more calls in one turn than ``max_tool_calls_per_turn``, or text after
    the call."""
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
    host resources), as opposed to the model's code raising, or an agent behind the endpoint raised, hung or broke
    its contract for a reason other than the model's output. ``Trajectory.error`` says what."""
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


class LeftOutReason(enum.StrEnum):
    """Why a step's update leaves a trajectory out (no advantage, not in the group statistics, not trained on):
    decided once, by the batch builder (and dynamic sampling), and read by whoever reports it (metrics, the trajectory
    viewer)."""

    WORLD_FAILURE = "world_failure"
    """The infrastructure failed it (``environment_error``, ``verifier_error``, ``cancelled``): not the policy's
    fault."""
    TRUNCATED = "truncated"
    """A budget cut it and ``truncated_policy='mask'`` leaves truncated trajectories out."""
    GROUP_TOO_SMALL = "group_too_small"
    """Too few members of its group survived the infrastructure to compare (``min_valid_group_fraction``)."""
    EQUAL_REWARDS = "equal_rewards"
    """Dynamic sampling dropped its group: the members trained on had one value of the metric (all right, all wrong),
    so no group-relative signal (``dynamic_sampling``)."""
    SURPLUS = "surplus"
    """Dynamic sampling dropped its group, informative but drawn after the batch was full (``dynamic_sampling``)."""
    FILLER = "filler"
    """Dynamic sampling drew its group only so that every rank generates in a refill round that counts fewer groups
    than there are ranks; never kept, whatever its rewards, so that the kept groups do not depend on the number of
    ranks (``dynamic_sampling``)."""


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
    """Digest of a fixed sample of the sampler's weights taken after its last sync
    (:data:`~trl_plugins.run.version.WEIGHTS_SAMPLE` says which values); None when the producer could not read them
    (a vLLM server, a ZeRO-3 shard)."""
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    """Sampling settings of the rollout."""
    logprob_source: LogprobSource = LogprobSource.TEMPERATURE_SCALED
    """Distribution the behaviour log-probs were taken from."""
    run_digest: str | None = None
    """:attr:`RunVersion.digest` of the run-level record (adapters, precision, sampler and package versions, tool
    schemas, plugin versions), stored once per run; None when the producer did not record one."""


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
    """True when the response was cut to ``max_tool_response_tokens`` observation tokens, counted as they reach the
    model (the tail is kept)."""
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
    """Wall time spent running the tool calls this turn made, seconds (0 if none; calls of one turn run
    concurrently, so this is the slowest call's time, not their sum)."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The tool calls this turn made, in the order written (several when the model made parallel calls), each with
    its result; empty if none."""
    policy_step: int | None = None
    """The optimizer step of the weights that sampled this turn (its span's behaviour version). Equal to the
    trajectory's ``policy_version.step`` unless the weights changed in the middle of the episode; None when the
    producer did not record it (the trajectory's version then stands for every turn)."""
    seed: int | None = None
    """The seed the sampler drew this turn with (the multi-turn rollout's ``derive_seed(request seed, trajectory,
    turn)``): with the same weights, prompt and sampling settings a seeded sampler draws the same tokens again,
    which ``python -m trl_plugins.replay --resample`` checks. None when the producer did not record one."""
    segment_start: bool = False
    """This turn's prompt does not continue the turns before it: its producer rendered the conversation afresh (an
    agent behind the endpoint rewrote its history). The trajectory's tokens start a new *segment* here, trained as a
    datum of its own (:func:`~trl_plugins.datum.build_datums`); ``prompt_sources`` then covers the whole prompt. Never
    set on a first turn."""

    @property
    def tool_call(self) -> ToolCall | None:
        """The turn's first tool call (its only one, unless it made parallel calls), or None."""
        return self.tool_calls[0] if self.tool_calls else None

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
    """What failed in the world when the stop reason is a world failure (tool or component, exception); for
    ``invalid_action``, why the turn was not a valid action (the parser's reason, or the per-turn call cap)."""

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
        """Tool calls made (run or not), each call of a turn with parallel calls counted."""
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def num_tokens(self) -> int:
        """Length of the whole episode: last prompt plus last completion."""
        return len(self.turns[-1].prompt_ids) + len(self.turns[-1].completion_ids) if self.turns else 0

    @property
    def num_action_tokens(self) -> int:
        """Sampled (trainable) tokens over all turns."""
        return sum(s == TokenSource.ACTION for t in self.turns for s in t.sources())

    @property
    def num_segments(self) -> int:
        """Prefix-consistent runs of turns (each becomes one datum): 1, plus one per turn that starts a segment."""
        return 1 + sum(t.segment_start for t in self.turns[1:])

    def turn_policy_steps(self) -> list[int | None]:
        """Per turn, the optimizer step of the weights that sampled it: the turn's own ``policy_step``, else the
        trajectory's ``policy_version.step``, else None (not recorded)."""
        default = self.policy_version.step if self.policy_version is not None else None
        return [default if t.policy_step is None else t.policy_step for t in self.turns]


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
    """1 when the return after the datum's last token is bootstrapped from the critic: a truncated trajectory
    (:func:`~trl_plugins.datum.build_datum`; the trainer keeps it only under ``truncated_policy='bootstrap'``), or
    any but the last datum of a split; else 0."""
    ref_logprobs: list[float] | None = None
    """Reference-model log-prob of ``target_ids[t]`` (same temperature as the behaviour ones), filled
    once per rollout batch when a reference KL is on; None otherwise."""
    teacher_logprobs: list[float] | None = None
    """The teacher's log-prob of ``target_ids[t]`` (same temperature as the behaviour ones) where
    ``action_mask[t] == 1``, 0.0 elsewhere; filled once per rollout batch when the run has a teacher
    (``teacher_model_name_or_path``: on-policy distillation); None otherwise."""
    teacher_top: list[list[tuple[int, float]]] | None = None
    """A server teacher's most likely tokens after ``input_ids[: t + 1]`` as ``(token id, log-prob)`` by rank where
    ``action_mask[t] == 1`` (its top-k prompt log-probs), empty lists elsewhere; filled once per rollout batch for a
    loss that compares the distributions there (``jsd`` with a server teacher); None otherwise."""
    old_logprobs: list[float] | None = None
    """The trainer's own log-prob of ``target_ids[t]`` under the sampling weights (a no-grad forward
    before the first update on the batch), filled when the sampler/trainer mismatch correction applies:
    the PPO ratio is then ``pi / pi_old`` and ``pi_old / pi_behaviour`` the importance weight. None
    otherwise (the ratio is ``pi / pi_behaviour``)."""
    old_values: list[float] | None = None
    """Critic value of the state before ``target_ids[t]`` at rollout time (actor-critic runs)."""
    returns: list[float] | None = None
    """Value targets at each position, 0 off the action mask (actor-critic runs)."""
    turn_ids: list[int] | None = None
    """The assistant turn (index into the trajectory's ``turns``) whose completion holds ``target_ids[t]`` where
    ``action_mask[t] == 1``; -1 elsewhere. One turn is one action of the trajectory contract: its positions form one
    span, whose log-prob is the sum over them. Set by :func:`~trl_plugins.datum.build_datums`; None on datums built
    by hand before it existed (their micro-batches carry no turn ids, and a loss that needs them refuses them)."""

    behaviour_steps: list[int] | None = None
    """The optimizer step of the weights that sampled ``target_ids[t]`` where ``action_mask[t] == 1`` (its turn's,
    :meth:`Trajectory.turn_policy_steps`); -1 elsewhere. None when the trajectory did not record it. The staleness of
    a token at an update is the update's step minus this."""

    @property
    def num_tokens(self) -> int:
        """Model input length ``T`` (after the shift); what packers and context limits measure."""
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Positions that contribute to the policy loss."""
        return sum(self.action_mask)
