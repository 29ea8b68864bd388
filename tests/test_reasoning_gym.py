"""``--task reasoning_gym``: reasoning-gym's datasets as rows (disjoint training and held-out questions, composites mixed
by weight, the whole entry kept), the ``reasoning_gym`` reward (the dataset's own ``score_answer``), and refusals of
bad ``task_kwargs`` when the config is parsed, before any model loads."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from trl_plugins.rewards.reasoning_gym import ReasoningGymReward  # noqa: E402
from trl_plugins.types import StopReason, Trajectory, Turn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
from retool.reasoning_gym_task import parse_task_kwargs, reasoning_gym_problems  # noqa: E402

TASKS = {
    "chain_sum": {"datasets": {"chain_sum": {"weight": 1.0, "config": {"min_terms": 3, "max_terms": 4}}}},
    "basic_arithmetic": {"datasets": {"basic_arithmetic": {"weight": 1.0, "config": {}}}},
    "composite": {
        "datasets": {
            "chain_sum": {"weight": 1.0, "config": {"min_terms": 3, "max_terms": 4}},
            "basic_arithmetic": {"weight": 1.0, "config": {}},
        }
    },
}


def traj(text: str, stop=StopReason.FINAL_ANSWER) -> Trajectory:
    return Trajectory(turns=[Turn([1] * 10, [3] * 5, [-0.1] * 5, text=text + "<|im_end|>")], stop_reason=stop)


@pytest.fixture(scope="module")
def rows() -> dict[str, tuple[list[dict], list[dict]]]:
    """Per task: (300 training rows, 100 held-out rows), task_seed 0."""
    out = {}
    for name, kwargs in TASKS.items():
        task = parse_task_kwargs(kwargs)
        out[name] = (
            reasoning_gym_problems(task, 300, seed=0, split="train"),
            reasoning_gym_problems(task, 100, seed=0, split="test"),
        )
    return out


@pytest.mark.parametrize("name", list(TASKS))
def test_training_and_held_out_rows_never_share_a_question(rows, name):
    train, test = rows[name]
    assert len(train) == 300 and len(test) == 100
    train_q, test_q = [r["prompt"] for r in train], [r["prompt"] for r in test]
    assert len(set(train_q)) == 300 and len(set(test_q)) == 100  # each question once
    assert not set(train_q) & set(test_q)
    # Training leaves out the whole held-out pool (1000 items), not only the 100 asked for: a later evaluation with more
    # held-out problems still meets no training question.
    from retool.reasoning_gym_task import _held_out_pool

    task = parse_task_kwargs(TASKS[name])
    assert not set(train_q) & {r["prompt"] for r in _held_out_pool(task, 0)}
    # The same seed gives the same rows (a run and its evaluation child load them alike); ids are unique.
    assert reasoning_gym_problems(task, 100, seed=0, split="test") == test
    assert len({r["id"] for r in train + test}) == 400


def test_two_seeds_of_one_dataset_share_almost_every_item_which_the_split_avoids():
    # Negative control: reasoning-gym's item i is Random(seed + i), so seeds 0 and 1 give the same items shifted by one;
    # held-out and training rows made by seeds alone would overlap nearly whole.
    a = reasoning_gym.create_dataset("chain_sum", size=50, seed=0)
    b = reasoning_gym.create_dataset("chain_sum", size=50, seed=1)
    shared = {a[i]["question"] for i in range(50)} & {b[i]["question"] for i in range(50)}
    assert len(shared) >= 45


def test_too_few_distinct_questions_are_refused_with_the_numbers():
    # 1-digit terms, exactly 2 of them, no negation: at most 10 * 10 * 2 = 200 questions; 1000 held-out items take
    # nearly all of them, so 300 training questions outside them cannot exist.
    task = parse_task_kwargs(
        {
            "datasets": {
                "chain_sum": {
                    "config": {
                        "min_terms": 2,
                        "max_terms": 2,
                        "min_digits": 1,
                        "max_digits": 1,
                        "allow_negation": False,
                    }
                }
            }
        }
    )
    with pytest.raises(
        ValueError,
        match=r"300 asked for, but 6000 items .* hold only \d+ distinct questions outside the "
        r"\d+ held-out ones.*Lower --train_size",
    ):
        reasoning_gym_problems(task, 300, seed=0, split="train")
    with pytest.raises(
        ValueError,
        match=r"held-out rows: 500 asked for, but the held-out pool .* holds \d+ distinct "
        r"questions. Lower --eval_problems",
    ):
        reasoning_gym_problems(task, 500, seed=0, split="test")


def test_a_composites_weights_set_each_datasets_share():
    # 2000 rows at weights 3:1: the share of chain_sum is binomial around 0.75 with sd sqrt(0.75 * 0.25 / 2000) = 0.0097;
    # 4 sd = 0.039 (the draw is seeded, so this is a check of the mixing, not a flaky test). Reversed weights: 0.25.
    for weights, share in (((3.0, 1.0), 0.75), ((1.0, 3.0), 0.25)):
        task = parse_task_kwargs(
            {"datasets": {"chain_sum": {"weight": weights[0]}, "basic_arithmetic": {"weight": weights[1]}}}
        )
        train = reasoning_gym_problems(task, 2000, seed=0, split="train")
        got = sum(r["metadata"]["source_dataset"] == "chain_sum" for r in train) / len(train)
        assert abs(got - share) < 0.039, (weights, got)


def test_each_row_keeps_the_whole_entry_json_ready(rows):
    train, test = rows["composite"]
    data = parse_task_kwargs(TASKS["composite"]).composite(0, 1000)
    first = test[0]
    entry = data[0]  # the held-out pool's first item is the first held-out row
    assert first["prompt"] == entry["question"] and first["answer"] == entry["answer"]
    assert first["metadata"] == json.loads(json.dumps(entry["metadata"]))
    assert first["metadata"]["source_dataset"] in ("chain_sum", "basic_arithmetic")
    assert (
        first["reasoning_gym_config"] == TASKS["composite"]["datasets"][first["metadata"]["source_dataset"]]["config"]
    )
    assert {r["metadata"]["source_dataset"] for r in train} == {"chain_sum", "basic_arithmetic"}
    for row in train[:20] + test[:20]:
        assert json.loads(json.dumps(row)) == row  # what the viewer's batches save and a replay reads back


def test_metadata_json_cannot_hold_is_refused_when_the_rows_are_made(monkeypatch):
    # A saved row is JSON: a set in the metadata would come back as its text and the scorer would read another entry.
    from retool.reasoning_gym_task import ReasoningGymTask

    task = parse_task_kwargs(TASKS["chain_sum"])
    entries = [
        {"question": f"q{i}", "answer": "1", "metadata": {"source_dataset": "chain_sum", "seen": {1, 2}}}
        for i in range(5)
    ]
    monkeypatch.setattr(ReasoningGymTask, "composite", lambda self, seed, size: entries)
    with pytest.raises(
        ValueError,
        match=r"the metadata of chain_sum's entries holds a value JSON cannot hold .*"
        r"could not be scored again",
    ):
        reasoning_gym_problems(task, 2, seed=0, split="test")


@pytest.mark.parametrize("name", list(TASKS))
def test_the_reward_is_the_datasets_own_score_answer(rows, name):
    reward = ReasoningGymReward()
    data = parse_task_kwargs(TASKS[name]).composite(0, 1000)  # the generating dataset: score_answer by source_dataset
    for row in rows[name][1][:10]:
        entry = {"question": row["prompt"], "answer": row["answer"], "metadata": row["metadata"]}
        oracle = str(row["answer"])
        cases = {
            f"so \\boxed{{{oracle}}}": oracle,  # right
            f"\\boxed{{{oracle}1}}": oracle + "1",  # wrong
            f"the answer is {oracle}": None,  # malformed: no box
            f"\\boxed{{{oracle} apples}}": f"{oracle} apples",  # contains the oracle: partial credit (base scorer)
        }
        for text, answer in cases.items():
            expected = data.score_answer(answer, entry)
            assert reward(traj(text), row) == expected, (text, expected)
        assert reward(traj(f"\\boxed{{{oracle}}}"), row) == 1.0
        assert reward.is_success(1.0) and not reward.is_success(reward(traj(f"\\boxed{{{oracle} apples}}"), row))
        partial = reward(traj(f"\\boxed{{{oracle} apples}}"), row)
        assert 0 < partial < 1  # len(oracle) / len(answer): partial credit is the reward as it is
        # Truncated: no final answer, scored as none.
        assert reward(traj(f"\\boxed{{{oracle}}}", StopReason.TURN_LENGTH), row) == data.score_answer(None, entry)
    tagged = ReasoningGymReward(answer_format="answer_tag")
    row = rows[name][1][0]
    assert tagged(traj(f"<answer>{row['answer']}</answer>"), row) == 1.0
    assert tagged(traj(f"\\boxed{{{row['answer']}}}"), row) == 0.0  # the other format is no answer here


def test_the_reward_reports_reasoning_gyms_version_and_rescores_a_saved_row(rows):
    from importlib import metadata

    from trl_plugins.protocols import as_reward
    from trl_plugins.replay.saved_batch import _check_rewards
    from trl_plugins.run.version import plugin_versions
    from trl_plugins.viewer.batch import _scalar

    plugin = as_reward(ReasoningGymReward(), "reasoning_gym")
    assert plugin_versions("reward/reasoning_gym", plugin) == {
        "reward/reasoning_gym": f"reasoning-gym {metadata.version('reasoning-gym')}"
    }
    row = rows["composite"][1][0]
    t = traj(f"\\boxed{{{row['answer']} apples}}")
    from trl_plugins.types import RewardComponent

    t.reward_components = [RewardComponent("reasoning_gym", plugin(t, row), 1.0)]
    saved = json.loads(json.dumps({"row": _scalar(dict(row))}))  # as save_batch writes the row, read back

    class _Run:
        rewards = [plugin]

    assert _check_rewards(_Run(), {}, saved, t, 0) is None  # the saved row scores the same again
    t.reward_components = [RewardComponent("reasoning_gym", 0.5, 1.0)]
    assert _check_rewards(_Run(), {}, saved, t, 0) is not None  # negative control: another saved value differs
    assert pickle.loads(pickle.dumps(ReasoningGymReward())) == ReasoningGymReward()


def test_a_row_without_reasoning_gyms_metadata_is_named():
    with pytest.raises(KeyError, match="needs the entry's metadata with 'source_dataset'"):
        ReasoningGymReward()(traj("\\boxed{1}"), {"prompt": "What is 1?", "answer": "1"})
    with pytest.raises(ValueError, match="answer_format must be one of"):
        ReasoningGymReward(answer_format="json")


def _recipe():
    from support.recipes import recipe_module

    return recipe_module()


@pytest.mark.parametrize(
    "task_kwargs,message",
    [
        (
            '{"datasets": {"chain_summ": {"weight": 1.0}}}',
            r"dataset 'chain_summ', which reasoning-gym .* does not have. Did you mean 'chain_sum'",
        ),
        (
            '{"datasets": {"chain_sum": {"config": {"min_term": 3}}}}',
            r"no field\(s\) \['min_term'\] in reasoning-gym's ChainSumConfig \(did you mean 'min_term' -> 'min_terms'\?\)",
        ),
        (
            '{"datasets": {"chain_sum": {"config": {"min_terms": 5, "max_terms": 2}}}}',
            r"refused by reasoning-gym's ChainSumConfig",
        ),
        ('{"datasets": {"chain_sum": {"weight": 0}}}', r"datasets.chain_sum.weight must be a positive number"),
        (
            '{"datasets": {"chain_sum": {"weight": -1.0}, "basic_arithmetic": {}}}',
            r"datasets.chain_sum.weight must be a positive number",
        ),
        (
            '{"datasets": {"chain_sum": {"config": {"seed": 3}}}}',
            r"sets \['seed'\]: the run sets them \(seed from --task_seed\)",
        ),
        (
            '{"datasets": {"chain_sum": {"weigth": 2}}}',
            r"datasets.chain_sum takes \['config', 'weight'\]; got \['weigth'\]",
        ),
        ('{"datasets": {"chain_sum": {"weight": Infinity}}}', r"datasets.chain_sum.weight must be a positive number"),
        ('{"dataset": {"chain_sum": {}}}', r"take \['datasets', 'held_out_pool'\]; got \['dataset'\]"),
        ("{}", r"needs task_kwargs naming at least one reasoning-gym dataset"),
    ],
)
def test_bad_task_kwargs_are_refused_when_the_config_is_parsed(task_kwargs, message, no_model_no_eval):
    retool_ppo = _recipe()
    with pytest.raises(SystemExit, match=r"configuration error \(before any model loads\): .*" + message):
        retool_ppo.parse_args(["--task", "reasoning_gym", "--task_kwargs", task_kwargs])
    assert no_model_no_eval == []


def test_task_kwargs_for_another_task_are_refused():
    with pytest.raises(
        SystemExit, match="task_kwargs are the settings of --task reasoning_gym; task 'arithmetic' takes none"
    ):
        _recipe().parse_args(["--task_kwargs", json.dumps(TASKS["chain_sum"])])


def test_a_dry_run_of_the_reasoning_gym_recipe_checks_everything_and_refuses_it_without_its_reward(
    tmp_path, monkeypatch, no_model_no_eval, capsys
):
    import wandb

    import retool.launch
    from conftest import refusing

    monkeypatch.setattr(retool.launch, "prepare_child", refusing(no_model_no_eval, "a spare child interpreter"))
    monkeypatch.setattr(wandb, "init", refusing(no_model_no_eval, "wandb.init"))
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))  # empty: the embedded default stands in
    retool_ppo = _recipe()
    common = [
        "--config",
        str(ROOT / "recipes" / "retool_reasoning_gym.yaml"),
        "--dry_run",
        "true",
        "--report_to",
        "none",
        "--output_dir",
        str(tmp_path / "out"),
        "--train_size",
        "64",
        "--eval_problems",
        "8",
    ]
    script_args, args = retool_ppo.parse_args(common + ["--reward_components", "correct", "format"])
    with pytest.raises(SystemExit, match=r"before any model loads.*reward_components must include 'reasoning_gym'"):
        retool_ppo.main(script_args, args)
    script_args, args = retool_ppo.parse_args(common + ["--final_answer_pattern", "<answer>"])
    with pytest.raises(SystemExit, match=r"answer_format='boxed'.*final_answer_pattern='<answer>' does not match it"):
        retool_ppo.main(script_args, args)
    script_args, args = retool_ppo.parse_args(common)
    assert script_args.success_component == "reasoning_gym"  # what the held-out accuracy and pass@k count by
    assert pickle.loads(pickle.dumps(script_args)).reasoning_gym_task == script_args.reasoning_gym_task  # to children
    assert retool_ppo.main(script_args, args) == 0
    said = capsys.readouterr().out
    assert "dataset:      reasoning-gym: chain_sum (100%" in said
    assert "rewards:      reasoning_gym x 1" in said
    assert "training rows: 64 reasoning-gym questions" in said and "held-out rows: 8 reasoning-gym questions" in said
    assert "[embedded default] dry run: not in the cache; the run would build its weights and cold start" in said
    assert "start-up checks: passed their contract checks" in said and "dry run: every start-up check passed" in said
    assert no_model_no_eval == [] and not (tmp_path / "out").exists()


def test_the_task_alone_brings_its_rewards_and_a_users_choice_still_wins(tmp_path):
    # Before: `--task reasoning_gym --task_kwargs ...` without the recipe's config file kept retool_ppo.yaml's
    # [correct, format] (the arithmetic task's) and was refused for lacking 'reasoning_gym'.
    from retool.config import parse_args

    chain = ["--task", "reasoning_gym", "--task_kwargs", json.dumps(TASKS["chain_sum"])]
    script_args, args = parse_args(chain)
    assert args.reward_components == ["reasoning_gym", "format"] and args.reward_component_weights == [1.0, 0.1]
    assert args.reward_component_kwargs == {"reasoning_gym": {"answer_format": "boxed"}}
    assert script_args.success_component == "reasoning_gym"
    assert script_args.provenance["reward_components"] == "the task 'reasoning_gym'"
    assert "reward_components" in script_args.task_settings and script_args.config_files[-1].endswith("retool_ppo.yaml")
    # --config none keeps the task's own settings (before: an empty reward_components, refused).
    assert parse_args(["--config", "none", *chain])[1].reward_components == ["reasoning_gym", "format"]
    # The command line wins; a weight the task gave is kept by name.
    _, args = parse_args([*chain, "--reward_components", "reasoning_gym", "tool_use"])
    assert args.reward_components == ["reasoning_gym", "tool_use"] and args.reward_component_weights == [1.0, 1.0]
    # So does a config file of the user's.
    mine = tmp_path / "mine.yaml"
    mine.write_text("reward_components: [reasoning_gym]\nreward_component_weights: [2.0]\n")
    script_args, args = parse_args(["--config", str(mine), *chain])
    assert args.reward_components == ["reasoning_gym"] and args.reward_component_weights == [2.0]
    assert script_args.provenance["reward_components"] == "mine.yaml"
    assert "reward_components" not in script_args.task_settings
    # Negative control: the arithmetic task brings the arithmetic rewards.
    assert parse_args([])[1].reward_components == ["correct", "format"]


def test_a_dry_run_of_the_task_alone_passes_and_the_banner_says_what_the_task_set(
    tmp_path, monkeypatch, no_model_no_eval, capsys
):
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    retool_ppo = _recipe()
    script_args, args = retool_ppo.parse_args(
        [
            "--task",
            "reasoning_gym",
            "--task_kwargs",
            json.dumps(TASKS["chain_sum"]),
            "--dry_run",
            "true",
            "--report_to",
            "none",
            "--train_size",
            "64",
            "--eval_problems",
            "8",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    assert retool_ppo.main(script_args, args) == 0
    said = capsys.readouterr().out
    assert (
        "task:         'reasoning_gym' set reward_component_kwargs, reward_component_weights, reward_components, "
        "success_component (its own settings"
    ) in said
    assert "rewards:      reasoning_gym x 1; format x 0.1" in said
    assert no_model_no_eval == []


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--task", "reasoning_gym", "--task_kwargs", '{"datasets": {"gcd": {}}}'],
            r"reasoning-gym's 'gcd' entries hold no metadata.expression: bring a model for it \(--model_name_or_path\)",
        ),
        (["--embedded", '{"cold_start_epoch": 2}'], r"--embedded .*unknown embedded settings \['cold_start_epoch'\]"),
        (
            ["--embedded", '{"task": "lookup"}'],
            r"embedded settings name task 'lookup' but the run's task is 'arithmetic'",
        ),
        (
            [
                "--config",
                str(ROOT / "recipes" / "retool_reasoning_gym.yaml"),
                "--embedded",
                json.dumps({"task_kwargs": json.dumps(TASKS["composite"])}),
            ],
            r"embedded settings name task_kwargs",
        ),
    ],
)
def test_what_the_embedded_defaults_build_would_refuse_is_refused_at_start_up_in_one_line(
    argv, message, tmp_path, monkeypatch, no_model_no_eval, capsys
):
    # Before: the banner, the rows, then the build in a child process, failing minutes later with a traceback.
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    retool_ppo = _recipe()
    script_args, args = retool_ppo.parse_args(
        [*argv, "--dry_run", "true", "--report_to", "none", "--output_dir", str(tmp_path / "out")]
    )
    with pytest.raises(SystemExit) as refused:
        retool_ppo.main(script_args, args)
    text = str(refused.value.code)
    assert text.startswith("configuration error (before any model loads): ") and "\n" not in text
    assert __import__("re").search(message, text), text
    assert "ReTool PPO: the run" not in capsys.readouterr().out  # before the banner
    assert no_model_no_eval == []
    # Negative control: a model named by the user needs no embedded default, so nothing is refused for it.
    from retool.default_model import check_embedded_default

    script_args.model_name_or_path = str(tmp_path / "a-model")
    check_embedded_default(script_args, args)


def test_the_refusal_is_one_line_with_the_exit_code_of_other_configuration_errors(tmp_path):
    import os
    import subprocess

    env = {**os.environ, "TRL_PLUGINS_CACHE": str(tmp_path / "cache")}
    argv = ["--task", "reasoning_gym", "--task_kwargs", '{"datasets": {"gcd": {}}}', "--dry_run", "true"]
    refused = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "retool_ppo.py"), *argv, "--report_to", "none",
         "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    # Every configuration error ends the recipe as SystemExit(message): exit code 1, the message on stderr.
    from retool.config import parse_args

    with pytest.raises(SystemExit) as other:
        parse_args(["--task", "reasoning_gym", "--task_kwargs", '{"datasets": {"chain_summ": {}}}'])
    assert isinstance(other.value.code, str) and other.value.code.startswith("configuration error")
    assert refused.returncode == 1
    assert refused.stdout == "" and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]
    assert "'gcd' entries hold no metadata.expression" in refused.stderr


def test_the_embedded_default_is_built_for_the_runs_datasets_under_its_own_key():
    from retool.config import parse_args
    from retool.default_model import EmbeddedSettings, embedded_settings_for

    recipe = str(ROOT / "recipes" / "retool_reasoning_gym.yaml")
    said: list[str] = []
    settings = embedded_settings_for(*parse_args(["--config", recipe]), log=said.append)
    assert settings.task == "reasoning_gym" and settings.cold_start_tool_fraction == 0.3 and not said
    assert settings.cold_start_code.format(expression="123 + 456 - 789") == 'print(f"{123 + 456 - 789:+05d}")'
    assert json.loads(settings.task_kwargs)["datasets"] == {
        "chain_sum": {"weight": 1.0, "config": {"min_terms": 3, "max_terms": 3, "min_digits": 3, "max_digits": 3}}
    }
    # The recipe's datasets are the task's default build (python -m retool.default_model --settings '{"task": ...}').
    assert EmbeddedSettings.from_json('{"task": "reasoning_gym"}').key() == settings.key()
    arithmetic = embedded_settings_for(*parse_args([]), log=said.append)
    assert arithmetic.key() != settings.key() and arithmetic.task_kwargs == ""
    # Other datasets: a build of their own; the same datasets spelt otherwise (order, an int weight): the same one.
    other = embedded_settings_for(
        *parse_args(["--config", recipe, "--task_kwargs", json.dumps(TASKS["composite"])]), log=said.append
    )
    reordered = {"datasets": dict(reversed(list(TASKS["composite"]["datasets"].items())))}
    reordered["datasets"]["basic_arithmetic"]["weight"] = 1
    same = embedded_settings_for(
        *parse_args(["--config", recipe, "--task_kwargs", json.dumps(reordered)]), log=said.append
    )
    assert other.key() != settings.key() and same.key() == other.key()
    with pytest.raises(ValueError, match="task_kwargs are the reasoning_gym task's; task 'arithmetic' takes none"):
        EmbeddedSettings(task_kwargs=settings.task_kwargs)
    # --embedded cannot build for other datasets than the run trains on: refused, naming --task_kwargs.
    with pytest.raises(ValueError, match=r"embedded settings name task_kwargs.*set them with --task_kwargs"):
        embedded_settings_for(
            *parse_args(["--config", recipe, "--embedded", json.dumps({"task_kwargs": other.task_kwargs})]),
            log=said.append,
        )


def test_the_cold_starts_transcripts_hold_what_the_real_tool_printed():
    from retool.coldstart import with_tool_outputs
    from retool.default_model import EmbeddedSettings, _scores_full_marks
    from retool.task import bundled_problems

    problems = bundled_problems("reasoning_gym", 16, split="train", task_kwargs=TASKS["composite"])
    assert {p["metadata"]["source_dataset"] for p in problems} == {"chain_sum", "basic_arithmetic"}
    assert all(p["expression"] == p["metadata"]["expression"] for p in problems)
    kept, dropped = with_tool_outputs(problems, right=_scores_full_marks)
    # The sandbox's own text (print's newline included); where boxing it would not get full marks from the dataset's
    # scorer (basic_arithmetic's divisions print -30.0 for -30), the question is left out of the cold start.
    assert len(kept) + len(dropped) == len(problems) and kept
    for p in kept:
        assert p["tool_output"] == f"{p['answer']}\n"
    for p in dropped:
        assert p["metadata"]["source_dataset"] == "basic_arithmetic" and "/" in p["expression"]
        assert float(p["tool_output"]) == float(p["answer"]) and p["tool_output"] != f"{p['answer']}\n"
    dropped_before = dropped[:1] or [{**problems[0], "expression": "-30 / 1"}]
    # The recipe's build: the fixed-width code, every output 5 characters and full marks; a float refuses the format.
    settings = EmbeddedSettings.from_json('{"task": "reasoning_gym"}')
    fixed = bundled_problems("reasoning_gym", 8, task_kwargs=settings.task_kwargs)
    kept, dropped = with_tool_outputs(fixed, code=settings.cold_start_code, right=_scores_full_marks)
    assert (
        not dropped
        and {len(p["tool_output"]) for p in kept} == {6}
        and {p["tool_output"][0] for p in kept} <= {"+", "-"}
    )
    assert all(int(p["tool_output"]) == int(p["answer"]) for p in kept)
    with pytest.raises(ValueError, match=r"failed on print\(f\"\{.*/.*:\+05d\}\"\).*cold_start_code"):
        with_tool_outputs(dropped_before, code=settings.cold_start_code)
    wrong = [{**p, "answer": "12345"} for p in problems[:3]]
    with pytest.raises(
        ValueError,
        match=r"for 3 of 3 questions the code interpreter's output is not the answer.*"
        r"the answer is '12345'.*--model_name_or_path",
    ):
        with_tool_outputs(wrong)


def test_a_dataset_whose_entries_hold_no_expression_cannot_be_taught_and_says_so():
    from retool.task import bundled_problems

    with pytest.raises(
        ValueError,
        match=r"'leg_counting' entries hold no metadata.expression: bring a model for it "
        r"\(--model_name_or_path\)",
    ):
        bundled_problems("reasoning_gym", 4, task_kwargs={"datasets": {"leg_counting": {}}})


def test_the_cold_start_transcript_boxes_the_tools_text(chat_format_reasoning_gym):
    from retool.coldstart import transcript

    chat, problem = chat_format_reasoning_gym
    ids, mask = transcript(chat, {**problem, "tool_output": f"{problem['answer']}\n"}, use_tool=True)
    text = chat.tokenizer.decode(ids)
    assert f"print({problem['expression']})" in text and f"\\boxed{{{problem['answer']}}}" in text
    # The tool's message is context (mask 0); the call and the answer are the model's (mask 1).
    boxed = chat.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert f"print({problem['expression']})" in boxed and f"{problem['answer']}\n<|im_end|>" not in boxed


@pytest.fixture(scope="module")
def chat_format_reasoning_gym():
    from retool.default_model import EmbeddedSettings, embedded_tokenizer, task_schemas
    from retool.task import bundled_problems
    from trl_plugins.rollout import ChatFormat

    settings = EmbeddedSettings.from_json('{"task": "reasoning_gym"}')
    chat = ChatFormat(embedded_tokenizer(settings), task_schemas(settings.task))
    return chat, bundled_problems("reasoning_gym", 1, task_kwargs=settings.task_kwargs)[0]


def test_the_train_batch_accuracy_of_a_reasoning_gym_run_is_the_mean_of_its_scores():
    from retool.report import train_accuracy

    # retool_compare.py's table and the runs' plots read it: a reasoning-gym run logs no reward/correct.
    assert train_accuracy({"reward/correct": 0.5, "reward/reasoning_gym": 0.1}) == 0.75
    assert train_accuracy({"reward/reasoning_gym": 0.3, "reward/format": 1.0}) == 0.3
    assert train_accuracy({"reward/format": 1.0}) is None


@pytest.mark.slow
def test_the_embedded_default_builds_from_the_tools_own_outputs(tmp_path, capsys):
    # The build's wiring end to end, tiny: the datasets' questions, the fixed-width code run in the sandbox, the copy
    # check over every copied token; the manifest records the reasoning_gym settings it was built with.
    from retool.default_model import EmbeddedSettings, build_embedded_default

    settings = EmbeddedSettings.from_json(
        json.dumps(
            {
                "task": "reasoning_gym",
                "cold_start_problems": 24,
                "cold_start_epochs": 0.5,
                "hidden_size": 32,
                "cold_start_batch_size": 8,
                "cold_start_max_extra_epochs": 0,
            }
        )
    )
    model_dir = build_embedded_default(settings, tmp_path, show_progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["settings"]["task_kwargs"] == settings.task_kwargs and (model_dir / "config.json").is_file()
    assert 0.0 <= manifest["cold_start"]["copy_accuracy"] <= 1.0
    said = capsys.readouterr().out
    assert "cold-start SFT (reasoning_gym): 24 transcripts (30% take each tool step)" in said
