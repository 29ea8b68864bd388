"""The ReTool recipe: its YAMLs, the embedded default's cache, evaluation maths, and real launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import accelerate_launch, cpu_launch_env, hang_guard_s
from support.judges import scripted_judge as scripted_judge_module
from support.recipes import ROOT, recipe_module
from trl_plugins.evaluation import pass_at_k, summarise
from trl_plugins.types import StopReason, ToolCall, Trajectory, Turn

# A build that takes seconds: a handful of transcripts, a fraction of an epoch.
TINY_EMBEDDED = {
    "cold_start_problems": 24,
    "cold_start_epochs": 0.5,
    "hidden_size": 32,
    "cold_start_batch_size": 8,
    "cold_start_max_extra_epochs": 1,
}


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "recipes").glob("*.yaml")) + sorted((ROOT / "examples").rglob("*.yaml")),
    ids=lambda p: p.name,
)
def test_every_recipe_yaml_loads_and_validates(path):
    retool_ppo = recipe_module()
    values = yaml.safe_load(path.read_text())
    assert isinstance(values, dict) and values
    script_args, training_args = retool_ppo.parse_args(["--config", str(path)])
    # Every key of the YAML landed in one of the two argument classes, with its value.
    for key, value in values.items():
        holder = script_args if hasattr(script_args, key) else training_args
        assert hasattr(holder, key), key
        got = getattr(holder, key)
        if key in ("report_to", "lr_scheduler_type", "save_strategy"):
            continue  # normalised by transformers (enums, lists)
        if key == "teacher_model_name_or_path" and value == "embedded-rl":  # resolved to its cache entry's model
            assert got == str(script_args.embedded_teacher.model_dir)
            continue
        assert got == value or str(got) == str(value) or (isinstance(got, float) and got == pytest.approx(value)), key


def test_default_yaml_is_the_retool_setup():
    import torch

    retool_ppo = recipe_module()
    _, args = retool_ppo.parse_args([])
    assert args.policy_loss == "ppo_clip"
    assert (1 - args.policy_loss_kwargs["clip_low"], 1 + args.policy_loss_kwargs["clip_high"]) == pytest.approx(
        (0.8, 1.28)
    )
    assert args.advantage == "group" and args.num_generations >= 2
    assert args.reward_components[0] == "correct" and args.tools == ["code_interpreter"]
    assert "\\boxed{" in args.system_prompt and "<tool_call>" in args.system_prompt
    # `--bf16 false` is added on a machine without CUDA; with CUDA, TRL's default (bf16) stands.
    assert args.bf16 is torch.cuda.is_available()


def test_command_line_overrides_the_yaml_and_bad_values_are_named():
    retool_ppo = recipe_module()
    script_args, args = retool_ppo.parse_args(
        ["--max_steps", "3", "--eval_problems", "7", "--truncated_policy", "mask"]
    )
    assert args.max_steps == 3 and script_args.eval_problems == 7 and args.truncated_policy == "mask"
    with pytest.raises(
        SystemExit,
        match=r"before any model loads\): truncated_policy must be.*\[set by: truncated_policy in the command line\]",
    ):
        retool_ppo.parse_args(["--truncated_policy", "ignore"])


def test_pass_at_k_matches_the_combinatorial_definition():
    from itertools import combinations

    for n, c, k in [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 6, 4), (8, 3, 8)]:
        flags = [True] * c + [False] * (n - c)
        subsets = list(combinations(flags, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _traj(qid, calls, stop=StopReason.FINAL_ANSWER):
    turns = []
    for i in range(calls):
        turns.append(Turn([1], [2], [-0.1], tool_calls=[ToolCall("code_interpreter", {"code": "1"}, ok=i != 1)]))
    turns.append(Turn([1], [3], [-0.1], text="\\boxed{1}"))
    return Trajectory(turns=turns, question_id=qid, stop_reason=stop)


def test_summarise_counts_tool_use_accuracy_and_pass_at_k():
    trajs = [_traj("a", 1), _traj("a", 0), _traj("b", 2), _traj("b", 0, StopReason.MAX_TURNS)]
    result = summarise(trajs, [True, False, False, False], ks=(1, 2))
    assert result.problems == 2 and result.samples == 2
    assert result.accuracy == 0.25 and result.pass_at_k[2] == 0.5
    assert result.tool_call_rate == 0.5 and result.tool_calls_mean == 0.75
    assert result.tool_error_rate == pytest.approx(1 / 3)  # the second call of "b" failed
    assert result.accuracy_with_tool == 0.5 and result.accuracy_without_tool == 0.0
    assert result.truncated_frac == 0.25
    with pytest.raises(ValueError, match="pass@k needs"):
        summarise(trajs, [True] * 4, ks=(3,))
    # Tool calls per solved sample, and recovery: of the samples shown a failed call, the share that still solved it.
    assert result.tool_calls_per_solved == 1.0 and result.failed_call_frac == 0.25 and result.recovery_rate == 0.0
    result = summarise(trajs, [True, False, True, False])
    assert result.tool_calls_per_solved == 1.5 and result.recovery_rate == 1.0
    assert summarise(trajs, [False] * 4).tool_calls_per_solved is None
    infra = _traj("c", 2)
    infra.turns[1].tool_calls[
        0
    ].infra_error = "sandbox died"  # the infrastructure's failure: not the model's to recover
    assert summarise([infra], [False]).recovery_rate is None and summarise([infra], [False]).failed_call_frac == 0.0
    assert summarise([_traj("d", 1)], [True]).recovery_rate is None  # nothing failed


def test_embedded_default_is_cached_reused_and_rebuilt_when_corrupted(tmp_path):
    from retool.default_model import EmbeddedSettings, ensure_embedded_default

    settings = EmbeddedSettings(**TINY_EMBEDDED)
    messages: list[str] = []
    # Built in this process, as the builds below: the cache's bookkeeping is the same either way, and the recipe's
    # launches in this module build into a fresh cache through the default clean child (an interpreter of its own
    # costs some 10 s of imports).
    path = ensure_embedded_default(settings, root=tmp_path, log=messages.append, in_process=True)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert any("building" in m for m in messages)
    weights = next(path.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns

    messages.clear()
    assert ensure_embedded_default(settings, root=tmp_path, log=messages.append) == path
    assert any("using the cached model" in m for m in messages) and not any("building" in m for m in messages)
    assert weights.stat().st_mtime_ns == stamp

    # A different setting is a different entry; the first stays.
    other = ensure_embedded_default(
        EmbeddedSettings(**{**TINY_EMBEDDED, "seed": 1}), root=tmp_path, log=messages.append, in_process=True
    )
    assert other != path and weights.is_file()

    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as by a full disk or a killed copy
    messages.clear()
    again = ensure_embedded_default(settings, root=tmp_path, log=messages.append, in_process=True)
    assert again == path
    assert any("corrupted" in m and "checksum mismatch" in m for m in messages), messages
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(again)  # loads again
    assert not list((tmp_path / "embedded").glob("*.building-*"))  # no staging left behind


# The docs' example of a changed prompt: the recipe's, plus a line for a second tool.
_PROMPT_WITH_A_SECOND_TOOL = " Use the calculator tool for plain arithmetic."


def test_changed_system_prompt_reuses_the_cached_embedded_default(tmp_path, monkeypatch):
    from retool import default_model
    from retool.coldstart import DEFAULT_SYSTEM_PROMPT

    retool_ppo = recipe_module()
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "run_in_child", lambda fn, *args, what, **kwargs: fn(*args, **kwargs))
    embedded = ["--embedded", json.dumps(TINY_EMBEDDED)]
    messages: list[str] = []
    path = default_model.model_path_or_default(*retool_ppo.parse_args(embedded), log=messages.append)
    assert any("building the tiny model" in m for m in messages)

    changed = ["--system_prompt", DEFAULT_SYSTEM_PROMPT + _PROMPT_WITH_A_SECOND_TOOL]
    messages.clear()
    assert default_model.model_path_or_default(*retool_ppo.parse_args(embedded + changed), log=messages.append) == path
    assert not any("building" in m for m in messages), messages
    assert any("the same build serves it" in m for m in messages)
    assert any("using the cached model" in m for m in messages)
    assert len(list((tmp_path / "embedded").iterdir())) == 1

    # Negative controls, on the settings alone (no build): where the prompt can reach the model (full attention),
    # or where --embedded names a prompt, the prompt is part of the key.
    def key(argv: list[str], embedded_settings: dict) -> str:
        args = retool_ppo.parse_args(["--embedded", json.dumps(embedded_settings), *argv])
        return default_model.embedded_settings_for(*args, log=lambda m: None).key()

    assert key(changed, TINY_EMBEDDED) == key([], TINY_EMBEDDED)
    full_attention = {**TINY_EMBEDDED, "sliding_window": None}
    assert key(changed, full_attention) != key([], full_attention)
    assert key([], {**TINY_EMBEDDED, "system_prompt": "Another."}) != key([], TINY_EMBEDDED)


def test_system_prompt_lies_beyond_the_embedded_models_reach():
    # Why a changed prompt may reuse the build: the tiny model's logits at every position it writes see
    # receptive_field() = 2 layers x 48 = 96 tokens back, and the tools block puts the system prompt further away
    # than that; so the cold start (cut to the receptive field) and the model's outputs ignore the prompt.
    from dataclasses import replace

    import torch

    from retool.coldstart import DEFAULT_SYSTEM_PROMPT, cold_start_dataset, receptive_field, transcript
    from retool.default_model import PROMPT_TO_ANSWER_MIN_TOKENS, EmbeddedSettings, embedded_tokenizer
    from retool.task import arithmetic_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tiny import build_tiny_model
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    settings = EmbeddedSettings()
    assert settings.receptive_field() == 96 < PROMPT_TO_ANSWER_MIN_TOKENS and not settings.sees_system_prompt()
    assert EmbeddedSettings(sliding_window=None).sees_system_prompt() and settings.sees_system_prompt(with_tools=False)
    # The bound: tokens after the system prompt up to the first written token, smallest schema, empty question.
    smallest = {
        "type": "function",
        "function": {"name": "t", "description": "", "parameters": {"type": "object", "properties": {}}},
    }
    for template in ("qwen2_5", "qwen3"):
        tok = embedded_tokenizer(replace(settings, template=template))
        messages = [{"role": "system", "content": "END-OF-PROMPT"}, {"role": "user", "content": ""}]
        text = tok.apply_chat_template(messages, tools=[smallest], tokenize=False, add_generation_prompt=True)
        after = text[text.index("END-OF-PROMPT") + len("END-OF-PROMPT") :]
        assert len(tok(after, add_special_tokens=False)["input_ids"]) >= PROMPT_TO_ANSWER_MIN_TOKENS, template

    tokenizer = embedded_tokenizer(settings)
    chat = ChatFormat(tokenizer, [CodeInterpreter().schema()])
    prompts = (DEFAULT_SYSTEM_PROMPT, DEFAULT_SYSTEM_PROMPT + _PROMPT_WITH_A_SECOND_TOOL)
    problems = arithmetic_problems(16, seed=0, split="train")

    # The cold start's transcripts, cut to the receptive field, are the same token for token.
    def rows(prompt: str, left_context: int | None) -> list:
        data = cold_start_dataset(chat, problems, tool_fraction=0.7, system_prompt=prompt, left_context=left_context)
        return [data["input_ids"], data["assistant_masks"]]

    assert rows(prompts[0], settings.receptive_field()) == rows(prompts[1], settings.receptive_field())
    assert rows(prompts[0], None) != rows(prompts[1], None)  # negative control: uncut, they differ

    # The model's logits at every position it writes do not move when the prompt changes (random weights: the
    # claim is about the architecture, whatever the training made of them).
    def written_logits(model, prompt: str) -> torch.Tensor:
        ids, mask = transcript(chat, problems[0], use_tool=True, system_prompt=prompt)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        return logits[[i - 1 for i, m in enumerate(mask) if m]]

    windowed = build_tiny_model(
        tokenizer, hidden_size=32, num_layers=settings.num_layers, seed=0, sliding_window=settings.sliding_window
    )
    assert receptive_field(windowed.config) == settings.receptive_field()
    torch.testing.assert_close(written_logits(windowed, prompts[0]), written_logits(windowed, prompts[1]))
    full = build_tiny_model(tokenizer, hidden_size=32, num_layers=settings.num_layers, seed=0)  # negative control
    assert not torch.allclose(written_logits(full, prompts[0]), written_logits(full, prompts[1]), atol=1e-4)


def test_the_recipe_system_prompts_markup_is_text_beyond_the_cold_starts_reach(monkeypatch):
    # Issue 59.4: content is text, so the "<tool_call>" the recipe's system prompt writes ("write one <tool_call>
    # block") is 4 tokens of text where it was its markup token (docs/rollout.md). It lies beyond the embedded model's
    # receptive field: the cold start's transcripts cut to it are the same token for token as with the markup token.
    from retool.coldstart import DEFAULT_SYSTEM_PROMPT, cold_start_dataset
    from retool.default_model import EmbeddedSettings, embedded_tokenizer
    from retool.task import arithmetic_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    settings = EmbeddedSettings()
    assert settings.system_prompt == DEFAULT_SYSTEM_PROMPT and "<tool_call>" in DEFAULT_SYSTEM_PROMPT
    tok = embedded_tokenizer(settings)
    chat = ChatFormat(tok, [CodeInterpreter().schema()])
    problems = arithmetic_problems(16, seed=0, split="train")
    messages = [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": problems[0]["prompt"]},
    ]
    as_text = chat.initial_prompt_ids(messages)
    as_markup = list(
        tok.apply_chat_template(
            messages, tools=chat.tools, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )
    markup = tok.convert_tokens_to_ids("<tool_call>")
    assert len(as_text) == len(as_markup) + 3 and as_text.count(markup) == as_markup.count(markup) - 1
    assert tok.decode(as_text, skip_special_tokens=False) == tok.decode(as_markup, skip_special_tokens=False)

    def rows(left_context: int | None) -> list:
        data = cold_start_dataset(
            chat, problems, tool_fraction=0.7, system_prompt=DEFAULT_SYSTEM_PROMPT, left_context=left_context
        )
        return [data["input_ids"], data["assistant_masks"]]

    text_rows = rows(settings.receptive_field()), rows(None)
    with monkeypatch.context() as m:  # the first prompt as it was: the system prompt's markup text its token
        m.setattr(
            chat,
            "initial_prompt_ids",
            lambda messages: list(
                tok.apply_chat_template(
                    messages, tools=chat.tools, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            ),
        )
        markup_rows = rows(settings.receptive_field()), rows(None)
    assert text_rows[0] == markup_rows[0]
    assert text_rows[1] != markup_rows[1]  # negative control: uncut, they differ


_BUILD_WHEN_TOLD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from retool.default_model import EmbeddedSettings, ensure_embedded_default
settings, root, ready, go = EmbeddedSettings(**json.loads(sys.argv[2])), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
ready.touch()
while not go.exists():
    time.sleep(0.01)
print("path:", ensure_embedded_default(settings, root=root, in_process=True), flush=True)
"""


def test_concurrent_builders_of_one_entry_build_it_once(tmp_path):
    # Two processes (two pytest workers, two launches) ask for the same entry at the same moment: one
    # builds it, the other waits and then uses it; neither sees the entry vanish under it.
    procs = []
    for i in range(2):
        args = [
            str(ROOT / "recipes"),
            json.dumps(TINY_EMBEDDED),
            str(tmp_path / "cache"),
            str(tmp_path / f"ready-{i}"),
            str(tmp_path / "go"),
        ]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _BUILD_WHEN_TOLD, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + hang_guard_s(300)
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        (tmp_path / "go").touch()  # both start asking now; a build takes seconds
        outputs = [p.communicate(timeout=hang_guard_s(600))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("building the tiny model" in out for out in outputs) == 1, outputs
    assert sum("using the cached model" in out for out in outputs) == 1, outputs
    paths = {line for out in outputs for line in out.splitlines() if line.startswith("path:")}
    assert len(paths) == 1, outputs
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(paths.pop().split(" ", 1)[1])
    assert not list((tmp_path / "cache" / "embedded").glob("*.building-*"))


def test_failed_build_leaves_nothing_in_the_cache(tmp_path):
    from retool.default_model import EmbeddedSettings, ensure_embedded_default

    with pytest.raises(ValueError, match="tool_fraction"):
        ensure_embedded_default(
            EmbeddedSettings(**{**TINY_EMBEDDED, "cold_start_tool_fraction": 2.0}),
            root=tmp_path,
            log=lambda m: None,
            in_process=True,
        )
    assert list((tmp_path / "embedded").iterdir()) == []


@pytest.fixture(scope="module")
def first_launch(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """The main command on one process into a fresh cache (it builds the tiny embedded default there): its output
    and its folder (``out/``, ``cache/``)."""
    root = tmp_path_factory.mktemp("first-launch")
    # It also saves checkpoint-1 and step 2's batch (sampled by step 1's weights): the replay's check of a real run.
    return _launch(root, "cpu.yaml", ["--viewer_steps", "2", "--save_strategy", "steps", "--save_steps", "1"]), root


@pytest.fixture(scope="module")
def built_cache(first_launch) -> Path:
    """A cache holding the launches' tiny embedded default: the one the first launch built, the way the recipe
    resolves and builds it (for the launches that test something else than the build)."""
    proc, root = first_launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "cache"


def _launch(
    tmp_path, config: str, extra: list[str], timeout: int = 600, cache: Path | None = None
) -> subprocess.CompletedProcess:
    """Two steps of the main command on the tiny embedded default; built into a fresh cache, or read from
    ``cache`` (:func:`built_cache`), which it must then find (one build per module is what it saves).

    The tiny default earns neither of the recipe's rewards in two steps (every group's rewards equal: no update, and
    the recipe exits 1 for a run that trained nothing), so a third component that varies with the sampled tokens
    (``support.trainer:TokenReward``, weight 0.1) gives the update something to train on."""
    env = cpu_launch_env(
        TRL_PLUGINS_CACHE=str(cache or tmp_path / "cache"),
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")])),
    )
    cmd = accelerate_launch(
        config,
        ROOT / "recipes" / "retool_ppo.py",
        "--max_steps",
        "2",
        "--output_dir",
        str(tmp_path / "out"),
        "--embedded",
        json.dumps(TINY_EMBEDDED),
        "--train_size",
        "32",
        "--eval_problems",
        "4",
        "--eval_samples",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--num_generations",
        "4",
        "--save_strategy",
        "no",
        "--trajectory_table_steps",
        "1",
        "--eval_every_steps",
        "1",
        "--eval_every_problems",
        "4",
        "--reward_components",
        "correct",
        "format",
        "support.trainer:TokenReward",
        "--reward_component_weights",
        "1.0",
        "0.1",
        "0.1",
        *extra,
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard_s(timeout))
    if cache is not None and proc.returncode == 0:
        assert "using the cached model" in proc.stdout and "building the tiny model" not in proc.stdout, proc.stdout[
            -3000:
        ]
    return proc


@pytest.mark.slow
def test_main_command_runs_two_steps_on_one_process(first_launch):
    proc, root = first_launch
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = root / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    for key in ("before", "after"):
        assert summary[key]["problems"] == 4 and summary[key]["samples"] == 2
    assert "ReTool PPO summary" in proc.stdout and "held-out accuracy gain" in proc.stdout
    assert (out / "retool_ppo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2] and "reward/correct" in steps[0] and "reward/format" in steps[0]
    assert any(r["train/update_skipped"] == 0.0 for r in steps)  # it trained: else it would have exited 1
    # The periodic held-out evaluation of the live policy, logged with its step.
    assert all(0.0 <= r["heldout/accuracy"] <= 1.0 and 0.0 <= r["heldout/tool_call_rate"] <= 1.0 for r in steps)
    assert all(r["heldout/accuracy_se"] >= 0.0 for r in steps)  # with its standard error, clustered by problem
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B offline by default
    # The banner comes before the embedded default is built (what the run will do, said before it spends compute).
    assert 0 <= proc.stdout.index("ReTool PPO: the run") < proc.stdout.index("building the tiny model")
    # Its saved batch replays clean with the checkpoint that sampled it (docs/replay.md): every seeded turn drawn
    # again, the rewards recomputed and the stop reasons re-derived.
    from trl_plugins.replay.cli import main as replay

    assert (
        replay(
            [
                str(out / "trajectories" / "step-000002.json"),
                "--checkpoint",
                str(out / "checkpoint-1"),
                "--resample",
                "--rewards",
            ]
        )
        == 0
    )
    # Re-scoring needs the run's config, not its weights: from the batch's own run folder (output_dir/run_config/).
    assert replay([str(out / "trajectories" / "step-000002.json"), "--rewards"]) == 0


@pytest.mark.slow
def test_main_command_under_zero3_on_two_processes_builds_once_and_generates_with_continuous_batching(tmp_path):
    # One launch for two things (each 2-process launch costs ~70 s of a 2-core machine; they do not interact):
    #
    # ZeRO-3 on two processes into a fresh cache: only the main process builds the embedded default (one build
    # message, one cache entry), the two steps train, and the periodic evaluation runs on both ranks (2 problems
    # each, full weights gathered) and is summed.
    #
    # use_transformers_continuous_batching through the real launcher, on ZeRO-3-sharded weights (gathered once per
    # rollout, as for HF generate), with the manager and its cache kept between rollouts: the steps train, the
    # periodic and final evaluations generate with the same backend. (HF generate under ZeRO-3 is the trainer's
    # default path, run in tests/test_distributed.py's launches.)
    proc = _launch(
        tmp_path,
        "cpu_zero3.yaml",
        [
            "--report_to",
            "none",
            "--use_transformers_continuous_batching",
            "--transformers_continuous_batching_config",
            '{"page_size": 32, "num_blocks": 256, "max_batch_tokens": 1024}',
            "--continuous_batching_keep_cache",
        ],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["after"]["problems"] == 4
    assert proc.stdout.count("building the tiny model") == 1
    assert len([p for p in (tmp_path / "cache" / "embedded").iterdir()]) == 1
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("heldout/accuracy" in r for r in steps)
    # One generate call per turn: a per-request backend (turns_mean is over all ranks, generate_calls the max).
    assert all(r["rollout/generate_calls"] >= r["rollout/turns_mean"] * 8 - 1e-6 for r in steps), steps


def test_with_a_remote_sandbox_the_dataset_paths_are_named_for_the_server_not_added_to_the_tool(tmp_path):
    # The client may not set hidden_paths (the server's setting): the recipe says which paths to start it with.
    from types import SimpleNamespace

    from retool.data import hide_answers

    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    said: list[str] = []
    remote = SimpleNamespace(tools=["code_interpreter"], tool_kwargs={"code_interpreter": {"backend": "remote"}})
    hide_answers(str(data), remote, say=said.append)
    assert remote.tool_kwargs == {"code_interpreter": {"backend": "remote"}}
    assert len(said) == 1 and "--hidden-path" in said[0] and str(data.resolve()) in said[0], said
    local = SimpleNamespace(tools=["code_interpreter"], tool_kwargs={})  # control: the local sandbox hides them
    hide_answers(str(data), local, say=said.append)
    assert str(data.resolve()) in local.tool_kwargs["code_interpreter"]["hidden_paths"]


def test_embedded_settings_reject_bad_json_and_unknown_fields():
    from retool.default_model import EmbeddedSettings

    assert EmbeddedSettings.from_json('{"cold_start_epochs": 2}', seed=3) == EmbeddedSettings(
        cold_start_epochs=2, seed=3
    )
    with pytest.raises(ValueError, match="JSON object"):
        EmbeddedSettings.from_json("{cold_start_epochs: 2}")
    with pytest.raises(ValueError, match=r"unknown embedded settings \['epochs'\]; known: .*cold_start_epochs"):
        EmbeddedSettings.from_json('{"epochs": 2}')
    assert EmbeddedSettings(seed=1).key() != EmbeddedSettings(seed=2).key()


def test_local_dataset_files_are_hidden_from_model_written_code(tmp_path):
    import asyncio
    import tempfile

    from retool.data import answer_paths, load_task_rows
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    # A host directory the sandbox shows unless told to hide it: it shows only the interpreter and the
    # system's /usr (read-only), so /usr/local/share, else the interpreter's own prefix.
    base = next((d for d in ("/usr/local/share", sys.prefix) if os.path.isdir(d) and os.access(d, os.W_OK)), None)
    if base is None:
        pytest.skip("no host directory the sandbox shows is writable here")
    data_dir = Path(tempfile.mkdtemp(prefix="trl-plugins-answers-", dir=base))
    data_dir.chmod(0o755)  # the sandboxed code runs as another user
    try:
        data = data_dir / "answers.jsonl"
        data.write_text(json.dumps({"question": "What is 6 * 7?", "meta": {"gold": 42}}) + "\n")
        rows = load_task_rows(str(data), "train", size=None, prompt_column="question", answer_column="meta.gold")
        assert rows == [{"id": "train-0", "prompt": "What is 6 * 7?", "answer": "42"}]
        with pytest.raises(ValueError, match=r"no column\(s\) \['answer'\]"):
            load_task_rows(str(data), "train", size=None, prompt_column="question")
        hidden = answer_paths(str(data))
        assert str(data.resolve()) in hidden and answer_paths(None) == []
        code = {"code": f"print(open({str(data)!r}).read())"}
        for paths, readable in (((), True), (tuple(hidden), False)):
            tool = CodeInterpreter(mode="cold", hidden_paths=paths)
            try:
                out = asyncio.run(tool(code))
            finally:
                tool.close()
            assert ("42" in out.text) is readable and out.ok is readable, out.text
            if not readable:  # the code ran and was refused the file, not a sandbox failure
                assert "PermissionError" in out.text or "FileNotFoundError" in out.text, out.text
    finally:
        import shutil

        shutil.rmtree(data_dir, ignore_errors=True)


class _Oracle:
    """Predicts the true next token everywhere except digits, where it says ``wrong_digit``."""

    training = False

    def __init__(self, digits=None):
        self.digits = digits

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, input_ids, attention_mask):
        import torch

        nxt = torch.roll(input_ids, -1, dims=1)
        if self.digits is not None:
            nxt = torch.where(torch.isin(nxt, self.digits), self.digits[0], nxt)
        logits = torch.zeros(*input_ids.shape, 2048)
        logits.scatter_(2, nxt.unsqueeze(-1), 1.0)
        return type("Out", (), {"logits": logits})()


def test_copy_accuracy_scores_the_copied_digits_at_the_right_positions():
    import torch

    from retool.coldstart import copy_accuracy
    from retool.task import arithmetic_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [CodeInterpreter().schema()])
    problems = arithmetic_problems(8, seed=5)
    assert copy_accuracy(_Oracle(), chat, problems) == 1.0
    zero = tok.convert_tokens_to_ids("0")
    digits = torch.tensor([zero] + [tok.convert_tokens_to_ids(str(d)) for d in range(1, 10)])
    # Always "0" for a digit: right exactly as often as the copied digit is a 0.
    expected = sum(p["expression"].count("0") + p["answer"].count("0") for p in problems) / sum(
        sum(c.isdigit() for c in p["expression"]) + len(p["answer"]) for p in problems
    )
    assert copy_accuracy(_Oracle(digits), chat, problems) == pytest.approx(expected)


def test_cutting_the_prompt_to_the_receptive_field_leaves_the_sft_loss_unchanged():
    import torch

    from retool.coldstart import cold_start_dataset, receptive_field
    from retool.task import arithmetic_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tiny import build_tiny_model, build_tokenizer
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [CodeInterpreter().schema()])
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, sliding_window=8).eval()
    assert receptive_field(model.config) == 16 and receptive_field(build_tiny_model(tok, hidden_size=32).config) is None
    problems = arithmetic_problems(4, seed=2)

    def losses(left_context):
        ds = cold_start_dataset(chat, problems, tool_fraction=0.5, seed=1, left_context=left_context)
        out = []
        for row in ds:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.where(torch.tensor([row["assistant_masks"]]) == 1, ids, -100)
            with torch.no_grad():
                out.append(float(model(input_ids=ids, labels=labels).loss))
        return out, [len(r["input_ids"]) for r in ds]

    full, full_len = losses(None)
    cut, cut_len = losses(receptive_field(model.config))
    assert all(c < f for c, f in zip(cut_len, full_len))  # the long system prompt is gone
    assert cut == pytest.approx(full, rel=1e-5, abs=1e-6)
    too_short, _ = losses(receptive_field(model.config) - 8)  # negative control: cuts into the window
    assert too_short != pytest.approx(full, rel=1e-5, abs=1e-6)


def test_run_in_child_passes_objects_and_returns_the_result(monkeypatch, capfd):
    import child_jobs
    from retool.launch import ChildProcessError, available_cpus, run_in_child

    monkeypatch.setenv("RANK", "1")  # a distributed launch's variables do not reach the child
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    out = run_in_child(child_jobs.double, 21, what="doubling")
    assert out == {"twice": 42, "threads": str(available_cpus()), "rank": None}
    with pytest.raises(
        ChildProcessError, match=r"the failing job failed in its child process: RuntimeError: child says no"
    ):
        run_in_child(child_jobs.fail, what="the failing job")
    assert "child says no" in capfd.readouterr().err  # the child's traceback, on its stderr
    with pytest.raises(ChildProcessError, match=r"its child process ended \(exit 3\) without a result or an error"):
        run_in_child(child_jobs.exit_without_a_word, what="the silent job")


def test_a_spare_child_runs_the_next_job_as_a_fresh_child_would(monkeypatch, capfd):
    # prepare_child starts the next child ahead (it imports, then waits); run_in_child hands it the job. The job sees
    # the environment a child started now would get, errors come back the same way, and one spare serves one job.
    import child_jobs
    from retool import launch

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    launch.prepare_child(preload=("json",))
    spare = launch._spare[0]
    launch.prepare_child(preload=("json",))  # one at a time
    assert launch._spare[0] is spare
    monkeypatch.setenv("WANDB_MODE", "offline")  # set after the spare started, read at use: handed over with the job
    out = launch.run_in_child(child_jobs.whoami, what="who")
    assert out == {"pid": spare.pid, "wandb_mode": "offline", "rank": None} and launch._spare is None
    assert spare.poll() == 0
    # The next job without a spare: a child of its own.
    assert launch.run_in_child(child_jobs.whoami, what="who")["pid"] != spare.pid
    launch.prepare_child(preload=("json",))
    with pytest.raises(launch.ChildProcessError, match="the failing job failed"):
        launch.run_in_child(child_jobs.fail, what="the failing job")
    assert "child says no" in capfd.readouterr().err
    # A spare started before another change of the environment is not used: the job gets a child of its own.
    launch.prepare_child(preload=("json",))
    stale = launch._spare[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("SOMETHING_READ_AT_IMPORT", "x")
    assert launch.run_in_child(child_jobs.whoami, what="who")["pid"] != stale.pid
    assert stale.poll() is not None


def test_an_unused_spare_child_ends_with_its_parent():
    code = (
        "import sys; sys.path.insert(0, %r); from retool import launch; launch.prepare_child(preload=('json',)); "
        "print(launch._spare[0].pid, flush=True)" % str(ROOT / "recipes")
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(proc.stdout.split()[0])
    assert proc.returncode == 0
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # a zombie is reaped by init, not us
        status = Path(f"/proc/{pid}/status").read_text() if Path(f"/proc/{pid}/status").exists() else ""
        if "zombie" in status:
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_evaluation_settings_are_refused_before_anything_is_built():
    from retool.evaluate import check_eval_settings
    from trl_plugins.run import resolve_run

    retool_ppo = recipe_module()
    script_args, args = retool_ppo.parse_args([])
    assert check_eval_settings(script_args, resolve_run(args)) == [1, 4]
    script_args, args = retool_ppo.parse_args(["--reward_components", "format", "--reward_component_weights", "1.0"])
    with pytest.raises(SystemExit, match="not among reward_components=\\['format'\\].*--eval_problems 0"):
        check_eval_settings(script_args, resolve_run(args))
    script_args, args = retool_ppo.parse_args(
        ["--reward_components", "format", "--reward_component_weights", "1.0", "--eval_problems", "0"]
    )
    assert check_eval_settings(script_args, resolve_run(args)) == [1, 4]  # no held-out evaluation: nothing to count by
    script_args, args = retool_ppo.parse_args(["--eval_temperature", "0"])
    with pytest.raises(SystemExit, match="greedy"):
        check_eval_settings(script_args, resolve_run(args))


def _refusal(argv: list[str], monkeypatch) -> str:
    """The main command's refusal of ``argv``: the message of the ``SystemExit`` it stops with, run in this process.

    What the four "stops before anything is built" tests check is that the refusal comes first, so they need no
    interpreter of their own (~10 s of imports each): ``main`` runs here as ``python recipes/retool_ppo.py`` would
    run it, with the spare child interpreter it starts ahead for the first evaluation (``prepare_child``: it only
    imports) left out, and the environment and torch's thread count put back."""
    import torch

    retool_ppo = recipe_module()
    monkeypatch.setattr("retool.launch.prepare_child", lambda *a, **k: None)
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as stop:
            retool_ppo.main(*retool_ppo.parse_args(argv))
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    assert isinstance(stop.value.code, str), stop.value  # the message, not an exit status after a traceback
    return stop.value.code


def test_use_vllm_without_vllm_stops_the_recipe_before_anything_is_built(tmp_path, monkeypatch):
    # The main command with --use_vllm on a machine without vLLM: the message, not a cold start then an ImportError.
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    assert "vLLM is not installed here" in _refusal(
        ["--use_vllm", "true", "--output_dir", str(tmp_path / "out")], monkeypatch
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_an_output_folder_an_earlier_run_filled_is_refused_unless_resuming_or_overwriting(tmp_path, monkeypatch):
    # metrics.jsonl is appended to: a second run into the same folder would interleave its steps (1, 2, 1, 2).
    from retool.launch import claim_output_dir

    out = tmp_path / "out"
    claim_output_dir(out, resume=None, overwrite=False)  # missing: fine
    out.mkdir()
    claim_output_dir(out, resume=None, overwrite=False)  # empty: fine
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "checkpoint-2").mkdir()
    with pytest.raises(
        SystemExit, match="already holds files of an earlier run.*--resume_from_checkpoint.*--overwrite_output_dir"
    ):
        claim_output_dir(out, resume=None, overwrite=False)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched
    claim_output_dir(out, resume="true", overwrite=False)  # resuming continues in it
    claim_output_dir(out, resume=None, overwrite=True, move=False)  # not the main process: leaves it to the main
    assert (out / "metrics.jsonl").exists()
    messages = []
    claim_output_dir(out, resume=None, overwrite=True, log=messages.append)
    (aside,) = out.glob("previous-*")
    assert sorted(p.name for p in out.iterdir()) == [aside.name]  # afresh; nothing deleted
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n' and (aside / "checkpoint-2").is_dir()
    assert "moved to" in messages[0]
    claim_output_dir(out, resume=None, overwrite=False)  # an earlier run moved aside does not count

    # The main command stops on it before anything is built (no embedded default, no evaluation).
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    assert "already holds files of an earlier run" in _refusal(
        ["--output_dir", str(out), "--report_to", "none"], monkeypatch
    )
    assert not (tmp_path / "cache").exists()


def test_a_negative_learning_rate_is_refused_when_the_config_is_parsed():
    retool_ppo = recipe_module()
    with pytest.raises(SystemExit, match="learning_rate must be > 0, got -0.001"):
        retool_ppo.parse_args(["--learning_rate=-1e-3"])


# --- Held-out rows never overlap the training rows (issue 13, point 1) -----------------------------------


def _write_jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": str(i)}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_a_single_file_is_split_into_disjoint_training_and_held_out_rows(tmp_path):
    from retool.data import task_rows

    prompts = [f"What is {i} + {2 * i}?" for i in range(40)]
    data = _write_jsonl(tmp_path / "arith.jsonl", prompts)
    retool_ppo = recipe_module()
    script_args, _ = retool_ppo.parse_args(["--dataset_name", str(data)])
    said: list[str] = []
    train = task_rows(script_args, "train", size=None, log=said.append)
    held = task_rows(script_args, "test", size=None, log=said.append)
    train_prompts, held_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in held}
    assert not train_prompts & held_prompts and train_prompts | held_prompts == set(prompts)
    assert len(held) == 4 and len(train) == 36  # round(0.1 * 40) held out
    # Said, with the counts and how.
    assert said[0] == said[1] and "held-out rows: 4 of the 40 rows of the file" in said[0]
    assert "chosen by a hash of the prompt" in said[0] and "training uses the other 36" in said[0]
    # Deterministic, whatever the row order, the seed or the size asked for.
    _write_jsonl(tmp_path / "shuffled.jsonl", prompts[::-1])
    again, _ = retool_ppo.parse_args(["--dataset_name", str(tmp_path / "shuffled.jsonl"), "--task_seed", "5"])
    assert {r["prompt"] for r in task_rows(again, "test", size=None)} == held_prompts
    assert {r["prompt"] for r in task_rows(script_args, "test", size=2)} < held_prompts
    # A larger fraction holds out more, still disjoint.
    quarter, _ = retool_ppo.parse_args(["--dataset_name", str(data), "--held_out_fraction", "0.25"])
    assert len(task_rows(quarter, "test", size=None)) == 10 and len(task_rows(quarter, "train", size=None)) == 30
    # Two rows with one prompt fall on the same side.
    dup = _write_jsonl(tmp_path / "dup.jsonl", prompts + [min(held_prompts)])
    dup_args, _ = retool_ppo.parse_args(["--dataset_name", str(dup)])
    assert min(held_prompts) not in {r["prompt"] for r in task_rows(dup_args, "train", size=None)}


def test_a_split_that_cannot_be_held_out_is_refused_saying_what_to_do(tmp_path):
    from retool.data import task_rows

    retool_ppo = recipe_module()
    small = _write_jsonl(tmp_path / "small.jsonl", ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"])
    before = small.read_text()
    script_args, _ = retool_ppo.parse_args(["--dataset_name", str(small)])
    with pytest.raises(
        ValueError, match=r"has 3 rows and held_out_fraction=0.1 leaves none held out.*too few rows.*--eval_problems 0"
    ):
        task_rows(script_args, "test", size=None)
    assert len(task_rows(script_args, "train", size=None)) == 3  # nothing to hold out: training keeps them all
    none_held, _ = retool_ppo.parse_args(["--dataset_name", str(small), "--held_out_fraction", "0"])
    with pytest.raises(
        ValueError, match=r"single file: it has no held-out split, and held_out_fraction is 0.*--held_out_fraction 0.1"
    ):
        task_rows(none_held, "test", size=None)
    assert small.read_text() == before  # the data is untouched
    with pytest.raises(
        SystemExit,
        match=r"held_out_fraction must be in \[0, 1\), got 1.0\. \[set by: held_out_fraction in the command line\]",
    ):
        retool_ppo.parse_args(["--held_out_fraction", "1"])


def test_a_dataset_folder_uses_its_own_test_split_or_holds_out_part_of_its_training_split(tmp_path):
    from retool.data import task_rows

    retool_ppo = recipe_module()
    both = tmp_path / "both"
    both.mkdir()
    _write_jsonl(both / "train.jsonl", [f"train {i}" for i in range(20)])
    _write_jsonl(both / "test.jsonl", [f"test {i}" for i in range(5)])
    script_args, _ = retool_ppo.parse_args(["--dataset_name", str(both)])
    said: list[str] = []
    assert {r["prompt"] for r in task_rows(script_args, "test", size=None, log=said.append)} == {
        f"test {i}" for i in range(5)
    }
    assert {r["prompt"] for r in task_rows(script_args, "train", size=None, log=said.append)} == {
        f"train {i}" for i in range(20)
    }
    assert said[0].startswith("held-out rows: split 'test' of") and "its split 'test'" in said[1]

    only_train = tmp_path / "only_train"
    only_train.mkdir()
    _write_jsonl(only_train / "train.jsonl", [f"train {i}" for i in range(20)])
    script_args, _ = retool_ppo.parse_args(["--dataset_name", str(only_train)])
    held = {r["prompt"] for r in task_rows(script_args, "test", size=None, log=said.append)}
    train = {r["prompt"] for r in task_rows(script_args, "train", size=None)}
    assert len(held) == 2 and len(train) == 18 and not held & train
    assert "the dataset has no split 'test'" in said[-1]
    none_held, _ = retool_ppo.parse_args(["--dataset_name", str(only_train), "--held_out_fraction", "0"])
    with pytest.raises(
        ValueError, match=r"has no split 'test' \(it has \['train'\]\) and held_out_fraction is 0.*--dataset_test_split"
    ):
        task_rows(none_held, "test", size=None)
    missing, _ = retool_ppo.parse_args(["--dataset_name", str(only_train), "--dataset_train_split", "training"])
    with pytest.raises(ValueError, match=r"has no split 'training'; it has \['train'\]. Set --dataset_train_split"):
        task_rows(missing, "train", size=None)


def test_naming_the_training_split_as_the_held_out_split_is_refused():
    from retool.evaluate import check_eval_settings
    from trl_plugins.run import resolve_run

    retool_ppo = recipe_module()
    script_args, args = retool_ppo.parse_args(["--dataset_test_split", "train"])
    with pytest.raises(
        SystemExit, match=r"both 'train': the held-out evaluation would score the training rows.*--eval_problems 0"
    ):
        check_eval_settings(script_args, resolve_run(args))
    with pytest.raises(SystemExit, match=r"both 'train'.*set --dataset_train_split to another name"):
        check_eval_settings(
            script_args, resolve_run(args), training=False
        )  # retool_eval.py: no --eval_problems 0 way out
    script_args, args = retool_ppo.parse_args(["--dataset_test_split", "train", "--eval_problems", "0"])
    assert check_eval_settings(script_args, resolve_run(args)) == [1, 4]  # no held-out evaluation: nothing to refuse


def test_the_recipe_stops_on_a_file_too_small_to_hold_out_before_building_anything(tmp_path, monkeypatch):
    small = _write_jsonl(tmp_path / "small.jsonl", ["What is 1 + 1?", "What is 2 + 2?"])
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    refusal = _refusal(
        ["--dataset_name", str(small), "--report_to", "none", "--output_dir", str(tmp_path / "out")], monkeypatch
    )
    assert "leaves none held out" in refusal, refusal
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


# --- Held-out figures with their uncertainty (point 3) ----------------------------------------------------


def test_the_summary_shows_each_figure_with_its_standard_error_and_the_gain_with_a_paired_one():
    from retool.report import accuracy_gain, format_summary

    def result(correct):  # 4 problems x 2 samples, the numbers summarise() would give
        per_problem = [c / 2 for c in correct]
        mean = sum(per_problem) / 4
        se = (sum((p - mean) ** 2 for p in per_problem) / 3 / 4) ** 0.5
        return {
            "problems": 4,
            "samples": 2,
            "accuracy": mean,
            "accuracy_se": se,
            "tool_call_rate": 0.5,
            "accuracy_with_tool": None,
            "accuracy_without_tool": mean,
            "accuracy_without_tool_se": se,
            "truncated_frac": 0.0,
            "pass_at_k": {"1": mean, "2": 0.75},
            "pass_at_k_se": {"1": se, "2": 0.25},
            "correct_by_problem": {q: [c, 2] for q, c in zip("abcd", correct)},
        }

    before, after = result([1, 0, 1, 2]), result([2, 1, 1, 2])
    # before: per problem 0.5, 0, 0.5, 1 -> 50.0% ± 20.4 (sd 0.408 / 2); after: 1, 0.5, 0.5, 1 -> 75.0% ± 14.4.
    # Gain 0.25 with the paired se 0.1443 (changes 0.5, 0.5, 0, 0: sd 0.2887 / 2); 95%: 25 -/+ 1.96 * 14.43.
    gain = accuracy_gain(before, after)
    assert gain["accuracy"] == 0.25 and gain["se"] == pytest.approx(0.144338, abs=1e-6) and gain["paired"]
    text = format_summary(before, after, steps=2, wall_s=60.0, paths={})
    lines = {line[:28].strip(): line[28:] for line in text.splitlines()}
    assert lines["accuracy (pass@1)"].split() == ["50.0%", "±", "20.4", "75.0%", "±", "14.4"]
    assert lines["accuracy with the tool"].split() == ["n/a", "n/a"]
    assert lines["pass@2"].split() == ["75.0%", "±", "25.0", "75.0%", "±", "25.0"]
    assert lines["tool-call rate"].split() == ["50.0%", "50.0%"]  # a rate, not an estimate of skill: no ±
    assert "held-out accuracy gain: +25.0 points ± 14.4 (paired by problem; 95% interval -3.3 to +53.3)" in text
    assert "clustered by problem" in text
    # Different problems: no pairing; the two standard errors combine as if independent (sqrt(0.204^2 + 0.144^2)).
    other = {**after, "correct_by_problem": {q + "'": v for q, v in after["correct_by_problem"].items()}}
    assert accuracy_gain(before, other) == {"accuracy": 0.25, "se": pytest.approx(0.25), "paired": False}
    assert "± 25.0 (unpaired" in format_summary(before, other, steps=2, wall_s=60.0, paths={})


# --- A failed evaluation reports its own cause (point 4) ----------------------------------------------------


def test_a_failed_child_evaluation_reports_the_childs_own_error(tmp_path, monkeypatch):
    from retool.evaluate import evaluate_checkpoint
    from retool.launch import ChildProcessError, run_in_child
    from trl_plugins.run import resolve_run

    # (A failing and a silent job: test_run_in_child_passes_objects_and_returns_the_result.)
    # The recipe's own evaluation, of a checkpoint that is not there: the child's error names the folder, and
    # nothing guesses about dataset splits.
    retool_ppo = recipe_module()
    script_args, args = retool_ppo.parse_args(["--output_dir", str(tmp_path / "out")])
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(ChildProcessError) as failed:
        run_in_child(
            evaluate_checkpoint,
            str(missing),
            script_args,
            resolve_run(args).spec,
            ks=[1],
            rows=[{"id": "q", "prompt": "What is 1 + 1?", "answer": "2"}],
            what="the held-out evaluation",
        )
    message = str(failed.value)
    assert message.startswith("the held-out evaluation failed in its child process: ") and str(missing) in message
    assert "split" not in message


@pytest.mark.slow
def test_main_command_on_a_single_file_with_continuous_batching_trains_a_lora_adapter_with_a_critic(
    tmp_path, built_cache
):
    # Four features through one real launch (each launch costs ~30 s of a 2-core machine; they do not interact,
    # except that every generation of the LoRA policy, before, during and after RL, goes through the paged cache):
    #
    # --use_peft: only the adapter is saved, and the held-out evaluation after RL loads final/ (base + adapter) by
    # its path. --advantage gae: choosing a critic-based estimator brings the critic (a full one, from the base);
    # its settings have defaults.
    #
    # --dataset_name arith.jsonl: 6 of its 60 rows are held out (said), training draws from the other 54, and the
    # before/after numbers carry standard errors and a paired gain.
    #
    # Issue 30.12: `--use_transformers_continuous_batching true` and nothing else died within two steps on a fresh
    # machine: transformers sized the paged cache to fill half the memory it saw at the first rollout, and every
    # later rollout rebuilt it (the cache is not kept by default) from those figures with less memory free
    # ("MemoryError: Memory footprint ... is more than available memory ..."). Sized from the run's workload it
    # is checked before the model loads and rebuilt at the same small size every rollout: the starting model's
    # evaluation, two steps, an evaluation after each, and the final evaluation all generate with it.
    from retool.task import arithmetic_problems

    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in arithmetic_problems(60, seed=3)]
    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _launch(
        tmp_path,
        "cpu.yaml",
        [
            "--dataset_name",
            str(data),
            "--report_to",
            "none",
            "--use_transformers_continuous_batching",
            "true",
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--advantage",
            "gae",
        ],
        cache=built_cache,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The adapter alone saved, and the evaluation after RL read it from final/.
    final = tmp_path / "out" / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "adapter_config.json").is_file()
    assert not list(final.glob("model*.safetensors"))
    # The file: its held-out rows, said once before the model; figures with standard errors and a paired gain.
    assert "held-out rows: 6 of the 60 rows of the file" in proc.stdout and "training uses the other 54" in proc.stdout
    assert proc.stdout.count("held-out rows:") == 1  # said once, before the model
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    for key in ("before", "after"):
        numbers = summary[key]
        assert numbers["problems"] == 4 and numbers["accuracy_se"] is not None and "2" in numbers["pass_at_k_se"]
        assert sorted(numbers["correct_by_problem"]) == ["test-0", "test-1", "test-2", "test-3"]
    assert summary["gain"]["paired"] and summary["gain"]["se"] is not None
    assert json.loads((out / "eval_after.json").read_text())["accuracy_se"] == summary["after"]["accuracy_se"]
    table = next(line for line in proc.stdout.splitlines() if line.startswith("accuracy (pass@1)"))
    assert table.count("±") == 2, table
    assert "paired by problem; 95% interval" in proc.stdout
    # Continuous batching: 8 trajectories (per_device_train_batch_size) x ceil(1024 / 256) pages = 32 blocks;
    # max(8, 1024) batch tokens; one generate call per turn in training, and every evaluation generated with it.
    assert "start-up checks: continuous-batching cache" in proc.stdout
    assert "(max_batch_tokens=1024, num_blocks=32)" in proc.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/generate_calls"] >= r["rollout/turns_mean"] * 8 - 1e-6 for r in steps), steps  # per turn
    assert all("heldout/accuracy" in r for r in steps)
    assert summary["steps"] == 2 and summary["after"]["model"] == str(final)
    assert all("critic/value_loss" in r and "critic/explained_variance" in r for r in steps)


def test_a_damaged_checkpoint_stops_the_recipe_before_anything_is_built(tmp_path, monkeypatch):
    # --resume_from_checkpoint latest with the newest checkpoint truncated: refused naming the file, before the
    # embedded default is built or any model loads; nothing in the output folder is touched.
    from support.checkpoints import fake_checkpoint, snapshot, truncate

    out = tmp_path / "out"
    for step in (1, 2):
        fake_checkpoint(out / f"checkpoint-{step}", step)
    truncate(out / "checkpoint-2" / "model.safetensors")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    before = snapshot(out)
    monkeypatch.setenv("TRL_PLUGINS_CACHE", str(tmp_path / "cache"))
    refusal = _refusal(
        ["--output_dir", str(out), "--report_to", "none", "--resume_from_checkpoint", "Latest"], monkeypatch
    )
    assert f"{out / 'checkpoint-2' / 'model.safetensors'}: " in refusal and "--resume_fallback true" in refusal, refusal
    assert snapshot(out) == before and not (tmp_path / "cache").exists()


def test_a_resumed_run_reuses_the_starting_models_evaluation_only_when_it_is_the_same(tmp_path):
    from retool.evaluate import reusable_evaluation

    rows = [
        {"id": "test-0", "prompt": "What is 1 + 1?", "answer": "2"},
        {"id": "test-1", "prompt": "2 + 2?", "answer": "4"},
    ]
    saved = {
        "model": "/m",
        "samples": 4,
        "temperature": 1.0,
        "accuracy": 0.5,
        "correct_by_problem": {"test-0": [2, 4], "test-1": [2, 4]},
    }
    path = tmp_path / "eval_before.json"
    path.write_text(json.dumps(saved))
    same = dict(model="/m", rows=rows, samples=4, temperature=1.0)
    assert reusable_evaluation(path, **same) == saved
    # Anything different evaluates again: another model, other problems, samples or temperature.
    assert reusable_evaluation(path, **{**same, "model": "/other"}) is None
    assert reusable_evaluation(path, **{**same, "rows": rows[:1]}) is None
    assert reusable_evaluation(path, **{**same, "samples": 8}) is None
    assert reusable_evaluation(path, **{**same, "temperature": 0.0}) is None
    # No file, or one cut short: evaluate again.
    assert reusable_evaluation(tmp_path / "missing.json", **same) is None
    path.write_text(json.dumps(saved)[:20])
    assert reusable_evaluation(path, **same) is None


def _finished_run(run_dir, before, after, *, with_se=True):
    """A run folder as the recipe leaves it: summary.json (with or without standard errors) and metrics.jsonl."""
    from retool.report import accuracy_gain

    def result(correct):  # 2 problems x 4 samples
        acc = sum(correct) / 8
        out = {
            "problems": 2,
            "samples": 4,
            "accuracy": acc,
            "accuracy_with_tool": acc,
            "tool_call_rate": 1.0,
            "pass_at_k": {"1": acc, "4": 1.0},
        }
        if with_se:
            per = [c / 4 for c in correct]
            se = ((sum((p - acc) ** 2 for p in per) / 1) / 2) ** 0.5
            out.update(
                accuracy_se=se,
                accuracy_with_tool_se=se,
                pass_at_k_se={"1": se, "4": 0.0},
                correct_by_problem={"a": [correct[0], 4], "b": [correct[1], 4]},
            )
        return out

    b, a = result(before), result(after)
    run_dir.mkdir(parents=True)
    summary = {"before": b, "after": a, "steps": 40, "wall_s": 120.0}
    if with_se:
        summary["gain"] = accuracy_gain(b, a)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "reward/total": 0.5, "reward/correct": 0.0, "rollout/tool_calls_mean": 1.0}) + "\n"
            for s in range(1, 41)
        )
    )


@pytest.mark.parametrize("script", ["retool_seeds.py", "retool_compare.py"])
def test_the_seed_and_compare_tables_carry_standard_errors(tmp_path, script):
    import subprocess
    import sys

    # Seed 0 from today's recipe (standard errors), seed 1 from an older one (none: the table leaves them out).
    folders = {"retool_seeds.py": ("seed0", "seed1"), "retool_compare.py": ("grpo_s0", "grpo_s1")}[script]
    _finished_run(tmp_path / folders[0], [1, 3], [3, 4])
    _finished_run(tmp_path / folders[1], [2, 2], [4, 4], with_se=False)
    extra = ["--variants", "grpo"] if script == "retool_compare.py" else []
    proc = subprocess.run(
        [sys.executable, f"recipes/{script}", "--seeds", "0", "1", "--out", str(tmp_path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # before 0.5 (per problem 0.25, 0.75: se 0.25), after 0.875 (0.75, 1.0: se 0.125); paired gain +0.375 (changes
    # 0.5, 0.25: se 0.125).
    assert "0.500 ± 0.250" in proc.stdout and "0.875 ± 0.125" in proc.stdout and "+0.375 ± 0.125" in proc.stdout
    assert "| 0.500 |" in proc.stdout or "0.500 -> 1.000" in proc.stdout  # the older run: no ± to show


class _TranscriptSampler:
    """A causal LM that continues the transcripts it was given: one-hot on the true next token, except that where the
    next token is a digit of the code (``spread_code``) or of the answer (``spread_answer``) every digit is equally
    likely. Its "cache" is the token list so far."""

    training = False

    def __init__(self, transcripts, digits, *, spread_code=False, spread_answer=False):
        self.transcripts, self.digits = transcripts, digits
        self.spread_code, self.spread_answer = spread_code, spread_answer

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, input_ids, cache=None, use_cache=True, attention_mask=None):
        import torch

        ids = (cache or []) + input_ids[0].tolist()
        full = next(t for t in self.transcripts if t[: len(ids)] == ids)
        nxt = full[len(ids)]
        logits = torch.full((2048,), -1e9)
        in_answer = len(ids) > len(full) - 12  # the final turn, "The answer is \\boxed{NNNNN}." and its end
        if nxt in self.digits and (self.spread_answer if in_answer else self.spread_code):
            logits[list(self.digits)] = 0.0
        else:
            logits[nxt] = 0.0
        return type("Out", (), {"logits": logits.view(1, 1, -1), "cache": ids})()


def test_sampled_copy_rate_counts_a_problem_only_when_both_copies_sample_right():
    from retool.coldstart import sampled_copy_rate, transcript
    from retool.task import arithmetic_problems
    from trl_plugins.rollout import ChatFormat
    from trl_plugins.tiny import build_tokenizer
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [CodeInterpreter().schema()])
    problems = arithmetic_problems(6, seed=5)
    transcripts = [transcript(chat, p, use_tool=True)[0] for p in problems]
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    sharp = _TranscriptSampler(transcripts, digits)
    assert sampled_copy_rate(sharp, chat, problems) == 1.0
    # Every digit of one copy spread over 10 digits: a problem's copy samples right with probability 1e-7 or less.
    for spread in ({"spread_code": True}, {"spread_answer": True}):
        assert sampled_copy_rate(_TranscriptSampler(transcripts, digits, **spread), chat, problems) == 0.0


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_an_agent_written_with_the_openai_agents_sdk_trains_two_steps(tmp_path, built_cache):
    """examples/agents/openai_agents_sdk/retool_agent.yaml through the real launcher, on the module's built cache: the
    SDK's Runner on its default Responses API against the agent endpoint, two steps trained (a run whose trajectories
    all failed would exit non-zero), no environment error."""
    pytest.importorskip("agents")
    proc = _launch(
        tmp_path,
        "cpu.yaml",
        [
            "--config",
            str(ROOT / "examples" / "agents" / "openai_agents_sdk" / "retool_agent.yaml"),
            "--report_to",
            "none",
            "--eval_every_steps",
            "0",
        ],
        cache=built_cache,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 2
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rates = [s[k] for s in steps for k in s if k.endswith("environment_error") and k.startswith("rollout/")]
    assert rates and all(r == 0.0 for r in rates), [k for s in steps for k in s if "environment" in k]


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_two_steps_scored_by_its_own_scorer(tmp_path, built_cache):
    """recipes/retool_reasoning_gym.yaml through the real launcher, on the module's tiny model (named: the run builds
    nothing whichever embedded default the task has): reasoning-gym's chain_sum as the rows, two updates, the
    ``reasoning_gym`` component logged by name, and each saved trajectory's value what reasoning-gym's own
    ``score_answer`` gives its answer against the entry its row kept."""
    reasoning_gym = pytest.importorskip("reasoning_gym")
    from trl_plugins.rewards.reasoning_gym import entry_of, extract_answer

    model = next((built_cache / "embedded").glob("*/model"))
    proc = _launch(
        tmp_path,
        "cpu.yaml",
        [
            "--config",
            str(ROOT / "recipes" / "retool_reasoning_gym.yaml"),
            "--model_name_or_path",
            str(model),
            "--report_to",
            "none",
            "--eval_every_steps",
            "0",
            "--viewer_steps",
            "2",
            "--reward_components",
            "reasoning_gym",
            "format",
            "support.trainer:TokenReward",
        ],
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building the tiny model" not in proc.stdout
    assert "reasoning-gym: chain_sum (100%" in proc.stdout and "rewards:      reasoning_gym x 1;" in proc.stdout
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/total" in s]
    assert [s["step"] for s in steps] == [1, 2] and all(s["train/update_skipped"] == 0.0 for s in steps)
    assert all("reward/reasoning_gym" in s and s["reward/verifier_error_rate/reasoning_gym"] == 0.0 for s in steps)
    saved = json.loads((tmp_path / "out" / "trajectories" / "step-000002.json").read_text())["trajectories"]
    assert saved
    for traj in saved:
        row = traj["row"]
        assert row["id"].startswith("rg-train-") and row["metadata"]["source_dataset"] == "chain_sum"
        (value,) = [c["value"] for c in traj["reward_components"] if c["name"] == "reasoning_gym"]
        answer = extract_answer(traj["turns"][-1]["text"], "boxed")
        scorer = reasoning_gym.create_dataset("chain_sum", **row["reasoning_gym_config"], size=1, seed=0)
        assert value == scorer.score_answer(answer, entry_of(row)), (answer, row)


@pytest.mark.slow
def test_a_verifiers_environment_trains_two_steps_scored_by_its_rubric(tmp_path, built_cache):
    """examples/verifiers/verifiers.yaml through the real launcher, on the module's built cache: the environment's
    tasks as the rows, each trajectory one run of its runner in verifiers' interpreter, two updates, no environment
    error, the rubric's functions recorded by name in every trajectory and its weighted total trained on through
    ``agent_reward``. Small: one question of two samples a step, no before/after evaluation (each trajectory starts
    verifiers' interpreter, ~3 s of a core)."""
    from trl_plugins.environments.verifiers_env import verifiers_python
    from trl_plugins.rollout import RolloutError

    try:
        verifiers_python()
    except RolloutError as exc:
        pytest.skip(str(exc))
    proc = _launch(
        tmp_path,
        "cpu.yaml",
        [
            "--config",
            str(ROOT / "examples" / "verifiers" / "verifiers.yaml"),
            "--report_to",
            "none",
            "--eval_every_steps",
            "0",
            "--eval_problems",
            "0",
            "--per_device_train_batch_size",
            "2",
            "--num_generations",
            "2",
            "--viewer_steps",
            "2",
            "--reward_components",
            "agent_reward",
            "correct",
            "support.trainer:SampleIndexReward",
            "--reward_component_weights",
            "1.0",
            "0.0",
            "0.1",
        ],
        cache=built_cache,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "environment 'examples/verifiers/sums_env.py' (200 rows; rubric boxed x0.1, correct x1)" in proc.stdout
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/total" in s]
    assert [s["step"] for s in steps] == [1, 2] and all(s["train/update_skipped"] == 0.0 for s in steps)
    assert all(s["rollout/stop/environment_error"] == 0.0 and "reward/agent_reward" in s for s in steps)
    saved = json.loads((tmp_path / "out" / "trajectories" / "step-000002.json").read_text())["trajectories"]
    assert len(saved) == 2
    for traj in saved:
        assert traj["error"] is None and isinstance(traj["row"]["task"], dict)  # a task of the environment's
        got = {c["name"]: c for c in traj["reward_components"]}
        assert {"agent_return", "agent_return/correct", "agent_return/boxed"} <= set(got)
        # agent_reward trains on the rubric's total: correct x1 + boxed x0.1 (verifiers' weights)
        total = got["agent_return/correct"]["value"] + 0.1 * got["agent_return/boxed"]["value"]
        assert got["agent_return"]["value"] == pytest.approx(total) == got["agent_reward"]["value"]
        assert got["agent_reward"]["weight"] == 1.0 and got["agent_return"]["weight"] == 0.0


@pytest.mark.slow
def test_the_mcp_time_and_judge_layers_train_two_steps_together(tmp_path, built_cache, monkeypatch):
    """Two recipe layers in one launch (each launch costs ~45 s of CPU here; they do not interact):

    recipes/retool_mcp_time.yaml: mcp-server-time (from the package registry) started at the run's build, its two
    tools shown beside the code interpreter, and the server gone when the run ends.

    recipes/retool_judge.yaml, against the scripted judge (examples/judges/): the `judge` component stored beside
    `correct` and `format`, its cost logged, its key read from the environment and written nowhere, and a replay of
    the saved batch re-scored from the judge's cache without one call."""
    pytest.importorskip("mcp_server_time")
    scripted_judge = scripted_judge_module()
    from urllib.parse import urlsplit

    layer = yaml.safe_load((ROOT / "recipes" / "retool_judge.yaml").read_text())
    judge = layer["reward_component_kwargs"]["judge"]
    assert urlsplit(judge["base_url"]).hostname == "127.0.0.1"  # the recipe layer's judge is loopback
    server, _ = scripted_judge.serve(0)
    try:
        judge.update(
            base_url=f"http://127.0.0.1:{server.server_port}/v1",
            cache_path=str(tmp_path / "judge.sqlite"),
            api_key_env="TEST_JUDGE_KEY",
        )
        layer["output_dir"] = str(tmp_path / "out")
        (tmp_path / "layer.yaml").write_text(yaml.safe_dump(layer))
        secret = "sk-judge-4242-never-logged"
        monkeypatch.setenv("TEST_JUDGE_KEY", secret)
        proc = _launch(
            tmp_path,
            "cpu.yaml",
            [
                "--config",
                str(ROOT / "recipes" / "retool_mcp_time.yaml"),
                "--config",
                str(tmp_path / "layer.yaml"),
                "--reward_components",
                "correct",
                "judge",
                "format",
                "support.trainer:TokenReward",
                "--reward_component_weights",
                "1.0",
                "0.5",
                "0.1",
                "0.1",
                "--report_to",
                "wandb",
                "--viewer_steps",
                "2",
                "--eval_every_steps",
                "0",
            ],
            cache=built_cache,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = tmp_path / "out"
        # The MCP layer: both tools shown, the server found and gone.
        assert (
            "(the model calls it 'get_current_time')" in proc.stdout
            and "(the model calls it 'convert_time')" in proc.stdout
        )
        # Found by its bare name on this PATH, else in the interpreter's scripts folder (a venv not activated): the
        # banner names the path found.
        from trl_plugins.tools.sandbox.launcher import find_command

        mcp_server = find_command("mcp-server-time")
        assert (
            f"MCP server 'time' (stdio, shared: {mcp_server} --local-timezone UTC, protocol 2026-07-28)" in proc.stdout
        )
        assert json.loads((out / "summary.json").read_text())["steps"] == 2
        left = [d for d in Path("/proc").iterdir() if d.name.isdigit() and b"mcp-server-time" in _cmdline(d)]
        assert not left, "the MCP server outlived the run"
        # The judge layer.
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "reward/total" in s]
        assert [s["step"] for s in steps] == [1, 2]
        for s in steps:  # its own component, its cost, no failure
            assert "reward/judge" in s and "reward/correct" in s and "reward/format" in s
            assert s["judge/calls"] + s["judge/cache_hits"] >= 8 and s["judge/tokens_in"] > 0
            assert s["reward/verifier_error_rate"] == 0.0
        requests = scripted_judge._state["requests"]
        assert requests > 0 and set(scripted_judge._state["keys"]) == {f"Bearer {secret}"}  # it reached the judge
        leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
        assert not leaked and secret not in proc.stdout + proc.stderr, leaked
        from trl_plugins.replay.cli import main as replay

        assert replay([str(out / "trajectories" / "step-000002.json"), "--rewards"]) == 0
        assert scripted_judge._state["requests"] == requests  # every answer from the cache
    finally:
        server.shutdown()


@pytest.mark.slow
def test_the_claude_code_harness_trains_two_steps_of_the_recipe(tmp_path, built_cache):
    """examples/agents/claude_code/retool_agent.yaml: the stock CLI per trajectory (its prompt shrunk by its own flags,
    about 6,300 tokens), sandboxed, as the rollout of two recipe steps on the tiny embedded default. A plumbing check:
    the model is far too small to use Claude Code's tools; what is checked is that every trajectory went through the
    CLI to the endpoint and back and the update ran."""
    import shutil

    from trl_plugins.harness.claude_code import HarnessError, find_claude

    if "claude_code" not in os.environ.get("TRL_PLUGINS_TEST_REQUIRE", "").split(","):  # .ci/run requires it
        try:
            find_claude()
        except HarnessError as exc:
            pytest.skip(str(exc))
        if shutil.which("bwrap") is None:
            pytest.skip("no bubblewrap (.ci/run installs it)")
    proc = _launch(
        tmp_path,
        "cpu.yaml",
        ["--config", str(ROOT / "examples/agents/claude_code/retool_agent.yaml"), "--output_dir", str(tmp_path / "out")]
        + ["--per_device_train_batch_size", "4", "--num_generations", "2", "--eval_every_steps", "0"]
        + ["--eval_problems", "2", "--eval_samples", "1"],
        cache=built_cache,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/total" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/update_skipped"] == 0.0 for r in steps)
    # Every trajectory reached the endpoint through the CLI: no environment errors, prompts of the CLI's size.
    assert all(r.get("rollout/stop/environment_error", 0.0) == 0.0 for r in steps), steps
    assert all(r["rollout/trajectory_tokens_mean"] > 5000 for r in steps), steps
