"""The teacher ``embedded-rl`` (recipes/retool/teacher.py): resolved to a cache entry when the arguments are parsed,
built once by the task's RL recipe in a child (here a fake child that writes a tiny model folder) and read from the
cache after, refused beside ``--model_name_or_path``, and looked up but not built by a dry run of
``recipes/retool_distill.yaml``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import refusing
from support.recipes import ROOT, recipe_module

DISTILL = str(ROOT / "recipes" / "retool_distill.yaml")

FAKE_RECIPE_CHILD = """
import json, os, sys
from pathlib import Path

args = sys.argv[2:]  # after the recipe's path: what the build gives the recipe
value = lambda name, default=None: args[args.index(name) + 1] if name in args else default
with open(os.environ["FAKE_LAUNCHES"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
if os.environ.get("FAKE_EXIT"):
    sys.exit(int(os.environ["FAKE_EXIT"]))
out = Path(value("--output_dir"))
(out / "final").mkdir(parents=True)
(out / "final" / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
(out / "final" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
(out / "final" / "tokenizer.json").write_text("{}")
after = {"accuracy": 0.9, "accuracy_se": 0.01, "tool_call_rate": 0.98, "tool_calls_mean": 2.4}
(out / "eval_after.json").write_text(json.dumps(after))
summary = {
    "before": {"accuracy": 0.25}, "after": after, "steps": 100, "wall_s": 600.0, "stopped": None,
    "trained_nothing": None, "model": os.environ["FAKE_STUDENT"],
    "config": {
        "script": {"task": value("--task"), "task_seed": int(value("--task_seed"))},
        "training": {"seed": int(value("--seed")), "max_steps": 100},
        "files": ["/somewhere/recipes/retool_ppo.yaml", value("--config")],
    },
}
(out / "summary.json").write_text(json.dumps(summary))
"""
"""A fake of the teacher's build: the recipe's run replaced by a script that writes what a finished run leaves (a tiny
model folder in final/, summary.json, eval_after.json) and logs its arguments; FAKE_EXIT makes it fail."""


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """An empty cache under ``tmp_path``, and the teacher's build launching :data:`FAKE_RECIPE_CHILD` with the
    recipe's arguments (what the real command gives it); returns the file that logs each launch's arguments."""
    import retool.teacher

    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    script, launches = tmp_path / "fake_recipe_child.py", tmp_path / "launches.jsonl"
    script.write_text(FAKE_RECIPE_CHILD)
    launches.touch()
    monkeypatch.setenv("FAKE_LAUNCHES", str(launches))
    real = retool.teacher.launch_command

    def fake_command(teacher, output_dir):
        cmd = real(teacher, output_dir)
        recipe = cmd.index(str(ROOT / "recipes" / "retool_ppo.py"))
        assert cmd[:recipe] == [sys.executable, "-m", "accelerate.commands.launch", "--config_file", cmd[recipe - 1]]
        return [sys.executable, str(script), *cmd[recipe:]]

    monkeypatch.setattr(retool.teacher, "launch_command", fake_command)
    return launches


def _launched(launches: Path) -> list[list[str]]:
    return [json.loads(line) for line in launches.read_text().splitlines()]


def _teacher(*argv: str):
    script_args, training_args = recipe_module().parse_args(["--config", DISTILL, "--report_to", "none", *argv])
    return script_args, training_args, script_args.embedded_teacher


def test_embedded_rl_resolves_to_a_cache_entry_that_the_lookup_recipe_builds_once(fake_build, tmp_path, monkeypatch):
    from retool.default_model import embedded_entry, verify_entry
    from retool.teacher import ensure_embedded_teacher, teacher_results

    script_args, args, teacher = _teacher()
    # Resolved when parsed, nothing built: the teacher path is the entry's model folder, and the provenance says so.
    assert args.teacher_model_name_or_path == str(teacher.model_dir) == args.features.distillation.teacher
    assert teacher.model_dir == tmp_path / "cache" / "teachers" / teacher.key / "model"
    assert script_args.provenance["teacher_model_name_or_path"].startswith("embedded-rl in retool_distill.yaml")
    assert not (tmp_path / "cache").exists()
    monkeypatch.setenv("FAKE_STUDENT", str(embedded_entry(teacher.student) / "model"))

    said: list[str] = []
    assert ensure_embedded_teacher(teacher, log=said.append) == teacher.model_dir
    (argv,) = _launched(fake_build)
    assert argv[0] == str(ROOT / "recipes" / "retool_ppo.py")
    assert argv[1:-2] == [
        *("--config", "recipes/retool_lookup.yaml", "--task", "lookup", "--task_seed", "0"),
        *("--seed", "0", "--report_to", "none"),
    ]
    assert argv[-2] == "--output_dir" and not Path(argv[-1]).exists()  # a temporary folder, gone
    verify_entry(teacher.entry)  # checksummed: final/ as model/, the run's summary and evaluation beside it
    assert (teacher.model_dir / "model.safetensors").read_bytes() == bytes(range(256)) * 4
    assert teacher_results(str(teacher.model_dir)) == {
        "model": str(teacher.model_dir),
        "steps": 100,
        **{"accuracy": 0.9, "accuracy_se": 0.01, "tool_call_rate": 0.98, "tool_calls_mean": 2.4},
    }
    assert sorted(p.name for p in teacher.entry.parent.iterdir()) == [teacher.key]  # no staging folder left

    # The second call reads the cache; a corrupted entry is said and rebuilt.
    assert ensure_embedded_teacher(teacher, log=said.append) == teacher.model_dir
    assert len(_launched(fake_build)) == 1 and said[-1].startswith("[embedded teacher] using the cached teacher")
    (teacher.model_dir / "model.safetensors").write_bytes(b"torn")
    ensure_embedded_teacher(teacher, log=said.append)
    assert len(_launched(fake_build)) == 2 and any("is corrupted" in line for line in said)

    # Another task seed is another student: another entry, built from it.
    _, _, other = _teacher("--task_seed", "1")
    assert other.key != teacher.key and other.recipe_args[other.recipe_args.index("--task_seed") + 1] == "1"


def test_the_builds_arguments_start_its_rl_run_from_the_runs_own_embedded_default():
    from retool.default_model import embedded_settings_for

    _, _, teacher = _teacher("--embedded", '{"cold_start_epochs": 2}', "--task_seed", "3")
    assert teacher.recipe_args[teacher.recipe_args.index("--embedded") + 1] == '{"cold_start_epochs": 2}'
    # The child parses what the build gives it (config paths are the checkout's): the same student, the lookup recipe.
    child = [str(ROOT / a) if a.endswith(".yaml") else a for a in teacher.recipe_args]
    script_args, training_args = recipe_module().parse_args(child)
    assert embedded_settings_for(script_args, training_args, log=lambda *_: None) == teacher.student
    assert (script_args.task, script_args.task_seed, training_args.seed, training_args.max_steps) == (
        "lookup",
        3,
        0,
        100,
    )
    _, _, default = _teacher("--task_seed", "3")
    assert default.key != teacher.key and "--embedded" not in default.recipe_args


@pytest.mark.parametrize("failure", ["the child fails", "the child trained another student"])
def test_a_failed_or_foreign_build_leaves_nothing_in_the_cache(fake_build, tmp_path, monkeypatch, failure):
    from retool.launch import ChildProcessError
    from retool.teacher import ensure_embedded_teacher

    _, _, teacher = _teacher()
    if failure == "the child fails":
        monkeypatch.setenv("FAKE_EXIT", "3")
        monkeypatch.setenv("FAKE_STUDENT", "unused")
        expected, match = ChildProcessError, "the recipe's run ended with exit 3"
    else:
        monkeypatch.setenv("FAKE_STUDENT", str(tmp_path / "another" / "model"))
        expected, match = ValueError, "is not a run of the teacher's build .*: it trained .*another/model, not"
    with pytest.raises(expected, match=match):
        ensure_embedded_teacher(teacher, log=lambda *_: None)
    assert list((tmp_path / "cache" / "teachers").iterdir()) == []


def test_embedded_rl_beside_model_name_or_path_is_refused_in_one_line():
    with pytest.raises(SystemExit) as refused:
        _teacher("--model_name_or_path", "path/to/student")
    message = str(refused.value)
    assert "\n" not in message
    assert "teacher_model_name_or_path 'embedded-rl'" in message and "model_name_or_path 'path/to/student'" in message
    assert "give a teacher path: --teacher_model_name_or_path path/to/teacher" in message


def test_a_dry_run_of_the_distill_recipe_looks_the_teacher_up_and_builds_nothing(
    fake_build, tmp_path, monkeypatch, no_model_no_eval, capsys
):
    import retool.teacher
    from retool.default_model import embedded_entry

    retool_ppo = recipe_module()
    build = retool.teacher.ensure_embedded_teacher
    monkeypatch.setattr(retool.teacher, "ensure_embedded_teacher", refusing(no_model_no_eval, "the teacher's build"))
    argv = ["--dry_run", "true", "--report_to", "none", "--output_dir", str(tmp_path / "out")]
    script_args, args, teacher = _teacher(*argv)
    assert retool_ppo.main(script_args, args) == 0
    said = capsys.readouterr().out
    assert f"teacher:      {teacher.model_dir} (embedded-rl: the embedded default after the lookup task's" in said
    assert f"[embedded teacher] dry run: not in the cache; the run would first build it into {teacher.entry}" in said
    assert "dry run: every start-up check passed" in said
    assert no_model_no_eval == [] and _launched(fake_build) == [] and not (tmp_path / "cache" / "teachers").exists()

    # Once it is cached, the dry run checks the entry and says the run reads it.
    monkeypatch.setenv("FAKE_STUDENT", str(embedded_entry(teacher.student) / "model"))
    build(teacher, log=lambda *_: None)
    script_args, args, teacher = _teacher(*argv)
    assert retool_ppo.main(script_args, args) == 0
    said = capsys.readouterr().out
    assert f"[embedded teacher] using the cached teacher at {teacher.model_dir} (checksums verified)" in said
    assert no_model_no_eval == [] and len(_launched(fake_build)) == 1
