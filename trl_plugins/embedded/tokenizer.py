"""A tiny byte-level BPE tokenizer with the real Qwen chat templates, built locally in ~1 s.

The vocabulary is trained on a small built-in corpus of arithmetic, Python and chat text; digits are
split one per token (as in Qwen2), so multi-digit arithmetic is tokenised the way real models see it.
The special and added tokens are Qwen's (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ...), and
the chat template is the exact file TRL ships in ``trl/chat_templates/`` (TRL recognises templates by
exact string match, so a copy would not do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["CHAT_TEMPLATES", "build_tokenizer", "load_trl_chat_template"]

# Qwen2's pre-tokenisation regex: single digits, words, punctuation runs, newlines, spaces.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Control tokens (``special=True``): never produced by tokenising text from a tool."""
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
"""Atomic markup tokens (``special=False``, as in Qwen's tokenizers)."""

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


def build_tokenizer(template: str = "qwen2_5", vocab_size: int = 512, extra_corpus: Sequence[str] = ()):
    """Train a tiny byte-level BPE tokenizer and attach a TRL chat template.

    Args:
        template: A file name (without ``.jinja``) in ``trl/chat_templates/``.
        vocab_size: Target vocabulary size (before the special and added tokens).
        extra_corpus: More training text, e.g. the rendered system prompt and tool schemas of a recipe,
            so that text every prompt repeats costs few tokens.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with Qwen's special tokens, ``eos_token="<|im_end|>"``
        and ``pad_token="<|endoftext|>"``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken as TkAddedToken
    from transformers import AddedToken, PreTrainedTokenizerFast

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
        special_tokens=[TkAddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4 + list(extra_corpus) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": []})
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    fast.chat_template = load_trl_chat_template(template)
    return fast
