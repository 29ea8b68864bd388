"""Build, cache and load the embedded default: tokenizer + tiny Qwen2 model after a cold-start SFT.

The build runs once per settings in a clean child process (one CPU process, no DeepSpeed, whatever
launcher started the caller) and is cached under ``<cache root>/embedded/<key>/`` where the key hashes
the settings and the build code's version. Files are checksummed: a cache entry that fails its
check is reported and rebuilt. Entries appear atomically (built aside, then renamed), so a crashed
build never leaves a half-written entry behind, and a build holds a lock on its key, so processes that
ask for the same entry at once (several launches or test workers) build it once: the others wait for it.

The run's ``--system_prompt`` is not a setting of the build where it cannot reach the model: the default's
attention sees 96 tokens back (2 layers x a 48-token sliding window) and the chat template puts the tool schemas,
well over that, between the system prompt and the first token the model writes. So a run with another prompt
reuses the cached build (:func:`embedded_settings_for`); the prompt only meets the tokenizer, whose byte-level BPE
encodes any text.

Run ``python -m retool.default_model --help`` (from ``recipes/``) to build one by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

from retool.coldstart import DEFAULT_SYSTEM_PROMPT, LOOKUP_SYSTEM_PROMPT, TASKS
from retool.launch import run_in_child

__all__ = [
    "EmbeddedSettings",
    "TASK_DEFAULTS",
    "reasoning_gym_task_kwargs",
    "task_schemas",
    "cache_root",
    "ensure_embedded_default",
    "build_embedded_default",
    "CacheError",
    "model_path_or_default",
    "check_embedded_default",
    "model_for_dry_run",
    "embedded_settings_for",
    "embedded_tokenizer",
    "embedded_stand_in",
    "embedded_entry",
    "verify_entry",
    "file_sha256",
    "build_lock",
    "MANIFEST",
    "PROMPT_TO_ANSWER_MIN_TOKENS",
]

BUILD_VERSION = 4

SAMPLED_COPY_WARNING = 0.8
"""Below this :func:`~retool.coldstart.sampled_copy_rate` the build says it will start weak."""
"""Bump when the build changes what it produces for the same settings."""
MANIFEST = "manifest.json"
PROMPT_TO_ANSWER_MIN_TOKENS = 120
"""Fewest tokens the chat template (``qwen2_5``, ``qwen3``) puts between the end of the system prompt and the first
token the model writes when the run has a tool: the tools block's fixed text (123 with the smallest schema and an
empty question; 178 with the code interpreter's schema). ``tests/test_recipe.py`` measures it."""


class CacheError(RuntimeError):
    """A cache entry is missing files or fails its checksums."""


@dataclass(frozen=True)
class EmbeddedSettings:
    """Everything that determines the embedded default (and so its cache key)."""

    seed: int = 0
    """Seed of the model initialisation, the cold-start problems and the SFT data order."""
    template: str = "qwen2_5"
    """Chat template from ``trl/chat_templates/``."""
    vocab_size: int = 1024
    """BPE vocabulary (before special tokens), trained on the built-in corpus plus the system prompt."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    sliding_window: int | None = 48
    """Qwen2 sliding-window attention span (None: full attention); see :func:`build_tiny_model`."""
    cold_start_problems: int = 6000
    """Synthetic transcripts in the cold-start SFT set (from the train split)."""
    cold_start_tool_fraction: float = 0.7
    """Share of transcripts that call the tool; the rest answer without it."""
    cold_start_epochs: float = 3.0
    """Epochs before the first copy check (~560 steps of 32)."""
    cold_start_max_extra_epochs: int = 6
    """More epochs, one at a time, while the copy check is below ``cold_start_copy_target``: copying
    numbers sets in suddenly, after 300 to 700+ steps depending on the seed."""
    cold_start_copy_target: float = 0.95
    """Teacher-forced digit-copy accuracy (:func:`~retool.coldstart.copy_accuracy`) to reach."""
    cold_start_learning_rate: float = 3e-3
    cold_start_batch_size: int = 32
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """The system prompt the tokenizer is trained on (rendered with the tool schema) and the cold-start transcripts
    carry. A run's own ``--system_prompt`` replaces it only when it could reach the model
    (:meth:`sees_system_prompt`); to build for another prompt anyway: ``--embedded '{"system_prompt": ...}'``."""
    task: str = "arithmetic"
    """The bundled task the cold start teaches (:data:`~retool.coldstart.TASKS`); the run's ``--task``."""
    cold_start_recovery_fraction: float = 0.5
    """``lookup``: share of the transcripts meeting a moved key that follow the move (the others guess)."""
    cold_start_code: str = "print({expression})"
    """``reasoning_gym``: the code the cold start's tool calls run, ``{expression}`` the entry's (its output is what
    the transcripts box)."""
    task_kwargs: str = ""
    """``reasoning_gym``: the run's ``--task_kwargs`` as canonical JSON (:func:`reasoning_gym_task_kwargs`): the
    datasets the cold start's questions come from. Empty for the bundled tasks."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
        if self.task != "reasoning_gym" and self.task_kwargs:
            raise ValueError(f"task_kwargs are the reasoning_gym task's; task {self.task!r} takes none.")

    @classmethod
    def from_json(cls, text: str, **base) -> "EmbeddedSettings":
        """Settings from a JSON object of field overrides (on top of ``base``).

        Raises:
            ValueError: text that is not a JSON object, or an unknown field (naming the known ones).
        """
        try:
            raw = json.loads(text or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"embedded settings must be a JSON object, e.g. '{{\"cold_start_epochs\": 2}}'; got {text!r}: {exc}"
            ) from exc
        if not isinstance(raw, dict):
            raise ValueError(f"embedded settings must be a JSON object, got {type(raw).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown embedded settings {unknown}; known: {sorted(known)}.")
        if "task" in raw and raw["task"] != base.get("task", raw["task"]):
            raise ValueError(
                f"embedded settings name task {raw['task']!r} but the run's task is {base['task']!r}: "
                f"choose the task with --task (its embedded default follows)."
            )
        if "task_kwargs" in raw and "task_kwargs" in base and raw["task_kwargs"] != base["task_kwargs"]:
            raise ValueError(
                "embedded settings name task_kwargs, but the run's --task_kwargs choose the datasets (and "
                "its embedded default follows them): set them with --task_kwargs."
            )
        task = raw.get("task", base.get("task", "arithmetic"))  # an unknown one is refused by __post_init__
        return cls(**{**TASK_DEFAULTS.get(task, {}), **base, **raw, "task": task})

    def key(self) -> str:
        values = asdict(self)
        for name, default in _ADDED_FIELDS.items():  # fields added later leave the keys of earlier builds as they were
            if values[name] == default:
                del values[name]
        blob = json.dumps({"build_version": BUILD_VERSION, **values}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def receptive_field(self) -> int | None:
        """How many positions back a logit can depend on: layers x sliding window (None: full attention)."""
        return None if self.sliding_window is None else self.num_layers * self.sliding_window

    def sees_system_prompt(self, *, with_tools: bool = True) -> bool:
        """Whether the model's outputs can depend on the system prompt, i.e. whether the prompt can lie within the
        receptive field of a token the model writes: always with full attention or without tools (nothing long
        separates the prompt from the answer), else when the receptive field spans more than
        :data:`PROMPT_TO_ANSWER_MIN_TOKENS`. Where it cannot, the cold start (cut to the receptive field) never holds
        the prompt either."""
        reach = self.receptive_field()
        return reach is None or not with_tools or reach > PROMPT_TO_ANSWER_MIN_TOKENS


_ADDED_FIELDS = {
    "task": "arithmetic",
    "cold_start_recovery_fraction": 0.5,
    "task_kwargs": "",
    "cold_start_code": "print({expression})",
}
"""Fields added after builds were cached, with the value every earlier build had: left out of the key at it."""

TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "arithmetic": {},
    # Every copy of the lookup task reaches at most ~35 tokens back: the arithmetic task's window serves it. (A
    # 160-token window, for a version whose second call copied from ~130 tokens back, did not learn to copy:
    # docs/experiment_log.md.)
    "lookup": {"system_prompt": LOOKUP_SYSTEM_PROMPT},
    # A third of the transcripts call the tool: the cold start solves about as many held-out questions, and RL has the
    # tool-calling to learn (docs/results.md, the reasoning-gym task). The tiny model learns copies at constant
    # offsets only (docs/experiment_log.md): the recipe's chain sums have one layout (3 terms of 3 digits), and the
    # code prints the sum at a fixed width with its sign (-0210, +1234; chain_sum's score_answer takes both), so every
    # copy keeps its offset. The datasets are the recipe's (recipes/retool_reasoning_gym.yaml); a run's --task_kwargs
    # replace them (embedded_settings_for).
    # Its copies are longer (9 digits and 2 operators into the code, 5 characters into the answer): 4 epochs, and more
    # until the teacher-forced copy of every token of them is 0.99 (its digits at 0.996 and its operators at 0.5,
    # samples copied every number right for 27% of questions).
    "reasoning_gym": {
        "cold_start_tool_fraction": 0.3,
        "cold_start_code": 'print(f"{{{expression}:+05d}}")',
        "cold_start_epochs": 4.0,
        "cold_start_copy_target": 0.99,
        "cold_start_max_extra_epochs": 12,
        "task_kwargs": '{"datasets": {"chain_sum": {"config": {"max_digits": 3, "max_terms": 3, '
        '"min_digits": 3, "min_terms": 3}, "weight": 1.0}}, "held_out_pool": 1000}',
    },
}
"""Per task, the :class:`EmbeddedSettings` that differ from the arithmetic task's."""


def reasoning_gym_task_kwargs(task: Any) -> str:
    """A :class:`~retool.reasoning_gym_task.ReasoningGymTask` as the canonical JSON of ``task_kwargs`` (one cache
    key for one set of datasets, whatever order or spelling the run gave them in)."""
    datasets = {name: {"weight": float(weight), "config": dict(config)} for name, weight, config in task.datasets}
    return json.dumps({"datasets": datasets, "held_out_pool": task.held_out_pool}, sort_keys=True)


def task_schemas(task: str) -> list[dict]:
    """The tool schemas a ``task`` run shows the model, in the order of its recipe's ``tools``."""
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    if task == "lookup":
        from retool.lookup import LookupTool

        return [LookupTool().schema(), CodeInterpreter().schema()]
    return [CodeInterpreter().schema()]


def cache_root() -> Path:
    """``$TRL_PLUGINS_CACHE``, else ``$XDG_CACHE_HOME/trl-plugins``, else ``~/.cache/trl-plugins``."""
    if os.environ.get("TRL_PLUGINS_CACHE"):
        return Path(os.environ["TRL_PLUGINS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trl-plugins"


def embedded_entry(settings: EmbeddedSettings, root: str | Path | None = None) -> Path:
    """The cache entry of ``settings``' build, ``<root>/embedded/<key>/`` (root: :func:`cache_root`); the model and
    its tokenizer are in its ``model/``."""
    return (Path(root) if root is not None else cache_root()) / "embedded" / settings.key()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_entry(entry: Path) -> None:
    """Check a cache entry against its manifest: every file it lists present, with its checksum.

    Raises:
        CacheError: the manifest is unreadable or lists nothing, or a file is missing or differs.
    """
    manifest_path = entry / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CacheError(f"unreadable manifest {manifest_path}: {exc}") from exc
    if not files:
        raise CacheError(f"manifest {manifest_path} lists no files")
    for rel, digest in files.items():
        path = entry / rel
        if not path.is_file():
            raise CacheError(f"missing file {path}")
        if file_sha256(path) != digest:
            raise CacheError(f"checksum mismatch for {path}")


def embedded_tokenizer(settings: EmbeddedSettings) -> Any:
    """The embedded default's tokenizer: a byte-level BPE trained on the built-in corpus plus the system prompt and
    the code interpreter's schema as the chat template renders them, so the text every prompt repeats costs few
    tokens (any other text still encodes, byte by byte at worst)."""
    from trl_plugins.tiny import build_tokenizer

    bootstrap = build_tokenizer(settings.template, vocab_size=settings.vocab_size)
    question = {"arithmetic": "What is 1 + 1?", "lookup": 'What is x * x, where x is the number under key "K417"?'}.get(
        settings.task
    )
    if question is None:  # reasoning_gym: its own questions' wording, the call and the answer every transcript holds
        from retool.task import bundled_problems

        problems = bundled_problems(
            settings.task, 8, seed=settings.seed, split="train", task_kwargs=settings.task_kwargs
        )
        question = problems[0]["prompt"]
    rendered = bootstrap.apply_chat_template(
        [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": question}],
        tools=task_schemas(settings.task),
        tokenize=False,
        add_generation_prompt=True,
    )
    corpus = [rendered]
    if settings.task == "lookup":  # the calls and errors every transcript repeats
        corpus += [
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "K417"}}\n</tool_call>',
            '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(182 * 182)"}}\n</tool_call>',
            "Error: key K417 was moved to K902; look up K902.",
            "The answer is \\boxed{33124}.",
            "x * x = \\boxed{33124}.",
        ]
    if settings.task == "reasoning_gym":
        code = json.dumps({"code": settings.cold_start_code.format(expression=problems[0]["expression"])})
        corpus += [p["prompt"] for p in problems[1:]]
        corpus += [
            f'<tool_call>\n{{"name": "code_interpreter", "arguments": {code}}}\n</tool_call>',
            f"The answer is \\boxed{{{problems[0]['answer']}}}.",
        ]
    return build_tokenizer(settings.template, vocab_size=settings.vocab_size, extra_corpus=corpus)


def _model_shape(settings: EmbeddedSettings) -> dict[str, Any]:
    # The model's shape, for the build (build_tiny_model) and its stand-in (tiny_model_config) alike.
    return {
        "hidden_size": settings.hidden_size,
        "num_layers": settings.num_layers,
        "num_heads": settings.num_heads,
        "num_kv_heads": settings.num_kv_heads,
        "sliding_window": settings.sliding_window,
    }


def embedded_stand_in(settings: EmbeddedSettings, out_dir: str | Path) -> Path:
    """The embedded default without its weights: the tokenizer and the model config :func:`build_embedded_default`
    makes, saved into ``out_dir`` (seconds: no model, no cold start). What a dry run's checks read where the cache
    does not hold the build (the chat template, dropout, the continuous-batching cache's size); returns ``out_dir``."""
    from trl_plugins.tiny import tiny_model_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = embedded_tokenizer(settings)
    config = tiny_model_config(tokenizer, **_model_shape(settings))
    config.architectures = ["Qwen2ForCausalLM"]  # as save_pretrained of the model records it
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_embedded_default(settings: EmbeddedSettings, out_dir: str | Path, *, show_progress: bool = True) -> Path:
    """Build the tokenizer, the model and its cold start into ``out_dir`` (in this process).

    Writes ``out_dir/model`` (``save_pretrained`` of model and tokenizer) and the manifest.
    """
    import random

    import torch

    from retool.coldstart import (
        cold_start_dataset,
        copy_accuracy,
        receptive_field,
        run_cold_start_sft,
        sampled_copy_rate,
        with_tool_outputs,
    )
    from retool.task import bundled_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tiny import build_tiny_model

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(settings.seed)
    torch.manual_seed(settings.seed)
    task = settings.task
    tokenizer = embedded_tokenizer(settings)
    chat = ChatFormat(tokenizer, task_schemas(task))

    def problems_of(n: int, seed: int) -> tuple[list[dict], list[dict]]:
        """``(kept, dropped)``: ``n`` training problems; reasoning_gym's with the tool's own output (the bundled
        tasks' is print's), those whose output would not get full marks dropped."""
        problems = bundled_problems(task, n, seed=seed, split="train", task_kwargs=settings.task_kwargs or None)
        if task != "reasoning_gym":
            return problems, []
        return with_tool_outputs(problems, code=settings.cold_start_code, right=_scores_full_marks)

    problems, dropped = problems_of(settings.cold_start_problems, settings.seed)
    if dropped:
        print(
            f"[embedded default] cold start: {len(dropped)} of {len(dropped) + len(problems)} questions left out: "
            f"boxing the code interpreter's output does not get full marks from their dataset's score_answer "
            f"(e.g. {dropped[0]['code']} gave {dropped[0]['tool_output'].strip()!r} for "
            f"{dropped[0]['answer']!r})",
            flush=True,
        )
    model = build_tiny_model(tokenizer, **_model_shape(settings), seed=settings.seed)
    dataset = cold_start_dataset(
        chat,
        problems,
        tool_fraction=settings.cold_start_tool_fraction,
        seed=settings.seed,
        system_prompt=settings.system_prompt,
        left_context=receptive_field(model.config),
        task=task,
        recovery_fraction=settings.cold_start_recovery_fraction,
    )
    print(
        f"[embedded default] cold-start SFT ({task}): {len(dataset)} transcripts "
        f"({settings.cold_start_tool_fraction:.0%} take each tool step), {settings.cold_start_epochs:g} epochs, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters",
        flush=True,
    )
    model = run_cold_start_sft(
        model,
        tokenizer,
        dataset,
        str(out / "sft_run"),
        epochs=settings.cold_start_epochs,
        learning_rate=settings.cold_start_learning_rate,
        batch_size=settings.cold_start_batch_size,
        seed=settings.seed,
        show_progress=show_progress,
    )
    # Copy check on problems the SFT set does not hold (same split, another seed).
    check = problems_of(64, settings.seed + 10_000)[0]
    copy = copy_accuracy(model, chat, check, system_prompt=settings.system_prompt, task=task)
    epochs = settings.cold_start_epochs
    print(
        f"[embedded default] digit-copy accuracy after {epochs:g} epochs: {copy:.3f} "
        f"(target {settings.cold_start_copy_target})",
        flush=True,
    )
    for extra in range(1, settings.cold_start_max_extra_epochs + 1):
        if copy >= settings.cold_start_copy_target:
            break
        model = run_cold_start_sft(
            model,
            tokenizer,
            dataset,
            str(out / "sft_run"),
            epochs=1.0,
            learning_rate=settings.cold_start_learning_rate,
            batch_size=settings.cold_start_batch_size,
            seed=settings.seed + extra,
            show_progress=show_progress,
        )
        epochs += 1
        copy = copy_accuracy(model, chat, check, system_prompt=settings.system_prompt, task=task)
        print(f"[embedded default] digit-copy accuracy after {epochs:g} epochs: {copy:.3f}", flush=True)
    if copy < settings.cold_start_copy_target:
        print(
            f"[embedded default] warning: the cold start copies only {copy:.0%} of digits right after {epochs:g} "
            f"epochs; RL will have little to reinforce. Try another --task_seed or raise "
            f"cold_start_max_extra_epochs in --embedded.",
            flush=True,
        )
    # What the rollout does: sample. The likeliest-token check above passed builds whose samples copy far less well.
    sampled = sampled_copy_rate(model, chat, check, system_prompt=settings.system_prompt, seed=settings.seed, task=task)
    print(
        f"[embedded default] samples at temperature 1 copy every number right for {sampled:.0%} of the check problems",
        flush=True,
    )
    if sampled < SAMPLED_COPY_WARNING:
        print(
            f"[embedded default] warning: below {SAMPLED_COPY_WARNING:.0%}, this build starts weak: its held-out "
            f"accuracy with the tool will be about as low (a build at 36% started at 31% overall, 48% with the "
            f"tool, where one at 92% started at 56-70%). Same settings, other float arithmetic (CPU kernels, "
            f"threads); 2 more epochs, at a constant or a decaying rate, did not raise it. See the README's "
            f"result section.",
            flush=True,
        )
    shutil.rmtree(out / "sft_run", ignore_errors=True)
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    files = {str(p.relative_to(out)): file_sha256(p) for p in sorted(model_dir.rglob("*")) if p.is_file()}
    manifest = {
        "settings": asdict(settings),
        "build_version": BUILD_VERSION,
        "files": files,
        "cold_start": {"epochs": epochs, "copy_accuracy": round(copy, 4), "sampled_copy_rate": round(sampled, 4)},
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return model_dir


def _scores_full_marks(problem: dict, text: str) -> bool:
    from trl_plugins.rewards.reasoning_gym import score_answer

    return score_answer(problem, text) == 1.0


@contextlib.contextmanager
def build_lock(base: Path, key: str, log: Callable[[str], None], *, label: str = "embedded default") -> Iterator[None]:
    """Hold the exclusive lock on building entry ``key`` (kept in ``<base>/locks/``, outside the entries;
    the kernel releases it if the holder dies); ``label`` names what is built where ``log`` says it waits."""
    locks = base / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{key}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"[{label}] another process is building {key}; waiting for it.")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ensure_embedded_default(
    settings: EmbeddedSettings = EmbeddedSettings(),
    *,
    root: str | Path | None = None,
    rebuild: bool = False,
    log: Callable[[str], None] = print,
    in_process: bool = False,
) -> Path:
    """Path of the cached embedded model directory (model + tokenizer), building it when needed.

    A corrupted or partial entry is reported through ``log`` and rebuilt. The build runs in a clean
    child process unless ``in_process``. Under several processes call this on the main process first
    (e.g. inside ``PartialState().main_process_first()``): the others then find the finished entry.
    Unrelated processes that ask at once are safe too: one builds under a lock, the others wait for it.

    Raises:
        retool.launch.ChildProcessError: the build failed (the child's output says why); nothing is left in the cache.
    """
    base = Path(root) if root is not None else cache_root()
    entry = embedded_entry(settings, base)
    if not rebuild:
        with contextlib.suppress(CacheError):
            verify_entry(entry)  # the common case takes no lock (a read-only cache works)
            log(f"[embedded default] using the cached model at {entry / 'model'}")
            return entry / "model"
    with build_lock(base, settings.key(), log):
        if entry.exists() and not rebuild:  # checked again: it may have been built while we waited
            try:
                verify_entry(entry)
                log(f"[embedded default] using the cached model at {entry / 'model'}")
                return entry / "model"
            except CacheError as exc:
                log(f"[embedded default] the cache entry {entry} is corrupted ({exc}); rebuilding it.")
        elif rebuild and entry.exists():
            log(f"[embedded default] rebuilding {entry} (rebuild requested).")
        base.joinpath("embedded").mkdir(parents=True, exist_ok=True)
        staging = entry.with_name(f"{entry.name}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        log(f"[embedded default] building the tiny model and its cold start into {entry} (once; cached after).")
        try:
            if in_process:
                build_embedded_default(settings, staging)
            else:
                run_in_child(build_embedded_default, settings, staging, what="building the embedded default")
            verify_entry(staging)
            shutil.rmtree(entry, ignore_errors=True)
            os.replace(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return entry / "model"


def embedded_settings_for(
    script_args: Any, training_args: Any, *, log: Callable[[str], None] = print
) -> EmbeddedSettings:
    """The embedded default a run uses: ``--embedded`` over the defaults, seeded with ``--task_seed``.

    The run's ``--system_prompt`` joins the settings (and so the cache key: a build of its own) only when it can
    reach the model (:meth:`EmbeddedSettings.sees_system_prompt`). Otherwise a run with another prompt reuses the
    build made with ``EmbeddedSettings.system_prompt`` and ``log`` says so: the build would differ only by its
    tokenizer's merges.
    """
    task = script_args.task
    base: dict[str, Any] = {"seed": script_args.task_seed, "task": task}
    if getattr(script_args, "reasoning_gym_task", None) is not None:  # the run's datasets: its cold start's questions
        base["task_kwargs"] = reasoning_gym_task_kwargs(script_args.reasoning_gym_task)
    run_prompt = training_args.system_prompt or TASK_DEFAULTS[task].get("system_prompt", DEFAULT_SYSTEM_PROMPT)
    settings = EmbeddedSettings.from_json(script_args.embedded, **base)
    if run_prompt == settings.system_prompt or "system_prompt" in json.loads(script_args.embedded or "{}"):
        return settings  # the build's own prompt, or one --embedded names
    if not settings.sees_system_prompt(with_tools=bool(training_args.tools)):
        log(
            f"[embedded default] the run's system_prompt is not the one the embedded default was built with; the "
            f"same build serves it: its attention sees {settings.receptive_field()} tokens back and the tool schemas "
            f"put the system prompt at least {PROMPT_TO_ANSWER_MIN_TOKENS} tokens before anything the model writes, so "
            f"only the tokenizer reads the prompt (byte-level: any text encodes). A build for this prompt: "
            f"--embedded '{{\"system_prompt\": ...}}' (minutes)."
        )
        return settings
    # The prompt can reach this model (full attention, a wide window, no tools): its cold start must carry it.
    reach = f"{settings.receptive_field()} tokens" if settings.receptive_field() else "the whole context"
    log(
        f"[embedded default] the run's system_prompt can reach this embedded default (its attention sees {reach} "
        f"back): it is built with that prompt, or read from the cache."
    )
    return EmbeddedSettings.from_json(script_args.embedded, **base, system_prompt=run_prompt)


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM's CPU attention runs (``vllm/v1/attention/backends/cpu_attn.py``); the embedded default's 16 is
not one of them."""

VLLM_VARIANT = '{"num_heads": 2, "num_kv_heads": 1}'
"""``--embedded`` for the embedded default's variant that vLLM's CPU attention runs: the same width, tokenizer and cold
start with 2 heads of 32 (1 key/value head), built and cached beside the default by the same code."""


def check_embedded_default(script_args: Any, training_args: Any) -> None:
    """Every refusal the embedded default's build can foresee, made at start-up (milliseconds, nothing built): an
    unknown ``--embedded`` field, ``--embedded`` naming another task or other ``task_kwargs`` than the run's, a
    reasoning-gym dataset whose entries hold no ``expression`` for the cold start to write its code from, and a head
    size vLLM's CPU attention cannot run on a CPU vLLM run (:data:`VLLM_VARIANT` can). Nothing to check when
    ``--model_name_or_path`` names the model.

    Raises:
        ValueError: the refusal, naming the setting and what to set instead.
    """
    if script_args.model_name_or_path is not None:
        return
    try:
        settings = embedded_settings_for(script_args, training_args, log=lambda *_: None)
    except ValueError as exc:
        raise ValueError(f"--embedded {script_args.embedded}: {exc}") from None
    head_size = settings.hidden_size // settings.num_heads
    if training_args.use_vllm and head_size not in VLLM_CPU_HEAD_SIZES:
        import torch

        if training_args.use_cpu or not torch.cuda.is_available():
            raise ValueError(
                f"the embedded default's attention heads have {head_size} dimensions, which vLLM's CPU attention "
                f"does not run (it runs {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use its vLLM variant: "
                f"--embedded '{VLLM_VARIANT}' (2 heads of 32; built and cached once, minutes), or generate with HF "
                f"generate (drop --use_vllm)."
            )
    task = getattr(script_args, "reasoning_gym_task", None)
    if settings.task == "reasoning_gym" and task is not None:
        from retool.reasoning_gym_task import datasets_without, no_expression_refusal

        lacking = datasets_without(task, "expression")
        if lacking:
            raise ValueError(no_expression_refusal(lacking))


def model_path_or_default(
    script_args: Any, training_args: Any, *, rebuild: bool = False, log: Callable[[str], None] = print
) -> str:
    """``--model_name_or_path``, or the embedded default of :func:`embedded_settings_for`, built or read from the
    cache (what both entry points use)."""
    if script_args.model_name_or_path is not None:
        return script_args.model_name_or_path
    settings = embedded_settings_for(script_args, training_args, log=log)
    return str(ensure_embedded_default(settings, rebuild=rebuild, log=log))


@contextlib.contextmanager
def model_for_dry_run(
    script_args: Any, training_args: Any, *, rebuild: bool = False, log: Callable[[str], None] = print
) -> Iterator[tuple[str, bool]]:
    """``(path, stand_in)``: what a dry run's checks read as the model, for the ``with`` block; nothing is built and
    no weights are read. ``--model_name_or_path`` as given; else the embedded default of :func:`embedded_settings_for`
    from the cache when it holds a sound build (checked as :func:`ensure_embedded_default` checks it); else (or with
    ``rebuild``) its stand-in (:func:`embedded_stand_in`, ``stand_in`` True) in a temporary folder removed after the
    block, and ``log`` says that the run would build the weights."""
    if script_args.model_name_or_path is not None:
        yield script_args.model_name_or_path, False
        return
    settings = embedded_settings_for(script_args, training_args, log=log)
    entry = embedded_entry(settings)
    why = "--rebuild_embedded"
    if not rebuild:
        try:
            verify_entry(entry)
            log(f"[embedded default] using the cached model at {entry / 'model'}")
            yield str(entry / "model"), False
            return
        except CacheError as exc:
            why = "not in the cache" if not entry.exists() else f"the cache entry is unusable ({exc})"
    log(
        f"[embedded default] dry run: {why}; the run would build its weights and cold start into {entry} (minutes). "
        f"The checks read the tokenizer and model config that build makes (seconds; no weights)."
    )
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trl-plugins-dry-run-") as into:
        yield str(embedded_stand_in(settings, into)), True


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the embedded default into a directory.")
    parser.add_argument("--out", required=True, help="Directory to build into.")
    parser.add_argument("--settings", default="{}", help="EmbeddedSettings fields as a JSON object.")
    parser.add_argument("--no-progress", action="store_true")
    ns = parser.parse_args(argv)
    try:
        settings = EmbeddedSettings.from_json(ns.settings)
    except ValueError as exc:
        parser.error(str(exc))
    build_embedded_default(settings, ns.out, show_progress=not ns.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
