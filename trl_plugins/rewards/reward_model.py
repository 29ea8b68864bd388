"""A reward model as a reward component (``reward_model``): a local ``AutoModelForSequenceClassification`` scores
each trajectory, as TRL's ``GRPOTrainer`` scores with a model in ``reward_funcs``.

What the model reads: the row's prompt (``prompt_key``: a string is one user message, a list is chat messages) and
then the trajectory as the assistant side, rendered with the reward model's own tokenizer's chat template (no
generation prompt) and tokenized without added special tokens, right-padded. ``show: final_answer``: one assistant
message with the last turn's text. ``show: turns``: every assistant turn's text as the policy wrote it (its
``<tool_call>`` markup included), each followed by one ``tool`` message per call with the call's output; a template
that refuses ``tool`` messages (or renders none of their text) gets the whole trajectory as one assistant message
instead, written as the judge's ``show: turns`` writes it (:func:`~trl_plugins.rewards.judge.render_trajectory`).
``max_length`` cuts a longer conversation from the left: the end (the answer, and the token the model pools) stays.

The value is the raw logit ``logits[:, label_index]`` (as float32) at the last non-pad token, unscaled: the run's
advantage estimator compares the values within a group. Forwards run ``batch_size`` conversations at a time (sorted by
length), under ``torch.no_grad`` in eval mode; one conversation's value does not depend on its batch beyond float
rounding (~1e-6). A row without its prompt fails that trajectory (``verifier_error``).

Placement. The model is loaded once per process on first use (shared by every copy of the component in the process,
the start-up check's included), on the current CUDA device, else the CPU; the loaded model is never pickled. Under
DDP and under ZeRO-3 alike each rank holds a full replica and scores its own trajectories; nothing is gathered and
no collective runs. The reference model is the trainer's own: TRL prepares it like the policy (sharded under ZeRO-3)
and the trainer forwards it where every rank must, packed like the update (dummy micro-batches included). A plugin
gets data and its own settings, never the trainer or its accelerator, and ranks score different numbers of
trajectories (failures, dynamic sampling): a sharded reward model, whose every layer gathers over the ranks, would
hang. So under ZeRO-3 this load switches off transformers' ``zero.Init`` partitioning, and no DeepSpeed engine is
built. The cost is one full copy per rank: a 7B reward model in bfloat16 is ~15 GB on every GPU besides the policy's
shards. A reward model that does not fit beside them belongs behind a server, scored over HTTP as the ``judge``
component scores.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from trl_plugins.registry import REWARDS
from trl_plugins.rewards.judge import render_trajectory
from trl_plugins.rewards.math import final_text, turn_text
from trl_plugins.types import Trajectory

__all__ = ["RewardModelReward", "conversation"]

_DTYPES = ("float32", "bfloat16", "float16")
_LOADED: dict[tuple[str, str, str], tuple[Any, Any]] = {}
_LOAD_LOCK = threading.Lock()


def conversation(trajectory: Trajectory, row: Mapping[str, Any], prompt_key: str, show: str) -> list[dict[str, Any]]:
    """The chat messages the reward model reads (``show: turns`` with tool messages; see the module docstring).

    Raises:
        KeyError: the row has no prompt (a string or chat messages) in ``prompt_key``.
    """
    prompt = row.get(prompt_key)
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise KeyError(
            f"the reward model reads the prompt from column {prompt_key!r} (a string or chat messages); the row has "
            f"{sorted(row)}. Set prompt_key in reward_component_kwargs."
        )
    if show == "final_answer":
        return [*messages, {"role": "assistant", "content": final_text(trajectory)}]
    for turn in trajectory.turns:
        messages.append({"role": "assistant", "content": turn_text(turn)})
        messages.extend({"role": "tool", "content": call.output} for call in turn.tool_calls)
    return messages


@contextlib.contextmanager
def _full_replica():
    """transformers partitions a model built under ZeRO-3 (``zero.Init``); this one must be whole on every rank."""
    from transformers.integrations import deepspeed as hf_deepspeed

    # transformers keeps the run's DeepSpeed config behind this weak reference (set by TrainingArguments); it is put
    # back as it was. A model another thread builds meanwhile would not be partitioned: none does during scoring.
    ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    held = ref() if ref is not None else None
    if held is None:
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(held)


@REWARDS.register("reward_model")
@dataclass
class RewardModelReward:
    """A local sequence-classification reward model (a folder with the model and its tokenizer). Settings are checked
    when the component is built (the folder and its config); the weights load on first use."""

    model: str = ""
    """The folder with the reward model (``config.json`` of a ``...ForSequenceClassification``, its weights) and its
    tokenizer with a chat template."""
    batch_size: int = 8
    """Conversations per forward."""
    max_length: int | None = None
    """Tokens per conversation at most, cut from the left (the end stays); None: no cut."""
    label_index: int = 0
    """The logit read as the value (TRL reads 0)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The weights' dtype once loaded."""
    prompt_key: str = "prompt"
    """The row's column with the prompt: a string (one user message) or chat messages."""
    show: Literal["final_answer", "turns"] = "final_answer"
    """What follows the prompt: the last turn's text, or every turn with tool messages (module docstring)."""
    device: str | None = None
    """Where the model runs, e.g. ``cuda:1``; None: the current CUDA device, else the CPU."""

    def __post_init__(self) -> None:
        problems = []
        path = Path(self.model).expanduser()
        if not self.model or not (path / "config.json").is_file():
            raise ValueError(
                f"reward_model: model={self.model!r} is no folder with a config.json; set model to the local folder "
                f"holding the reward model and its tokenizer (save_pretrained of both)."
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        heads = [a for a in config.architectures or [] if a.endswith("ForSequenceClassification")]
        if not heads:
            problems.append(
                f"{path} holds a {config.architectures or config.model_type}, not a ...ForSequenceClassification "
                f"(a causal LM would get a random score head): give a trained reward model"
            )
        if not 0 <= self.label_index < config.num_labels:
            problems.append(f"label_index={self.label_index} is not one of its {config.num_labels} label(s)")
        if self.batch_size < 1 or (self.max_length is not None and self.max_length < 1):
            problems.append(f"batch_size={self.batch_size} and max_length={self.max_length} must be >= 1")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype={self.dtype!r}: use one of {', '.join(_DTYPES)}")
        if self.show not in ("final_answer", "turns"):
            problems.append(f"show={self.show!r}: use 'final_answer' or 'turns'")
        if problems:
            raise ValueError("reward_model: " + "; ".join(problems) + ".")
        self.__setstate__({})

    def versions(self) -> dict[str, str | None]:
        """The reward model in the run's record: its folder, and a digest of its config and its weight files' names
        and sizes (cheap; a retrained model in the same folder is another digest)."""
        path = Path(self.model).expanduser()
        files = sorted((p.name, p.stat().st_size) for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
        digest = hashlib.sha256((path / "config.json").read_bytes() + repr(files).encode()).hexdigest()[:16]
        return {"model": f"{path.resolve()} ({digest})"}

    def step_metrics(self) -> dict[str, float]:
        """The step's cost: ``reward_model/sequences``, ``reward_model/tokens``, ``reward_model/truncated`` (cut to
        ``max_length``) and ``reward_model/seconds`` (tokenizing and forwards)."""
        with self._lock:
            taken, self._stats = self._stats, dict.fromkeys(self._stats, 0.0)
        return {f"reward_model/{k}": v for k, v in taken.items()}

    def step_metric_reductions(self) -> dict[str, str]:
        return {"reward_model/sequences": "sum", "reward_model/tokens": "sum", "reward_model/truncated": "sum",
                "reward_model/seconds": "max"}  # fmt: skip

    def __call__(self, trajectory: Trajectory, example: Mapping[str, Any]) -> float:
        (value,) = self.score_batch([trajectory], [example])
        if isinstance(value, BaseException):
            raise value
        return value

    def score_batch(
        self, trajectories: Sequence[Trajectory], rows: Sequence[Mapping[str, Any]]
    ) -> list[float | BaseException]:
        """Every trajectory's value (``rows[i]`` is ``trajectories[i]``'s row), or the exception that failed it."""
        import torch

        start = time.perf_counter()
        model, tokenizer = self._replica()
        out: list[float | BaseException] = [0.0] * len(trajectories)
        texts: dict[int, str] = {}
        for i, (trajectory, row) in enumerate(zip(trajectories, rows)):
            try:
                texts[i] = self._render(tokenizer, trajectory, row)
            except Exception as exc:  # noqa: BLE001 - this trajectory fails, named; the others are scored
                out[i] = exc
        ids = dict(zip(texts, tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"])) if texts else {}
        cut = self.max_length or max((len(x) for x in ids.values()), default=0)
        order = sorted(ids, key=lambda i: len(ids[i]))
        seen = {"sequences": len(ids), "tokens": sum(min(len(x), cut) for x in ids.values())}
        seen["truncated"] = sum(len(x) > cut for x in ids.values())
        with torch.no_grad():
            for lo in range(0, len(order), self.batch_size):
                chunk = order[lo : lo + self.batch_size]
                batch = tokenizer.pad(
                    {"input_ids": [ids[i][-cut:] for i in chunk]}, padding_side="right", return_tensors="pt"
                )
                values = model(**batch.to(model.device)).logits[:, self.label_index].float().tolist()
                for i, value in zip(chunk, values):
                    out[i] = value
        with self._lock:
            for key, value in {**seen, "seconds": time.perf_counter() - start}.items():
                self._stats[key] += value
        return out

    def __getstate__(self) -> dict[str, Any]:  # the loaded model stays in this process; a copy reloads (or shares it)
        return {k: v for k, v in self.__dict__.items() if k not in ("_loaded", "_lock", "_stats")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        stats = dict.fromkeys(("sequences", "tokens", "truncated", "seconds"), 0.0)
        self.__dict__.update(state, _loaded=None, _lock=threading.Lock(), _stats=stats)

    def _render(self, tokenizer: Any, trajectory: Trajectory, row: Mapping[str, Any]) -> str:
        messages = conversation(trajectory, row, self.prompt_key, self.show)
        if self.show == "turns" and any(m["role"] == "tool" for m in messages):
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
                if all(m["content"] in text for m in messages if m["role"] == "tool"):
                    return text
            except Exception:  # noqa: BLE001, S110 - a template without tool messages: the text form below
                pass
            prompt = messages[: next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
            messages = [*prompt, {"role": "assistant", "content": render_trajectory(trajectory, "turns")}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    def _replica(self) -> tuple[Any, Any]:
        if self._loaded is None:
            import torch

            device = self.device or (f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
            key = (str(Path(self.model).expanduser().resolve()), self.dtype, device)
            with _LOAD_LOCK:
                if key not in _LOADED:
                    _LOADED[key] = _load(key[0], getattr(torch, self.dtype), device)
            self._loaded = _LOADED[key]
        return self._loaded


def _load(path: str, dtype: Any, device: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from ``path``, the model whole, frozen, in eval mode on ``device``.

    Raises:
        ValueError: no chat template, or weights missing from the folder (a head transformers would draw at random).
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"reward_model: the tokenizer in {path} has no chat template to render the conversation.")
    if tokenizer.pad_token is None:  # as TRL: the model pools the last token that is not the pad token
        tokenizer.pad_token = tokenizer.eos_token
    with _full_replica():
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])[:3]
        raise ValueError(f"reward_model: {path} has no weights for {missing}; set model to a trained reward model.")
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer
