"""The ``reward_model`` reward component on a tiny local ``Qwen2ForSequenceClassification``: its values are TRL's
(the chat-rendered conversation, right-padded, ``logits[:, 0]`` at the last non-pad token), batching and the batch's
padding do not change them, it passes the reward contract (pickles without its model), and bad settings are refused
naming what to set. The 2-rank equality is in tests/test_distributed.py (the real-steps launch)."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.reward_model import save_reward_model
from trl_plugins.contracts import check_reward_contract, make_trajectory
from trl_plugins.protocols import as_reward
from trl_plugins.rewards.reward_model import RewardModelReward
from trl_plugins.types import StopReason, ToolCall

ROW = {"prompt": "What is 6 * 7?", "answer": "42"}
ANSWERS = ["The answer is \\boxed{42}.", "7", "", "Let me think step by step: 6 * 7 = 42, so \\boxed{42}<|im_end|>"]


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory) -> str:
    return save_reward_model(tmp_path_factory.mktemp("rm"))


def answered(text: str, seed: int = 0, tool_output: str | None = None):
    traj = make_trajectory(random.Random(seed), num_turns=2 if tool_output is not None else 1)
    if tool_output is not None:
        traj.turns[0].text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
        traj.turns[0].tool_calls = [ToolCall("python", {"code": "print(6 * 7)"}, output=tool_output, ok=True)]
    traj.turns[-1].text = text
    return traj


def trl_values(folder: str, conversations: list[list[dict]], max_length: int | None = None) -> list[float]:
    """TRL's GRPOTrainer with a reward model: render, tokenize right-padded without special tokens, ``logits[:, 0]``
    (``max_length``: the last tokens only, our documented cut)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts = [tok.apply_chat_template(c, tokenize=False) for c in conversations]
    inputs = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    if max_length is not None:
        ids = [x[-max_length:] for x in tok(texts, add_special_tokens=False)["input_ids"]]
        inputs = tok.pad({"input_ids": ids}, padding=True, padding_side="right", return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


def final_answer_conversation(text: str) -> list[dict]:
    return [
        {"role": "user", "content": ROW["prompt"]},
        {"role": "assistant", "content": text.removesuffix("<|im_end|>")},
    ]


def test_values_are_trls_and_do_not_depend_on_the_batch(rm_folder):
    trajs = [answered(a, seed=i) for i, a in enumerate(ANSWERS)]
    expected = trl_values(rm_folder, [final_answer_conversation(a) for a in ANSWERS])
    batched = RewardModelReward(model=rm_folder, batch_size=3).score_batch(trajs, [ROW] * len(trajs))
    one_by_one = [RewardModelReward(model=rm_folder, batch_size=1)(t, ROW) for t in trajs]
    assert batched == pytest.approx(expected, abs=1e-5)
    assert one_by_one == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 1e-3  # the answers give different values: the comparison can fail
    # The prompt as chat messages is the same conversation.
    messages_row = {"prompt": [{"role": "user", "content": ROW["prompt"]}]}
    assert RewardModelReward(model=rm_folder)(trajs[0], messages_row) == pytest.approx(expected[0], abs=1e-6)


def test_padding_is_on_the_right_and_the_last_real_token_is_pooled(rm_folder):
    # Negative control: read at the last position of a right-padded row (a pad token), the value is another one; the
    # model pools the last non-pad token, which is why the padded batch above equals one at a time.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_folder)
    model = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    texts = [tok.apply_chat_template(final_answer_conversation(a), tokenize=False) for a in ANSWERS[:2]]
    batch = tok(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    short = int(batch["attention_mask"].sum(1).argmin())
    assert batch["attention_mask"][short, -1] == 0  # the shorter row is padded at its end
    with torch.no_grad():
        per_token = model.score(model.model(**batch).last_hidden_state)[..., 0]
        pooled = model(**batch).logits[:, 0]
    last_real = int(batch["attention_mask"][short].sum()) - 1
    assert pooled[short] == pytest.approx(per_token[short, last_real].item(), abs=1e-6)
    assert abs(pooled[short] - per_token[short, -1]) > 1e-3
    mine = RewardModelReward(model=rm_folder)(answered(ANSWERS[short], seed=short), ROW)
    assert mine == pytest.approx(pooled[short].item(), abs=1e-5)


def test_max_length_keeps_the_end(rm_folder):
    traj = answered(ANSWERS[3])
    component = RewardModelReward(model=rm_folder, max_length=12)
    value = component(traj, ROW)
    assert value == pytest.approx(trl_values(rm_folder, [final_answer_conversation(ANSWERS[3])], 12)[0], abs=1e-5)
    assert value != pytest.approx(RewardModelReward(model=rm_folder)(traj, ROW), abs=1e-4)
    metrics = component.step_metrics()
    assert metrics["reward_model/sequences"] == 1 and metrics["reward_model/tokens"] == 12
    assert metrics["reward_model/truncated"] == 1 and component.step_metrics()["reward_model/sequences"] == 0


def test_turns_show_tool_messages_or_the_text_form(rm_folder, tmp_path):
    from trl_plugins.rewards.judge import render_trajectory

    traj = answered("So \\boxed{42}.", tool_output="42\n")
    assistant_1 = traj.turns[0].text
    # qwen2_5's template takes tool messages.
    turns = [
        {"role": "user", "content": ROW["prompt"]},
        {"role": "assistant", "content": assistant_1},
        {"role": "tool", "content": "42\n"},
        {"role": "assistant", "content": "So \\boxed{42}."},
    ]
    value = RewardModelReward(model=rm_folder, show="turns")(traj, ROW)
    assert value == pytest.approx(trl_values(rm_folder, [turns])[0], abs=1e-5)
    # gemma's refuses any role but user/model alternating: the trajectory becomes one assistant message in text form.
    gemma = save_reward_model(tmp_path / "gemma", template="gemma")
    text = [
        {"role": "user", "content": ROW["prompt"]},
        {"role": "assistant", "content": render_trajectory(traj, "turns")},
    ]
    value = RewardModelReward(model=gemma, show="turns")(traj, ROW)
    assert value == pytest.approx(trl_values(gemma, [text])[0], abs=1e-5)


def test_under_zero3_the_model_is_loaded_whole(rm_folder, tmp_path):
    # In a child process (support.reward_model.zero3_child): a one-rank ZeRO-3 config partitions what transformers
    # builds; the component's replica is whole and its value the one without DeepSpeed.
    code = f"from support.reward_model import zero3_child; zero3_child({rm_folder!r}, {str(tmp_path / 'store')!r})"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "zero3 ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.parametrize("show", ["final_answer", "turns"])
def test_reward_contract(rm_folder, show):
    component = RewardModelReward(model=rm_folder, show=show)
    check_reward_contract(component)  # finite, deterministic, leaves its inputs alone, pickles
    copy = pickle.loads(pickle.dumps(component))
    assert len(pickle.dumps(component)) < 2000  # the loaded model is not in the pickle
    assert copy == component and copy(answered("7"), ROW) == component(answered("7"), ROW)
    assert component.versions()["model"].endswith(")")


def test_one_batched_call_from_the_trainer_and_a_row_without_its_prompt(rm_folder):
    from trl_plugins.pipeline.batch import score_trajectories

    trajs = [answered(a, seed=i) for i, a in enumerate(ANSWERS)]
    trajs[2].group_id = 1
    component = RewardModelReward(model=rm_folder)
    failures = score_trajectories([as_reward(component, "reward_model", 0.0)], trajs, [ROW, {"question": "?"}])
    assert failures == {"reward_model": 1}
    assert trajs[2].stop_reason == StopReason.VERIFIER_ERROR and "prompt_key" in trajs[2].error
    for i in (0, 1, 3):
        (scored,) = trajs[i].reward_components
        assert scored.weight == 0.0 and scored.value == pytest.approx(component(trajs[i], ROW), abs=1e-5)


def test_bad_settings_are_refused(rm_folder, tmp_path):
    with pytest.raises(ValueError, match=r"model='/nowhere/rm' is no folder with a config.json; set model"):
        RewardModelReward(model="/nowhere/rm")
    with pytest.raises(ValueError, match="label_index=1 is not one of its 1 label"):
        RewardModelReward(model=rm_folder, label_index=1)
    with pytest.raises(ValueError, match="batch_size=0 .* must be >= 1.*dtype='float64'"):
        RewardModelReward(model=rm_folder, batch_size=0, dtype="float64")
    # The policy's folder (a causal LM): AutoModelForSequenceClassification would load it with a random head.
    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    build_tiny_model(tok).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    with pytest.raises(ValueError, match=r"\['Qwen2ForCausalLM'\], not a ...ForSequenceClassification"):
        RewardModelReward(model=str(tmp_path / "lm"))
    # Its weights under a config that claims a classifier: refused when loaded, the head being missing.
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has no weights for .*score.weight.*; set model to a trained reward model"):
        RewardModelReward(model=str(tmp_path / "lm"))(answered("7"), ROW)
