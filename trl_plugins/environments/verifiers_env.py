"""verifiers environments as a rollout: the rollout plugin ``verifiers``.

A verifiers environment (its dataset, its multi-turn protocol with tools, its rubric of reward functions) runs as a
``command`` agent of the agent endpoint (:class:`~trl_plugins.rollout.endpoint.AgentEndpointRollout`): each
trajectory is one run of :mod:`.verifiers_runner` in verifiers' own interpreter (verifiers pins ``openai`` and ``mcp``
versions that conflict with ours, so it lives in a venv of its own, made by :data:`MAKE_INTERPRETER`), which drives the
environment's rollout against the endpoint's URL and prints the rubric's scores as its return value. At start-up the
runner describes the environment (its reward functions with their weights, its rows) and refuses one that needs what
the endpoint does not serve. The environment's judges call the endpoint named by ``judge_base_url`` (without it, an
environment with a judge is refused); a trajectory whose judge failed is ``verifier_error``. docs/environments.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from trl_plugins.environments.verifiers_runner import JUDGE_FAILED
from trl_plugins.registry import ROLLOUTS
from trl_plugins.rewards.judge_client import endpoint_problems
from trl_plugins.rollout.endpoint.agent import AgentEndpointRollout
from trl_plugins.rollout.request import RolloutError, RolloutRequest, RolloutResult
from trl_plugins.types import StopReason

__all__ = [
    "MAKE_INTERPRETER",
    "RUNNER",
    "VERIFIERS_VERSION",
    "VerifiersRollout",
    "describe_environment",
    "verifiers_python",
]

VERIFIERS_VERSION = "0.4.0"
"""The verifiers release this is built and tested against (``constraints/verifiers.txt`` pins it; the runner refuses
another)."""
MAKE_INTERPRETER = "python3 -m venv .venv-verifiers && .venv-verifiers/bin/pip install -q -r constraints/verifiers.txt"
"""The one command (run in the repository's root) that makes verifiers' interpreter; ``.ci/run`` runs it."""
RUNNER = str(Path(__file__).with_name("verifiers_runner.py"))
"""The runner, run by path in verifiers' interpreter (it imports nothing of trl_plugins)."""
_REPO = Path(__file__).resolve().parents[2]


def verifiers_python(explicit: str | None = None) -> str:
    """verifiers' interpreter: ``explicit``, else ``$TRL_PLUGINS_VERIFIERS_PYTHON``, else ``.venv-verifiers/bin/python``
    in the working directory, else in the repository's root.

    Raises:
        RolloutError: none of them exists (the message gives :data:`MAKE_INTERPRETER`).
    """
    given = explicit or os.environ.get("TRL_PLUGINS_VERIFIERS_PYTHON")
    candidates = (
        [Path(given)] if given else [Path.cwd() / ".venv-verifiers/bin/python", _REPO / ".venv-verifiers/bin/python"]
    )
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    where = f"{given} (python / TRL_PLUGINS_VERIFIERS_PYTHON)" if given else " or ".join(map(str, candidates))
    raise RolloutError(
        f"verifiers' interpreter is not there: {where}. verifiers {VERIFIERS_VERSION} pins openai and mcp "
        f"versions that conflict with this project's, so it runs in a venv of its own; make it in the "
        f"repository's root with: {MAKE_INTERPRETER}"
    )


def describe_environment(
    python: str,
    environment: str,
    config: dict | None = None,
    *,
    max_rows: int | None = None,
    time_limit_s: float | None = 300.0,
    judge: dict | None = None,
) -> dict:
    """What the runner says about ``environment`` in verifiers' interpreter: ``{"verifiers", "environment", "rewards":
    [{"name", "weight"}], "judges": [{"name", "model", "base_url"}], "refused": [reasons], "rows": [row, ...]}``.
    ``judge`` (``{"base_url", "model", "api_key_env", "timeout_s"}``) points the environment's judges at an endpoint;
    without it, an environment with a judge is refused.

    Raises:
        RolloutError: the runner failed (the environment cannot be loaded: its stderr's tail is in the message) or
            ran past ``time_limit_s``.
    """
    argv = [python, RUNNER, "describe", "--environment", environment, "--config", json.dumps(config or {})]
    if max_rows is not None:
        argv += ["--max-rows", str(max_rows)]
    if judge is not None:
        argv += ["--judge", json.dumps(judge, sort_keys=True)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=time_limit_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RolloutError(f"describing verifiers environment {environment!r} ran past {time_limit_s} s") from None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not lines:
        raise RolloutError(
            f"verifiers environment {environment!r} cannot be loaded (the runner exited with status "
            f"{done.returncode}): {done.stderr.strip()[-1500:] or '(no stderr)'}"
        )
    return json.loads(lines[-1])


@ROLLOUTS.register("verifiers")
@dataclass
class VerifiersRollout(AgentEndpointRollout):
    """A verifiers environment (``environment``: its taskset's id, ``'package.module'`` or ``'path/to/file.py'``, each
    exporting its ``Taskset`` subclass) rolled out against the run's sampler: each trajectory is one run of the
    environment's own protocol (its tools, its user turns, its parsers) through the agent endpoint, token-exact as any
    agent's, and its rubric's reward functions are recorded by name (``agent_return/<name>``; the rubric's total,
    weighted by its weights or by ``rubric_weights``, is ``agent_return``, which ``agent_reward`` trains on). The
    environment's dataset is
    :meth:`rows`. The environment's judges call ``judge_base_url``; a trajectory whose judge failed ends as
    ``verifier_error``. Refused at start-up: an environment that needs what the endpoint does not serve (named), a
    judge without ``judge_base_url`` among them. The budgets and time limits are the endpoint's; ``agent`` and
    ``command`` are this plugin's own.
    """

    environment: str | None = None
    """The environment: a taskset id, ``'package.module'`` or ``'path/to/file.py'`` (its ``__all__`` exports one
    ``verifiers.v1.Taskset`` subclass, and optionally one ``Env`` subclass)."""
    environment_config: dict = field(default_factory=dict)
    """The taskset's own config fields (``TasksetConfig`` subclass), e.g. ``{"split": "train"}``."""
    max_rows: int | None = None
    """Rows to take from the environment's dataset (its first tasks); None: all (an ``INFINITE`` taskset, which
    generates tasks forever, needs a number, and so does one of more than the runner's ``MAX_ROWS``, 100,000)."""
    rubric_weights: dict = field(default_factory=dict)
    """``{reward function: weight}`` replacing the environment's own weights of the named functions in the rubric's
    total (``agent_return``, which ``agent_reward`` trains on); the others keep theirs. A name the rubric does not
    have is refused at start-up."""
    judge_base_url: str | None = None
    """The OpenAI base URL (e.g. ``http://127.0.0.1:8011/v1``) that every judge of the environment calls: its task
    config's plugged ``judges`` and any ``JudgeConfig`` field of it, each pointed through verifiers' own client
    config. None: an environment with a judge is refused at start-up (the endpoint serves only the policy)."""
    judge_model: str | None = None
    """The model name the judges ask for; None: each judge's own (its ``JudgeConfig.model``)."""
    judge_api_key_env: str | None = None
    """The environment variable holding the key the judges send (``Authorization: Bearer``); the key itself is never a
    setting, so it never reaches a log or the banner. None: no key (verifiers sends its ``EMPTY`` placeholder)."""
    judge_timeout_s: float = 30.0
    """Each phase of a judge's request (connecting, waiting for its answer) may take this long; past it the judge
    failed (``verifier_error``)."""
    python: str | None = None
    """verifiers' interpreter (default: :func:`verifiers_python`)."""
    describe_time_limit_s: float | None = 300.0
    """Wall time the start-up description of the environment (loading it, reading its dataset) may take."""
    environment_info: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.environment or not isinstance(self.environment, str):
            raise RolloutError(
                "rollout 'verifiers' needs environment: a taskset id, 'package.module' or "
                "'path/to/file.py' (docs/environments.md)."
            )
        if self.agent is not None or self.command is not None:
            raise RolloutError(
                "rollout 'verifiers' runs the environment's own protocol: drop agent/command (use "
                "rollout: agent_endpoint for an agent of your own)."
            )
        if not isinstance(self.environment_config, dict):
            raise RolloutError(
                f"environment_config must be a mapping of the taskset's config fields, got {self.environment_config!r}."
            )
        if not isinstance(self.rubric_weights, dict) or not all(
            isinstance(k, str) and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
            for k, w in self.rubric_weights.items()
        ):
            raise RolloutError(
                f"rubric_weights must map the rubric's reward function names to finite numbers, e.g. "
                f"{{correct: 1.0, boxed: 0.5}}; got {self.rubric_weights!r}."
            )
        judge = self._judge()
        self.python = verifiers_python(self.python)
        config = json.dumps(self.environment_config, sort_keys=True)
        self.command = [self.python, RUNNER, "rollout", "--environment", self.environment, "--config", config]
        if self.rubric_weights:
            self.command += ["--weights", json.dumps(self.rubric_weights, sort_keys=True)]
        if judge is not None:
            self.command += ["--judge", json.dumps(judge, sort_keys=True)]
        super().__post_init__()
        if self.max_rows is not None and self.max_rows < 1:
            raise RolloutError(f"max_rows must be >= 1 (or null for all), got {self.max_rows}.")
        info = describe_environment(
            self.python,
            self.environment,
            self.environment_config,
            max_rows=self.max_rows,
            time_limit_s=self.describe_time_limit_s,
            judge=judge,
        )
        if info.get("refused"):
            raise RolloutError(
                f"verifiers environment {self.environment!r} needs what the agent endpoint does not serve: "
                + "; ".join(info["refused"])
            )
        if not info.get("rewards"):
            raise RolloutError(
                f"verifiers environment {self.environment!r} has no reward functions (@vf.reward): "
                f"nothing would score its trajectories."
            )
        own = {r["name"]: float(r["weight"]) for r in info["rewards"]}
        unknown = sorted(set(self.rubric_weights) - set(own))
        if unknown:
            raise RolloutError(
                f"rubric_weights names {unknown}, which verifiers environment {self.environment!r}'s "
                f"rubric does not have; its reward functions: "
                + ", ".join(f"{name} x{weight:g}" for name, weight in own.items())
                + "."
            )
        for reward in info["rewards"]:
            if reward["name"] in self.rubric_weights:
                reward["environment_weight"] = reward["weight"]
                reward["weight"] = float(self.rubric_weights[reward["name"]])
        self.environment_info = info

    def _judge(self) -> dict | None:
        """The judge settings the runner points the environment's judges with (None: no endpoint for them)."""
        problems = []
        if self.judge_base_url is None:
            given = [n for n in ("judge_model", "judge_api_key_env") if getattr(self, n) is not None]
            if given:
                problems.append(f"{' and '.join(given)} without judge_base_url: set the judges' endpoint too")
        else:  # the judge component's own rules for its endpoint
            names = ("judge_base_url", "judge_api_key_env")
            problems += endpoint_problems(self.judge_base_url, self.judge_api_key_env, names=names)
        if self.judge_model is not None and (not isinstance(self.judge_model, str) or not self.judge_model):
            problems.append(f"judge_model={self.judge_model!r}: name the model the judges' server serves (or null)")
        timeout = self.judge_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            problems.append(f"judge_timeout_s must be > 0 seconds, got {timeout!r}")
        if problems:
            raise RolloutError("rollout 'verifiers': " + "; ".join(problems) + ".")
        if self.judge_base_url is None:
            return None
        return {
            "base_url": self.judge_base_url,
            "model": self.judge_model,
            "api_key_env": self.judge_api_key_env,
            "timeout_s": float(timeout),
        }

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        """The endpoint's rollout; a trajectory whose runner says its judge failed is ``verifier_error`` (the judge's
        fault, like a reward component's), not ``environment_error``, counted as ``verifiers/judge_failures``."""
        judged = bool(self.environment_info.get("judges"))
        try:
            result = super().__call__(request)
        except BaseException as exc:
            _judge_failures(getattr(exc, "rollout_result", None), judged)
            raise
        _judge_failures(result, judged)
        return result

    @property
    def rubric(self) -> list[tuple[str, float]]:
        """The environment's reward functions: ``(name, weight)``, in the rubric's order; the weight is
        ``rubric_weights``' where it names the function, else the environment's."""
        return [(r["name"], float(r["weight"])) for r in self.environment_info["rewards"]]

    def rows(self) -> list[dict]:
        """The environment's dataset as rows ``{"id", "prompt", "answer", "task_index", "task"}`` (one per task; the
        runner rebuilds a trajectory's task from its row's ``task``, the task's whole data)."""
        return [dict(row) for row in self.environment_info["rows"]]

    def describe(self) -> str:
        rubric = ", ".join(
            f"{r['name']} x{float(r['weight']):g}"
            + (
                f" (rubric_weights; the environment's x{r['environment_weight']:g})"
                if "environment_weight" in r
                else ""
            )
            for r in self.environment_info["rewards"]
        )
        judges = "".join(
            f"; judge {j['name']} (model {j['model']!r} at {j['base_url']})"
            for j in self.environment_info.get("judges", [])
        )
        return (
            f"verifiers {self.environment_info.get('verifiers')} environment {self.environment!r} "
            f"({len(self.environment_info['rows'])} rows; rubric {rubric}{judges}); {super().describe()}"
        )


def _judge_failures(result: RolloutResult | None, judged: bool) -> None:
    """Each trajectory whose runner reported :data:`JUDGE_FAILED` (the endpoint recorded its exit 1 as
    ``environment_error``) becomes ``verifier_error``, its error the judge's; ``judged``: count them."""
    if result is None:
        return
    failed = 0
    for traj in result.trajectories:
        if traj.stop_reason == StopReason.ENVIRONMENT_ERROR and JUDGE_FAILED in (traj.error or ""):
            traj.stop_reason = StopReason.VERIFIER_ERROR
            traj.error = JUDGE_FAILED + traj.error.split(JUDGE_FAILED, 1)[1]
            traj.reward_components = []
            failed += 1
    if judged:
        result.counters["verifiers/judge_failures"] = result.counters.get("verifiers/judge_failures", 0.0) + failed
