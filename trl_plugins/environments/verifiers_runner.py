"""Run one verifiers environment rollout against the agent endpoint, in verifiers' own interpreter.

Run by path (``<verifiers python> verifiers_runner.py ...``): it imports only the standard library and verifiers,
never trl_plugins (whose openai/mcp versions conflict with verifiers'). Two commands:

- ``describe --environment SPEC --config JSON``: one JSON line ``{"verifiers", "environment", "harness", "rewards":
  [{"name", "weight"}], "refused": [...], "rows": [...]}``: the environment's reward functions with their weights,
  what it needs that the agent endpoint does not serve (empty: nothing), and its dataset as rows (one per task, with
  its ``task_index`` and its whole data under ``task``).
- ``rollout --environment SPEC --config JSON``: the row (JSON) on stdin; runs its task's episode (the task rebuilt
  from the row's ``task``) with the model at
  ``OPENAI_BASE_URL`` (key ``OPENAI_API_KEY``) and prints ``{"reward": <the rubric's weighted total>, <name>: <score>,
  ...}``; ``--weights JSON`` (``{name: weight}``, the rollout's ``rubric_weights``) weights the named rewards in the
  total instead of their own weights. An episode that fails (the environment raised, a tool server died, a request
  was refused) exits 1 with the error on stderr: the endpoint records that trajectory as ``environment_error``; one
  whose judge failed (and nothing else) exits 1 with :data:`JUDGE_FAILED` heading the error, which the rollout
  records as ``verifier_error``.

``--judge JSON`` (both commands; the rollout's ``judge_*`` settings: ``{"base_url", "model", "api_key_env",
"timeout_s"}``) points every judge the environment's task config declares (its plugged ``judges`` and any
``JudgeConfig`` field) at that endpoint, through verifiers' own client config (``JudgeConfig.base_url``,
``api_key_var``, ``model``, ``timeout``); without it, an environment with a judge is refused.

``SPEC`` is a taskset id (an installed package exporting its ``Taskset`` via ``__all__``), ``'package.module'``, or
``'path/to/file.py'`` (imported under its stem, its folder put on the tool servers' ``PYTHONPATH``).

verifiers' harness programs are PEP 723 scripts it runs with ``uv`` (fetching their dependencies); here they run with
this interpreter instead, which holds them (``constraints/verifiers.txt``): no ``uv``, no network.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

PINNED = "0.4.0"
"""The verifiers release this runner is written against
(``trl_plugins.environments.verifiers_env.VERIFIERS_VERSION``)."""
HARNESS = "null"
"""The harness every environment is played with: verifiers' plain chat loop with the environment's MCP tools."""
MODEL = "policy"
MAX_ROWS = 100_000
"""Tasks read at most from a taskset without ``--max-rows``: more is refused (the rows are held in memory and sent
at start-up), which also stops a ``load()`` that never ends but is not marked ``INFINITE``."""
JUDGE_FAILED = "the environment's judge failed:"
"""Heads the error of an episode whose judge failed (the endpoint down, an answer it could not parse) while the rest of
the rubric scored: the rollout (``verifiers_env``) records that trajectory as ``verifier_error``, never a 0."""
NO_KEY = "TRL_PLUGINS_VERIFIERS_JUDGE_NO_KEY"
"""The key variable of a judge pointed without ``api_key_env``: kept unset here, so verifiers sends its ``EMPTY``
placeholder (never the run's token in ``OPENAI_API_KEY``, nor a Prime key)."""
_CLIENT_FIELDS = ("base_url", "api_key_var", "model", "timeout")


def _fail(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(1)


def _import_spec(spec: str) -> str:
    """The taskset id verifiers' loader imports for ``spec`` (a file is imported now, under its stem)."""
    if spec.endswith(".py"):
        path = Path(spec).resolve()
        if not path.is_file():
            _fail(f"environment {spec!r}: no file {path}")
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        # Tool servers start as `python -m <module>` in a subprocess: it must find the file too.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        importlib.import_module(path.stem)
        return path.stem
    return spec


def _check_version() -> Any:
    import importlib.metadata

    version = importlib.metadata.version("verifiers")
    if version != PINNED:
        _fail(
            f"this runner is written against verifiers {PINNED}, and the interpreter {sys.executable} has {version}: "
            f"remake it with the pinned constraints/verifiers.txt"
        )
    return version


def _local_uv_scripts() -> None:
    """Run verifiers' PEP 723 scripts (harness programs, task verifiers) with this interpreter instead of uv."""
    import hashlib

    from verifiers.v1.runtimes.base import Runtime

    with_uv = Runtime.prepare_uv_script

    async def prepare_uv_script(self: Any, script: Any, env: Any = None, *, activate: bool = True) -> list[str]:
        if self.type != "subprocess":  # refused at start-up; kept as verifiers has it all the same
            return await with_uv(self, script, env, activate=activate)
        data = script.encode() if isinstance(script, str) else script
        folder = Path(self.scripts_dir if getattr(self, "user", None) is None else f"{self.scripts_dir}-{self.user}")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{hashlib.sha256(data).hexdigest()}.py"
        # The folder is shared by every trajectory's runner: written whole, then renamed into place (a runner starting
        # the program while another writes it must never read half a file).
        tmp = folder / f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return [sys.executable, str(path)]

    Runtime.prepare_uv_script = prepare_uv_script


def _env_config(taskset_id: str, config: dict, judge: dict | None = None) -> Any:
    """The environment's config with every agent role played by :data:`HARNESS` in a local subprocess runtime
    (verifiers' default runtime is a remote sandbox), and its task config's judges pointed at ``judge``'s endpoint."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    raw: dict = {"taskset": {"id": taskset_id, **config}}
    resolved = resolve_env_config(raw)
    for role in agent_config_fields(resolved):
        raw[role] = {"harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}}
    if judge and _judges(resolved.taskset.task):
        raw["taskset"]["task"] = _pointed(resolved.taskset.task, judge)  # taken as it is: already validated
    return resolve_env_config(raw)


def _judge_fields(task_config: Any) -> dict[str, Any]:
    """The fields of ``task_config`` that hold judges: its plugged ``judges`` and any holding a ``JudgeConfig`` (or a
    list of them), which task code builds its judges from."""
    from verifiers.v1.configs.judge import JudgeConfig

    fields = {}
    for name in type(task_config).model_fields:
        value = getattr(task_config, name)
        many = isinstance(value, (list, tuple)) and value and all(isinstance(v, JudgeConfig) for v in value)
        if isinstance(value, JudgeConfig) or many:
            fields[name] = value
    return fields


def _judges(task_config: Any) -> dict[str, Any]:
    """The judges ``task_config`` declares, by name: a plugged one by its reward name, another by its field's."""
    from verifiers.v1.configs.judge import judge_key

    found: dict[str, Any] = {}
    for name, value in _judge_fields(task_config).items():
        if name == "judges":
            found.update({judge_key(j): j for j in value})
        elif isinstance(value, (list, tuple)):
            found.update({f"{name}[{i}]": j for i, j in enumerate(value)})
        else:
            found[name] = value
    return found


def _pointed(task_config: Any, judge: dict) -> Any:
    """``task_config`` with each of its judges' client config (verifiers' ``JudgeConfig``: base URL, key variable,
    timeouts, and the model where ``judge`` names one) set from ``judge``, each validated by its own config class."""
    timeout = float(judge["timeout_s"])
    client = {
        "base_url": judge["base_url"],
        "api_key_var": judge.get("api_key_env") or NO_KEY,
        "timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout},
        **({"model": judge["model"]} if judge.get("model") else {}),
    }

    def point(config: Any) -> Any:
        return type(config).model_validate({**config.model_dump(), **client})

    update = {
        name: type(value)(point(j) for j in value) if isinstance(value, (list, tuple)) else point(value)
        for name, value in _judge_fields(task_config).items()
    }
    return task_config.model_copy(update=update)


def _tasks(env: Any, limit: int | None = None) -> list[Any]:
    """The taskset's first ``limit`` tasks (None: all of them, at most :data:`MAX_ROWS` of them)."""
    import itertools

    taskset = env.taskset
    name = type(taskset).__name__
    if limit is not None:
        return list(taskset.take(limit))
    if not taskset.bounded:
        _fail(
            f"the taskset {name} is INFINITE (it generates tasks forever): set the rollout's max_rows to the number "
            f"of tasks to train and evaluate on (rollout_kwargs: {{max_rows: 1000}})"
        )
    tasks = list(itertools.islice(taskset, MAX_ROWS + 1))
    if len(tasks) > MAX_ROWS:
        _fail(
            f"the taskset {name} yields more than {MAX_ROWS:,} tasks (every row is read and held at start-up; a "
            f"load() that never ends reads the same): set the rollout's max_rows to the number of tasks to train and "
            f"evaluate on (rollout_kwargs: {{max_rows: 1000}})"
        )
    return tasks


def _task_of(env: Any, row: dict) -> Any:
    """The row's task, rebuilt from the data the description put in the row (an INFINITE or shuffled taskset need
    not load the same tasks twice)."""
    task_cls = type(env.taskset).task_type()
    return task_cls(task_cls.data_type().model_validate(row["task"]), env.taskset.config.task)


def _rewards(task: Any) -> list[dict]:
    """The task's reward functions (``@vf.reward`` methods and plugged ones), then its plugged judges, with their
    weights, in scoring order."""
    rewards = [{"name": fn.__name__, "weight": float(getattr(fn, "_vf_weight", 1.0))} for fn in task.hooks("reward")]
    return rewards + [{"name": j.reward_name, "weight": float(j.config.weight)} for j in task.plugged_judges()]


def _refusals(tasks: list[Any], task_config: Any, judged: bool) -> list[str]:
    """What the environment needs that the agent endpoint (or this runner) does not serve: each kind named once, with
    the first task that needs it. ``task_config`` is the taskset's (every trajectory's task is rebuilt with it);
    ``judged``: its judges are pointed at an endpoint (``--judge``)."""

    def settings(config: Any) -> dict:  # its judges' own settings, not where they are served
        return {name: j.model_dump(exclude=set(_CLIENT_FIELDS)) for name, j in _judges(config).items()}

    shared = settings(task_config)
    found: dict[str, str] = {}
    for task in tasks:
        prompt = task.data.prompt
        for message in prompt if isinstance(prompt, list) else []:
            content = getattr(message, "content", None)
            if isinstance(content, list) and any(getattr(p, "type", "text") != "text" for p in content):
                found.setdefault(
                    "images",
                    f"images (task {task.data.idx}: a prompt with non-text content parts; the endpoint serves text)",
                )
        if getattr(task.data, "image", None):
            found.setdefault(
                "image",
                f"a container image (task {task.data.idx}: {task.data.image!r}; the runner plays "
                f"every task in a local subprocess runtime)",
            )
        judges = _judges(task.config)
        if judges and not judged:
            found.setdefault(
                "judge",
                f"a judge model (task {task.data.idx}: {list(judges)}; a judge makes model calls of its own, and the "
                f"endpoint serves only the policy being trained: set judge_base_url in rollout_kwargs to an "
                f"OpenAI-compatible endpoint serving the judge, with judge_model and judge_api_key_env where it needs "
                f"them)",
            )
        if task.config is not task_config and settings(task.config) != shared:
            found.setdefault(
                "task judges",
                f"judges of a task's own (task {task.data.idx}: {list(judges)}, the taskset's task config has "
                f"{list(shared)}; every trajectory's task is rebuilt with the taskset's task config: plug the judges "
                f"there, e.g. environment_config: {{task: {{judges: [{{id: reference}}]}}}})",
            )
        for toolset in type(task).toolsets(task.config):
            runtime = getattr(toolset.config, "runtime", None)
            if getattr(toolset.config, "url", None) or getattr(runtime, "type", "subprocess") != "subprocess":
                found.setdefault(
                    "tools",
                    f"a remote tool server ({type(toolset).__name__}: the runner serves tools in local subprocesses)",
                )
    return list(found.values())


def _role_refusals(taskset_id: str, config: dict) -> list[str]:
    """What the environment's agent roles need that a trajectory (one agent's conversation with the policy, played by
    :data:`HARNESS`) does not give, each named."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import default_harness_id, resolve_env_config

    roles = agent_config_fields(resolve_env_config({"taskset": {"id": taskset_id, **config}}))
    found = []
    if len(roles) > 1:
        found.append(f"several agents (roles {list(roles)}: a trajectory is one agent's conversation with the policy)")
    bundled = default_harness_id(taskset_id)
    if bundled not in ("bash", HARNESS):
        found.append(
            f"a harness of its own (the taskset's {bundled!r}: the runner plays every role with verifiers' "
            f"{HARNESS!r} chat loop)"
        )
    for name, spec in roles.items():
        if spec.harness is not None and spec.harness.id != HARNESS:
            found.append(
                f"a harness of its own (role {name!r}: {spec.harness.id!r}: the runner plays every role with "
                f"verifiers' {HARNESS!r} chat loop)"
            )
        if spec.client is not None or spec.model is not None:
            found.append(f"a model of its own (role {name!r}: its calls would not be the policy's)")
        pinned = spec.sampling.model_dump(exclude_none=True) if spec.sampling is not None else {}
        if pinned:
            found.append(f"sampling settings of its own (role {name!r}: {pinned}; a trajectory samples with the run's)")
    return found


def _row(index: int, task: Any) -> dict:
    data = task.data.model_dump(mode="json")
    prompt = data.get("prompt")
    if prompt is None:  # the environment's run() opens the conversation; the row still needs a prompt
        prompt = ""
    elif isinstance(prompt, list):
        prompt = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
    return {
        "id": str(data.get("name") or index),
        "prompt": prompt,
        "answer": str(data.get("answer", "")),
        "task_index": index,
        "task": data,
    }


def describe(spec: str, config: dict, max_rows: int | None = None, judge: dict | None = None) -> dict:
    version = _check_version()
    taskset_id = _import_spec(spec)
    from verifiers.v1.utils.loaders import load_environment

    env = load_environment(_env_config(taskset_id, config, judge))
    tasks = _tasks(env, max_rows)
    if not tasks:
        _fail(f"environment {spec!r} has no tasks")
    task_config = env.taskset.config.task
    return {
        "verifiers": version,
        "environment": spec,
        "harness": HARNESS,
        "rewards": _rewards(tasks[0]),
        "judges": [
            {"name": name, "model": j.model, "base_url": j.base_url} for name, j in _judges(task_config).items()
        ],
        "refused": _role_refusals(taskset_id, config) + _refusals(tasks, task_config, judged=bool(judge)),
        "rows": [_row(i, t) for i, t in enumerate(tasks)],
    }


async def _episode(env: Any, task: Any) -> Any:
    from verifiers.v1.clients import EvalClientConfig, ModelContext

    ctx = ModelContext(
        model=MODEL, client=EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY")
    )
    async with env.serving():
        return await env.run_episode(task, ctx)


def _total(trace: Any, weights: dict[str, float]) -> float:
    """The rubric's weighted total, each reward weighted by ``weights`` where named there, else by its own weight."""
    unscored = sorted(set(weights) - set(trace.rewards))
    if unscored:
        _fail(f"rubric_weights names {unscored}, which the rubric did not score (it scored {sorted(trace.rewards)})")
    return sum(r.score * float(weights.get(name, r.weight)) for name, r in trace.rewards.items())


def _judge_failure(task: Any, trace: Any) -> bool:
    """The trace's rubric scored every reward function and left a plugged judge unscored: its judge failed (verifiers
    seeds every expected score with None and scores the judges last; a judge that raises leaves its None)."""
    judges = {j.reward_name for j in task.plugged_judges()}
    functions = [fn.__name__ for fn in task.hooks("reward")]
    scored = trace.rewards
    return any(name in scored and scored[name] is None for name in judges) and all(
        scored.get(name) is not None for name in functions
    )


def rollout(
    spec: str, config: dict, row: dict, weights: dict[str, float] | None = None, judge: dict | None = None
) -> dict:
    _check_version()
    os.environ.pop(NO_KEY, None)  # a judge pointed without a key sends verifiers' placeholder, nothing else
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
        if not os.environ.get(name):
            _fail(f"{name} is not set: the agent endpoint sets it for each trajectory")
    if not isinstance(row.get("task"), dict):
        _fail(
            f"the row holds no task (the rows come from the environment: VerifiersRollout.rows()); its keys are "
            f"{sorted(row)}"
        )
    taskset_id = _import_spec(spec)
    _local_uv_scripts()
    from verifiers.v1.utils.loaders import load_environment

    env = load_environment(_env_config(taskset_id, config, judge))
    task = _task_of(env, row)
    episode = asyncio.run(_episode(env, task))
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
    if episode.traces and not episode.errors and _judge_failure(task, episode.traces[-1]):
        # The harness played and the reward functions scored; only the judge gave nothing: not a 0, a verifier error.
        _fail(f"{JUDGE_FAILED} " + ("; ".join(errors) or "it gave no score within the episode's time")[:1000])
    if errors or not episode.traces:
        _fail("the episode failed: " + ("; ".join(errors) or "it ran no agent"))
    trace = episode.traces[-1]
    scores = {name: (None if r is None else r.score) for name, r in trace.rewards.items()}
    missing = [name for name, score in scores.items() if score is None]
    if missing:
        _fail(f"the rubric did not score {missing}")
    return {"reward": float(_total(trace, weights or {})), **{name: float(score) for name, score in scores.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("describe", "rollout"))
    parser.add_argument("--environment", required=True)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--weights", default="{}", help="rollout: {reward name: weight} replacing the rubric's own")
    parser.add_argument("--judge", default="null", help='{"base_url", "model", "api_key_env", "timeout_s"}')
    args = parser.parse_args(argv)
    config, judge = json.loads(args.config), json.loads(args.judge)
    if args.command == "describe":
        result = describe(args.environment, config, args.max_rows, judge)
    else:
        row = json.loads(sys.stdin.read() or "{}")
        result = rollout(args.environment, config, row, json.loads(args.weights), judge)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    # Run by path, this file's folder heads sys.path: nothing here may shadow an installed module.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    main()
