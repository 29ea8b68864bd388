"""verifiers environments as a rollout (plugin ``verifiers``): environments built with the pinned verifiers' own
classes (tests/verifiers_envs/: single-turn, with a tool, multi-turn with a scripted user) run by their runner in
verifiers' interpreter through the agent endpoint against a scripted policy: token-exact trajectories, the rubric's
values as reward components, a raising environment as ``environment_error``, a judge pointed at the scripted judge
(examples/judges/scripted_judge.py, loopback) scoring the rubric, a failing one as ``verifier_error``.

verifiers runs in an interpreter of its own (it pins openai and mcp versions that conflict with ours); CI makes it
(``.ci/run``) and these tests skip, naming the command, where it is absent.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support.judges import scripted_judge as scripted_judge_module
from trl_plugins.contracts import check_rollout_contract
from trl_plugins.datum import build_datums
from trl_plugins.environments.verifiers_env import (
    MAKE_INTERPRETER,
    VERIFIERS_VERSION,
    VerifiersRollout,
    verifiers_python,
)
from trl_plugins.protocols import as_rollout
from trl_plugins.registry import ROLLOUTS
from trl_plugins.rollout import ChatFormat, RolloutError, RolloutRequest, ScriptedBackend, questions_from_rows
from trl_plugins.tiny import build_tokenizer
from trl_plugins.types import StopReason, TokenSource

ENVS = Path(__file__).parent / "verifiers_envs"

try:
    PYTHON = verifiers_python()
except RolloutError:
    PYTHON = None
needs_verifiers = pytest.mark.skipif(
    PYTHON is None, reason=f"no verifiers interpreter: make it with {MAKE_INTERPRETER}"
)


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(build_tokenizer("qwen2_5"), [], final_answer_pattern=r"\\boxed\{")


def policy(chat: ChatFormat) -> ScriptedBackend:
    """Scripted samples read from the conversation: a call of ``calc_add`` where the tool is offered and not yet
    called, else a boxed answer (7 to "3 + 4", 4 to "2 + 2", the tool's sum after it answered)."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        if '"calc_add"' in text and "<tool_response>" not in text:
            body = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 20, "b": 22}}\n</tool_call>'
        elif "sum=" in text:
            body = "The answer is \\boxed{" + re.findall(r"sum=(\d+)", text)[-1] + "}."
        elif "2 + 2" in text:
            body = "\\boxed{4}"
        else:
            body = "\\boxed{7}"
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


def rollout_request(chat: ChatFormat, rollout: VerifiersRollout) -> RolloutRequest:
    return RolloutRequest(questions_from_rows(chat, rollout.rows()), 1, policy(chat), chat, {}, policy_step=1, seed=3)


def environment(name: str, **kwargs) -> VerifiersRollout:
    return VerifiersRollout(environment=str(ENVS / name), agent_time_limit_s=120, max_turns=4, **kwargs)


def continues(traj) -> bool:
    """Each turn's prompt starts with the previous turn's prompt and completion, token for token."""
    return all(
        b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
        for a, b in zip(traj.turns, traj.turns[1:])
    )


def trains_exactly_what_was_sampled(traj) -> bool:
    (datum,) = build_datums(traj, advantage=1.0)
    trained = [t for t, m in zip(datum.target_ids, datum.action_mask) if m]
    return trained == [t for turn in traj.turns for t in turn.completion_ids]


def components(traj) -> dict[str, tuple[float, float]]:
    return {c.name: (c.value, c.weight) for c in traj.reward_components}


def test_the_plugin_is_registered_and_refuses_what_it_cannot_run(monkeypatch, tmp_path):
    assert ROLLOUTS.get("verifiers") is VerifiersRollout
    with pytest.raises(RolloutError, match="needs environment"):
        VerifiersRollout()
    with pytest.raises(RolloutError, match="drop agent/command"):
        VerifiersRollout(environment="x", command=["true"])
    monkeypatch.setenv("TRL_PLUGINS_VERIFIERS_PYTHON", str(tmp_path / "missing" / "python"))
    with pytest.raises(RolloutError, match=re.escape(MAKE_INTERPRETER)):
        VerifiersRollout(environment="x")


def test_the_interpreter_command_is_the_one_ci_runs_and_pins_the_version():
    root = Path(__file__).resolve().parents[1]
    assert MAKE_INTERPRETER in (root / ".ci" / "run").read_text().splitlines()
    ci = (root / ".ci" / "run").read_text()
    assert ci.index(MAKE_INTERPRETER) < ci.index("python -m pytest")  # made before the suite runs
    pins = (root / "constraints" / "verifiers.txt").read_text()
    assert re.search(rf"^verifiers=={re.escape(VERIFIERS_VERSION)}$", pins, re.M)
    assert MAKE_INTERPRETER in (root / "docs" / "environments.md").read_text()


@needs_verifiers
@pytest.mark.slow
def test_an_environment_that_needs_what_the_endpoint_does_not_serve_is_refused_at_start_up_naming_it():
    with pytest.raises(RolloutError) as caught:
        environment("refused_env.py")
    message = str(caught.value)
    assert "needs what the agent endpoint does not serve" in message
    assert "images (task 0" in message and "a container image (task 1: 'python:3.12'" in message
    assert "a judge model (task 2: ['reference']" in message and "set judge_base_url in rollout_kwargs" in message
    assert "judges of a task's own (task 2: ['reference'], the taskset's task config has []" in message
    assert "several agents (roles ['solver', 'critic']" in message
    assert "sampling settings of its own (role 'solver': {'temperature': 0.2}" in message


@pytest.fixture(scope="module")
def single_turn():
    return environment("single_turn_env.py")


@needs_verifiers
@pytest.mark.slow
def test_a_single_turn_environment_scores_with_its_rubric_and_a_raising_one_is_an_environment_error(chat, single_turn):
    rollout = single_turn
    assert rollout.rubric == [("brief", 0.25), ("correct", 1.0)]  # verifiers' own order: by priority, then name
    assert [(r["prompt"], r["answer"]) for r in rollout.rows()] == [("What is 3 + 4?", "7"), ("Say boom.", "0")]
    assert as_rollout(rollout, "verifiers").rows_fn() == rollout.rows()  # what the recipe trains and evaluates on
    right, boom = rollout(rollout_request(chat, rollout)).trajectories
    assert right.stop_reason == StopReason.FINAL_ANSWER, right.error
    assert len(right.turns) == 1 and trains_exactly_what_was_sampled(right)
    # The prompt is what verifiers' harness sent: the task's prompt as the one user message, rendered by the template.
    tok = chat.tokenizer
    assert tok.decode(right.turns[0].prompt_ids) == tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    # correct 1 x 1.0 + brief 1 x 0.25 ("\boxed{7}" is short): verifiers' weighted total, then each function's score.
    assert components(right) == {
        "agent_return": (1.25, 0.0),
        "agent_return/correct": (1.0, 0.0),
        "agent_return/brief": (1.0, 0.0),
    }
    # Its reward function raised: the runner exits 1 with verifiers' error, the endpoint records an environment error.
    assert boom.stop_reason == StopReason.ENVIRONMENT_ERROR and "the scorer exploded" in boom.error
    assert boom.reward_components == []


@needs_verifiers
def test_the_rollout_meets_the_rollout_contract(single_turn):
    # The contract's rows are not the environment's (no task): each run refuses its row, as an environment error.
    check_rollout_contract(single_turn)


@needs_verifiers
@pytest.mark.slow
def test_an_environment_with_a_tool_trains_the_sampled_call_and_sees_the_tools_output(chat):
    rollout = environment("tool_env.py")
    (traj,) = rollout(rollout_request(chat, rollout)).trajectories
    assert traj.stop_reason == StopReason.FINAL_ANSWER, traj.error
    assert len(traj.turns) == 2 and traj.num_segments == 1 and continues(traj) and trains_exactly_what_was_sampled(traj)
    (call,) = traj.turns[0].tool_calls
    assert call.name == "calc_add" and call.arguments == {"a": 20, "b": 22}
    second = traj.turns[1]
    added = second.prompt_ids[len(traj.turns[0].prompt_ids) + len(traj.turns[0].completion_ids) :]
    observed = [t for t, s in zip(added, second.prompt_sources[-len(added) :]) if s == TokenSource.OBSERVATION]
    assert chat.tokenizer.decode(observed).strip() == "sum=42"  # the tool server's answer, as the model saw it
    assert "\\boxed{42}" in second.text
    # correct 1 x 1.0 + used_tool 1 x 0.5
    assert components(traj) == {
        "agent_return": (1.5, 0.0),
        "agent_return/correct": (1.0, 0.0),
        "agent_return/used_tool": (1.0, 0.0),
    }


@needs_verifiers
@pytest.mark.slow
def test_a_multi_turn_environment_whose_user_is_scripted_continues_its_tokens(chat):
    rollout = environment("user_turns_env.py")
    (traj,) = rollout(rollout_request(chat, rollout)).trajectories
    assert traj.stop_reason in (StopReason.FINAL_ANSWER, StopReason.NO_TOOL_CALL), traj.error
    assert len(traj.turns) == 2 and traj.num_segments == 1 and continues(traj) and trains_exactly_what_was_sampled(traj)
    tok = chat.tokenizer
    # verifiers relaunched its harness with the conversation and the user's follow-up: one segment, the follow-up's
    # tokens observations after the first reply's sampled ones.
    first, second = traj.turns
    assert tok.decode(second.prompt_ids).endswith("<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n")
    added = second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids) :]
    observed = [t for t, s in zip(added, second.prompt_sources[-len(added) :]) if s == TokenSource.OBSERVATION]
    assert tok.decode(observed) == "Are you sure?"
    assert components(traj) == {"agent_return": (1.0, 0.0), "agent_return/answered_every_turn": (1.0, 0.0)}


class _RowsRollout:
    """A rollout with a dataset of its own, as the recipe sees one (only its rows matter here)."""

    token_budget = 64

    def __init__(self, rows):
        self._rows = rows

    def rows(self):
        return self._rows

    def __call__(self, request):  # pragma: no cover - never rolled out here
        raise AssertionError


def test_a_rollouts_own_rows_are_the_recipes_rows_held_out_by_a_hash_of_the_prompt():
    from types import SimpleNamespace

    from retool.data import task_rows

    rows = [{"id": str(i), "prompt": f"What is {i} + 1?", "task": {"idx": i}} for i in range(20)]
    rows += [
        {"id": f"u{i}", "prompt": "", "task": {"idx": 20 + i, "question": f"q{i}"}} for i in range(20)
    ]  # no prompt
    rollout = as_rollout(_RowsRollout(rows), "rows")
    args = SimpleNamespace(task_seed=0, held_out_fraction=0.25)
    said: list[str] = []
    train = task_rows(args, "train", size=None, log=said.append, rollout=rollout)
    held = task_rows(args, "test", size=None, log=said.append, rollout=rollout)
    # round(0.25 * 40) = 10 held out, the other 30 trained on, none on both sides (rows without a prompt by their task).
    assert len(held) == 10 and len(train) == 30
    assert {r["id"] for r in train}.isdisjoint({r["id"] for r in held}) and len({r["id"] for r in train + held}) == 40
    assert "10 held out" in said[0] and "30 for training" in said[0]
    sample = task_rows(args, "train", size=5, rollout=rollout)
    assert len(sample) == 5 and {r["id"] for r in sample} < {r["id"] for r in train}
    assert task_rows(args, "train", size=5, rollout=rollout) == sample  # seeded
    with pytest.raises(ValueError, match="held_out_fraction is 0"):
        task_rows(SimpleNamespace(task_seed=0, held_out_fraction=0.0), "test", size=None, rollout=rollout)
    # A rollout without rows of its own leaves the recipe's task to give them.
    assert as_rollout(SimpleNamespace(token_budget=None, __call__=None), "plain").rows_fn is None


@needs_verifiers
def test_a_row_that_is_not_the_environments_is_an_environment_error_naming_it(chat, single_turn):
    request = RolloutRequest(
        questions_from_rows(chat, [{"id": "x", "prompt": "What is 3 + 4?"}]),
        1,
        policy(chat),
        chat,
        {},
        policy_step=1,
        seed=3,
    )
    (traj,) = single_turn(request).trajectories
    assert traj.stop_reason == StopReason.ENVIRONMENT_ERROR and "the row holds no task" in traj.error


def test_the_runner_imports_only_the_standard_library_and_verifiers():
    import ast
    import sys

    from trl_plugins.environments.verifiers_env import RUNNER

    def imported(source: str) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
                names.add("." if node.level else (node.module or "").split(".")[0])
        return names

    def outside(source: str) -> set[str]:
        return {n for n in imported(source) if n not in sys.stdlib_module_names and n != "verifiers"}

    assert outside(Path(RUNNER).read_text()) == set()  # it runs in verifiers' interpreter, which has no trl_plugins
    assert outside("import json\nfrom verifiers.v1 import Env\nfrom trl_plugins import types\nimport openai\n") == {
        "trl_plugins",
        "openai",
    }  # negative control


def test_the_docs_worked_example_is_the_example_config():
    import yaml

    root = Path(__file__).resolve().parents[1]
    section = (root / "docs" / "environments.md").read_text().split("## verifiers", 1)[1]
    block = re.search(r"```yaml\n(.+?)\n```", section, re.S).group(1)  # the verifiers section's first example
    shown, example = yaml.safe_load(block), yaml.safe_load((root / "examples/verifiers/verifiers.yaml").read_text())
    for key, value in shown.items():  # what the docs show is what the example sets (the docs leave some out)
        if isinstance(value, dict):
            assert value.items() <= example[key].items(), key
        else:
            assert example[key] == value, key
    assert (root / example["rollout_kwargs"]["environment"]).is_file()


@needs_verifiers
def test_an_interpreter_with_another_verifiers_is_refused_at_start_up_naming_both_versions(tmp_path):
    # An interpreter whose verifiers reports 0.3.9 (a dist-info ahead of the real one on its path): the runner's first
    # act is the version check, so the start-up description stops there, saying what to remake it with.
    site = tmp_path / "site" / "verifiers-0.3.9.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: verifiers\nVersion: 0.3.9\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site.parent} exec {PYTHON} "$@"\n')
    python.chmod(0o755)
    with pytest.raises(RolloutError) as caught:
        VerifiersRollout(environment=str(ENVS / "single_turn_env.py"), python=str(python))
    message = str(caught.value)
    assert f"written against verifiers {VERIFIERS_VERSION}, and the interpreter" in message and "has 0.3.9" in message
    assert "remake it with the pinned constraints/verifiers.txt" in message


@needs_verifiers
@pytest.mark.slow
def test_an_endless_taskset_is_refused_at_start_up_unless_max_rows_bounds_it():
    # Marked INFINITE (verifiers' flag): refused before reading a task.
    with pytest.raises(RolloutError, match=r"CountTaskset is INFINITE .*set the rollout's max_rows"):
        environment("endless_env.py")
    # Not marked, its load() never ending all the same: refused after the runner's MAX_ROWS tasks, not a hang.
    with pytest.raises(RolloutError, match=r"CountTaskset yields more than 100,000 tasks .*set the rollout's max_rows"):
        environment("endless_env.py", environment_config={"marked": False})
    # max_rows takes its first tasks (verifiers' take(); it failed on every max_rows before).
    rollout = environment("endless_env.py", max_rows=3)
    assert [(r["prompt"], r["answer"], r["task_index"]) for r in rollout.rows()] == [
        ("What is 0 + 1?", "1", 0),
        ("What is 1 + 1?", "2", 1),
        ("What is 2 + 1?", "3", 2),
    ]


def test_rubric_weights_are_checked_against_the_rubric_at_start_up(monkeypatch):
    import sys

    import trl_plugins.environments.verifiers_env as verifiers_env

    for bad in ({"correct": "2"}, {"correct": float("nan")}, {"correct": True}, ["correct"]):
        with pytest.raises(RolloutError, match="rubric_weights must map the rubric's reward function names"):
            VerifiersRollout(environment="x", rubric_weights=bad)
    described = {
        "verifiers": VERIFIERS_VERSION,
        "refused": [],
        "rows": [{"id": "0", "prompt": "q", "task": {}}],
        "rewards": [{"name": "brief", "weight": 0.25}, {"name": "correct", "weight": 1.0}],
    }
    monkeypatch.setattr(verifiers_env, "describe_environment", lambda *a, **k: json.loads(json.dumps(described)))
    with pytest.raises(
        RolloutError,
        match=r"rubric_weights names \['brevity'\], which verifiers environment 'x''s "
        r"rubric does not have; its reward functions: brief x0.25, correct x1\.",
    ):
        VerifiersRollout(environment="x", python=sys.executable, rubric_weights={"brevity": 2.0})
    rollout = VerifiersRollout(environment="x", python=sys.executable, rubric_weights={"brief": 2.0})
    assert rollout.rubric == [("brief", 2.0), ("correct", 1.0)]
    assert "rubric brief x2 (rubric_weights; the environment's x0.25), correct x1" in rollout.describe()
    assert rollout.command[-2:] == ["--weights", '{"brief": 2.0}']  # what the runner weights the total with
    assert "--weights" not in VerifiersRollout(environment="x", python=sys.executable).command


@needs_verifiers
@pytest.mark.slow
def test_rubric_weights_reweight_the_rubrics_total_that_agent_reward_trains_on(chat):
    rollout = environment("single_turn_env.py", rubric_weights={"brief": 2.0}, max_rows=1)
    (traj,) = rollout(rollout_request(chat, rollout)).trajectories
    assert traj.stop_reason == StopReason.FINAL_ANSWER, traj.error
    # correct 1 x 1.0 + brief 1 x 2.0 (configured; the environment's 0.25 gave 1.25 above); each score unchanged.
    assert components(traj) == {
        "agent_return": (3.0, 0.0),
        "agent_return/correct": (1.0, 0.0),
        "agent_return/brief": (1.0, 0.0),
    }


def test_judge_settings_are_checked_at_start_up_and_travel_to_the_runner_without_the_key(monkeypatch):
    import sys

    import trl_plugins.environments.verifiers_env as verifiers_env

    for kwargs, expected in [
        ({"judge_model": "m"}, "judge_model without judge_base_url"),
        ({"judge_base_url": "127.0.0.1:8011/v1"}, "is not an http(s) URL"),
        ({"judge_base_url": "http://127.0.0.1:8011/v1", "judge_api_key_env": "NO_SUCH_JUDGE_KEY"}, "is not set"),
        ({"judge_base_url": "http://127.0.0.1:8011/v1", "judge_timeout_s": 0}, "judge_timeout_s must be > 0"),
    ]:
        with pytest.raises(RolloutError, match=re.escape(expected)):
            VerifiersRollout(environment="x", **kwargs)
    asked = []
    described = {
        "verifiers": VERIFIERS_VERSION,
        "refused": [],
        "rows": [{"id": "0", "prompt": "q", "task": {}}],
        "rewards": [{"name": "boxed", "weight": 0.1}, {"name": "reference", "weight": 1.0}],
        "judges": [{"name": "reference", "model": "m", "base_url": "http://127.0.0.1:8011/v1"}],
    }
    monkeypatch.setattr(verifiers_env, "describe_environment", lambda *a, **k: asked.append(k) or described)
    monkeypatch.setenv("VERIFIERS_JUDGE_KEY", "sk-judge-secret")
    rollout = VerifiersRollout(
        environment="x",
        python=sys.executable,
        judge_base_url="http://127.0.0.1:8011/v1",
        judge_model="m",
        judge_api_key_env="VERIFIERS_JUDGE_KEY",
    )
    judge = {
        "api_key_env": "VERIFIERS_JUDGE_KEY",
        "base_url": "http://127.0.0.1:8011/v1",
        "model": "m",
        "timeout_s": 30.0,
    }
    assert asked[-1]["judge"] == judge  # the start-up description points the judges as the rollouts will
    assert rollout.command[-2:] == ["--judge", json.dumps(judge, sort_keys=True)]
    assert "sk-judge-secret" not in " ".join(rollout.command) + rollout.describe()  # the variable's name, never the key
    assert "judge reference (model 'm' at http://127.0.0.1:8011/v1)" in rollout.describe()
    assert "--judge" not in VerifiersRollout(environment="x", python=sys.executable).command
    assert asked[-1]["judge"] is None  # no endpoint: the runner refuses an environment with a judge


def test_the_scripted_judge_gives_verifiers_reference_judge_its_verdict():
    scripted_judge = scripted_judge_module()
    # verifiers 0.4's reference.txt, filled in as its ReferenceJudge fills it.
    prompt = (
        "Given a task, a reference answer, and a response, determine if the response is correct.\n\nTask:\n```\n"
        "What is 3 + 4?\n```\n\nReference answer:\n```\n{reference}\n```\n\nResponse:\n```\n{response}\n```\n\n"
        'Respond either "yes" or "no" only.'
    )
    assert scripted_judge.verdict(prompt.format(reference="7", response="So \\boxed{7}.")) == "yes"
    assert scripted_judge.verdict(prompt.format(reference="7", response="\\boxed{8}, not 7")) == "no"
    assert "cannot grade" in scripted_judge.verdict(prompt.format(reference="", response="\\boxed{7}"))
    assert scripted_judge.verdict("Reference answer: 7\n\nResponse:\n\\boxed{7}\n\nScore the response") is None


@needs_verifiers
@pytest.mark.slow
def test_an_environment_whose_rubric_has_a_judge_scores_with_it_at_the_named_endpoint(chat, monkeypatch):
    import urllib.request

    server, _ = scripted_judge_module().serve(0)  # on 127.0.0.1: nothing else is contacted
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("VERIFIERS_JUDGE_KEY", "sk-judge-secret")
        rollout = environment(
            "judged_env.py",
            judge_base_url=f"{url}/v1",
            judge_model="scripted-judge",
            judge_api_key_env="VERIFIERS_JUDGE_KEY",
        )
        assert rollout.rubric == [("boxed", 0.1), ("reference", 1.0)]  # the task's functions, then its judge
        result = rollout(rollout_request(chat, rollout))
        right, ungradable = result.trajectories
        assert right.stop_reason == StopReason.FINAL_ANSWER, right.error
        # boxed 1 x 0.1 + the judge's "yes" (verifiers' reference judge: 1.0) x 1.0 = 1.1
        assert components(right) == {
            "agent_return": (1.1, 0.0),
            "agent_return/boxed": (1.0, 0.0),
            "agent_return/reference": (1.0, 0.0),
        }
        # The judge answered with no verdict (no reference to grade against): verifiers raises rather than score 0, and
        # the trajectory is the judge's failure, not the policy's nor the environment's.
        assert ungradable.stop_reason == StopReason.VERIFIER_ERROR and ungradable.reward_components == []
        assert (
            ungradable.error.startswith("the environment's judge failed:") and "no yes/no verdict" in ungradable.error
        )
        assert result.counters["verifiers/judge_failures"] == 1
        with urllib.request.urlopen(f"{url}/stats") as reply:
            keys = json.load(reply)["keys"]
        assert keys == ["Bearer sk-judge-secret"] * 2  # the named variable's key, to the judge only
    finally:
        server.shutdown()
