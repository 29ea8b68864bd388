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
from typing import Any, Callable, Sequence

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "LOOKUP_SYSTEM_PROMPT",
    "TASKS",
    "transcript",
    "with_tool_outputs",
    "lookup_transcript",
    "full_transcript",
    "cold_start_dataset",
    "run_cold_start_sft",
    "copy_accuracy",
    "sampled_copy_rate",
    "receptive_field",
]

DEFAULT_SYSTEM_PROMPT = (
    "You solve maths problems. You may run Python with the code_interpreter tool: write one <tool_call> "
    "block and wait for its output. End with one line that gives the final answer as \\boxed{...}."
)
"""System prompt of the recipe and of the cold-start transcripts."""

LOOKUP_SYSTEM_PROMPT = (
    "You solve maths problems. Read the number a key holds with the lookup tool and run Python with the "
    "code_interpreter tool: write one <tool_call> block at a time and wait for its output. End with one line that "
    "gives the final answer as \\boxed{...}."
)
"""System prompt of the lookup task (``recipes/retool_lookup.yaml``) and of its cold-start transcripts."""

TASKS = ("arithmetic", "lookup", "reasoning_gym")
"""The tasks with an embedded default (``--task``): the bundled ``arithmetic`` (:mod:`retool.task`) and ``lookup``
(:mod:`retool.lookup`), and reasoning-gym's datasets whose entries carry the ``expression`` they ask for
(:mod:`retool.reasoning_gym_task`; ``chain_sum``, ``basic_arithmetic``), taught like ``arithmetic``."""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def transcript(
    chat: Any,
    problem: dict,
    *,
    use_tool: bool,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    tool_name: str = "code_interpreter",
) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of one solved problem, as the rollout would build it.

    With ``use_tool`` the first turn calls ``tool_name`` with the problem's ``code`` (default ``print(<expression>)``),
    the tool message holds what the sandbox prints (the problem's ``tool_output``, where :func:`with_tool_outputs` ran
    the real tool; else the answer and a newline, what ``print`` writes), and the second turn boxes it; otherwise one
    turn boxes the answer (as the tool printed it, where it ran).

    Returns:
        ``(input_ids, assistant_mask)`` with 1 on the assistant's sampled tokens (end-of-turn included).
    """
    tok = chat.tokenizer
    eos = tok.eos_token_id
    ids, mask = _first_prompt(chat, problem, system_prompt)
    output = problem.get("tool_output", f"{problem['answer']}\n")
    answer = output.strip()  # what the tool prints is what every transcript boxes
    if use_tool:
        final = _ids(tok, f"The answer is \\boxed{{{answer}}}.") + [eos]
    else:  # "in the head": restate the expression, then the answer (a tiny model can only guess it)
        final = _ids(tok, f"{problem['expression']} = \\boxed{{{answer}}}.") + [eos]
    if use_tool:
        _tool_step(chat, ids, mask, tool_name, {"code": problem.get("code", f"print({problem['expression']})")}, output)
    ids += final
    mask += [1] * len(final)
    return ids, mask


def _first_prompt(chat: Any, problem: dict, system_prompt: str | None) -> tuple[list[int], list[int]]:
    """The rendered first prompt (system prompt, if any, and the question) and its all-zero assistant mask."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": problem["prompt"]}
    ]
    ids = chat.initial_prompt_ids(messages)
    return ids, [0] * len(ids)


def _tool_step(chat: Any, ids: list[int], mask: list[int], name: str, arguments: dict, output: str) -> None:
    """Append one sampled tool-call turn (mask 1, its end-of-turn included) and the glue and tool message the rollout
    adds after it (mask 0) to ``ids`` / ``mask``."""
    tok = chat.tokenizer
    sampled = _ids(tok, "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>")
    sampled.append(tok.eos_token_id)
    glue = chat.tool_turn(sampled, output, tool_name=name, arguments=arguments).ids
    ids.extend(sampled + glue)
    mask.extend([1] * len(sampled) + [0] * len(glue))


def lookup_transcript(
    chat: Any,
    problem: dict,
    *,
    lookup: bool,
    recover: bool,
    compute: bool,
    system_prompt: str | None = LOOKUP_SYSTEM_PROMPT,
) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of one lookup problem (:func:`retool.lookup.lookup_problems`), as the rollout
    would build it, on one of the paths a policy can take:

    - ``lookup``: call ``lookup`` with the question's key (else answer at once, a guess);
    - a moved key answers with an error naming the new key: ``recover`` looks that one up (else guess);
    - ``compute``: run ``print(<number> * <number>)`` in the code interpreter and box its output (else box the
      answer "in the head", a guess a tiny model cannot make).

    Every tool message is what the tool itself prints (:class:`retool.lookup.LookupTool`, ``print``), so the errors
    the transcripts recover from are the environment's, not scripted mistakes.
    """
    from retool.lookup import LookupTool

    tok = chat.tokenizer
    ids, mask = _first_prompt(chat, problem, system_prompt)
    answer = problem["answer"]
    final = f"x * x = \\boxed{{{answer}}}."  # a guess
    if lookup:
        table = LookupTool()
        key = problem["key"]
        text, ok = table.lookup(key)
        _tool_step(chat, ids, mask, "lookup", {"key": key}, text)
        if not ok and recover:
            key = problem["moved_to"]
            text, ok = table.lookup(key)
            _tool_step(chat, ids, mask, "lookup", {"key": key}, text)
        if ok and compute:
            _tool_step(chat, ids, mask, "code_interpreter", {"code": f"print({text} * {text})"}, f"{answer}\n")
            final = f"The answer is \\boxed{{{answer}}}."
        elif ok:
            final = f"{text} * {text} = \\boxed{{{answer}}}."
    out = _ids(tok, final) + [tok.eos_token_id]
    return ids + out, mask + [1] * len(out)


def full_transcript(chat: Any, problem: dict, task: str, *, system_prompt: str | None) -> tuple[list[int], list[int]]:
    """The transcript that uses every tool a problem of ``task`` needs (and recovers from every error)."""
    if task == "lookup":
        return lookup_transcript(chat, problem, lookup=True, recover=True, compute=True, system_prompt=system_prompt)
    return transcript(chat, problem, use_tool=True, system_prompt=system_prompt)


def with_tool_outputs(
    problems: Sequence[dict],
    *,
    code: str = "print({expression})",
    right: Callable[[dict, str], bool] | None = None,
    tool_name: str = "code_interpreter",
) -> tuple[list[dict], list[dict]]:
    """``(kept, dropped)``: the problems, each with its ``code`` (``code`` formatted with its ``expression``) and the
    ``tool_output`` the real code interpreter gives for it (run in its sandbox, as the rollout runs it), so the
    transcripts hold the tool's own text, not what it should print. ``right(problem, text)`` says whether boxing the
    tool's text (stripped) solves the problem (default: it equals the answer); the problems where it does not are
    ``dropped`` (e.g. ``-30.0`` where reasoning-gym's basic_arithmetic wants ``-30``): a transcript copying it would
    teach a wrong answer.

    Raises:
        ValueError: a call that failed, or more than half the problems dropped: the expressions do not compute the
            answers, so the task cannot be taught with the tool (naming an example).
    """
    import asyncio

    from trl_plugins.tools.code_interpreter import CodeInterpreter

    right = right or (lambda problem, text: text == str(problem["answer"]).strip())
    tool = CodeInterpreter(name=tool_name)
    problems = [{**p, "code": code.format(expression=p["expression"])} for p in problems]

    async def run() -> list:
        return await asyncio.gather(*(tool({"code": p["code"]}) for p in problems))

    try:
        outputs = asyncio.run(run())
    finally:
        tool.close()
    kept, dropped = [], []
    for problem, out in zip(problems, outputs):
        if not out.ok:
            raise ValueError(
                f"cold start: the code interpreter failed on {problem['code']} for {problem['id']}: "
                f"{out.text!r}. Check that the sandbox runs (docs/sandbox.md), and that cold_start_code "
                f"suits the datasets' expressions (--embedded '{{\"cold_start_code\": ...}}')."
            )
        (kept if right(problem, out.text.strip()) else dropped).append({**problem, "tool_output": out.text})
    if len(dropped) * 2 > len(problems):
        example = dropped[0]
        raise ValueError(
            f"cold start: for {len(dropped)} of {len(problems)} questions the code interpreter's output "
            f"is not the answer ({example['code']} gave {example['tool_output']!r}, the "
            f"answer is {example['answer']!r}): this task cannot be taught by copying the tool's output. "
            f"Bring a model (--model_name_or_path)."
        )
    return kept, dropped


def receptive_field(model_config: Any) -> int | None:
    """How many positions back a token's logits can depend on: layers x window for a model whose every
    layer uses sliding-window attention, None (unbounded) otherwise."""
    window = getattr(model_config, "sliding_window", None)
    layer_types = getattr(model_config, "layer_types", None) or []
    if not window or not layer_types or any(t != "sliding_attention" for t in layer_types):
        return None
    return len(layer_types) * window


def cold_start_dataset(
    chat: Any,
    problems: Sequence[dict],
    *,
    tool_fraction: float,
    seed: int = 0,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    left_context: int | None = None,
    task: str = "arithmetic",
    recovery_fraction: float = 0.5,
):
    """A pre-tokenised ``datasets.Dataset`` (``input_ids``, ``assistant_masks``) for TRL's SFTTrainer.

    ``arithmetic`` and ``reasoning_gym``: ``tool_fraction`` of the transcripts call the tool, the others answer in the
    head. ``lookup``:
    each transcript looks the key up with probability ``tool_fraction``, then computes with the code interpreter
    with probability ``tool_fraction``; after a moved key's error it follows the move with probability
    ``recovery_fraction`` (else it guesses). The other paths box a guess, so RL has choices to learn at every turn.

    ``left_context``: keep only this many tokens before the first assistant token. With the model's
    :func:`receptive_field` the loss and its gradient are unchanged (nothing further back reaches a
    loss position, and RoPE only sees relative positions) while the long system prompt stops costing
    compute.

    Raises:
        ValueError: ``tool_fraction`` outside [0, 1].
    """
    from datasets import Dataset

    for name, value in (("tool_fraction", tool_fraction), ("recovery_fraction", recovery_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}.")
    rng = random.Random(f"cold-start/{seed}")
    rows = []
    for problem in problems:
        if task == "lookup":
            ids, mask = lookup_transcript(
                chat,
                problem,
                lookup=rng.random() < tool_fraction,
                recover=rng.random() < recovery_fraction,
                compute=rng.random() < tool_fraction,
                system_prompt=system_prompt,
            )
        else:
            ids, mask = transcript(chat, problem, use_tool=rng.random() < tool_fraction, system_prompt=system_prompt)
        if left_context is not None:
            cut = max(mask.index(1) - left_context, 0)
            ids, mask = ids[cut:], mask[cut:]
        rows.append({"input_ids": ids, "assistant_masks": mask})
    return Dataset.from_list(rows)


def run_cold_start_sft(
    model: Any,
    tokenizer: Any,
    dataset: Any,
    output_dir: str,
    *,
    epochs: float = 1.0,
    learning_rate: float = 3e-3,
    batch_size: int = 32,
    seed: int = 0,
    show_progress: bool = True,
):
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
        # Off: recomputing activations saves memory a tiny model does not need and costs a third more time (the
        # recomputed forward is the same arithmetic: same gradients, same build).
        activation_checkpointing=False,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer.model


def copy_accuracy(
    model: Any,
    chat: Any,
    problems: Sequence[dict],
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    task: str = "arithmetic",
) -> float:
    """Teacher-forced share of the digits a tool-using transcript (:func:`full_transcript`) copies that the model
    gets right.

    The digits are those the assistant writes: the expression in the code (copied from the question)
    and the boxed answer (copied from the tool's output); for ``lookup`` also the keys and the number looked up; for
    ``reasoning_gym`` every token from the first digit of a turn to its last (the operators between them too).
    A model that cannot copy scores ~0.1.
    """
    import torch

    tok = chat.tokenizer
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    rows = [full_transcript(chat, p, task, system_prompt=system_prompt) for p in problems]
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
        if task == "reasoning_gym":  # every token of each copied span: its operators too (a build copied the digits of
            # chain sums at 0.996 and their operators at 0.5, a coin toss)
            checked = [
                p for start, end in _turn_digit_spans(ids, mask, digits) for p in range(max(start, 1), end) if mask[p]
            ]
        else:
            checked = [p for p in range(1, len(ids)) if mask[p] and ids[p] in digits]
        total += len(checked)
        hits += sum(int(predicted[r, p - 1]) == ids[p] for p in checked)
    return hits / max(total, 1)


def sampled_copy_rate(
    model: Any,
    chat: Any,
    problems: Sequence[dict],
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    seed: int = 0,
    task: str = "arithmetic",
) -> float:
    """Share of problems whose every copy a sample at temperature 1 gets right, each after the transcript up to it:
    in each assistant turn of :func:`full_transcript`, the span from its first digit to its last (arithmetic: the
    expression into the code and the tool's output into the boxed answer; lookup also the keys into the calls and
    the number into the code).

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
            ids, mask = full_transcript(chat, problem, task, system_prompt=system_prompt)
            hits += all(sampled_right(ids, start, end) for start, end in _turn_digit_spans(ids, mask, digits))
    finally:
        model.train(was_training)
    return hits / max(len(problems), 1)


def _turn_digit_spans(ids: Sequence[int], mask: Sequence[int], digits: set[int]) -> list[tuple[int, int]]:
    """``(first, last + 1)`` of the digits of each assistant turn (a maximal run of ``mask``) that writes any."""
    spans, turn = [], []
    for i, m in enumerate([*mask, 0]):
        if m:
            turn.append(i)
            continue
        written = [j for j in turn if ids[j] in digits]
        if written:
            spans.append((written[0], written[-1] + 1))
        turn = []
    return spans
