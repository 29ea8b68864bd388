"""``--dry_run``: every start-up check and the banner, then exit 0 or with the refusal; nothing trained, written,
moved, built or loaded (retool_ppo.py, retool_eval.py, and each run retool_compare.py / retool_seeds.py launch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import accelerate_launch, cpu_launch_env, hang_guard_s, refusing
from support.recipes import ROOT, recipe_module
from support.settings import update_settings


def _listing(folder: Path) -> list[tuple[str, int, int]]:
    # Every path under folder with its size and mtime: a move, a write or a touch changes it.
    if not folder.exists():
        return []
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def _earlier_run(out: Path) -> None:
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')


@pytest.fixture
def no_child_no_tracker(no_model_no_eval, monkeypatch):
    """``no_model_no_eval`` (no model load, no embedded build, no evaluation child), and no spare interpreter and no
    W&B run either: each attempt is recorded and stops the test."""
    import wandb

    import retool.launch

    monkeypatch.setattr(retool.launch, "prepare_child", refusing(no_model_no_eval, "a spare child interpreter"))
    monkeypatch.setattr(wandb, "init", refusing(no_model_no_eval, "wandb.init"))
    return no_model_no_eval


@pytest.mark.slow
def test_a_dry_run_of_the_embedded_default_on_an_empty_cache_takes_seconds_and_leaves_everything_as_it_was(tmp_path):
    # The real launcher, the recipe's defaults (report_to wandb, evaluations before and after), a HOME without a
    # cache: the run would build the embedded default for minutes; the dry run builds its tokenizer and config only.
    home, wandb_dir, out = tmp_path / "home", tmp_path / "wandb", tmp_path / "out"
    home.mkdir()
    wandb_dir.mkdir()
    (wandb_dir / "keep.txt").write_text("an earlier file")
    env = cpu_launch_env(HOME=str(home), WANDB_DIR=str(wandb_dir), PYTHONUNBUFFERED="1")
    for name in ("TRL_PLUGINS_CACHE", "XDG_CACHE_HOME", "WANDB_MODE", "WANDB_API_KEY"):
        env.pop(name, None)
    before = (_listing(home), _listing(wandb_dir))
    cmd = accelerate_launch(
        "cpu.yaml", ROOT / "recipes" / "retool_ppo.py", "--dry_run", "true", "--output_dir", str(out)
    )
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard_s(300))
    wall = time.perf_counter() - began
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    assert "ReTool PPO: the run (dry run" in stdout and "sandbox isolation=" in stdout  # the banner, tools probed
    assert "W&B offline (not started in a dry run)" in stdout
    assert "start-up checks: passed their contract checks" in stdout
    # No weights: the build was not started (its first line) and the checks read the stand-in's tokenizer and config.
    assert "the run would build its weights" in stdout and "building the tiny model" not in stdout
    assert "dry run: every start-up check passed" in stdout and "skipped in a dry run: they need the weights" in stdout
    # Nothing written: no output_dir, no W&B files, no cache entry (the embedded build's minutes are not spent).
    assert not out.exists()
    assert (_listing(home), _listing(wandb_dir)) == before
    assert wall < hang_guard_s(120), f"a dry run took {wall:.0f} s"  # seconds of imports; the build takes minutes


def test_a_dry_run_at_a_filled_output_dir_refuses_it_or_says_what_would_move_and_moves_nothing(
    tmp_path, monkeypatch, no_child_no_tracker, capsys
):
    retool_ppo = recipe_module()
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))  # empty: the embedded default stands in
    out = tmp_path / "out"
    _earlier_run(out)
    listed = _listing(out)
    common = ["--dry_run", "true", "--output_dir", str(out), "--report_to", "none"]
    script_args, args = retool_ppo.parse_args(common)
    with pytest.raises(SystemExit, match="already holds files of an earlier run.*--overwrite_output_dir true"):
        retool_ppo.main(script_args, args)  # the refusal the run would give: a non-zero exit
    assert _listing(out) == listed

    script_args, args = retool_ppo.parse_args(common + ["--overwrite_output_dir", "true"])
    assert retool_ppo.main(script_args, args) == 0
    said = capsys.readouterr().out
    assert f"would move the earlier run's 2 file(s) to {out}/previous-" in said and "nothing was moved" in said
    assert "start-up checks: update memory: ~" in said and "for the full logits" in said  # the update's memory check
    assert "ReTool PPO: the run (dry run" in said and "dry run: every start-up check passed" in said
    assert _listing(out) == listed  # no previous-<time>/, nothing renamed
    assert not (tmp_path / "cache").exists()
    assert no_child_no_tracker == []  # no weights, no build, no evaluation, no spare child, no wandb.init


def test_a_dry_run_refuses_a_bad_chat_template_with_the_runs_refusal(tmp_path, no_child_no_tracker):
    from trl_plugins.tiny import build_tokenizer

    retool_ppo = recipe_module()
    tokenizer_dir = tmp_path / "qwen3-tokenizer"  # a tokenizer only: a dry run never asks for weights
    build_tokenizer("qwen3").save_pretrained(tokenizer_dir)
    script_args, args = retool_ppo.parse_args(
        [
            "--dry_run",
            "true",
            "--model_name_or_path",
            str(tokenizer_dir),
            "--output_dir",
            str(tmp_path / "out"),
            "--report_to",
            "none",
            "--chat_template_kwargs",
            '{"enable_thinking": false}',
        ]
    )
    with pytest.raises(SystemExit, match="before any model loads.*chat template.*not prefix-preserving"):
        retool_ppo.main(script_args, args)
    assert no_child_no_tracker == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags,match",
    [
        # 10^9 positions per micro-batch: the layers' activations alone are far over any machine's memory.
        (
            ["--max_padded_tokens_per_micro_batch", "1000000000"],
            "the update will not fit.*GB of activations for a 1000000000-token micro-batch.*Lower "
            "max_padded_tokens_per_micro_batch",
        ),
        # One process without DeepSpeed, and the embedded default's 4 heads over 3 ranks: each named.
        (
            ["--sequence_parallel_size", "3"],
            "sequence_parallel_size=3 cannot run: 1 processes cannot form groups of 3.*under DeepSpeed only.*attention heads "
            "do not split over 3 ranks",
        ),
    ],
    ids=["update-memory", "sequence-parallelism"],
)
def test_a_dry_run_refuses_an_update_that_cannot_run_here_before_the_model_loads(
    flags, match, tmp_path, monkeypatch, no_child_no_tracker
):
    retool_ppo = recipe_module()
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    script_args, args = retool_ppo.parse_args(
        ["--dry_run", "true", "--output_dir", str(tmp_path / "out"), "--report_to", "none", *flags]
    )
    with pytest.raises(SystemExit, match="before any model loads.*" + match):
        retool_ppo.main(script_args, args)
    assert no_child_no_tracker == [] and not (tmp_path / "out").exists()


def test_the_update_memory_estimate_by_hand():
    from types import SimpleNamespace

    from trl_plugins.run.update_memory import check_update_memory, update_memory

    # 1,000 tokens, H 8, I 16, 2 layers, fp32: a layer keeps 1000 x (10*8 + 4*16) x 4 = 576,000 bytes; checkpointed,
    # 2 x 1000 x 8 x 4 = 64,000 of layer inputs plus one layer recomputed = 640,000; the head's chunk of 10 x V 100 in
    # 4 float32 copies = 16,000 (the full logits: 1000 x 100 x 16 = 1,600,000).
    est = update_memory(
        tokens=1000, hidden=8, intermediate=16, num_layers=2, vocab=100, chunk=10, bytes_per_value=4, checkpointing=True
    )
    assert (est.layers, est.head, est.full_logits, est.total) == (640_000, 16_000, 1_600_000, 656_000)
    assert (
        update_memory(
            tokens=1000,
            hidden=8,
            intermediate=16,
            num_layers=2,
            vocab=100,
            chunk=10,
            bytes_per_value=4,
            checkpointing=False,
        ).layers
        == 1_152_000
    )
    args = update_settings(
        bf16=False,
        fp16=False,
        logprob_chunk_size=10,
        logprob_chunk_memory_mb=256,
        activation_checkpointing=True,
        max_padded_tokens_per_micro_batch=1000,
    )
    config = SimpleNamespace(hidden_size=8, vocab_size=100, intermediate_size=16, num_hidden_layers=2)
    # + 10,000 bytes of weights, trainable: x4 (gradient, two AdamW moments) = 40,000; 696,000 in all.
    assert "of 0.00 GB free" in check_update_memory(
        args, config, weights_bytes=10_000, trainable_fraction=1.0, free=(696_000, "free")
    )
    with pytest.raises(ValueError, match="will not fit"):
        check_update_memory(args, config, weights_bytes=10_000, trainable_fraction=1.0, free=(695_999, "free"))
    # Sequence parallelism over 4 ranks: each forwards 250 of the 1,000 positions, a quarter of the layers' 640,000.
    split = update_settings(**{k: v for k, v in vars(args).items() if k != "features"}, sequence_parallel_size=4)
    line = check_update_memory(split, config, weights_bytes=10_000, trainable_fraction=1.0, free=(216_000, "free"))
    assert "250-token micro-batch (1/4 of 1000: sequence parallelism)" in line
    with pytest.raises(ValueError, match="raise sequence_parallel_size"):
        check_update_memory(split, config, weights_bytes=10_000, trainable_fraction=1.0, free=(215_999, "free"))


def test_a_dry_run_with_an_unknown_plugin_exits_non_zero_with_the_refusal(tmp_path):
    env = {**os.environ, "TRL_PLUGINS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "recipes/retool_ppo.py",
            "--dry_run",
            "true",
            "--advantage",
            "grop",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=hang_guard_s(300),
    )
    assert proc.returncode != 0
    assert "configuration error (before any model loads)" in proc.stderr and "'group'" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_the_embedded_stand_in_is_the_builds_tokenizer_and_model_config():
    # What a dry run checks must be what the run would load: the same tokenizer and the model's config, no weights.
    import tempfile

    from transformers import AutoConfig, AutoTokenizer

    from retool.default_model import EmbeddedSettings, _model_shape, embedded_stand_in, embedded_tokenizer
    from trl_plugins.tiny import build_tiny_model

    settings = EmbeddedSettings()
    with tempfile.TemporaryDirectory() as folder:
        embedded_stand_in(settings, folder)
        assert sorted(p.name for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin")) == []
        tokenizer, config = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder)
    built_tokenizer = embedded_tokenizer(settings)
    assert (
        tokenizer.get_vocab() == built_tokenizer.get_vocab()
        and tokenizer.chat_template == built_tokenizer.chat_template
    )
    model_config = build_tiny_model(built_tokenizer, **_model_shape(settings), seed=settings.seed).config
    ignore = {"transformers_version", "_attn_implementation", "_name_or_path", "dtype", "architectures"}
    assert {k: v for k, v in config.to_dict().items() if k not in ignore} == {
        k: v for k, v in model_config.to_dict().items() if k not in ignore
    }
    assert config.sliding_window == 48 and config.vocab_size == len(built_tokenizer)


def test_a_dry_run_of_the_evaluation_checks_and_returns_what_it_would_evaluate(
    tmp_path, monkeypatch, no_child_no_tracker, capsys
):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import retool_eval
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    written = tmp_path / "eval.json"
    got = retool_eval.main(
        ["--dry_run", "true", "--eval_problems", "8", "--eval_samples", "2", "--output_json", str(written)]
    )
    assert got == {"dry_run": True, "model": None, "problems": 8, "samples": 2, "ks": [1, 2]}
    said = capsys.readouterr().out
    assert "dry run: would evaluate the embedded default" in said and "sandbox isolation=" in said
    assert not written.exists() and not (tmp_path / "cache").exists()
    assert no_child_no_tracker == []
    with pytest.raises(SystemExit, match="--k values must lie in"):  # a refusal is the evaluation's own
        retool_eval.main(["--dry_run", "true", "--eval_samples", "2", "--k", "4"])


@pytest.mark.parametrize("script", ["retool_seeds.py", "retool_compare.py"])
def test_the_multi_run_recipes_dry_run_each_run_they_would_launch(tmp_path, monkeypatch, capsys, script):
    import importlib

    launched = []

    def fake_run(cmd, **kwargs):
        launched.append(cmd)
        return subprocess.CompletedProcess(cmd, 1 if "refuse-me" in cmd else 0)

    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        module = importlib.import_module(script.removesuffix(".py"))
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(subprocess, "run", fake_run)
    folders = {"retool_seeds.py": ("seed0", "seed1", "seed2"), "retool_compare.py": ("grpo_s0", "grpo_s1", "grpo_s2")}[
        script
    ]
    finished = tmp_path / folders[0]
    finished.mkdir()
    (finished / "summary.json").write_text("{}")  # not a summary a table could read: a dry run must not read it
    listed = _listing(tmp_path)
    extra = ["--variants", "grpo"] if script == "retool_compare.py" else []
    monkeypatch.setattr(
        sys,
        "argv",
        [script, "--seeds", "0", "1", "2", "--out", str(tmp_path), *extra, "--dry_run", "--", "--max_steps", "3"],
    )
    assert module.main() == 0
    # Seeds 1 and 2 are launched as dry runs with the arguments a run gets; seed 0 finished, so it is not.
    assert [cmd[cmd.index("--output_dir") + 1] for cmd in launched] == [str(tmp_path / f) for f in folders[1:]]
    assert all(cmd[-2:] == ["--dry_run", "true"] and "--max_steps" in cmd for cmd in launched)
    said = capsys.readouterr().out
    assert "would not run again" in said and "every run passed its start-up checks" in said
    assert _listing(tmp_path) == listed  # no table, no figure

    launched.clear()
    monkeypatch.setattr(
        sys,
        "argv",
        [
            script,
            "--seeds",
            "1",
            "2",
            "--out",
            str(tmp_path),
            *extra,
            "--dry_run",
            "true",
            "--",
            "--run_name",
            "refuse-me",
        ],
    )
    assert module.main() == 1
    assert len(launched) == 2  # every run's dry run, also after one refused
