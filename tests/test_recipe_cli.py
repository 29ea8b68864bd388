"""The recipe's command line and start-up: config-file layering, reward weights by name, --help, the checks that
run before any model loads, the start-up banner, summary.json's record, the model card and the plot."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import accelerate_launch, cpu_launch_env, hang_guard_s, tiny_recipe_inputs
from support.recipes import ROOT, recipe_module


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- config files (point 8) -------------------------------------------------------------------------------


def test_a_small_override_file_layers_over_the_recipe_yaml(tmp_path):
    from retool.config import DEFAULT_CONFIG, parse_args

    override = _write(tmp_path / "my.yaml", "max_steps: 3\neval_problems: 8\n")
    for argv in (["--config", str(override)], [f"--config={override}"]):
        script_args, args = parse_args(argv)
        assert args.max_steps == 3 and script_args.eval_problems == 8  # the file's two keys
        # Everything else is the recipe's YAML: its reward components and weights, its rollout budgets.
        assert args.reward_components == ["correct", "format"] and args.reward_component_weights == [1.0, 0.1]
        assert args.rollout_kwargs["max_turns"] == 4 and args.learning_rate == pytest.approx(3e-4)
        assert script_args.config_files == [str(DEFAULT_CONFIG), str(override)]
    # Later files win over earlier ones, the command line over every file.
    second = _write(tmp_path / "second.yaml", "max_steps: 5\n")
    script_args, args = parse_args(["--config", str(override), "--config", str(second), "--eval_problems", "2"])
    assert args.max_steps == 5 and script_args.eval_problems == 2
    # A *_kwargs mapping in a file replaces the recipe's whole, as it does on the command line.
    kwargs_file = _write(tmp_path / "kw.yaml", "rollout_kwargs: {max_turns: 2}\n")
    _, args = parse_args(["--config", str(kwargs_file)])
    assert args.rollout_kwargs == {"max_turns": 2}


def test_an_unknown_key_in_a_config_file_is_refused_with_its_name(tmp_path):
    from retool.config import parse_args

    text = "max_steps: 3\nmax_step: 4\n"
    bad = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(SystemExit, match=r"bad.yaml sets 'max_step', which is no field.*Did you mean 'max_steps'"):
        parse_args([f"--config={bad}"])
    assert bad.read_text() == text  # nothing touched
    with pytest.raises(SystemExit, match="cannot read the config"):
        parse_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(SystemExit, match="must hold a YAML mapping"):
        parse_args(["--config", str(_write(tmp_path / "list.yaml", "- 1\n- 2\n"))])
    with pytest.raises(SystemExit, match="--config needs a YAML file"):
        parse_args(["--max_steps", "2", "--config"])


def test_config_none_starts_from_the_dataclass_defaults(tmp_path):
    from retool.config import parse_args

    # Without the recipe's YAML the task still brings its reward components (retool/tasks.py); a reward_components
    # emptied by a layer above it is refused by the dataclass, as it should be.
    script_args, args = parse_args(["--config", "none"])
    assert args.reward_components == ["correct", "format"] and script_args.config_files == []
    assert args.rollout_kwargs == {} and args.system_prompt is None  # the recipe's YAML is gone
    empty = _write(tmp_path / "empty.yaml", "reward_components: []\n")
    with pytest.raises(SystemExit, match=r"before any model loads\): reward_components is empty"):
        parse_args(["--config", "none", "--config", str(empty)])
    own = _write(tmp_path / "own.yaml", "reward_components: [correct]\nmax_steps: 7\n")
    script_args, args = parse_args(["--config", "none", "--config", str(own)])
    assert args.reward_components == ["correct"] and args.max_steps == 7
    assert args.rollout_kwargs == {} and args.policy_loss_kwargs == {}  # not the recipe's
    assert script_args.config_files == [str(own)]


# -- reward weights by name (point 5) ---------------------------------------------------------------------


def test_changed_reward_components_keep_their_weights_by_name_and_new_ones_get_one(tmp_path):
    from retool.config import parse_args

    # The task's own settings: correct x 1.0, format x 0.1. Reordered plus a new one on the command line: format
    # keeps 0.1 (by position it would have got 1.0), tool_use is new (by position it would have got none).
    script_args, args = parse_args(["--reward_components", "format", "correct", "tool_use"])
    assert args.reward_components == ["format", "correct", "tool_use"]
    assert args.reward_component_weights == [0.1, 1.0, 1.0]
    assert "kept by name from the task 'arithmetic'" in script_args.reward_weight_origins["format"]
    assert "defaulted to 1.0" in script_args.reward_weight_origins["tool_use"]
    # --reward_components=... (one token) and a prefix of the flag read the same.
    _, args = parse_args(["--reward_components=format"])
    assert args.reward_component_weights == [0.1]
    # Components changed in a user's file, not on the command line: the same rule.
    changed = _write(tmp_path / "c.yaml", "reward_components: [tool_use, format]\n")
    script_args, args = parse_args(["--config", str(changed)])
    assert args.reward_component_weights == [1.0, 0.1] and "c.yaml" in script_args.reward_weight_origins["tool_use"]
    # Weights given with the components are taken as given (by position, as written), and nothing is noted.
    script_args, args = parse_args(
        ["--reward_components", "format", "correct", "--reward_component_weights", "0.5", "2"]
    )
    assert args.reward_component_weights == [0.5, 2.0] and script_args.reward_weight_origins == {}
    # Weights alone on the command line apply to the YAML's components.
    script_args, args = parse_args(["--reward_component_weights", "0.5", "0.5"])
    assert args.reward_components == ["correct", "format"] and args.reward_component_weights == [0.5, 0.5]
    # Nothing changed: the YAML's pairs, nothing noted.
    script_args, args = parse_args([])
    assert args.reward_component_weights == [1.0, 0.1] and script_args.reward_weight_origins == {}


# -- --help (point 12) ------------------------------------------------------------------------------------


def test_help_lists_config_then_the_recipe_and_plugin_fields_before_trls():
    proc = subprocess.run(
        [sys.executable, "recipes/retool_ppo.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=hang_guard_s(120),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout

    def at(flag: str) -> int:
        pos = out.find(f"\n  {flag} ")
        assert pos >= 0, flag
        return pos

    assert "layers OVER the recipe's YAML" in out and "--config=FILE works too" in out
    recipe = [at("--config"), at("--eval_problems"), at("--dataset_name")]
    plugins = [at("--reward_components"), at("--tool_kwargs"), at("--packer")]
    trl = [at("--use_peft"), at("--per_device_train_batch_size"), at("--learning_rate"), at("--beta")]
    assert max(recipe) < min(plugins) and max(plugins) < min(trl)
    # The defaults shown are the recipe YAML's (the values in force), e.g. its reward weights.
    assert "(default: [1.0, 0.1])" in out


# -- start-up checks before any model loads (point 4) -----------------------------------------------------


def test_a_bad_plugin_kwarg_is_refused_before_any_model_load_or_evaluation(tmp_path, no_model_no_eval, capsys):
    retool_ppo = recipe_module()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier file")
    for bad, message in (
        ('{"code_interpreter": {"timeout_s": -1}}', "timeout_s must be a number >= 0.01"),
        ('{"code_interpreter": {"timeout": 5}}', "takes no 'timeout'.*Did you mean 'timeout_s'"),
    ):
        script_args, args = retool_ppo.parse_args(
            ["--tool_kwargs", bad, "--output_dir", str(out), "--report_to", "none", "--overwrite_output_dir", "true"]
        )
        with pytest.raises(SystemExit, match=f"before any model loads.*{message}"):
            retool_ppo.main(script_args, args)
    assert no_model_no_eval == []
    # Refused before the output folder was claimed: --overwrite_output_dir moved nothing aside.
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert "ReTool PPO: the run" not in capsys.readouterr().out  # not even the banner


def test_a_chat_template_that_fails_the_prefix_check_is_refused_before_the_model_loads(
    tmp_path, no_model_no_eval, capsys
):
    from trl_plugins.tiny import build_tokenizer

    retool_ppo = recipe_module()
    tokenizer_dir = tmp_path / "qwen3-tokenizer"  # a tokenizer only: the model must never be asked for
    build_tokenizer("qwen3").save_pretrained(tokenizer_dir)
    out = tmp_path / "out"
    script_args, args = retool_ppo.parse_args(
        [
            "--model_name_or_path",
            str(tokenizer_dir),
            "--output_dir",
            str(out),
            "--report_to",
            "none",
            "--chat_template_kwargs",
            '{"enable_thinking": false}',
            "--eval_problems",
            "4",
        ]
    )
    with pytest.raises(SystemExit, match="before any model loads.*chat template.*not prefix-preserving"):
        retool_ppo.main(script_args, args)
    assert no_model_no_eval == []
    assert not (out / "eval_before.json").exists() and not (out / "metrics.jsonl").exists()
    assert "ReTool PPO: the run" in capsys.readouterr().out  # the banner came first, before the tokenizer loaded


# -- the start-up banner (point 9) ------------------------------------------------------------------------


def test_the_banner_names_plugins_settings_isolation_processes_precision_and_outputs():
    from types import SimpleNamespace

    from retool.config import parse_args
    from retool.startup import distributed_mode, evaluation_backend, format_banner
    from trl_plugins.run import SamplerKind, resolve_run

    script_args, args = parse_args(
        [
            "--reward_components",
            "format",
            "correct",
            "tool_use",
            "--output_dir",
            "/runs/a",
            "--report_to",
            "wandb",
            "--policy_loss_kwargs",
            '{"clip_low": 0.1, "clip_high": 0.3}',
        ]
    )
    isolation = "sandbox isolation=bwrap, mode=warm, memory 1024 MB per call"
    run = resolve_run(args)
    text = format_banner(
        script_args,
        run,
        world_size=2,
        device="cuda:0",
        distributed="DeepSpeed ZeRO-3",
        tool_start_up={"code_interpreter": isolation},
        wandb_mode="offline",
    )
    lines = text.splitlines()

    def line(prefix: str) -> str:
        (found,) = [ln for ln in lines if ln.startswith(prefix)]
        return found

    assert line("rollout:").startswith("rollout:      multi_turn") and '"max_turns": 4' in line("rollout:")
    assert '"timeout_s": 5.0' in line("tool:") and "code_interpreter" in line("tool:")
    assert lines[lines.index(line("tool:")) + 1].strip() == isolation
    rewards = line("rewards:")
    assert "format x 0.1 (kept by name from the task 'arithmetic')" in rewards
    assert "correct x 1 (kept by name" in rewards
    assert "tool_use x 1 (defaulted to 1.0: not in the task 'arithmetic', added by the command line)" in rewards
    assert line("advantage:").startswith("advantage:    group")
    assert '"clip_low": 0.1' in line("policy loss:") and "aggregation token_mean" in line("policy loss:")
    assert line("packer:").startswith("packer:       optimal (<= 64 rows")
    assert line("processes:") == f"processes:    2 on cuda:0, DeepSpeed ZeRO-3, {'bf16' if args.bf16 else 'fp32'}"
    assert "128 per step in all" in line("batch:")  # 2 processes x 64
    assert line("generation:").startswith("generation:   HF generate")
    assert line("outputs:").startswith("outputs:      /runs/a") and line("logging:").endswith("W&B offline")
    assert "retool_ppo.yaml < command line" in line("config files:")
    assert line("viewer:") == (
        "viewer:       /runs/a/trajectories/step-N.html every 10 steps (8 trajectories; "
        "python -m trl_plugins.viewer redraws a saved batch)"
    )
    assert "warning:" not in text  # the recipe's prompt names its tool
    # A tool the system prompt does not name is flagged: only its schema reaches the model.
    _, bare = parse_args(["--system_prompt", "Solve it.", "--viewer_steps", "0"])
    text = format_banner(script_args, resolve_run(bare), world_size=1, device="cpu", distributed="single process")
    assert "warning:      system_prompt does not mention the tool 'code_interpreter'" in text and "viewer:" not in text
    # Sequence parallelism: the processes line says how each datum is split, the packer line one row per micro-batch.
    _, split = parse_args(["--sequence_parallel_size", "2"])
    text = format_banner(script_args, resolve_run(split), world_size=4, device="cuda:0", distributed="DeepSpeed ZeRO-3")
    assert (
        f"processes:    4 on cuda:0, DeepSpeed ZeRO-3, each datum's tokens split over 2 ranks in the update "
        f"(sequence parallelism, 2 data-parallel groups), {'bf16' if split.bf16 else 'fp32'}"
    ) in text
    assert "packer:       optimal (1 row split over 2 ranks (sequence parallelism), <= " in text
    # A tool that has not started says when it will report.
    text = format_banner(script_args, run, world_size=1, device="cpu", distributed="single process")
    assert "reports how it runs when the tools start" in text
    # The helpers the recipe feeds it.
    assert (
        distributed_mode({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"})
        == "DeepSpeed ZeRO-2"
    )
    assert distributed_mode({"WORLD_SIZE": "2"}) == "DDP" and distributed_mode({}) == "single process"
    _, cb = parse_args(["--use_transformers_continuous_batching"])
    cb_run = resolve_run(cb)
    assert cb_run.sampler.describe(cb).startswith("transformers continuous batching")
    # The held-out evaluation says what generates it: vLLM serves the training rollouts only.
    assert evaluation_backend(cb_run) == cb_run.sampler.describe(cb)
    assert evaluation_backend(run) == "HF generate"
    vllm = SimpleNamespace(**{**vars(run), "sampler": SamplerKind.VLLM_COLOCATE})
    vllm.config = SimpleNamespace(**{**vars(args), "vllm_mode": "colocate", "features": args.features})
    assert evaluation_backend(vllm) == "HF generate (vLLM serves the training rollouts only)"
    assert "generated with HF generate (vLLM serves the training rollouts only)" in format_banner(
        script_args, vllm, world_size=1, device="cuda:0", distributed="single process"
    )


# -- summary.json, the model card and the plot (point 13) -------------------------------------------------


def test_the_run_record_holds_every_config_field_the_plugins_seeds_versions_and_the_commit(tmp_path):
    from retool.config import ScriptArguments, parse_args
    from retool.record import git_state, run_record
    from trl_plugins.trainers import MultiTurnGRPOConfig

    script_args, args = parse_args(["--reward_components", "correct", "tool_use", "--seed", "3"])
    record = json.loads(json.dumps(run_record(script_args, args)))  # JSON-safe as it is
    assert set(record["config"]["script"]) == {f.name for f in dataclasses.fields(ScriptArguments)}
    assert set(record["config"]["training"]) == {f.name for f in dataclasses.fields(MultiTurnGRPOConfig)}
    assert record["config"]["training"]["learning_rate"] == pytest.approx(3e-4)
    assert record["config"]["training"]["save_strategy"] == "steps"  # the enum's value
    assert record["plugins"]["reward_components"] == [
        {"name": "correct", "weight": 1.0, "kwargs": {}, "weight_origin": "kept by name from the task 'arithmetic'"},
        {
            "name": "tool_use",
            "weight": 1.0,
            "kwargs": {},
            "weight_origin": "defaulted to 1.0: not in the task 'arithmetic', added by the command line",
        },
    ]
    assert record["plugins"]["tools"][0]["kwargs"]["timeout_s"] == 5.0
    assert record["seeds"] == {"seed": 3, "data_seed": None, "task_seed": 0}
    import torch
    import trl

    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["trl"] == trl.__version__
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert "vllm" in record["versions"] and "deepspeed" in record["versions"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert record["git"]["commit"] == head.stdout.strip() and isinstance(record["git"]["dirty"], bool)
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout


def test_the_model_card_names_a_base_model_loaded_from_a_local_folder(tmp_path):
    import inspect

    from trl import GRPOTrainer
    from trl.trainer.utils import generate_model_card

    from trl_plugins.trainers import MultiTurnGRPOTrainer
    from trl_plugins.trainers.model_card import name_local_base_model, name_quick_start_model

    # The override calls TRL's with these parameters.
    assert list(inspect.signature(GRPOTrainer.create_model_card).parameters) == [
        "self",
        "model_name",
        "dataset_name",
        "tags",
    ]
    assert "name_local_base_model" in inspect.getsource(MultiTurnGRPOTrainer.create_model_card)

    def card(base_model):
        path = tmp_path / "README.md"
        generate_model_card(
            base_model=base_model,
            model_name="run",
            hub_model_id=None,
            dataset_name=None,
            tags=[],
            wandb_url=None,
            trackio_url=None,
            trainer_name="GRPO",
        ).save(path)
        return path

    path = card(None)  # what TRL writes for a policy loaded from a local folder
    assert "fine-tuned version of [None]" in path.read_text()
    assert name_local_base_model(path, "/cache/embedded/abc/model")
    text = path.read_text()
    assert "fine-tuned version of the local model `/cache/embedded/abc/model`" in text and "[None]" not in text
    # No Hub repo: TRL's quick-start said model="None"; it loads the trained model's folder instead.
    assert 'model="None"' in text and "name_quick_start_model" in inspect.getsource(
        MultiTurnGRPOTrainer.create_model_card
    )
    assert name_quick_start_model(path, "outputs/retool_ppo/final")
    text = path.read_text()
    assert 'pipeline("text-generation", model="outputs/retool_ppo/final"' in text and 'model="None"' not in text
    assert not name_quick_start_model(path, "elsewhere") and path.read_text() == text  # filled once
    path = card("Qwen/Qwen2.5-1.5B-Instruct")  # a Hub id: TRL names and links it, left as it is
    before = path.read_text()
    assert not name_local_base_model(path, "Qwen/Qwen2.5-1.5B-Instruct") and path.read_text() == before
    assert "[Qwen/Qwen2.5-1.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-1.5B-Instruct)" in before


def test_the_plot_has_whole_step_ticks_and_a_line_per_reward_component(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from retool.report import plot_run

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    metrics = [
        {
            "step": s,
            "reward/total": 0.1 * s,
            "reward/correct": -1 + 0.5 * s,
            "reward/format": 0.2 * s,
            "reward/verifier_error_rate": 0.0,
            "rollout/tool_calls_mean": 0.5,
        }
        for s in (1, 2, 3)
    ]
    path = plot_run(metrics, tmp_path / "p.png", reward_components=["correct", "format"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    fig.canvas.draw()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    (components,) = [ax for ax in fig.axes if ax.get_title().startswith("reward components")]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in components.get_lines()}
    assert lines == {
        "correct": [-0.5, 0.0, 0.5],
        "format": [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.6)],
    }
    # Without the run's list, every reward/* mean but the total and the verifier error rate.
    figures.clear()
    plot_run(metrics, tmp_path / "q.png")
    (components,) = [ax for ax in figures[0].axes if ax.get_title().startswith("reward components")]
    assert [ln.get_label() for ln in components.get_lines()] == ["correct", "format"]


# -- end to end ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_recipe_with_a_small_override_file_prints_the_banner_and_records_the_run(tmp_path):
    # A local model (no embedded default to build: tests/test_recipe.py's first launch checks that the banner comes
    # before the build). A random one: it earns neither reward, so no step updates the policy (every group's rewards
    # equal); the run completes as any (final/ with its card, summary.json, the plot), then exits 1 saying so.
    override = _write(tmp_path / "small.yaml", "max_steps: 2\ntrain_size: 32\n")
    model_dir, _ = tiny_recipe_inputs(tmp_path)
    env = cpu_launch_env(TRL_PLUGINS_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    cmd = accelerate_launch(
        "cpu.yaml",
        ROOT / "recipes" / "retool_ppo.py",
        f"--config={override}",
        "--output_dir",
        str(tmp_path / "out"),
        "--model_name_or_path",
        str(model_dir),
        "--eval_problems",
        "0",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--reward_components",
        "correct",
        "tool_use",
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard_s(600))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    why = (
        "the run finished without one policy update: all 2 of its steps skipped it (the last: no trajectory to "
        "train on: every group's rewards were equal (all 8 trajectories of the step, all ranks, have advantage 0))"
    )
    assert f"The run trained nothing: {why}" in proc.stderr, proc.stderr[-3000:]
    out = tmp_path / "out"
    stdout = proc.stdout
    assert "ReTool PPO summary" in stdout  # summarised before it failed
    # The banner says how the sandbox runs code.
    assert "ReTool PPO: the run" in stdout and "sandbox isolation=" in stdout
    assert not (tmp_path / "cache").exists()  # nothing built and "tool_use x 1 (defaulted to 1.0" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["config"]["training"]["max_steps"] == 2
    assert summary["trained_nothing"].startswith(why) and summary["stopped"] is None
    assert summary["config"]["script"]["train_size"] == 32 and summary["config"]["files"][-1] == str(override)
    assert [c["name"] for c in summary["plugins"]["reward_components"]] == ["correct", "tool_use"]
    assert summary["versions"]["trl"] and "commit" in summary["git"]
    card = (out / "final" / "README.md").read_text()
    assert f"fine-tuned version of the local model `{summary['model']}`" in card and "[None]" not in card
    assert (out / "retool_ppo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("reward/tool_use" in r for r in records if "reward/total" in r)


def test_a_cpu_vllm_run_on_the_embedded_default_is_pointed_at_its_vllm_variant():
    from retool.config import parse_args
    from retool.default_model import VLLM_CPU_HEAD_SIZES, VLLM_VARIANT, EmbeddedSettings, check_embedded_default

    script_args, args = parse_args(["--use_vllm", "true", "--vllm_mode", "server", "--use_cpu", "true"])
    with pytest.raises(ValueError, match=r"heads have 16 dimensions.*--embedded '\{\"num_heads\": 2, \"num_kv_heads\""):
        check_embedded_default(script_args, args)
    variant, _ = parse_args(
        ["--use_vllm", "true", "--vllm_mode", "server", "--use_cpu", "true", "--embedded", VLLM_VARIANT]
    )
    check_embedded_default(variant, args)  # refuses nothing
    settings = EmbeddedSettings.from_json(VLLM_VARIANT)
    assert settings.hidden_size // settings.num_heads in VLLM_CPU_HEAD_SIZES
    # Beside the default, not instead of it: its own cache key, the default's shape untouched.
    assert (
        settings.key() != EmbeddedSettings().key()
        and EmbeddedSettings().hidden_size // EmbeddedSettings().num_heads == 16
    )
    check_embedded_default(*parse_args([]))  # HF generate: the default as it is


def test_the_plot_in_an_interpreter_without_matplotlib_is_refused_at_start_up(monkeypatch):
    # vLLM's interpreter installs the project without its dependencies: the run's PNG at its end crashed the main
    # command there after 40 trained steps; now refused before anything loads, naming both ways out.
    import importlib.util

    from retool.config import parse_args
    from retool.startup import check_plot

    script_args, _ = parse_args([])
    check_plot(script_args)  # this interpreter has matplotlib
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ValueError, match="pip install matplotlib, or pass --plot false"):
        check_plot(script_args)
    check_plot(parse_args(["--plot", "false"])[0])
