"""What choosing a task brings to a run: each task's own settings (its reward components and their weights, the
component that counts a held-out sample correct, and what else its problems need: the lookup task's tool, prompt and
turn budgets).

They form a config layer of their own, named ``the task '<name>'``: over the recipe's YAML (``retool_ppo.yaml``) and
under the user's ``--config`` files and the command line (:func:`retool.config.parse_args`). So ``--task
reasoning_gym`` alone is scored by reasoning-gym's own scorer, a setting the user made still wins, and the banner says
which settings came from the task. A user's choice that cannot score the task is refused at start-up as before
(:func:`retool.reasoning_gym_task.check_run`). The task's embedded default follows it too
(:data:`retool.default_model.TASK_DEFAULTS`).
"""

from __future__ import annotations

import copy
from typing import Any

from retool.coldstart import LOOKUP_SYSTEM_PROMPT, TASKS

__all__ = ["TASK_SETTINGS", "TASK_TOOLS", "task_layer", "task_layer_name", "default_success_component"]

_OUTCOME_REWARDS = {"reward_components": ["correct", "format"], "reward_component_weights": [1.0, 0.1]}
"""math-verify's comparison of the boxed answer with the reference, and a small reward for the answer's format."""

TASK_SETTINGS: dict[str, dict[str, Any]] = {
    "arithmetic": {**_OUTCOME_REWARDS, "success_component": "correct"},
    # Two dependent calls and a moved key to follow (retool/lookup.py): the lookup tool beside the code interpreter,
    # and a turn more than the arithmetic task's budgets (lookup, lookup again after a move, compute, answer: 4).
    "lookup": {
        **_OUTCOME_REWARDS,
        "success_component": "correct",
        "tools": ["retool.lookup:LookupTool", "code_interpreter"],
        "system_prompt": LOOKUP_SYSTEM_PROMPT,
        "rollout_kwargs": {
            "max_turns": 5,
            "max_tool_calls": 4,
            "max_assistant_tokens": 64,
            "max_trajectory_tokens": 1024,
            "max_tool_response_tokens": 128,
        },
    },
    # Scored by each dataset's own score_answer (most of its answers are no maths math-verify reads), on the boxed
    # answer the system prompt asks for.
    "reasoning_gym": {
        "reward_components": ["reasoning_gym", "format"],
        "reward_component_weights": [1.0, 0.1],
        "reward_component_kwargs": {"reasoning_gym": {"answer_format": "boxed"}},
        "success_component": "reasoning_gym",
    },
}
"""Per task (:data:`retool.coldstart.TASKS`), the fields it sets where no config file or the command line does."""

assert set(TASK_SETTINGS) == set(TASKS), "every task declares its settings"

TASK_TOOLS: dict[str, tuple[str, ...]] = {"lookup": ("lookup", "code_interpreter")}
"""Per task, the tools (by the name the model calls them) its problems cannot be solved without: refused at start-up
when a ``--tools`` of the user's leaves one out (:func:`retool.startup.resolve`)."""


def task_layer_name(task: str) -> str:
    """The layer's name where the banner, ``summary.json`` and refusals say where a value came from."""
    return f"the task {task!r}"


def task_layer(task: str) -> tuple[str, dict[str, Any]]:
    """``(name, values)``: the config layer of ``task``'s own settings (empty for a task that is no task: the
    recipe's arguments refuse it)."""
    return task_layer_name(task), copy.deepcopy(TASK_SETTINGS.get(task, {}))


def default_success_component(task: str) -> str:
    """The component that counts a held-out sample correct when nothing set ``success_component``."""
    return TASK_SETTINGS.get(task, TASK_SETTINGS["arithmetic"])["success_component"]
