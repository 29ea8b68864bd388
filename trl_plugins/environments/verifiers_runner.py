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
  was refused) exits 1 with the error on stderr: the endpoint records that trajectory as ``environment_error``.

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


def _env_config(taskset_id: str, config: dict) -> Any:
    """The environment's config with every agent role played by :data:`HARNESS` in a local subprocess runtime
    (verifiers' default runtime is a remote sandbox)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    raw: dict = {"taskset": {"id": taskset_id, **config}}
    roles = agent_config_fields(resolve_env_config(raw))
    for role in roles:
        raw[role] = {"harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}}
    return resolve_env_config(raw)


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
    """The task's reward functions (``@vf.reward`` methods and plugged ones) with their weights, in scoring order."""
    return [{"name": fn.__name__, "weight": float(getattr(fn, "_vf_weight", 1.0))} for fn in task.hooks("reward")]


def _refusals(tasks: list[Any]) -> list[str]:
    """What the environment needs that the agent endpoint (or this runner) does not serve: each kind named once, with
    the first task that needs it."""
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
        if task.config.judges:
            names = [getattr(j, "id", type(j).__name__) for j in task.config.judges]
            found.setdefault(
                "judge",
                f"a judge model (task {task.data.idx}: {names}; a judge makes model calls of its "
                f"own, and the endpoint serves only the policy being trained)",
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


def describe(spec: str, config: dict, max_rows: int | None = None) -> dict:
    version = _check_version()
    taskset_id = _import_spec(spec)
    from verifiers.v1.utils.loaders import load_environment

    env = load_environment(_env_config(taskset_id, config))
    tasks = _tasks(env, max_rows)
    if not tasks:
        _fail(f"environment {spec!r} has no tasks")
    return {
        "verifiers": version,
        "environment": spec,
        "harness": HARNESS,
        "rewards": _rewards(tasks[0]),
        "refused": _role_refusals(taskset_id, config) + _refusals(tasks),
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


def rollout(spec: str, config: dict, row: dict, weights: dict[str, float] | None = None) -> dict:
    _check_version()
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

    env = load_environment(_env_config(taskset_id, config))
    episode = asyncio.run(_episode(env, _task_of(env, row)))
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
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
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    if args.command == "describe":
        result = describe(args.environment, config, args.max_rows)
    else:
        result = rollout(args.environment, config, json.loads(sys.stdin.read() or "{}"), json.loads(args.weights))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    # Run by path, this file's folder heads sys.path: nothing here may shadow an installed module.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    main()
