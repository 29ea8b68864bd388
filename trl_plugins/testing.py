"""What plugin authors and our own tests need: tiny models and tokenizers built locally, fake
trajectories, and a contract check for every seam.

Nothing here downloads anything. A plugin package can run the same checks our registry entries pass::

    from trl_plugins.testing import check_reward_contract, check_tool_contract

    def test_my_reward():
        check_reward_contract("my_reward")          # a registry name, "pkg.mod:attr" or an instance

Each ``check_*`` raises :class:`ContractError` naming the plugin and what is wrong, and returns
nothing when the plugin meets its seam's contract.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from trl_plugins.rollout.metrics import METRIC_REDUCTIONS as _REDUCTIONS  # the trainer's own list
from trl_plugins.types import (
    AdvantageInput,
    AdvantageOutput,
    PackPlan,
    PolicyLossInput,
    PolicyLossOutput,
    StopReason,
    TokenSource,
    Trajectory,
    Turn,
)

__all__ = [
    "CHAT_TEMPLATES",
    "ContractError",
    "build_tokenizer",
    "FAMILIES",
    "TokenizerFamily",
    "template_family",
    "build_tiny_model",
    "load_trl_chat_template",
    "make_trajectory",
    "plan_violations",
    "check_advantage_contract",
    "check_policy_loss_contract",
    "check_packer_contract",
    "check_reward_contract",
    "check_tool_contract",
    "check_rollout_contract",
]


# -- tiny tokenizer ------------------------------------------------------------------------------

# Qwen2's pre-tokenisation regex: single digits, words, punctuation runs, newlines, spaces.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Control tokens (``special=True``): never produced by tokenising text from a tool."""
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Atomic markup tokens (``special=False``, as in Qwen's tokenizers)."""


@dataclass(frozen=True)
class TokenizerFamily:
    """The special tokens of one model family, as its released tokenizer declares them."""

    special: tuple[str, ...]
    """Control tokens (``special=True``)."""
    added: tuple[str, ...] = ()
    """Atomic markup tokens (``special=False``)."""
    eos: str | None = None
    """``eos_token``."""
    bos: str | None = None
    """``bos_token`` (templates that start with ``{{ bos_token }}`` render it)."""
    pad: str | None = None
    """``pad_token``."""


_VISION = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
FAMILIES: dict[str, TokenizerFamily] = {
    "qwen": TokenizerFamily(tuple(SPECIAL_TOKENS), tuple(ADDED_TOKENS), eos="<|im_end|>", pad="<|endoftext|>"),
    "qwen_vl": TokenizerFamily(tuple(SPECIAL_TOKENS) + _VISION, tuple(ADDED_TOKENS), eos="<|im_end|>", pad="<|endoftext|>"),
    "nemotron": TokenizerFamily(("<s>", "</s>", "<|im_start|>", "<|im_end|>"), tuple(ADDED_TOKENS) + ("<tools>", "</tools>"),
                                eos="<|im_end|>", bos="<s>", pad="</s>"),
    "llama3": TokenizerFamily(("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                               "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
                              eos="<|eot_id|>", bos="<|begin_of_text|>", pad="<|finetune_right_pad_id|>"),
    "lfm2": TokenizerFamily(("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|tool_list_start|>",
                             "<|tool_list_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>",
                             "<|tool_response_end|>"), ("<think>", "</think>"),
                            eos="<|im_end|>", bos="<|startoftext|>", pad="<|pad|>"),
    "glm4": TokenizerFamily(("<|endoftext|>", "[gMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
                             "<|observation|>"),
                            ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                             "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
                            eos="<|endoftext|>", pad="<|endoftext|>"),
    "gptoss": TokenizerFamily(("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                               "<|constrain|>", "<|return|>", "<|call|>"), eos="<|return|>", pad="<|endoftext|>"),
    "gemma": TokenizerFamily(("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
                             eos="<eos>", bos="<bos>", pad="<pad>"),
    "gemma4": TokenizerFamily(("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                               "<tool_call|>", "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>",
                               "<|think|>", "<|image|>", "<|audio|>", "<|video|>"), ('<|"|>',),
                              eos="<eos>", bos="<bos>", pad="<pad>"),
    "deepseek": TokenizerFamily(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                 "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                                 "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
                                ("<think>", "</think>"), eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                                pad="<｜end▁of▁sentence｜>"),
    "cohere": TokenizerFamily(("<BOS_TOKEN>", "<EOS_TOKEN>", "<PAD>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
                               "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>",
                               "<|END_RESPONSE|>", "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>",
                               "<|END_TOOL_RESULT|>", "<|START_THINKING|>", "<|END_THINKING|>"),
                              eos="<|END_OF_TURN_TOKEN|>", bos="<BOS_TOKEN>", pad="<PAD>"),
    "phi3": TokenizerFamily(("<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                            eos="<|end|>", bos="<s>", pad="<|endoftext|>"),
    "muse": TokenizerFamily(("<|start|>", "<|message|>", "<|eot|>", "<|eom|>", "<|patch|>", "<|video|>", "<|pad|>"),
                            eos="<|eot|>", pad="<|pad|>"),
    "mistral": TokenizerFamily(("<s>", "</s>", "<unk>"), eos="</s>", bos="<s>", pad="<unk>"),
    "smol": TokenizerFamily(("<|im_start|>", "<end_of_utterance>", "<|endoftext|>", "<|begin_of_text|>"),
                            eos="<end_of_utterance>", bos="<|im_start|>", pad="<|endoftext|>"),
}
"""Special tokens per model family, for tokenizers built by :func:`build_tokenizer`."""


def template_family(template: str) -> str:
    """The :data:`FAMILIES` key of a ``trl/chat_templates`` file name."""
    name = template.removesuffix("_training")
    for prefix, family in (("qwen2_5_vl", "qwen_vl"), ("qwen3_vl", "qwen_vl"), ("qwen3_5", "qwen_vl"),
                           ("qwen3_6", "qwen_vl"), ("qwen3_8", "qwen_vl"), ("qwen", "qwen"), ("nemotron", "nemotron"),
                           ("llama", "llama3"), ("lfm2", "lfm2"), ("glm", "glm4"), ("gptoss", "gptoss"),
                           ("gemma4", "gemma4"), ("diffusion_gemma", "gemma4"), ("gemma", "gemma"),
                           ("deepseek", "deepseek"), ("cohere", "cohere"), ("phi3", "phi3"), ("muse", "muse"),
                           ("llava", "mistral"), ("idefics3", "smol"), ("smolvlm", "smol")):
        if name.startswith(prefix):
            return family
    raise KeyError(f"no tokenizer family known for chat template {template!r}; known: {', '.join(FAMILIES)}")


CHAT_TEMPLATES = ("qwen2_5", "qwen3")
"""Templates :func:`build_tokenizer` is tested with; any file name in ``trl/chat_templates/`` loads."""

_CORPUS = [
    "You are a helpful assistant. Solve the problem step by step, call the code_interpreter tool to run "
    "Python when it helps, and put the final answer in \\boxed{} on its own line.",
    "What is 123 * 456 + 789? Let me compute it with Python. The answer is \\boxed{56877}.",
    'print(123 * 456 + 789)\nresult = sum(range(10))\nfor i in range(3):\n    print(i ** 2)\n',
    'import math\nimport numpy as np\nimport sympy as sp\nx = sp.Symbol("x")\nprint(sp.solve(x**2 - 4, x))\n',
    'Traceback (most recent call last):\n  File "<code>", line 1, in <module>\nZeroDivisionError: division by zero\n',
    '{"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}',
    "The tool returned 2. Therefore the result is \\boxed{2}. user assistant system tool function",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n",
    'For each function call, return a json object with function name and arguments within XML tags:\n'
    '{"type": "function", "function": {"name": "code_interpreter", "description": "Run Python code", '
    '"parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}',
    "0123456789 + - * / = ( ) [ ] { } < > , . : ; ' \" ! ? _ # % & | ^ ~ ` @ $ \\",
]


def load_trl_chat_template(name: str) -> str:
    """The text of ``trl/chat_templates/<name>.jinja``.

    Raises:
        FileNotFoundError: naming the templates that exist.
    """
    import trl

    folder = Path(trl.__file__).parent / "chat_templates"
    path = folder / f"{name}.jinja"
    if not path.is_file():
        known = sorted(p.stem for p in folder.glob("*.jinja"))
        raise FileNotFoundError(f"no chat template {name!r} in {folder}; available: {', '.join(known)}")
    return path.read_text(encoding="utf-8")


def build_tokenizer(template: str = "qwen2_5", vocab_size: int = 512, extra_corpus: Sequence[str] = (),
                    family: str | None = None):
    """Train a tiny byte-level BPE tokenizer and attach a TRL chat template.

    Args:
        template: A file name (without ``.jinja``) in ``trl/chat_templates/``.
        vocab_size: Target vocabulary size (before the special and added tokens).
        extra_corpus: More training text, e.g. the rendered system prompt and tool schemas of a recipe,
            so that text every prompt repeats costs few tokens.
        family: A :data:`FAMILIES` key; by default the template's own family (:func:`template_family`), so
            that its markup tokens are tokens and its bos/eos are set.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the family's special and added tokens, eos, bos
        and pad (Qwen: ``eos_token="<|im_end|>"``, ``pad_token="<|endoftext|>"``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken as TkAddedToken
    from transformers import AddedToken, PreTrainedTokenizerFast

    spec = FAMILIES[family or template_family(template)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[TkAddedToken(t, special=True, normalized=False) for t in spec.special],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4 + list(extra_corpus) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec.eos,
        bos_token=spec.bos,
        pad_token=spec.pad,
        clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": []})
    if spec.added:
        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    fast.chat_template = load_trl_chat_template(template)
    return fast


# -- tiny model ----------------------------------------------------------------------------------


def build_tiny_model(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    sliding_window: int | None = None,
):
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (vocab = ``len(tokenizer)``).

    ``sliding_window`` turns on Qwen2's sliding-window attention in every layer: each token attends to
    the last ``sliding_window`` positions only. A tiny model trained for minutes learns to copy numbers
    (question -> code, tool output -> answer) far faster when its attention is not spread over a long
    system prompt.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0} if sliding_window else {}),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn_implementation
    return model


# -- fake data ------------------------------------------------------------------------------------


def make_trajectory(
    rng: random.Random,
    *,
    num_turns: int,
    vocab: int = 200,
    group_id: int = 0,
    sample_index: int = 0,
    advantage: float | None = None,
    stop_reason: StopReason = StopReason.FINAL_ANSWER,
) -> Trajectory:
    """A prefix-consistent multi-turn trajectory with random tokens, log-probs and provenance."""
    turns = []
    history: list[int] = []
    for i in range(num_turns):
        if i == 0:
            new = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
            new_sources = [TokenSource.PROMPT] * len(new)
        else:
            obs = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
            new = [1] + obs + [2]  # glue, tool output, glue
            new_sources = [TokenSource.GLUE] + [TokenSource.OBSERVATION] * len(obs) + [TokenSource.GLUE]
        prompt = history + new
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 14))]
        logprobs = [-rng.uniform(0.05, 3.0) for _ in completion]
        turns.append(
            Turn(prompt_ids=prompt, completion_ids=completion, completion_logprobs=logprobs, prompt_sources=new_sources)
        )
        history = prompt + completion
    return Trajectory(
        turns=turns,
        question_id=f"q{group_id}",
        group_id=group_id,
        sample_index=sample_index,
        stop_reason=stop_reason,
        advantage=advantage if advantage is not None else rng.uniform(-1.5, 1.5),
    )


def plan_violations(plan: PackPlan, lengths: Sequence[int], max_items: int, max_padded_tokens: int, world_size: int) -> list[str]:
    """Everything wrong with a plan; empty when it is a valid partition within the limits."""
    from trl_plugins.packing import padded_area

    problems = []
    if plan.world_size != world_size:
        problems.append(f"{plan.world_size} ranks, expected {world_size}")
    if len({len(r) for r in plan.ranks}) > 1:
        problems.append(f"unequal micro-batch counts {[len(r) for r in plan.ranks]}")
    flat = sorted(i for r in plan.ranks for mb in r for i in mb)
    if flat != list(range(len(lengths))):
        problems.append("not a partition of the items")
    for r, rank in enumerate(plan.ranks):
        for k, mb in enumerate(rank):
            if len(mb) > max_items:
                problems.append(f"rank {r} mb {k}: {len(mb)} items > {max_items}")
            if padded_area(lengths, mb) > max_padded_tokens:
                problems.append(f"rank {r} mb {k}: area {padded_area(lengths, mb)} > {max_padded_tokens}")
    return problems


# -- contract checks, one per seam -----------------------------------------------------------------


class ContractError(AssertionError):
    """A plugin breaks its seam's contract; the message names the plugin and what is wrong."""


def _resolve(registry: Any, plugin: Any, kwargs: Mapping[str, Any] | None) -> tuple[str, Any]:
    """``(label, instance)`` for a registry name / ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance."""
    if isinstance(plugin, str):
        target = registry.get(plugin)
        return f"{registry.seam} plugin {plugin!r}", target(**(kwargs or {})) if inspect.isclass(target) else target
    return f"{registry.seam} plugin {type(plugin).__name__}", plugin


def _check(ok: bool, label: str, what: str) -> None:
    if not ok:
        raise ContractError(f"{label}: {what}")


def _pickles(obj: Any, label: str, *, equal: bool = True) -> None:
    try:
        back = pickle.loads(pickle.dumps(obj))
    except Exception as exc:  # the trainer may ship plugins to other processes
        raise ContractError(f"{label}: does not pickle ({type(exc).__name__}: {exc}); use a callable class, not a closure.") from exc
    if equal:
        _check(back == obj, label, "does not compare equal to its pickled copy")


_N, _T = 6, 9


def check_advantage_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """An advantage estimator: ``(N,)`` or ``(N, T)`` finite advantages, zero off the action mask, picklable.

    Estimators that declare ``needs_values`` get critic values and bootstrap fields on the input.
    """
    import torch

    from trl_plugins.registry import ADVANTAGES

    label, est = _resolve(ADVANTAGES, plugin, kwargs)
    for flag in ("needs_values", "needs_groups"):
        _check(isinstance(getattr(est, flag, None), bool), label, f"must declare {flag} (a bool)")
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(_N, _T, generator=g) < 0.6).float()
    mask[:, -1] = 1
    inp = AdvantageInput(
        rewards=torch.randn(_N, generator=g),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        action_mask=mask,
        values=torch.randn(_N, _T, generator=g),
        bootstrap_mask=torch.tensor([0, 1, 0, 0, 1, 0]),
        bootstrap_values=torch.randn(_N, generator=g),
        token_rewards=torch.zeros(_N, _T),
    )
    out = est(inp)
    _check(isinstance(out, AdvantageOutput), label, f"returned {type(out).__name__}, not AdvantageOutput")
    _check(tuple(out.advantages.shape) in {(_N,), (_N, _T)}, label, f"advantages of shape {tuple(out.advantages.shape)}")
    _check(bool(torch.isfinite(out.advantages).all()), label, "non-finite advantages")
    if out.advantages.dim() == 2:
        _check(bool((out.advantages[mask == 0] == 0).all()), label, "non-zero advantage off the action mask")
    _pickles(est, label)


def check_policy_loss_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """A policy loss: ``(B, T)`` finite per-token loss, 0 and zero-gradient off the mask, picklable."""
    import torch

    from trl_plugins.registry import POLICY_LOSSES

    label, loss_fn = _resolve(POLICY_LOSSES, plugin, kwargs)
    for flag in ("needs_ref_logprobs", "needs_entropy"):
        _check(isinstance(getattr(loss_fn, flag, None), bool), label, f"must declare {flag} (a bool)")
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(_N, _T, generator=g) < 0.5).float()
    logp = (-torch.rand(_N, _T, generator=g) * 3).requires_grad_(True)
    inp = PolicyLossInput(
        logprobs=logp,
        behaviour_logprobs=logp.detach() + 0.3 * torch.randn(_N, _T, generator=g),
        advantages=torch.randn(_N, _T, generator=g) * mask,
        action_mask=mask,
        ref_logprobs=logp.detach() + 0.1,
        entropy=torch.rand(_N, _T, generator=g),
    )
    out = loss_fn(inp)
    _check(isinstance(out, PolicyLossOutput), label, f"returned {type(out).__name__}, not PolicyLossOutput")
    loss = out.per_token_loss
    _check(tuple(loss.shape) == (_N, _T) and bool(torch.isfinite(loss).all()), label, "per-token loss not a finite (B, T) tensor")
    _check(bool((loss[mask == 0] == 0).all()), label, "non-zero loss off the action mask")
    loss.sum().backward()
    _check(bool((logp.grad[mask == 0] == 0).all()), label, "masked tokens receive gradient")
    _check(float(logp.grad[mask == 1].abs().sum()) > 0, label, "no gradient on the action tokens")
    _pickles(loss_fn, label)


def check_packer_contract(plugin: Any) -> None:
    """A packer: a valid partition within both limits, the same micro-batch count on every rank."""
    from trl_plugins.registry import PACKERS

    label = f"packer {plugin!r}" if isinstance(plugin, str) else f"packer {getattr(plugin, '__name__', plugin)}"
    packer = PACKERS.get(plugin) if isinstance(plugin, str) else plugin
    rng = random.Random(2)
    for world_size in (1, 3):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(0, 60))]
        plan = packer(lengths, max_items=7, max_padded_tokens=1500, world_size=world_size)
        problems = plan_violations(plan, lengths, 7, 1500, world_size)
        _check(not problems, label, f"world_size {world_size}: {problems}")
    _check(pickle.loads(pickle.dumps(packer)) is packer, label, "does not pickle by reference (define it at module level)")


def _reward_cases() -> list[tuple[str, Trajectory]]:
    """``(description, trajectory)``: what a reward component meets in training. Every stop reason the
    trainer scores (world failures are not scored), right, wrong and missing answers, a tool call that
    failed, an empty last turn, one turn or two."""
    from trl_plugins.types import ToolCall

    cases = []
    for reason in StopReason:
        if reason.is_world_failure:
            continue
        traj = make_trajectory(random.Random(3), num_turns=2, stop_reason=reason)
        traj.turns[0].text = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
        traj.turns[0].tool_call = ToolCall("code_interpreter", {"code": "print(6 * 7)"}, output="42\n", ok=True)
        traj.turns[-1].text = "The answer is \\boxed{42}."
        traj.turns[-1].truncated = reason == StopReason.TURN_LENGTH
        cases.append((f"stopped by {reason.value}", traj))
    wrong = make_trajectory(random.Random(4), num_turns=1)
    wrong.turns[-1].text = "The answer is \\boxed{7}."
    cases.append(("with a wrong answer", wrong))
    missing = make_trajectory(random.Random(5), num_turns=1, stop_reason=StopReason.NO_TOOL_CALL)
    missing.turns[-1].text = "I do not know."
    cases.append(("without an answer", missing))
    empty = make_trajectory(random.Random(6), num_turns=1, stop_reason=StopReason.NO_TOOL_CALL)
    empty.turns[-1].completion_ids, empty.turns[-1].completion_logprobs, empty.turns[-1].text = [], [], ""
    cases.append(("with an empty last turn", empty))
    failed = make_trajectory(random.Random(7), num_turns=2, stop_reason=StopReason.INVALID_ACTION)
    failed.turns[0].tool_call = ToolCall("code_interpreter", {"code": "1 / 0"}, output="ZeroDivisionError: division by zero")
    failed.turns[-1].text = "<tool_call>\n{not json"
    cases.append(("after a failed tool call, ending in a malformed one", failed))
    return cases


def check_reward_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    example: Mapping[str, Any] | None = None,
    trajectories: Sequence[Trajectory] | None = None,
    deterministic: bool = True,
) -> None:
    """A reward component, called as the trainer calls it: ``component(trajectory, example)`` on every
    trajectory the trainer would score returns one finite number (the trainer's own rule,
    :func:`trl_plugins.rewards.reward_value`) without raising, leaves the trajectory and the example
    unchanged, returns the same value again for the same input (``deterministic``; pass ``False`` for a
    sampled judge), has an ``is_success(value)`` that returns a bool if it has one, a ``close()`` that
    can be called twice if it has one, and pickles.

    A component that raises is not scoring the trajectory as wrong: the trainer ends that trajectory as
    ``verifier_error`` and does not train on it. So a wrong, missing or truncated answer must get a
    value; raise only when the component cannot score at all (its verifier is down, the example lacks a
    column it needs).

    Args:
        plugin: A registry name, ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance.
        example: The dataset row (default ``{"answer": "42", "prompt": "What is 6 * 7?"}``).
        trajectories: Replace the built-in ones (one per stop reason the trainer scores, with the answer
            ``\\boxed{42}``, plus a wrong answer, no answer, an empty last turn and a failed tool call).
            Each must pass :func:`~trl_plugins.rollout.validate.validate_trajectory`.

    Raises:
        ContractError: naming the plugin, the trajectory and what is wrong.
        TrajectoryError: a trajectory given in ``trajectories`` breaks the trajectory contract.
    """
    import copy

    from trl_plugins.registry import REWARDS
    from trl_plugins.rewards import reward_value
    from trl_plugins.rollout.validate import validate_trajectory
    from trl_plugins.tools.base import close_plugin

    label, reward = _resolve(REWARDS, plugin, kwargs)
    _check(callable(reward), label, f"{type(reward).__name__} is not callable as component(trajectory, example)")
    example = dict(example if example is not None else {"answer": "42", "prompt": "What is 6 * 7?"})
    if trajectories is None:
        cases = _reward_cases()
    else:
        cases = [(f"number {i} (stopped by {t.stop_reason})", t) for i, t in enumerate(trajectories)]
    is_success = getattr(reward, "is_success", None)
    for what, traj in cases:
        validate_trajectory(traj)  # the trainer scores only trajectories that pass it
        where = f"{label} on the trajectory {what}"
        values = []
        for _ in range(2 if deterministic else 1):
            before, row = pickle.dumps(traj), copy.deepcopy(example)
            try:
                returned = reward(traj, row)
            except Exception as exc:
                raise ContractError(
                    f"{where}: raised {type(exc).__name__}: {exc}. The trainer would end the trajectory as "
                    f"verifier_error and not train on it; return a value for a wrong, missing or truncated answer "
                    f"and raise only when the component cannot score at all."
                ) from exc
            try:
                values.append(reward_value(returned))
            except (TypeError, ValueError) as exc:
                raise ContractError(f"{where}: {exc}") from None
            _check(pickle.dumps(traj) == before, where, "changed the trajectory it scored")
            _check(row == example, where, "changed the example (the dataset row every sample of the group shares)")
        _check(len(set(values)) == 1, where,
               f"returned {values[0]} and then {values[-1]} for the same trajectory and example; a reward must depend "
               f"on them only (seed any randomness), or pass deterministic=False")
        if is_success is not None:
            verdict = is_success(values[0])
            _check(isinstance(verdict, bool) or type(verdict).__name__ == "bool_", label,
                   f"is_success({values[0]}) returned {verdict!r}, not a bool")
    _pickles(reward, label, equal=False)
    try:
        close_plugin(reward)
        close_plugin(reward)
    except Exception as exc:
        raise ContractError(f"{label}: close() raised {type(exc).__name__}: {exc} (it must be idempotent)") from exc


_SAMPLE_VALUES = {"string": "1", "integer": 1, "number": 1.0, "boolean": True, "object": {}, "array": []}
_WRONG_VALUES = {"string": 1, "integer": "1", "number": "1", "boolean": "yes", "object": "{}", "array": "[]"}


def _schema_problem(schema: Any, name: str) -> str | None:
    """Why ``schema`` is not an OpenAI function schema for the tool ``name``, or None."""
    import json

    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        return f"schema() returned {schema!r:.200}; it must be {{'type': 'function', 'function': {{...}}}}"
    fn = schema["function"]
    if fn.get("name") != name:
        return f"schema()['function']['name'] is {fn.get('name')!r}, but the tool's name is {name!r}; the model calls it by the schema's"
    if not isinstance(fn.get("description"), str) or not fn["description"].strip():
        return "schema()['function'] has no 'description': the model is told what the tool does only there"
    params = fn.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(params.get("properties", {}), dict):
        return "schema()['function']['parameters'] must be a JSON-schema object: {'type': 'object', 'properties': {...}}"
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(required, list) or any(k not in props for k in required):
        return f"schema()['function']['parameters']['required'] ({required!r}) must list keys of 'properties' ({sorted(props)})"
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        return f"schema() is not JSON (the chat template renders it as JSON): {exc}"
    return None


def check_tool_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    arguments: Mapping[str, Any] | None = None,
    concurrent_calls: int = 4,
) -> None:
    """A tool, called as the rollout calls it.

    Asserts: a non-empty ``name``; an OpenAI function schema naming it, with a description and an object
    of parameters whose required keys are among its properties, that the trainer's chat format renders
    to the model and whose call, written as the model writes it, parses back to ``arguments`` (else the
    rollout would refuse every such call as ``invalid_action``); an ``async __call__`` that returns a
    :class:`~trl_plugins.tools.base.ToolOutput` (``text`` a str, ``ok`` a bool) without raising, with no
    ``infra_error`` for ``arguments`` (run alone and ``concurrent_calls`` at once on one event loop, as
    the rollout does) and ``ok=False`` without ``infra_error`` for arguments the schema refuses (missing,
    unexpected or mistyped: the model's mistake, which it should see); ``idempotent`` a bool if
    declared; ``start_up()`` a str and ``step_metrics()`` ``{name: float}`` and
    ``step_metric_reductions()`` ``{name: "sum" | "max" | "min" | "mean"}`` if defined; a ``close()``
    that can be called twice, after which the tool works again; and that it pickles. The tool is closed
    at the end.

    Args:
        plugin: A registry name, ``"pkg.mod:attr"`` (constructed with ``kwargs``) or an instance.
        arguments: Valid arguments (default: one value of the schema's type per required parameter).
        concurrent_calls: Calls run at once (0: none).

    Raises:
        ContractError: naming the plugin and what is wrong.
    """
    from trl_plugins.registry import TOOLS
    from trl_plugins.rollout.engine import run_async
    from trl_plugins.tools.base import ToolOutput, check_arguments, close_plugin

    label, tool = _resolve(TOOLS, plugin, kwargs)

    async def call(args: dict, times: int = 1) -> list[Any]:
        return list(await asyncio.gather(*(tool(dict(args)) for _ in range(times))))

    def run(args: dict, times: int = 1) -> list[ToolOutput]:
        try:
            outs = run_async(call(args, times))
        except Exception as exc:
            raise ContractError(
                f"{label}: raised {type(exc).__name__}: {exc} on arguments {args}. A tool never raises: the model's "
                f"mistakes are ToolOutput(text='Error: ...', ok=False), the tool's own failures "
                f"ToolOutput(infra_error=..., ok=False); the rollout counts an exception as the latter."
            ) from exc
        for out in outs:
            _check(isinstance(out, ToolOutput) and isinstance(out.text, str) and isinstance(out.ok, bool), label,
                   f"returned {out!r:.200} for arguments {args}, not a ToolOutput(text: str, ok: bool, ...)")
        return outs

    try:
        name = getattr(tool, "name", None)
        _check(isinstance(name, str) and bool(name), label, f"name {name!r} is not a non-empty string")
        label = f"{label} (name {name!r})" if isinstance(plugin, str) and plugin != name else label
        _check(callable(getattr(tool, "schema", None)), label, "has no schema() method: the model would not be told the tool exists")
        schema = tool.schema()
        problem = _schema_problem(schema, name)
        _check(problem is None, label, str(problem))
        _check(inspect.iscoroutinefunction(type(tool).__call__), label, "__call__ must be async (the rollout awaits it)")
        idempotent = getattr(tool, "idempotent", False)
        _check(isinstance(idempotent, bool), label, f"idempotent must be a bool, got {idempotent!r}")
        params = schema["function"]["parameters"]
        props = params.get("properties", {})
        if arguments is None:
            arguments = {k: _SAMPLE_VALUES.get(props[k].get("type"), "1") for k in params.get("required", [])}
        arguments = dict(arguments)
        why = check_arguments(schema, arguments)
        _check(why is None, label, f"the arguments {arguments} do not fit the schema ({why}): the rollout would refuse "
                                   f"such a call as invalid_action before the tool runs")
        _check_renders_and_parses(label, schema, arguments)
        start_up = getattr(tool, "start_up", None)
        if callable(start_up):
            said = start_up()
            _check(isinstance(said, str), label, f"start_up() returned {said!r:.100}; it returns what the trainer logs (a str)")

        for out in run(arguments) + (run(arguments, concurrent_calls) if concurrent_calls else []):
            _check(out.infra_error is None, label,
                   f"failed itself on the valid arguments {arguments}: infra_error={out.infra_error!r}")
        bad = [{}, {**arguments, "unexpected_argument": "1"}]
        bad += [{**arguments, k: _WRONG_VALUES.get(props[k].get("type"), None)} for k in params.get("required", [])]
        for args in bad:
            why = check_arguments(schema, args)
            if why is None:  # valid after all (no required keys, extra keys allowed)
                continue
            (out,) = run(args)
            _check(not out.ok and out.infra_error is None, label,
                   f"returned ok={out.ok}, infra_error={out.infra_error!r} for arguments {args} that break its schema "
                   f"({why}); the model's mistake is ToolOutput(text='Error: ...', ok=False) so that it sees it, "
                   f"not an infra_error (which ends the trajectory untrained)")

        step_metrics = getattr(tool, "step_metrics", None)
        if callable(step_metrics):
            metrics = step_metrics()
            _check(isinstance(metrics, dict) and all(isinstance(k, str) and isinstance(v, (int, float))
                                                     and not isinstance(v, bool) for k, v in metrics.items()),
                   label, f"step_metrics() returned {metrics!r:.200}; it must return {{name: float}}")
        reductions = getattr(tool, "step_metric_reductions", None)
        if callable(reductions):
            declared = reductions()
            _check(isinstance(declared, dict) and all(v in _REDUCTIONS for v in declared.values()), label,
                   f"step_metric_reductions() returned {declared!r:.200}; each value must be one of {list(_REDUCTIONS)}")
        _pickles(tool, label, equal=False)

        if callable(getattr(tool, "close", None)):
            try:
                close_plugin(tool)
                close_plugin(tool)
            except Exception as exc:
                raise ContractError(f"{label}: close() raised {type(exc).__name__}: {exc} (it must be idempotent)") from exc
            (out,) = run(arguments)
            _check(out.infra_error is None, label,
                   f"does not work after close(): infra_error={out.infra_error!r}; a closed tool starts its resources "
                   f"again on its next call")
    except BaseException:
        with contextlib.suppress(Exception):  # the contract error is the news, not a second failure closing
            close_plugin(tool)
        raise
    close_plugin(tool)


def _check_renders_and_parses(label: str, schema: dict, arguments: dict) -> None:
    """The trainer's chat format shows ``schema`` to the model, and a call written as the model writes it
    parses back to ``arguments`` (a Qwen2.5 template on a tiny tokenizer)."""
    import json

    from trl_plugins.rollout import ChatFormat, TurnKind
    from trl_plugins.rollout.chat import ChatTemplateError

    name = schema["function"]["name"]
    tok = build_tokenizer("qwen2_5")
    try:
        chat = ChatFormat(tok, [schema])
    except ChatTemplateError as exc:
        raise ContractError(f"{label}: the chat format refuses its schema: {exc}") from exc
    prompt = chat.initial_prompt_ids([{"role": "user", "content": "question"}])
    _check(name in tok.decode(prompt), label, "its schema does not reach the prompt the model sees")
    body = f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    completion = tok(body, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    parsed = chat.parse(prompt, completion)
    _check(parsed.kind == TurnKind.TOOL_CALL and parsed.tool_name == name and parsed.arguments == arguments, label,
           f"a call of it with {arguments}, as the model writes it, parses as {parsed.kind} "
           f"({parsed.tool_name!r}, {parsed.arguments!r}, error {parsed.error!r}), not as that call")


def check_rollout_contract(plugin: Any, kwargs: Mapping[str, Any] | None = None) -> None:
    """A rollout: declares ``token_budget``; on a scripted tool-calling policy it returns
    ``len(questions) * group_size`` trajectories, question-major, each passing
    :func:`~trl_plugins.rollout.validate.validate_trajectory` and within the token budget.
    """
    from trl_plugins.registry import ROLLOUTS
    from trl_plugins.rollout import ChatFormat, RolloutRequest, ScriptedBackend, questions_from_rows
    from trl_plugins.rollout.validate import validate_trajectory
    from trl_plugins.tools.base import ToolOutput

    label, rollout = _resolve(ROLLOUTS, plugin, kwargs)
    budget = getattr(rollout, "token_budget", "missing")
    _check(budget is None or (isinstance(budget, int) and budget > 0), label,
           f"token_budget must be a positive int or None, got {budget!r}")

    class EchoTool:
        name = "echo"

        def schema(self) -> dict:
            return {"type": "function", "function": {"name": "echo", "description": "Echo the text.",
                    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

        async def __call__(self, arguments: dict) -> ToolOutput:
            return ToolOutput(text=str(arguments.get("text")) + "\n", ok=True)

    tool = EchoTool()
    chat = ChatFormat(build_tokenizer("qwen2_5"), [tool.schema()])
    tok = chat.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        if tok.decode(prompt).count("<tool_response>") < 1:
            body = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
        else:
            body = "The answer is \\boxed{1}."
        return tok(body, add_special_tokens=False)["input_ids"] + [end]

    rows = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Say hi twice."}]
    request = RolloutRequest(questions_from_rows(chat, rows), 2, ScriptedBackend(script, stop_token_ids=chat.stop_token_ids),
                             chat, {"echo": tool})
    result = rollout(request)
    trajs = result.trajectories
    _check(len(trajs) == 4, label, f"returned {len(trajs)} trajectories for 2 questions x 2 samples")
    _check([t.question_id for t in trajs] == ["a", "a", "b", "b"], label, "trajectories are not question-major")
    for t in trajs:
        validate_trajectory(t)
        if budget is not None:
            _check(t.num_tokens <= budget, label, f"a trajectory of {t.num_tokens} tokens exceeds token_budget {budget}")
    _pickles(rollout, label)
