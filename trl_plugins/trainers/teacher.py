"""On-policy distillation's teacher on the trainer side: its tokenizer checked against the student's at start-up,
then the model loaded once and placed as TRL places its reference model (a frozen copy per rank under DDP, sharded
under ZeRO-3), for a no-gradient forward over each rollout batch's datums
(:func:`~trl_plugins.trainers.update.teacher_logprobs`, for the ``opd`` advantage estimator), or within each
micro-batch of the update for the ``jsd`` loss (:func:`check_divergence_models` says where that runs).

Cross-tokenizer distillation (a teacher with another vocabulary or chat format) is out of scope: it is refused."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from trl_plugins.run.settings import Distillation

__all__ = [
    "SAMPLE_CONVERSATION",
    "render_sample",
    "tokenizer_difference",
    "load_teacher",
    "teacher_version",
    "check_divergence_models",
]

SAMPLE_CONVERSATION: tuple[Mapping[str, Any], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 17 * 23? Use the tool."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(17 * 23)"}}}
        ],
    },
    {"role": "tool", "name": "code_interpreter", "content": "391"},
    {"role": "assistant", "content": "17 * 23 = \\boxed{391}."},
)
"""What both tokenizers render and encode for the check: a conversation with a tool call and its output."""


def _render(tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> list[int] | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    ids = tokenizer.apply_chat_template(
        list(SAMPLE_CONVERSATION), tools=list(tools) or None, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def render_sample(tokenizer: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[int]]:
    """The chat template's render of :data:`SAMPLE_CONVERSATION` (with ``tools``) as text, and that text's token ids
    (no special tokens added: the template writes them): what a server teacher's tokenizer is checked on."""
    text = tokenizer.apply_chat_template(list(SAMPLE_CONVERSATION), tools=list(tools) or None, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenizer_difference(student: Any, teacher: Any, tools: Sequence[Mapping[str, Any]] = ()) -> str | None:
    """What differs between the student's and the teacher's tokenizers, in one sentence, or None: the vocabulary
    (size, then the first token of another id), the special tokens, then the chat template's render of
    :data:`SAMPLE_CONVERSATION` (with ``tools``), token by token."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if len(a) != len(b):
        return f"the vocabularies differ in size: {len(a)} (student) vs {len(b)} (teacher)"
    if a != b:
        token = min((t for t in a if a[t] != b.get(t)), key=lambda t: a[t])
        return f"token {token!r} is id {a[token]} for the student and {b.get(token)} for the teacher"
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        mine, theirs = getattr(student, name, None), getattr(teacher, name, None)
        if mine != theirs:
            return f"{name} is {mine} for the student, {theirs} for the teacher"
    s, t = _render(student, tools), _render(teacher, tools)
    if (s is None) != (t is None):
        return f"only the {'student' if t is None else 'teacher'} has a chat template"
    if s is not None and s != t:
        i = next((k for k, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
        shown = [repr(student.decode(ids[i : i + 1])) if i < len(ids) else "(end)" for ids in (s, t)]
        return (
            f"their chat templates render a conversation with a tool call differently from token {i}: "
            f"{shown[0]} (student) vs {shown[1]} (teacher)"
        )
    return None


class RoutedTeachers:
    """Several teachers, each scoring the trajectories of the dataset rows whose ``route_field`` names it."""

    def __init__(self, route_field: str, teachers: Mapping[str, Any]) -> None:
        self.route_field = route_field
        self.teachers = dict(teachers)

    def route(self, row: Mapping[str, Any]) -> str:
        """The route of a dataset row: its ``route_field``'s value.

        Raises:
            ValueError: the row lacks the field, or its value names no teacher.
        """
        value = row.get(self.route_field) if isinstance(row, Mapping) else None
        if value is None or str(value) not in self.teachers:
            raise ValueError(
                f"teacher_route_field={self.route_field!r}: a row's value {value!r} names no teacher (the teachers: "
                f"{', '.join(self.teachers)}); add it to teacher_model_name_or_path's mapping."
            )
        return str(value)


def check_teacher_rows(settings: Distillation, rows: Any) -> None:
    """Refuse at start-up (before any teacher is loaded) a training dataset whose rows would reach no teacher (several
    teachers: the route field missing, or values no teacher is named for, at most five named) or lack the privileged
    field (self-distillation).

    Raises:
        ValueError: what is missing, and what to set.
    """
    if rows is None or not (settings.routes or settings.privileged_field):
        return
    names = list(getattr(rows, "column_names", None) or [])
    for field, what, role in (
        (settings.route_field, "teacher_route_field", "picks each row's teacher"),
        (settings.privileged_field, "teacher_privileged_field", "the teacher is shown"),
    ):
        if field is not None and field not in names:
            raise ValueError(
                f"{what}={field!r} is not a field of the training dataset (its fields: {', '.join(names)}); name the "
                f"field that {role}."
            )
    if not settings.routes:
        return
    field, teachers = settings.route_field, settings.teachers
    unrouted = sorted({str(v) for v in rows[field]} - set(teachers))
    if unrouted:
        raise ValueError(
            f"teacher_route_field={field!r}: rows with {', '.join(map(repr, unrouted[:5]))}"
            f"{' ...' if len(unrouted) > 5 else ''} reach no teacher (the teachers: {', '.join(teachers)}); add them "
            f"to teacher_model_name_or_path's mapping."
        )


def load_teacher(
    settings: Distillation,
    accelerator: Any,
    *,
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    dtype: torch.dtype,
    attn_implementation: str | None,
    deepspeed: bool,
) -> torch.nn.Module:
    """The teacher, checked and placed: its tokenizer against the student's (:func:`tokenizer_difference`), then its
    weights loaded in the policy's dtype with dropout off and no gradients, prepared like TRL's reference model; a
    server teacher's client, its server checked (:meth:`~trl_plugins.trainers.teacher_server.ServerTeacher.connect`).

    Raises:
        ValueError: the teacher's tokenizer differs from the student's, or the teacher cannot be loaded (both name
            ``teacher_model_name_or_path``).
        TeacherServerError: a server teacher does not answer, or lacks what distillation needs.
    """
    from transformers import AutoTokenizer
    from trl.models import prepare_deepspeed
    from trl.trainer.utils import create_model_from_path

    from trl_plugins.modeling.dropout import disable_dropout

    if settings.routes:
        teachers = {
            route: load_teacher(
                settings.single(route),
                accelerator,
                tokenizer=tokenizer,
                tools=tools,
                dtype=dtype,
                attn_implementation=attn_implementation,
                deepspeed=deepspeed,
            )
            for route in settings.teachers
        }
        return RoutedTeachers(settings.route_field, teachers)
    path = settings.teacher
    if settings.server:
        from trl_plugins.trainers.teacher_server import ServerTeacher

        return ServerTeacher.connect(
            path, tokenizer=tokenizer, sample=render_sample(tokenizer, tools), timeout_s=settings.request_timeout_s
        )
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"teacher_model_name_or_path={path!r}: cannot load its tokenizer ({exc}).") from exc
    difference = tokenizer_difference(tokenizer, teacher_tokenizer, tools)
    if difference is not None:
        raise ValueError(
            f"teacher_model_name_or_path={path!r} does not share the student's tokenizer: {difference}. "
            f"Distillation here compares log-probs token by token, so the teacher must use the student's tokenizer "
            f"and chat template (cross-tokenizer distillation is not supported)."
        )
    kwargs: dict[str, Any] = {"dtype": dtype, "device_map": None}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = create_model_from_path(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ValueError(f"teacher_model_name_or_path={path!r}: cannot load the teacher ({exc}).") from exc
    disable_dropout(model)
    model.eval()
    model.requires_grad_(False)
    if deepspeed:
        return prepare_deepspeed(model, accelerator)
    return accelerator.prepare_model(model, evaluation_mode=True)


def teacher_version(settings: Distillation | None, model: Any) -> dict[str, str | None]:
    """What the run's version records of its teacher: ``{"teacher": "<path> weights <digest>"}`` (the sample digest
    of :func:`~trl_plugins.rollout.weights.weights_digest`, each ZeRO-3 shard gathered in turn, every rank alike), so
    a saved batch names the teacher its log-probs came from and another teacher is a named difference; ``{}`` without
    one."""
    if settings is None or model is None:
        return {}
    if isinstance(model, RoutedTeachers):
        return {
            f"teacher/{route}": teacher_version(settings.single(route), each)["teacher"]
            for route, each in model.teachers.items()
        }
    if settings.server:
        return {"teacher": model.identity()}
    from trl_plugins.rollout.weights import weights_digest

    return {"teacher": f"{settings.teacher} weights {weights_digest(model, gather_each=True)}"}


def check_divergence_models(policy_loss: Any, student: torch.nn.Module, teacher: Any) -> None:
    """For a loss that reads the divergence to the teacher (``teacher_divergence``), refuse at start-up what it does not
    run on: ZeRO-3 (both output heads are read directly, outside their modules' gathering hooks) and a model whose
    logits are more than its output head's (soft-capping, logit scaling: :func:`~trl_plugins.modeling.chunked_head.
    chunkable`). Nothing to check for another loss.

    Raises:
        ValueError: what is refused, and what to use instead.
    """
    if getattr(policy_loss, "teacher_divergence", None) is None or teacher is None:
        return
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from trl_plugins.modeling.chunked_head import chunkable

    name = getattr(policy_loss, "name", "") or "jsd"
    if is_deepspeed_zero3_enabled():
        raise ValueError(
            f"policy_loss {name!r} (the divergence to the teacher over the vocabulary) does not run under DeepSpeed "
            f"ZeRO-3 yet: use DDP or ZeRO-2, or distil with advantage='opd' (tested under ZeRO-3)."
        )
    for who, model in (("the student", student), ("the teacher", teacher)):
        if isinstance(model, torch.nn.Module) and not chunkable(model):  # a server teacher gives its log-probs
            raise ValueError(
                f"policy_loss {name!r}: {who}'s logits are more than its output head's (soft-capping or logit "
                f"scaling), which the divergence does not apply; distil with advantage='opd' instead."
            )
