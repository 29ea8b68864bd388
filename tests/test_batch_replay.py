"""The policy version on every trajectory, and the replay of a saved batch (docs/replay.md).

One real 2-step run (in process, tiny model, checkpoints at steps 1 and 2, the saved batch of step 2, sampled by
step 1's weights) is replayed clean with its own checkpoint; each drift made on purpose is then found at its place.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from trl_plugins.modeling import token_logprobs
from trl_plugins.replay.cli import load_checkpoint, main
from trl_plugins.replay.saved_batch import ReplayRefused, replay_batch
from trl_plugins.rollout import MultiTurnRollout
from trl_plugins.rollout.backends import BackendBase, cut_sample
from trl_plugins.rollout.weights import weights_digest
from trl_plugins.run import resolve_run
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.viewer import load_batch

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


class EchoTool:
    """An idempotent stand-in for the code interpreter; ``output_format`` is the drift a tool upgrade makes."""

    name = "code_interpreter"
    idempotent = True
    version = "1"
    output_format = "result: {}\n"

    def schema(self):
        return SCHEMA

    async def __call__(self, arguments):
        return ToolOutput(text=self.output_format.format(len(arguments["code"])), ok=True)


class BoxedDigit:
    """Scores the boxed digit; ``version`` is what the replay checks, ``scale`` a behaviour change."""

    version = "1"
    scale = 1.0

    def __call__(self, trajectory, example) -> float:
        text = trajectory.turns[-1].text
        return self.scale * float(text.split("\\boxed{")[1][0]) if "\\boxed{" in text else 0.0


class _ScoredScript(BackendBase):
    """A scripted policy (a tool call, then \\boxed{seed % 3}) whose behaviour log-probs are the model's own
    log-probs of the scripted tokens: what the replay recomputes from the checkpoint must agree with them."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, max_new_tokens, *, seeds):
        out = []
        for prompt, budget, seed in zip(prompts, max_new_tokens, seeds):
            text = self.tok.decode(prompt)
            body = (
                (
                    "<tool_call>\n"
                    + json.dumps({"name": "code_interpreter", "arguments": {"code": "print(1)"}})
                    + "\n</tool_call>"
                )
                if "<tool_response>" not in text
                else f"\\boxed{{{seed % 3}}}"
            )
            ids = self.tok(body, add_special_tokens=False)["input_ids"] + [self.end]
            full = torch.tensor([list(prompt) + ids])
            model = getattr(self.model, "module", self.model)
            with torch.no_grad():
                lp = token_logprobs(model, full[:, :-1], torch.ones_like(full[:, :-1]), full[:, 1:])[
                    0, len(prompt) - 1 :
                ]
            out.append(cut_sample(ids, [float(x) for x in lp], budget, {self.end}))
        return out


class ScoredScriptRollout:
    token_budget = 600

    def __init__(self, max_turns=3, **kwargs):
        self.inner = MultiTurnRollout(
            max_turns=max_turns, max_assistant_tokens=40, max_trajectory_tokens=600, tool_retries=0
        )

    def __call__(self, request):
        request.backend = _ScoredScript(request.backend.model, request.chat.tokenizer)
        return self.inner(request)

    def rederive_stop(self, trajectory, chat):
        return self.inner.rederive_stop(trajectory, chat)


def _config(out, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOConfig

    kwargs = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        learning_rate=5e-2,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        rollout="test_batch_replay:ScoredScriptRollout",
        rollout_kwargs={},
        reward_components=["digit"],
        max_padded_tokens_per_micro_batch=4000,
        max_items_per_micro_batch=2,
        viewer_steps=2,
        viewer_trajectories=4,
        system_prompt="Answer in \\boxed{}.",
        replay_every_steps=1,
    )
    kwargs.update(overrides)
    return MultiTurnGRPOConfig(**kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 2-step run: its output folder and its trainer."""
    from datasets import Dataset

    from trl_plugins.tiny import build_tiny_model
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    out = tmp_path_factory.mktemp("replay") / "out"
    tok = build_tokenizer("qwen2_5")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        _config(out),
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        tools={"code_interpreter": EchoTool()},
        reward_components={"digit": BoxedDigit()},
    )
    trainer.train()
    # The tripwire's negative control, while the trainer's accelerator is live (a later config resets its state):
    # the last batch was sampled by step 1's weights, the model now holds step 2's.
    moved = copy.deepcopy(trainer.last_batch)
    moved.metrics = {}
    for traj in moved.trajectories:
        traj.policy_version = dataclasses.replace(traj.policy_version, step=2)
    trainer.step_runner.replay_gap(moved, trainer.model_wrapped, step=2)
    trainer.moved_weights_gap = moved.metrics
    return out, trainer


@pytest.fixture()
def saved(trained):
    return load_batch(trained[0] / "trajectories" / "step-000002.json")


def _run(tools=None, rewards=None, **overrides):
    run = resolve_run(
        _config("unused", **overrides),
        tools={"code_interpreter": tools or EchoTool()},
        reward_components={"digit": rewards or BoxedDigit()},
    )
    return run


def test_the_version_is_complete_in_the_saved_batch_and_the_checkpoint(trained, saved):
    out, trainer = trained
    version = trainer.run.version
    assert saved["format"] == "trl_plugins.viewer/3" and saved["version"]["digest"] == version.digest
    assert saved["version"]["plugin_versions"] == {
        "reward/digit": "1",
        "tool/code_interpreter": "1",
        "rollout/test_batch_replay:ScoredScriptRollout": None,
    }
    assert saved["version"]["sampler"] == "hf_generate" and saved["version"]["dtype"] == "float32"
    assert saved["version"]["packages"]["torch"] == torch.__version__ and saved["tool_schemas"] == [SCHEMA]
    row = saved["trajectories"][0]["row"]  # whole rows
    assert set(row) == {"prompt", "answer"} and row["answer"] == str(2 * int(row["prompt"].split()[2]))
    marker = json.loads((out / "checkpoint-2" / "checkpoint_complete.json").read_text())
    assert marker["version"]["digest"] == version.digest
    # The weights digest each trajectory carries is that of the weights that sampled it: checkpoint-1's, not 2's.
    one, _, step = load_checkpoint(out / "checkpoint-1")
    two, _, _ = load_checkpoint(out / "checkpoint-2")
    digests = {t["policy_version"]["weights_digest"] for t in saved["trajectories"]}
    assert step == 1 and digests == {weights_digest(one)} and weights_digest(two) not in digests
    assert all(t["policy_version"]["run_digest"] == version.digest for t in saved["trajectories"])


def test_a_saved_batch_replays_clean_with_its_own_checkpoint(trained, capsys):
    out, _ = trained
    batch = out / "trajectories" / "step-000002.json"
    assert main([str(batch), "--checkpoint", str(out / "checkpoint-1")]) == 0
    text = capsys.readouterr().out
    assert "replay: everything compared equal" in text and "rendering: 4 trajectories compared, all equal" in text
    assert "logprobs: 4 trajectories compared, all equal" in text and "datum: 4 trajectories compared" in text
    report = replay_batch(
        load_batch(batch), load_checkpoint(out / "checkpoint-1")[1], run=_run(), tools=True, rewards=True
    )
    assert report.ok and report.compared == {"rendering": 4, "tools": 4, "rewards": 4, "stop_reason": 4, "datum": 4}, (
        report.render()
    )


@pytest.fixture(scope="module")
def unsaved(tmp_path_factory):
    """A real 2-step run with the default ``save_steps`` (500): the only checkpoint is the last step's (transformers
    saves at the end), none of step 1, whose weights sampled the batch of step 2. Its plugins are named by import
    path, so its saved config rebuilds them."""
    from datasets import Dataset

    from trl_plugins.tiny import build_tiny_model
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    out = tmp_path_factory.mktemp("unsaved") / "out"
    tok = build_tokenizer("qwen2_5")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    config = _config(
        out,
        save_steps=MultiTurnGRPOConfig.save_steps,
        replay_every_steps=0,
        tools=["test_batch_replay:EchoTool"],
        reward_components=["test_batch_replay:BoxedDigit"],
    )
    MultiTurnGRPOTrainer(
        build_tiny_model(tok), config, train_dataset=Dataset.from_list(rows), processing_class=tok
    ).train()
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]
    return out


def test_a_batch_is_re_scored_from_its_run_folder_without_a_checkpoint(unsaved, capsys):
    batch = unsaved / "trajectories" / "step-000002.json"
    assert main([str(batch), "--rewards", "--tools"]) == 0
    text = capsys.readouterr().out
    assert "replay: everything compared equal" in text and "rewards: 4 trajectories compared, all equal" in text
    assert "tools: 4 trajectories compared" in text and "rendering: 4 trajectories compared, all equal" in text
    # Negative control: a saved reward value that no longer matches what the component gives is named.
    tampered = json.loads(batch.read_text())
    tampered["trajectories"][1]["reward_components"][0]["value"] += 1.0
    (unsaved / "trajectories" / "tampered.json").write_text(json.dumps(tampered))
    assert main([str(unsaved / "trajectories" / "tampered.json"), "--rewards"]) == 1
    text = capsys.readouterr().out
    assert "[rewards] trajectory 1: component 'test_batch_replay:BoxedDigit' scores it differently" in text, text
    assert "[rewards] trajectory 0" not in text


def test_a_batch_outside_its_run_folder_needs_run_or_checkpoint(unsaved, tmp_path, capsys):
    batch = tmp_path / "step-000002.json"
    batch.write_text((unsaved / "trajectories" / "step-000002.json").read_text())
    assert main([str(batch), "--rewards"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rewards rebuilds the run's plugins from its saved config" in err, err
    assert "not in a run's output folder" in err and "give --run OUTPUT_DIR or --checkpoint" in err
    assert main([str(batch)]) == 2 and "or --tokenizer DIR" in capsys.readouterr().err
    assert main([str(batch), "--rewards", "--run", str(unsaved)]) == 0
    # A run folder without the saved config (a run started before the trainer wrote it) says what to give instead.
    assert main([str(batch), "--rewards", "--run", str(tmp_path)]) == 2
    assert "run_config/training_args.bin: missing" in capsys.readouterr().err


def test_the_run_config_is_replaced_whole_by_a_later_start_and_kept_by_a_failed_one(tmp_path):
    from transformers import AutoTokenizer

    from trl_plugins.rollout.chat import tokenizer_digest
    from trl_plugins.run.saved import save_run_config

    tok = build_tokenizer("qwen2_5")
    save_run_config(tmp_path, {"seed": 0}, tok)
    folder = save_run_config(tmp_path, {"seed": 1}, tok)  # a resumed run's start
    assert torch.load(folder / "training_args.bin", weights_only=False) == {"seed": 1}
    assert tokenizer_digest(AutoTokenizer.from_pretrained(folder)) == tokenizer_digest(tok)

    class Unwritable:
        def save_pretrained(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_run_config(tmp_path, {"seed": 2}, Unwritable())
    assert torch.load(folder / "training_args.bin", weights_only=False) == {"seed": 1}  # the previous one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["run_config"]  # no half-written or old folder left beside it


def test_a_checkpoint_one_step_later_is_refused_and_its_gap_reported_anyway(trained, saved, capsys):
    out, _ = trained
    batch = str(out / "trajectories" / "step-000002.json")
    assert main([batch, "--checkpoint", str(out / "checkpoint-2")]) == 2
    assert "the weights given are step 2, but the batch was sampled at step(s) [1]" in capsys.readouterr().err
    assert main([batch, "--checkpoint", str(out / "checkpoint-2"), "--anyway"]) == 1
    text = capsys.readouterr().out
    assert "RAN DESPITE VERSION DIFFERENCES" in text and "[logprobs] trajectory 0, turn 0, token" in text
    model, tok, _ = load_checkpoint(out / "checkpoint-2")
    report = replay_batch(saved, tok, model=model, model_step=2, anyway=True)
    assert report.logprobs["max_abs_diff"] > 1e-3 and report.logprobs["beyond"] > 0  # lr 5e-2 moved them


def _tokenizer(trained):
    return copy.deepcopy(trained[1].processing_class)


def test_a_changed_chat_template_is_refused_then_found_at_its_first_token(trained, saved):
    tok = _tokenizer(trained)
    tok.chat_template = tok.chat_template.replace("<tool_response>\\n", "<tool_response>\\n\\n")
    assert tok.chat_template != trained[1].processing_class.chat_template
    with pytest.raises(ReplayRefused, match="tokenizer/chat-template digest"):
        replay_batch(saved, tok)
    report = replay_batch(saved, tok, anyway=True)
    first = next(d for d in report.differences if d.check == "rendering")
    t0 = saved["trajectories"][0]
    ids, cut = t0["tokens"]["ids"], t0["turns"][1]["prompt_start"]
    k = ids.index(tok.convert_tokens_to_ids("<tool_response>"), cut) + 1  # right after the tool message opens
    assert (first.trajectory, first.turn, first.token) == (0, 1, k), first.line()
    assert not report.ok and first.current != first.saved


def test_a_tokenizer_with_one_merged_token_is_found_where_it_merges(trained, saved):
    # The merge is in the template's own text (its user header): a message's content is text whatever the tokenizer
    # adds (docs/rollout.md, 'Content is text'), so an added token written in a question no longer merges there.
    tok = _tokenizer(trained)
    tok.add_tokens(["user\n"])  # the header's "user" + "\n" now tokenise as one
    report = replay_batch(saved, tok, anyway=True)
    first = next(d for d in report.differences if d.check == "rendering" and d.trajectory == 0)
    ids, old = saved["trajectories"][0]["tokens"]["ids"], trained[1].processing_class
    at = old.decode(ids).index("user\n")  # the first token that reaches into the merged text
    k = next(j for j in range(len(ids)) if len(old.decode(ids[: j + 1])) > at)
    assert (first.turn, first.token, first.current) == (0, k, repr("user\n")), first.line()


def test_a_tool_whose_output_format_changed_is_found_at_its_observation(trained, saved):
    tool = EchoTool()
    tool.output_format = "result = {}\n"
    report = replay_batch(saved, trained[1].processing_class, run=_run(tools=tool), tools=True)
    found = [d for d in report.differences if d.check == "tools"]
    assert len(found) == 4 and not [d for d in report.differences if d.check != "tools"]
    t0 = saved["trajectories"][0]
    ids, tok = t0["tokens"]["ids"], trained[1].processing_class
    at = tok.decode(ids).index("result: 8") + len("result")  # where the two outputs part
    k = next(j for j in range(len(ids)) if len(tok.decode(ids[: j + 1])) > at)
    assert (found[0].trajectory, found[0].turn, found[0].token) == (0, 0, k), found[0].line()
    assert t0["datum"]["sources"][k - 1] == "observation" and found[0].saved == repr(tok.decode([ids[k]]))
    assert "returned 'result = 8\\n' where it returned 'result: 8\\n'" in found[0].what


def test_a_reward_component_with_another_version_is_refused_and_another_behaviour_found(trained, saved):
    newer = BoxedDigit()
    newer.version = "2"
    with pytest.raises(ReplayRefused, match=r"reward/digit version: 1 \(saved\) vs 2 \(current\)"):
        replay_batch(saved, trained[1].processing_class, run=_run(rewards=newer), rewards=True)
    changed = BoxedDigit()
    changed.scale = 2.0
    report = replay_batch(saved, trained[1].processing_class, run=_run(rewards=changed), rewards=True)
    found = [d for d in report.differences if d.check == "rewards"]
    nonzero = [i for i, t in enumerate(saved["trajectories"]) if t["reward_components"][0]["value"]]
    assert [d.trajectory for d in found] == nonzero and nonzero, report.render()


def test_a_datum_whose_mask_changed_is_found_at_its_token(trained, saved):
    damaged = copy.deepcopy(saved)
    d = damaged["trajectories"][1]["datum"]
    j = d["action_mask"].index(1)
    d["action_mask"][j] = 0
    report = replay_batch(damaged, trained[1].processing_class)
    [found] = [x for x in report.differences if x.check == "datum"]
    assert (found.trajectory, found.token) == (1, j + 1) and "action_mask" in found.what


def test_a_format_2_file_replays_what_it_can_and_says_what_it_cannot(trained, saved, tmp_path):
    old = copy.deepcopy(saved)
    old["format"] = "trl_plugins.viewer/2"
    for key in ("version", "tool_schemas", "chat"):
        del old[key]
    for t in old["trajectories"]:
        del t["row"], t["policy_version"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    report = replay_batch(load_batch(path), trained[1].processing_class)
    assert any("no version was saved" in n for n in report.notes)
    assert [d.check for d in report.differences][:1] == [
        "rendering"
    ]  # no system prompt saved: the first prompt differs
    model, _, _ = load_checkpoint(trained[0] / "checkpoint-1")
    with pytest.raises(ReplayRefused, match=r"trajectory 0: no version was saved \(a format-2 file\)"):
        replay_batch(load_batch(path), trained[1].processing_class, model=model, resample=True)
    with pytest.raises(SystemExit):  # the command line: --resample needs the weights
        main([str(path), "--tokenizer", str(trained[0] / "checkpoint-1"), "--resample"])


def test_the_weights_digest_reads_its_stated_sample_and_ignores_a_wrapper():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3))
    wrapped = torch.nn.Module()
    wrapped.module = copy.deepcopy(model)  # DDP's layout: names start with "module."
    base = weights_digest(model)
    assert weights_digest(wrapped) == base and len(base) == 16
    flat = model[0].weight.data.view(-1)  # 100 values: the sample reads 8 of them, 0, 14, 28, ..., 99
    kept = flat[14].item()
    flat[14] += 1.0
    assert weights_digest(model) != base
    flat[14] = kept
    flat[15] += 1.0  # not sampled: stated, not told apart
    assert weights_digest(model) == base
    assert weights_digest(object()) is None


def test_the_trainer_refuses_trajectories_of_another_run_version_and_the_differences_are_named(trained):
    import dataclasses

    from trl_plugins.pipeline.batch import _check_result
    from trl_plugins.rollout import RolloutResult
    from trl_plugins.run.version import version_differences
    from trl_plugins.types import AdapterSpec, TrajectoryError

    _, trainer = trained
    run = trainer.run
    traj = copy.deepcopy(trainer.last_batch.trajectories[0])
    questions = [type("Q", (), {"question_id": traj.question_id})()]
    _check_result("r", RolloutResult([traj]), questions, 1, run.chat.digest, run.version.digest)  # its own: accepted
    lora = dataclasses.replace(run.version, adapters=(AdapterSpec("default", "LORA", 8, ("q_proj", "v_proj")),))
    traj.policy_version = dataclasses.replace(traj.policy_version, run_digest=lora.digest)
    with pytest.raises(TrajectoryError, match=f"run version {lora.digest}, but the trainer's is {run.version.digest}"):
        _check_result("r", RolloutResult([traj]), questions, 1, run.chat.digest, run.version.digest)
    assert version_differences(lora, run.version) == [
        "adapters: [{'name': 'default', 'kind': 'LORA', 'rank': 8, 'targets': ('q_proj', 'v_proj')}] (saved) vs [] (current)"
    ]


def test_a_lora_policy_records_its_adapter_set_and_its_sampler_digests_the_adapted_weights():
    from peft import LoraConfig, get_peft_model

    from trl_plugins.rollout import HFGenerationBackend
    from trl_plugins.run.version import run_version
    from trl_plugins.tiny import build_tiny_model

    tok = build_tokenizer("qwen2_5")
    base = build_tiny_model(tok)
    plain = run_version(tokenizer_digest="t", tool_schemas=[SCHEMA], model=base, sampler="hf_generate")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    version = run_version(tokenizer_digest="t", tool_schemas=[SCHEMA], model=model, sampler="hf_generate")
    assert plain.adapters == () and [(a.name, a.kind, a.rank, a.targets) for a in version.adapters] == [
        ("default", "LORA", 4, ("q_proj", "v_proj"))
    ]
    assert version.digest != plain.digest
    backend = HFGenerationBackend(model, pad_token_id=tok.pad_token_id, stop_token_ids=[0])
    before = backend.weights_digest()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)  # an adapter update
    assert before is not None and backend.weights_digest() != before


def test_the_replay_tripwire_logs_the_gap_each_step_and_sees_weights_that_moved(trained):
    out, trainer = trained
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["replay/logprob_gap_max"] for r in records if "replay/logprob_gap_max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-4  # the behaviour log-probs are the sampling weights' own
    moved = trainer.moved_weights_gap  # step 1's tokens under step 2's weights (the fixture)
    assert moved["replay/logprob_gap_max"] > 1e-3 and moved["replay/logprob_gap_mean"] > 0
    with pytest.raises(ValueError, match="replay_every_steps must be >= 0"):
        _config(out, replay_every_steps=-1)


def test_the_viewer_shows_the_version_and_flags_a_run_of_another_version(trained, saved, tmp_path):
    from trl_plugins.viewer.cli import main as viewer_main

    out, trainer = trained
    page = tmp_path / "page.html"
    assert (
        viewer_main(
            [str(out / "trajectories" / "step-000002.json"), "-o", str(page), "--beside", str(out / "checkpoint-1")]
        )
        == 0
    )
    text = page.read_text()
    assert f"version <b>{trainer.run.version.digest}</b>" in text and 'version-mismatch">' not in text
    other = copy.deepcopy(saved)
    other["version"]["dtype"] = "bfloat16"
    other["version"]["digest"] = "0123456789abcdef"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        viewer_main(
            [str(out / "trajectories" / "step-000002.json"), "-o", str(page), "--beside", str(tmp_path / "other.json")]
        )
        == 0
    )
    assert "dtype: float32 (saved) vs bfloat16 (current)" in page.read_text()


def test_another_packing_of_the_saved_datums_gives_the_same_masks_and_denominators(saved):
    from trl_plugins.datum import collate
    from trl_plugins.packing import PACKERS
    from trl_plugins.viewer import datum_from_dict

    datums = [datum_from_dict(t["datum"]) for t in saved["trajectories"]]
    lengths = [len(d.input_ids) for d in datums]
    seen = []
    for packer, max_items in (("ffd", 1), ("balanced", 4)):
        plan = PACKERS.get(packer)(lengths, max_items=max_items, max_padded_tokens=4000)
        rows = {}
        for mb in plan.ranks[0]:
            batch = collate(datums, mb, pad_token_id=0)
            for row, i in enumerate(mb):
                rows[i] = batch.action_mask[row, : lengths[i]].tolist()
        seen.append((len(plan.ranks[0]), rows, sum(map(sum, rows.values())), len(rows)))
    (n_a, rows_a, tokens_a, seqs_a), (n_b, rows_b, tokens_b, seqs_b) = seen
    assert n_a == 4 and n_b < n_a  # two packings indeed: 4 micro-batches of one, fewer of several
    assert rows_a == rows_b == {i: list(d.action_mask) for i, d in enumerate(datums)}
    assert (tokens_a, seqs_a) == (tokens_b, seqs_b) == (sum(sum(d.action_mask) for d in datums), 4)


def test_a_long_tool_output_is_saved_whole_and_shown_cut(saved):
    from trl_plugins.replay.saved_batch import saved_trajectory
    from trl_plugins.viewer import make_batch, render_html

    traj = saved_trajectory(saved["trajectories"][0])
    long = "x" * 9000 + "END"
    traj.turns[0].tool_calls[0].output = long
    again = make_batch([traj], [], rows=[{"prompt": "p", "answer": "y" * 5000}])
    assert again["trajectories"][0]["turns"][0]["tool_calls"][0]["output"] == long  # format 3 cuts nothing
    assert again["trajectories"][0]["row"]["answer"] == "y" * 5000
    page = render_html(again)
    assert "END" not in page and "[9003 chars; whole in the saved batch]" in page


def test_a_changed_tool_schema_is_refused(trained, saved):
    class Described(EchoTool):
        def schema(self):
            return {**SCHEMA, "function": {**SCHEMA["function"], "description": "Run Python 3.12."}}

    run = _run(tools=Described())
    with pytest.raises(ReplayRefused, match=r"tool schemas digest: \w+ \(saved\) vs \w+ \(current\)"):
        replay_batch(saved, trained[1].processing_class, run=run)
    assert replay_batch(saved, trained[1].processing_class, run=_run()).ok


# -- the stop reason, re-derived from the saved turns (--rewards) ---------------------------------------------------


def test_the_stop_reason_is_re_derived_from_the_turns_and_a_changed_rule_is_named_at_its_turn(trained, saved):
    tok = trained[1].processing_class
    report = replay_batch(saved, tok, run=_run(), rewards=True)
    assert report.ok and report.compared["stop_reason"] == 4, report.render()
    assert {t["stop_reason"] for t in saved["trajectories"]} == {"final_answer"}  # a tool call, then \boxed{}
    # The rules changed (max_turns 3 -> 1): every trajectory now ends after its tool call, at turn 0.
    found = [
        d
        for d in replay_batch(saved, tok, run=_run(rollout_kwargs={"max_turns": 1}), rewards=True).differences
        if d.check == "stop_reason"
    ]
    assert [(d.trajectory, d.turn, d.saved, d.current) for d in found] == [
        (i, 0, "another turn", "max_turns") for i in range(4)
    ]
    # A saved stop reason that its turns do not give (negative control of the comparison itself).
    damaged = copy.deepcopy(saved)
    damaged["trajectories"][2]["stop_reason"] = "no_tool_call"
    [d] = [d for d in replay_batch(damaged, tok, run=_run(), rewards=True).differences if d.check == "stop_reason"]
    assert (d.trajectory, d.turn, d.saved, d.current) == (2, 1, "no_tool_call", "final_answer"), d.line()


# -- versions of every plugin, and the hook a tool set fills (an MCP server's name and version) ---------------------


def test_a_tool_reports_the_versions_of_what_it_runs_on_and_the_replay_refuses_when_they_moved(trained, saved):
    from trl_plugins.protocols import PluginDeclarationError
    from trl_plugins.run.version import plugin_version, plugin_versions, run_version

    class Served(EchoTool):
        server = "time-server 1.0"

        def versions(self):
            return {"server/time": self.server}

    tool = Served()
    assert plugin_versions("tool/code_interpreter", tool) == {
        "tool/code_interpreter": "1",
        "tool/code_interpreter/server/time": "time-server 1.0",
    }
    run = _run(tools=tool)
    run.bind_tokenizer(trained[1].processing_class)
    version = run_version(
        tokenizer_digest="t",
        tool_schemas=[SCHEMA],
        model=trained[1].model,
        sampler="hf_generate",
        tools=run.tools,
        rollout=run.rollout,
    )
    assert version.plugin_versions["tool/code_interpreter/server/time"] == "time-server 1.0"
    assert "rollout/test_batch_replay:ScoredScriptRollout" in version.plugin_versions
    # The saved batch knew no server: a part that appeared is a change; the tools' check refuses, saying which.
    with pytest.raises(
        ReplayRefused,
        match=r"tool/code_interpreter/server/time version: absent \(saved\) vs "
        r"time-server 1.0 \(current\): the tool changed",
    ):
        replay_batch(saved, trained[1].processing_class, run=run, tools=True)
    moved = copy.deepcopy(saved)
    moved["version"]["plugin_versions"]["tool/code_interpreter/server/time"] = "time-server 0.9"
    with pytest.raises(ReplayRefused, match=r"server/time version: time-server 0.9 \(saved\) vs time-server 1.0"):
        replay_batch(moved, trained[1].processing_class, run=run, tools=True)
    tool.server = "time-server 0.9"
    assert replay_batch(moved, trained[1].processing_class, run=run, tools=True).ok
    unrecorded = copy.deepcopy(saved)  # a batch saved before the tool's version was recorded: nothing to compare
    del unrecorded["version"]["plugin_versions"]["tool/code_interpreter"]
    assert replay_batch(unrecorded, trained[1].processing_class, run=run, tools=True).ok

    # versions() is read after start_up(): a tool set learns its servers' versions when it connects.
    class Connecting(Served):
        server = None

        def start_up(self):
            self.server = "time-server 0.9"
            return "connected"

    assert replay_batch(moved, trained[1].processing_class, run=_run(tools=Connecting()), tools=True).ok
    tool.versions = lambda: ["time-server 1.0"]  # not a mapping
    with pytest.raises(PluginDeclarationError, match=r"tool 'code_interpreter' declares versions"):
        plugin_versions("tool/code_interpreter", run.tools["code_interpreter"])
    # A plugin of an installed distribution that declares no version gets the distribution's.
    from importlib import metadata

    assert plugin_version(MultiTurnRollout()) == f"trl-plugins {metadata.version('trl-plugins')}"


# -- --resample: the seeded turns drawn again ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampled():
    """A batch really sampled by HF generate from a tiny random model (seeded, temperature 1), saved and read back,
    with the model, tokenizer and run that sampled it."""
    from trl_plugins.pipeline.batch import rollout_rows
    from trl_plugins.rollout import HFGenerationBackend
    from trl_plugins.tiny import build_tiny_model
    from trl_plugins.trainers.callbacks import chat_settings
    from trl_plugins.viewer import make_batch

    tok = build_tokenizer("qwen2_5")
    torch.manual_seed(0)
    model = build_tiny_model(tok)
    run = _run(
        rollout="multi_turn", rollout_kwargs={"max_turns": 2, "max_assistant_tokens": 6, "max_trajectory_tokens": 600}
    )
    chat = run.bind_tokenizer(tok)
    run.bind_version(model)
    backend = HFGenerationBackend(model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids)
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(2)]
    result = rollout_rows(run, backend, rows, group_size=2, seed=7)
    batch = make_batch(
        result.trajectories,
        [],
        tok,
        rows=rows,
        version=run.version,
        tool_schemas=chat.tools,
        chat_settings=chat_settings(run),
    )
    return model, tok, chat, json.loads(json.dumps(batch))


def test_resampling_a_batch_with_its_own_weights_draws_every_token_again(sampled):
    model, tok, _, batch = sampled
    assert all(t["seed"] is not None for e in batch["trajectories"] for t in e["turns"])
    report = replay_batch(batch, tok, model=model, model_step=0, resample=True)
    assert report.ok and report.compared["resample"] == 4, report.render()


def test_a_turn_drawn_from_another_seed_is_named_at_its_first_differing_token(sampled):
    from trl_plugins.rollout import HFGenerationBackend

    model, tok, chat, batch = sampled
    damaged = copy.deepcopy(batch)
    turn = damaged["trajectories"][1]["turns"][0]
    turn["seed"] += 1
    ids = damaged["trajectories"][1]["tokens"]["ids"]
    prompt, completion = ids[: turn["completion_start"]], ids[turn["completion_start"] : turn["completion_end"]]
    (other,) = HFGenerationBackend(model, pad_token_id=tok.pad_token_id, stop_token_ids=chat.stop_token_ids).generate(
        [prompt], [len(completion)], seeds=[turn["seed"]]
    )
    k = next(j for j, (a, b) in enumerate(zip(completion, other.token_ids + [None] * len(completion))) if a != b)
    report = replay_batch(damaged, tok, model=model, model_step=0, resample=True)
    [found] = [d for d in report.differences if d.check == "resample"]
    assert (found.trajectory, found.turn, found.token) == (1, 0, len(prompt) + k), found.line()
    assert found.saved == repr(tok.decode([completion[k]])) and found.current != found.saved


def test_a_batch_that_cannot_be_resampled_says_what_it_lacks_per_trajectory(sampled):
    model, tok, _, batch = sampled
    unseeded = copy.deepcopy(batch)
    for t in unseeded["trajectories"][0]["turns"]:
        t["seed"] = None
    report = replay_batch(unseeded, tok, model=model, model_step=0, resample=True)
    assert (
        report.compared["resample"] == 3
        and "trajectory 0 not resampled: no sampling seed was saved for turn(s) [0]" in report.render()
    )
    vllm = copy.deepcopy(batch)
    vllm["version"]["sampler"] = "vllm_server"
    with pytest.raises(
        ReplayRefused,
        match=r"(?s)no trajectory of this batch can be regenerated.*trajectory 3: it was "
        r"sampled by vllm_server, whose seeded draws are made inside the vLLM engine",
    ):
        replay_batch(vllm, tok, model=model, model_step=0, resample=True)
    with pytest.raises(ValueError, match="resample=True regenerates the turns with the weights"):
        replay_batch(batch, tok, resample=True)
