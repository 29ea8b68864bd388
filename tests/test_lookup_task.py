"""The lookup task (recipes/retool/lookup.py): two dependent tool calls, moved keys to recover from, and cold-start
transcripts that are exactly what the rollout produces with the real tools."""

from __future__ import annotations

import asyncio
import re

import pytest

from retool.lookup import KEY_PATTERN, LookupTool, key_value, lookup_problems, moved_to, resolve_key


def test_problems_are_deterministic_with_answers_behind_the_key_and_splits_disjoint_by_key():
    train = lookup_problems(400, seed=0, split="train")
    assert train == lookup_problems(400, seed=0, split="train")
    assert train != lookup_problems(400, seed=1, split="train")
    test = lookup_problems(100, seed=0, split="test")
    assert lookup_problems(50, seed=0, split="test") == test[:50]
    # Held-out problems ask about keys no training problem names: a value memorised in training does not help.
    assert not {r["key"] for r in train} & {r["key"] for r in test}
    assert len({r["key"] for r in train}) == len(train)  # one problem per key
    assert len({r["key"] for r in lookup_problems(741, split="train")}) == 741
    again = lookup_problems(2000, split="train")  # more rows than keys: round again
    assert again[:741] != again[741:1482] and {r["key"] for r in again[:741]} == {r["key"] for r in again[741:1482]}
    assert len({r["id"] for r in again}) == 2000
    for row in train + test:
        target, value = resolve_key(row["key"])
        assert row["value"] == value == key_value(target) and 100 <= value <= 316
        assert int(row["answer"]) == value * value and len(row["answer"]) == 5
        assert row["prompt"] == f'What is x * x, where x is the number under key "{row["key"]}"?'
        assert row["moved_to"] == moved_to(row["key"])
        assert str(value) not in row["prompt"]  # only the tool knows x
    moved = sum(r["moved_to"] is not None for r in train) / len(train)
    assert 0.3 < moved < 0.5  # MOVED_PERCENT of the keys: a first call fails often enough to learn recovery
    with pytest.raises(ValueError, match="split must be"):
        lookup_problems(1, split="validation")
    with pytest.raises(ValueError, match="one per key"):
        lookup_problems(160, split="test")


def test_a_moved_key_points_once_to_a_key_that_holds_the_number():
    keys = [f"K{k}" for k in range(100, 1000)]
    moves = {k: moved_to(k) for k in keys}
    for key, target in moves.items():
        if target is not None:
            assert target != key and KEY_PATTERN.fullmatch(target) and moved_to(target) is None
    assert 0.35 < sum(t is not None for t in moves.values()) / len(keys) < 0.45


def test_the_tool_answers_the_number_or_an_error_that_says_what_to_do_and_passes_the_tool_contract():
    from trl_plugins.contracts import check_tool_contract

    tool = LookupTool()
    still = next(f"K{k}" for k in range(100, 1000) if moved_to(f"K{k}") is None)
    gone = next(f"K{k}" for k in range(100, 1000) if moved_to(f"K{k}") is not None)
    out = asyncio.run(tool({"key": still}))
    assert (out.text, out.ok, out.infra_error) == (str(key_value(still)), True, None)
    out = asyncio.run(tool({"key": gone}))
    assert not out.ok and out.infra_error is None  # the model's to fix, not the infrastructure's
    assert out.text == f"Error: key {gone} was moved to {moved_to(gone)}; look up {moved_to(gone)}."
    assert asyncio.run(tool({"key": moved_to(gone)})).text == str(resolve_key(gone)[1])
    out = asyncio.run(tool({"key": "k12"}))
    assert not out.ok and "Keys are K100 to K999" in out.text
    out = asyncio.run(tool({"name": "K417"}))
    assert not out.ok and "missing required argument 'key'" in out.text
    check_tool_contract(tool, arguments={"key": "K417"})
    check_tool_contract("retool.lookup:LookupTool", arguments={"key": "K417"})


@pytest.fixture(scope="module")
def lookup_chat():
    from retool.default_model import EmbeddedSettings, embedded_tokenizer, task_schemas
    from trl_plugins.rollout import ChatFormat

    settings = EmbeddedSettings.from_json("{}", task="lookup")
    return ChatFormat(embedded_tokenizer(settings), task_schemas("lookup"), final_answer_pattern=r"\\boxed\{"), settings


@pytest.mark.parametrize(
    "path",
    [
        dict(lookup=True, recover=True, compute=True),
        dict(lookup=True, recover=False, compute=True),
        dict(lookup=True, recover=True, compute=False),
        dict(lookup=False, recover=False, compute=False),
    ],
)
def test_cold_start_transcripts_are_what_the_rollout_makes_with_the_real_tools(lookup_chat, path):
    # A policy that writes the transcript's assistant turns, run through the rollout with LookupTool and the real
    # code interpreter: every token of the trajectory (prompt, calls, the tools' own outputs and errors, glue,
    # answer) is the transcript's. So the recovery the cold start shows is from errors the environment really gives.
    from retool.coldstart import lookup_transcript
    from trl_plugins.rollout import MultiTurnRollout, RolloutQuestion, RolloutRequest, ScriptedBackend
    from trl_plugins.tools.code_interpreter import CodeInterpreter
    from trl_plugins.types import StopReason

    chat, settings = lookup_chat
    problems = lookup_problems(40, seed=3)
    problems = [next(p for p in problems if p["moved_to"]), next(p for p in problems if not p["moved_to"])]

    def messages(p: dict) -> list[dict]:
        return [{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": p["prompt"]}]

    expected = {p["id"]: lookup_transcript(chat, p, system_prompt=settings.system_prompt, **path) for p in problems}

    def script(prompt: list[int]) -> list[int]:
        for ids, mask in expected.values():
            if ids[: len(prompt)] == prompt and mask[len(prompt)] == 1:
                end = next((i for i in range(len(prompt), len(ids)) if not mask[i]), len(ids))
                return ids[len(prompt) : end]
        raise AssertionError("the rollout built a prompt no transcript has")

    questions = [
        RolloutQuestion(p["id"], chat.initial_prompt_ids(messages(p)), group_id=i) for i, p in enumerate(problems)
    ]
    with CodeInterpreter(mode="cold") as code:
        result = MultiTurnRollout(max_turns=5, max_tool_calls=4)(
            RolloutRequest(
                questions,
                1,
                ScriptedBackend(script, stop_token_ids=chat.stop_token_ids),
                chat,
                {"lookup": LookupTool(), "code_interpreter": code},
                policy_step=0,
                seed=0,
            )
        )
    for traj, problem in zip(result.trajectories, problems):
        ids, mask = expected[problem["id"]]
        last = traj.turns[-1]
        assert last.prompt_ids + last.completion_ids == ids
        assert traj.stop_reason == StopReason.FINAL_ANSWER
        calls = [c for t in traj.turns for c in t.tool_calls]
        assert [c.name for c in calls] == (
            ["lookup"] * (1 + bool(problem["moved_to"] and path["recover"])) if path["lookup"] else []
        ) + (
            ["code_interpreter"]
            if path["compute"] and path["lookup"] and (path["recover"] or not problem["moved_to"])
            else []
        )
        assert [c.ok for c in calls] == [
            not (c.name == "lookup" and i == 0 and problem["moved_to"]) for i, c in enumerate(calls)
        ]
        if calls and calls[-1].name == "code_interpreter":
            assert calls[-1].output.strip() == problem["answer"]
            assert calls[-1].arguments == {"code": f"print({problem['value']} * {problem['value']})"}


def test_the_recipe_yaml_sets_up_the_task_its_embedded_default_is_built_for():
    from pathlib import Path

    import yaml

    from retool.coldstart import LOOKUP_SYSTEM_PROMPT
    from retool.config import parse_args
    from retool.default_model import embedded_settings_for

    path = Path(__file__).resolve().parent.parent / "recipes" / "retool_lookup.yaml"
    assert yaml.safe_load(path.read_text())["task"] == "lookup"
    script_args, training_args = parse_args(["--config", str(path)])
    assert script_args.task == "lookup" and training_args.tools == ["retool.lookup:LookupTool", "code_interpreter"]
    assert training_args.system_prompt == LOOKUP_SYSTEM_PROMPT and training_args.rollout_kwargs["max_turns"] == 5
    # The task brings them (recipes/retool/tasks.py): --task lookup alone is the same run, and says so.
    alone, alone_training = parse_args(["--task", "lookup"])
    for name in ("tools", "system_prompt", "rollout_kwargs", "reward_components", "reward_component_weights"):
        assert getattr(alone_training, name) == getattr(training_args, name), name
        assert alone.provenance[name] == "the task 'lookup'" and name in alone.task_settings
    said: list[str] = []
    settings = embedded_settings_for(script_args, training_args, log=said.append)
    assert settings.task == "lookup" and settings.system_prompt == LOOKUP_SYSTEM_PROMPT and not said
    arithmetic = embedded_settings_for(*parse_args([]), log=said.append)
    assert arithmetic.task == "arithmetic" and arithmetic.key() != settings.key()


def test_the_arithmetic_embedded_defaults_cache_key_did_not_move():
    # The fields the lookup task added stay out of the key at their defaults: every cached build stays valid.
    from dataclasses import asdict

    from retool.default_model import EmbeddedSettings

    assert EmbeddedSettings().key() == "a7d365ff0ae072b7"
    assert "task" in asdict(EmbeddedSettings())


def test_a_task_without_its_tools_or_beside_a_dataset_is_refused_before_anything_is_built(tmp_path):
    from retool.config import parse_args
    from retool.startup import resolve

    with pytest.raises(SystemExit, match=r"task 'lookup' names a bundled task, but dataset_name"):
        parse_args(["--task", "lookup", "--dataset_name", "some/set"])
    with pytest.raises(SystemExit, match="task must be one of"):
        parse_args(["--task", "lookups"])
    # The task brings its tools; a --tools of the user's that leaves one out is refused, naming where it was set.
    script_args, training_args = parse_args(
        ["--task", "lookup", "--tools", "code_interpreter", "--output_dir", str(tmp_path / "out")]
    )
    with pytest.raises(
        SystemExit,
        match=re.escape("task 'lookup' needs the tool(s) ['lookup']")
        + ".*"
        + re.escape("drop the --tools you set (its provenance: the command line)"),
    ):
        resolve(script_args, training_args)
    assert not (tmp_path / "out").exists()


def test_every_number_a_solution_writes_is_within_the_models_attention_window(lookup_chat):
    # What lets the tiny model learn the task: each digit run an assistant turn writes (a key, a moved key's new
    # name, the number in the code, the boxed answer) appears, token for token, in the window of tokens before it.
    from retool.coldstart import full_transcript

    chat, settings = lookup_chat
    digits = {chat.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    window = settings.sliding_window
    problems = lookup_problems(30, seed=4)
    assert any(p["moved_to"] for p in problems) and not all(p["moved_to"] for p in problems)
    for problem in problems:
        ids, mask = full_transcript(chat, problem, "lookup", system_prompt=settings.system_prompt)
        runs, i = [], 0
        while i < len(ids):
            if mask[i] and ids[i] in digits:
                j = i
                while j < len(ids) and mask[j] and ids[j] in digits:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        assert len(runs) == (5 if problem["moved_to"] else 4)  # key, [new key], number twice, answer
        for start, end in runs:
            run, seen = ids[start:end], ids[max(start - window, 0) : start]
            assert any(seen[k : k + len(run)] == run for k in range(len(seen))), (problem, start)


def test_the_cold_starts_recovery_and_tool_fractions_decide_its_paths(lookup_chat):
    # cold_start_recovery_fraction and cold_start_tool_fraction reach the lookup transcripts: 0 and 1 give none and
    # all of the recoveries (a second lookup call after a moved key) and of the lookups.
    from retool.coldstart import cold_start_dataset

    chat, settings = lookup_chat
    problems = [p for p in lookup_problems(60, seed=2) if p["moved_to"]]
    lookup_id = chat.tokenizer.encode("lookup", add_special_tokens=False)

    def lookups(ids: list[int]) -> int:
        return sum(ids[i : i + len(lookup_id)] == lookup_id for i in range(len(ids)))

    def counts(**kw) -> list[int]:
        data = cold_start_dataset(chat, problems, task="lookup", system_prompt=settings.system_prompt, **kw)
        first = [m.index(1) for m in data["assistant_masks"]]
        return [lookups(list(ids)[start:]) for ids, start in zip(data["input_ids"], first)]

    assert set(counts(tool_fraction=1.0, recovery_fraction=1.0)) == {2}
    assert set(counts(tool_fraction=1.0, recovery_fraction=0.0)) == {1}
    assert set(counts(tool_fraction=0.0, recovery_fraction=1.0)) == {0}
    with pytest.raises(ValueError, match="recovery_fraction must be in"):
        cold_start_dataset(chat, problems, task="lookup", tool_fraction=0.5, recovery_fraction=1.5)
