"""Tiny models and tokenizers built locally (nothing is downloaded): a byte-level BPE tokenizer with a real
chat template from ``trl/chat_templates`` and the special tokens of its model family, and a small random
``Qwen2ForCausalLM``. Recipes (for a default model of their own), the benchmarks, the template matrix and the tests
build
on them; so can a plugin package's own tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "CHAT_TEMPLATES",
    "FAMILIES",
    "TokenizerFamily",
    "template_family",
    "load_trl_chat_template",
    "build_tokenizer",
    "tiny_model_config",
    "build_tiny_model",
]

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
    "qwen_vl": TokenizerFamily(
        tuple(SPECIAL_TOKENS) + _VISION, tuple(ADDED_TOKENS), eos="<|im_end|>", pad="<|endoftext|>"
    ),
    "nemotron": TokenizerFamily(
        ("<s>", "</s>", "<|im_start|>", "<|im_end|>"),
        tuple(ADDED_TOKENS) + ("<tools>", "</tools>"),
        eos="<|im_end|>",
        bos="<s>",
        pad="</s>",
    ),
    "llama3": TokenizerFamily(
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
            "<|finetune_right_pad_id|>",
        ),
        eos="<|eot_id|>",
        bos="<|begin_of_text|>",
        pad="<|finetune_right_pad_id|>",
    ),
    "lfm2": TokenizerFamily(
        (
            "<|startoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|pad|>",
            "<|tool_list_start|>",
            "<|tool_list_end|>",
            "<|tool_call_start|>",
            "<|tool_call_end|>",
            "<|tool_response_start|>",
            "<|tool_response_end|>",
        ),
        ("<think>", "</think>"),
        eos="<|im_end|>",
        bos="<|startoftext|>",
        pad="<|pad|>",
    ),
    "glm4": TokenizerFamily(
        ("<|endoftext|>", "[gMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        (
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        eos="<|endoftext|>",
        pad="<|endoftext|>",
    ),
    "gptoss": TokenizerFamily(
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        eos="<|return|>",
        pad="<|endoftext|>",
    ),
    "gemma": TokenizerFamily(
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), eos="<eos>", bos="<bos>", pad="<pad>"
    ),
    "gemma4": TokenizerFamily(
        (
            "<bos>",
            "<eos>",
            "<pad>",
            "<|turn>",
            "<turn|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            "<|channel>",
            "<channel|>",
            "<|think|>",
            "<|image|>",
            "<|audio|>",
            "<|video|>",
        ),
        ('<|"|>',),
        eos="<eos>",
        bos="<bos>",
        pad="<pad>",
    ),
    "deepseek": TokenizerFamily(
        (
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>",
            "<｜tool▁output▁begin｜>",
            "<｜tool▁output▁end｜>",
            "<｜tool▁sep｜>",
        ),
        ("<think>", "</think>"),
        eos="<｜end▁of▁sentence｜>",
        bos="<｜begin▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
    ),
    "cohere": TokenizerFamily(
        (
            "<BOS_TOKEN>",
            "<EOS_TOKEN>",
            "<PAD>",
            "<|START_OF_TURN_TOKEN|>",
            "<|END_OF_TURN_TOKEN|>",
            "<|USER_TOKEN|>",
            "<|CHATBOT_TOKEN|>",
            "<|SYSTEM_TOKEN|>",
            "<|START_RESPONSE|>",
            "<|END_RESPONSE|>",
            "<|START_ACTION|>",
            "<|END_ACTION|>",
            "<|START_TOOL_RESULT|>",
            "<|END_TOOL_RESULT|>",
            "<|START_THINKING|>",
            "<|END_THINKING|>",
        ),
        eos="<|END_OF_TURN_TOKEN|>",
        bos="<BOS_TOKEN>",
        pad="<PAD>",
    ),
    "phi3": TokenizerFamily(
        ("<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        eos="<|end|>",
        bos="<s>",
        pad="<|endoftext|>",
    ),
    "muse": TokenizerFamily(
        ("<|start|>", "<|message|>", "<|eot|>", "<|eom|>", "<|patch|>", "<|video|>", "<|pad|>"),
        eos="<|eot|>",
        pad="<|pad|>",
    ),
    "mistral": TokenizerFamily(("<s>", "</s>", "<unk>"), eos="</s>", bos="<s>", pad="<unk>"),
    "smol": TokenizerFamily(
        ("<|im_start|>", "<end_of_utterance>", "<|endoftext|>", "<|begin_of_text|>"),
        eos="<end_of_utterance>",
        bos="<|im_start|>",
        pad="<|endoftext|>",
    ),
}
"""Special tokens per model family, for tokenizers built by :func:`build_tokenizer`."""


def template_family(template: str) -> str:
    """The :data:`FAMILIES` key of a ``trl/chat_templates`` file name."""
    name = template.removesuffix("_training")
    for prefix, family in (
        ("qwen2_5_vl", "qwen_vl"),
        ("qwen3_vl", "qwen_vl"),
        ("qwen3_5", "qwen_vl"),
        ("qwen3_6", "qwen_vl"),
        ("qwen3_8", "qwen_vl"),
        ("qwen", "qwen"),
        ("nemotron", "nemotron"),
        ("llama", "llama3"),
        ("lfm2", "lfm2"),
        ("glm", "glm4"),
        ("gptoss", "gptoss"),
        ("gemma4", "gemma4"),
        ("diffusion_gemma", "gemma4"),
        ("gemma", "gemma"),
        ("deepseek", "deepseek"),
        ("cohere", "cohere"),
        ("phi3", "phi3"),
        ("muse", "muse"),
        ("llava", "mistral"),
        ("idefics3", "smol"),
        ("smolvlm", "smol"),
    ):
        if name.startswith(prefix):
            return family
    raise KeyError(f"no tokenizer family known for chat template {template!r}; known: {', '.join(FAMILIES)}")


CHAT_TEMPLATES = ("qwen2_5", "qwen3")
"""Templates :func:`build_tokenizer` is tested with; any file name in ``trl/chat_templates/`` loads."""

_CORPUS = [
    "You are a helpful assistant. Solve the problem step by step, call the code_interpreter tool to run "
    "Python when it helps, and put the final answer in \\boxed{} on its own line.",
    "What is 123 * 456 + 789? Let me compute it with Python. The answer is \\boxed{56877}.",
    "print(123 * 456 + 789)\nresult = sum(range(10))\nfor i in range(3):\n    print(i ** 2)\n",
    'import math\nimport numpy as np\nimport sympy as sp\nx = sp.Symbol("x")\nprint(sp.solve(x**2 - 4, x))\n',
    'Traceback (most recent call last):\n  File "<code>", line 1, in <module>\nZeroDivisionError: division by zero\n',
    '{"name": "code_interpreter", "arguments": {"code": "print(1 + 1)"}}',
    "The tool returned 2. Therefore the result is \\boxed{2}. user assistant system tool function",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n",
    "For each function call, return a json object with function name and arguments within XML tags:\n"
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


def build_tokenizer(
    template: str = "qwen2_5", vocab_size: int = 512, extra_corpus: Sequence[str] = (), family: str | None = None
):
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
    from tokenizers import AddedToken as TkAddedToken
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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


def tiny_model_config(
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    sliding_window: int | None = None,
):
    """The ``Qwen2Config`` :func:`build_tiny_model` builds its model from (vocab = ``len(tokenizer)``): what a check
    that needs the model's shape but not its weights reads (a recipe's dry run). The arguments are
    :func:`build_tiny_model`'s."""
    from transformers import Qwen2Config

    return Qwen2Config(
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
        **(
            {"use_sliding_window": True, "sliding_window": sliding_window, "max_window_layers": 0}
            if sliding_window
            else {}
        ),
    )


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
    """A randomly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer`` (vocab = ``len(tokenizer)``), built from
    :func:`tiny_model_config`.

    ``sliding_window`` turns on Qwen2's sliding-window attention in every layer: each token attends to
    the last ``sliding_window`` positions only. A tiny model trained for minutes learns to copy numbers
    (question -> code, tool output -> answer) far faster when its attention is not spread over a long
    system prompt.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    config = tiny_model_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_positions=max_positions,
        sliding_window=sliding_window,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = attn_implementation
    return model
