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
import inspect
import math
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

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


def _finished(stop_reason: StopReason) -> Trajectory:
    rng = random.Random(3)
    traj = make_trajectory(rng, num_turns=2, stop_reason=stop_reason)
    traj.turns[-1].text = "The answer is \\boxed{42}."
    return traj


def check_reward_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    example: Mapping[str, Any] | None = None,
    trajectories: Sequence[Trajectory] | None = None,
) -> None:
    """A reward component: ``component(trajectory, example)`` returns a finite float for finished
    trajectories of every stop reason, does not change the trajectory, and pickles.

    ``example`` is the dataset row (default ``{"answer": "42", "prompt": "..."}``); ``trajectories``
    replaces the built-in fake ones (one per stop reason, last turn ``The answer is \\boxed{42}.``).
    """
    from trl_plugins.registry import REWARDS

    label, reward = _resolve(REWARDS, plugin, kwargs)
    example = dict(example or {"answer": "42", "prompt": "What is 6 * 7?"})
    trajs = list(trajectories) if trajectories is not None else [_finished(r) for r in StopReason]
    for traj in trajs:
        before = pickle.dumps(traj)
        value = reward(traj, example)
        where = f"{label} on a trajectory stopped by {traj.stop_reason}"
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), where, f"returned {value!r}, not a float")
        _check(math.isfinite(float(value)), where, f"returned {value}")
        _check(pickle.dumps(traj) == before, where, "changed the trajectory it scored")
    _pickles(reward, label, equal=False)


def check_tool_contract(
    plugin: Any,
    kwargs: Mapping[str, Any] | None = None,
    *,
    arguments: Mapping[str, Any] | None = None,
) -> None:
    """A tool: a name, an OpenAI-format schema, an async call returning :class:`ToolOutput` for
    ``arguments`` (default: one value of the schema's type per required parameter) and for bad
    arguments without raising, optional ``step_metrics`` returning floats, and ``close``; picklable.
    """
    from trl_plugins.registry import TOOLS
    from trl_plugins.tools.base import ToolOutput

    label, tool = _resolve(TOOLS, plugin, kwargs)
    try:
        name = tool.name
        _check(isinstance(name, str) and name, label, f"name {name!r} is not a non-empty string")
        schema = tool.schema()
        fn = schema.get("function", {})
        _check(schema.get("type") == "function" and fn.get("name") == name, label,
               "schema() must be {'type': 'function', 'function': {'name': <tool.name>, ...}}")
        _check(isinstance(fn.get("parameters"), dict), label, "schema has no 'parameters' object")
        _check(inspect.iscoroutinefunction(type(tool).__call__), label, "__call__ must be async")
        if arguments is None:
            samples = {"string": "1", "integer": 1, "number": 1.0, "boolean": True, "object": {}, "array": []}
            props = fn["parameters"].get("properties", {})
            arguments = {k: samples.get(props.get(k, {}).get("type"), "1") for k in fn["parameters"].get("required", [])}
        for args in (dict(arguments), {"unexpected": object.__name__}, {}):
            out = asyncio.run(tool(args))
            _check(isinstance(out, ToolOutput) and isinstance(out.text, str), label,
                   f"returned {type(out).__name__} for arguments {args}; a tool returns ToolOutput and never raises on model input")
        step_metrics = getattr(tool, "step_metrics", None)
        if step_metrics is not None:
            metrics = step_metrics()
            _check(isinstance(metrics, dict) and all(isinstance(v, (int, float)) for v in metrics.values()), label,
                   "step_metrics() must return {name: float}")
        _pickles(tool, label, equal=False)
    finally:
        close = getattr(tool, "close", None)
        if close is not None:
            close()


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
