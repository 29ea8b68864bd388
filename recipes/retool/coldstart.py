"""Cold start for the embedded default: synthetic tool-use transcripts and a short TRL SFT stage.

The transcripts are tokenised with the rollout's own :class:`~trl_plugins.rollout.ChatFormat` (first
prompt, sampled turns, tool-turn glue, observation encoding), so the supervised stage teaches exactly
the token sequences the rollout later produces and parses. Only the assistant's own tokens carry
loss (``assistant_masks``); the prompt, the glue and the tool's output are context.

Only a fraction of the transcripts call the tool; the rest answer "in the head", which a tiny model
cannot do for multi-digit arithmetic. That leaves RL something to learn: call the tool more often.
"""

from __future__ import annotations

import json
import random
from typing import Any, Sequence

__all__ = ["DEFAULT_SYSTEM_PROMPT", "transcript", "cold_start_dataset", "run_cold_start_sft", "copy_accuracy", "receptive_field"]

DEFAULT_SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""System prompt of the recipe and of the cold-start transcripts."""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def transcript(chat: Any, problem: dict, *, use_tool: bool, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
               tool_name: str = "code_interpreter") -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of one solved problem, as the rollout would build it.

    With ``use_tool`` the first turn calls ``tool_name`` with ``print(<expression>)``, the tool message
    holds what the sandbox prints, and the second turn boxes it; otherwise one turn boxes the answer.

    Returns:
        ``(input_ids, assistant_mask)`` with 1 on the assistant's sampled tokens (end-of-turn included).
    """
    tok = chat.tokenizer
    eos = tok.eos_token_id
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": problem["prompt"]}
    ]
    ids = chat.initial_prompt_ids(messages)
    mask = [0] * len(ids)
    if use_tool:
        final = _ids(tok, f"The answer is \\boxed{{{problem['answer']}}}.") + [eos]
    else:  # "in the head": restate the expression, then the answer (a tiny model can only guess it)
        final = _ids(tok, f"{problem['expression']} = \\boxed{{{problem['answer']}}}.") + [eos]
    if use_tool:
        call = {"name": tool_name, "arguments": {"code": f"print({problem['expression']})"}}
        first = _ids(tok, "<tool_call>\n" + json.dumps(call) + "\n</tool_call>") + [eos]
        glue = chat.tool_turn(first, f"{problem['answer']}\n", tool_name=tool_name, arguments=call["arguments"]).ids
        ids += first + glue
        mask += [1] * len(first) + [0] * len(glue)
    ids += final
    mask += [1] * len(final)
    return ids, mask


def receptive_field(model_config: Any) -> int | None:
    """How many positions back a token's logits can depend on: layers x window for a model whose every
    layer uses sliding-window attention, None (unbounded) otherwise."""
    window = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None) or []
    if not window or not layer_types or any(t != "sliding_attention" for t in layer_types):
        return None
    return len(layer_types) * window


def cold_start_dataset(chat: Any, problems: Sequence[dict], *, tool_fraction: float, seed: int = 0,
                       system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, left_context: int | None = None):
    """A pre-tokenised ``datasets.Dataset`` (``input_ids``, ``assistant_masks``) for TRL's SFTTrainer.

    ``left_context``: keep only this many tokens before the first assistant token. With the model's
    :func:`receptive_field` the loss and its gradient are unchanged (nothing further back reaches a
    loss position, and RoPE only sees relative positions) while the long system prompt stops costing
    compute.

    Raises:
        ValueError: ``tool_fraction`` outside [0, 1].
    """
    from datasets import Dataset

    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}.")
    rng = random.Random(f"cold-start/{seed}")
    rows = []
    for problem in problems:
        ids, mask = transcript(chat, problem, use_tool=rng.random() < tool_fraction, system_prompt=system_prompt)
        if left_context is not None:
            cut = max(mask.index(1) - left_context, 0)
            ids, mask = ids[cut:], mask[cut:]
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return Dataset.from_list(rows)


def run_cold_start_sft(model: Any, tokenizer: Any, dataset: Any, output_dir: str, *, epochs: float = 1.0,
                       learning_rate: float = 3e-3, batch_size: int = 32, seed: int = 0, show_progress: bool = True):
    """Supervised warm start with TRL's SFTTrainer (fp32, CPU-friendly); returns the trained model."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=output_dir,
        num_train_epochs=epochs,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        # Constant: copying numbers is learned in a sudden transition after a few hundred steps, which
        # a decaying rate can stall.
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        weight_decay=0.0,
        logging_steps=20,
        save_strategy="no",
        report_to=[],
        bf16=False,
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        max_length=None,
        disable_tqdm=not show_progress,
        dataloader_num_workers=0,
        activation_checkpointing=True,  # TRL's default, by its new name (the old one raises a FutureWarning)
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer.model


def copy_accuracy(model: Any, chat: Any, problems: Sequence[dict], *,
                  system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> float:
    """Teacher-forced share of the digits a tool-using transcript copies that the model gets right.

    The digits are those the assistant writes: the expression in the code (copied from the question)
    and the boxed answer (copied from the tool's output). A model that cannot copy scores ~0.1.
    """
    import torch

    tok = chat.tokenizer
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    rows = [transcript(chat, p, use_tool=True, system_prompt=system_prompt) for p in problems]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for r, (ids, _) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
    was_training = model.training
    model.eval()
    with torch.no_grad():
        predicted = model(input_ids=input_ids, attention_mask=attention).logits.argmax(-1)
    model.train(was_training)
    hits = total = 0
    for r, (ids, mask) in enumerate(rows):
        for pos in range(1, len(ids)):
            if mask[pos] and ids[pos] in digits:
                total += 1
                hits += int(predicted[r, pos - 1]) == ids[pos]
    return hits / max(total, 1)


def sampled_copy_rate(model: Any, chat: Any, problems: Sequence[dict], *, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                      seed: int = 0) -> float:
    """Share of problems whose two copies a sample at temperature 1 gets right, each after the transcript up to it:
    the expression into the code (from its first digit to its last) and the tool's output into the boxed answer.

    :func:`copy_accuracy` takes the likeliest token at each position, which can be right while the distribution is
    still spread: two builds of the same settings on one machine, one with AVX2 kernels, both scored 1.0 there and
    0.36 and 0.92 here; their held-out accuracy with the tool was 48% and 95%. Sampling is what the rollout does,
    so this is the check that predicts how a build starts.
    """
    import torch

    digits = {chat.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()

    def sampled_right(ids: list[int], start: int, end: int) -> bool:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids[:start]]), use_cache=True)
            for pos in range(start, end):
                probs = torch.softmax(out.logits[0, -1].float(), -1)
                if int(torch.multinomial(probs, 1, generator=gen)) != ids[pos]:
                    return False
                out = model(input_ids=torch.tensor([[ids[pos]]]), cache=out.cache, use_cache=True)
        return True

    hits = 0
    try:
        for problem in problems:
            ids, mask = transcript(chat, problem, use_tool=True, system_prompt=system_prompt)
            copied = [i for i, t in enumerate(ids) if mask[i] and t in digits]
            turn_break = next(i for i in range(copied[0], len(ids)) if not mask[i])  # the call turn ends
            code = [i for i in copied if i < turn_break]
            answer = [i for i in copied if i > turn_break]
            hits += sampled_right(ids, code[0], code[-1] + 1) and sampled_right(ids, answer[0], answer[-1] + 1)
    finally:
        model.train(was_training)
    return hits / max(len(problems), 1)
