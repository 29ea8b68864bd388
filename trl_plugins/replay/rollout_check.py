"""Replay checks: recompute the behaviour log-probs of sampled tokens with a plain forward pass
(:func:`replay_logprobs`), and re-render a trajectory's parsed conversation with the chat template
(:func:`replay_rendering`).

With unchanged weights the log-prob difference measures sampler/trainer mismatch (kernels, padding, KV cache,
dtype, a log-prob taken from the wrong distribution). It is small in fp32 on CPU (< 1e-4); tests and
benchmarks call it (the trainer does not yet log it per step). The rendering replay says where a conversation
rebuilt from parsed messages departs from the sampled tokens, and why (a final turn without thinking,
whitespace the template strips from reasoning).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trl_plugins.datum import build_datum, collate
from trl_plugins.modeling import token_logprobs
from trl_plugins.rollout.chat.vocab import first_difference
from trl_plugins.types import Trajectory

__all__ = ["ReplayReport", "replay_logprobs", "RenderReplayError", "conversation_messages", "replay_rendering"]


@dataclass
class ReplayReport:
    """How far stored behaviour log-probs are from a fresh forward pass."""

    max_abs_diff: float
    """Largest ``|stored - recomputed|`` over all sampled tokens."""
    mean_abs_diff: float
    """Mean of the same."""
    num_tokens: int
    """Sampled tokens compared."""


@torch.no_grad()
def replay_logprobs(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    *,
    pad_token_id: int,
    temperature: float = 1.0,
    batch_size: int = 8,
) -> ReplayReport:
    """Compare stored behaviour log-probs with ``log_softmax(logits / temperature)`` of a plain forward.

    ``temperature`` must be the sampling temperature (use 1.0 for greedy sampling).
    """
    datums = [build_datum(t, advantage=0.0, trajectory_index=i) for i, t in enumerate(trajectories)]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    diffs = []
    try:
        for k in range(0, len(datums), batch_size):
            mb = collate(datums, list(range(k, min(k + batch_size, len(datums)))), pad_token_id=pad_token_id)
            lp = token_logprobs(
                model,
                mb.input_ids.to(device),
                mb.attention_mask.to(device),
                mb.target_ids.to(device),
                temperature=temperature,
            ).cpu()
            mask = mb.action_mask.bool()
            diffs.append((lp[mask].double() - mb.behaviour_logprobs[mask].double()).abs())
    finally:
        model.train(was_training)
    all_diffs = torch.cat(diffs) if diffs else torch.zeros(0)
    if all_diffs.numel() == 0:
        return ReplayReport(0.0, 0.0, 0)
    return ReplayReport(float(all_diffs.max()), float(all_diffs.mean()), int(all_diffs.numel()))


class RenderReplayError(ValueError):
    """Re-rendering a trajectory's parsed conversation does not give its tokens: says which turn, which case, what
    differs and what to do."""


def conversation_messages(chat: Any, trajectory: Trajectory, messages: Sequence[dict]) -> list[dict]:
    """The trajectory as chat messages: ``messages`` (its first prompt's), then each assistant turn as the
    tokenizer's parser reads it (content, reasoning, the call) and each tool call's output as a tool message (one per
    call, in call order)."""
    out = [dict(m) for m in messages]
    for turn in trajectory.turns:
        parsed = _parse_message(chat, turn)
        out.append(parsed)
        out.extend(
            {"role": "tool", "name": call.name, "tool_call_id": f"call_{j}", "content": call.output}
            for j, call in enumerate(turn.tool_calls)
        )
    return out


def replay_rendering(chat: Any, trajectory: Trajectory, messages: Sequence[dict]) -> list[int]:
    """Re-render the trajectory's parsed conversation with the chat template and check it gives its tokens.

    The rollout never re-renders (token-in, token-out), so the tokens are what was sampled; this check tells
    whether a consumer that rebuilds the conversation from parsed messages (an SFT export, another trainer)
    would see the same tokens, and where and why not.

    Args:
        chat: The run's ``ChatFormat``.
        trajectory: A finished trajectory sampled with ``chat``.
        messages: The messages its first prompt was rendered from (system and user).

    Returns:
        The rendered token ids (the trajectory's tokens, plus whatever the template renders after its end).

    Raises:
        RenderReplayError: naming the turn and the case: a final turn sampled without the reasoning block the
            template renders, whitespace inside a reasoning block that the template strips, or (otherwise) the
            first differing token; and what to do.
    """
    tok = chat.tokenizer
    turns = trajectory.turns
    full = list(turns[-1].prompt_ids) + list(turns[-1].completion_ids)
    conversation = conversation_messages(chat, trajectory, messages)
    last_is_tool = conversation[-1]["role"] == "tool"
    rendered = list(
        tok.apply_chat_template(
            conversation,
            tools=chat.tools or None,
            tokenize=True,
            add_generation_prompt=last_is_tool,
            return_dict=False,
            **chat.template_kwargs,
        )
    )
    k = first_difference(full, rendered)
    if k == len(full):
        return rendered
    if k < len(turns[0].prompt_ids):
        raise RenderReplayError(
            f"the first prompt is not the rendering of the messages given (first difference at token {k}): pass the "
            f"messages the rollout rendered its first prompt from."
        )
    i = next(j for j, t in reversed(list(enumerate(turns))) if len(t.prompt_ids) <= k)
    turn, start = turns[i], len(turns[i].prompt_ids)
    final = i == len(turns) - 1
    where = f"assistant turn {i + 1} of {len(turns)}" + (" (its final turn)" if final else "")
    if k >= start + len(turn.completion_ids):  # in the tool turn after it
        raise RenderReplayError(
            f"re-rendering differs in the tool turn after {where} (at token {k}: sampled {_show(tok, full, k)}, "
            f"rendered {_show(tok, rendered, k)})"
            + (
                ": its output was cut to its tail, and the parsed conversation holds the whole output"
                if any(call.output_truncated for call in turn.tool_calls)
                else ""
            )
            + ". Train from the trajectory's tokens (build_datum), not from a re-rendering."
        )
    stops = set(chat.stop_token_ids)
    sampled = tok.decode([t for t in turn.completion_ids if t not in stops], skip_special_tokens=False)
    end = next((j for j in range(start, len(rendered)) if rendered[j] in stops), len(rendered))
    written = tok.decode(rendered[start:end], skip_special_tokens=False)
    reasoning = _reasoning(_parse_message(chat, turn))
    if not reasoning.strip() and written.endswith(sampled) and written != sampled:
        raise RenderReplayError(
            f"{where} was sampled without a reasoning block (the model skipped thinking: {_clip(sampled)}), and the "
            f"template renders one before it ({written[: len(written) - len(sampled)]!r}): re-rendering puts tokens "
            f"the model never sampled into that turn. The trajectory's tokens are what was sampled and train as "
            f"such; train from them (build_datum), not from a re-rendering, or keep thinking in every turn (e.g. a "
            f"generation prompt that opens the reasoning block)."
        )
    if reasoning.strip() and re.sub(r"\s+", "", sampled) == re.sub(r"\s+", "", written):
        body = reasoning.strip()
        at_s, at_w = sampled.find(body), written.find(body)
        closing = re.compile(r"\s*(?:<[^\s<>]*>)?\s*")  # whitespace, the block's closing tag, whitespace
        ends_s = closing.match(sampled, at_s + len(body)).end()
        ends_w = closing.match(written, at_w + len(body)).end()
        if at_s >= 0 and at_w >= 0 and (sampled[:at_s] != written[:at_w] or sampled[:ends_s] != written[:ends_w]):
            extra = sampled[:ends_s].count("\n") - written[:ends_w].count("\n")
            raise RenderReplayError(
                f"{where} has whitespace inside its reasoning block that the template does not keep ("
                + (f"{extra} extra newline(s); " if extra > 0 else "")
                + f"sampled {sampled[:ends_s]!r}, the template writes {written[:ends_w]!r}: it strips the "
                f"reasoning), so re-rendering the parsed turn gives other tokens than were sampled. The trajectory's "
                f"tokens are what was sampled and train as such; train from them (build_datum), not from a "
                f"re-rendering."
            )
    raise RenderReplayError(
        f"re-rendering differs in {where} (at token {k}: sampled {_show(tok, full, k)}, rendered "
        f"{_show(tok, rendered, k)}; the parser read it as {_clip(str(_parse_message(chat, turn)))}). Train from the "
        f"trajectory's tokens (build_datum), not from a re-rendering."
    )


def _parse_message(chat: Any, turn: Any) -> dict:
    parsed = (
        chat.tokenizer.parse_response(list(turn.completion_ids), prefix=list(turn.prompt_ids), tools=chat.tools or None)
        or {}
    )
    message = {"role": "assistant", "content": parsed.get("content") or ""}
    if _reasoning(parsed):
        message["reasoning_content"] = message["thinking"] = _reasoning(parsed)
    if turn.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "id": f"call_{j}", "function": {"name": call.name, "arguments": call.arguments}}
            for j, call in enumerate(turn.tool_calls)
        ]
    return message


def _reasoning(parsed: dict) -> str:
    return parsed.get("reasoning_content") or parsed.get("thinking") or ""


def _show(tok: Any, ids: Sequence[int], k: int) -> str:
    return repr(tok.decode(list(ids[max(0, k - 3) : k + 3]), skip_special_tokens=False))


def _clip(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")
