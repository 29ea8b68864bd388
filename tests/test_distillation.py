"""On-policy distillation: the teacher's per-token signal (hand-computed), the opd estimator's weights, the datums'
teacher log-probs against a direct forward of the teacher, zero on prompt/tool/template tokens, and the start-up
refusals (no teacher, a teacher nothing reads, another tokenizer, a teacher that cannot load)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from support.trainer import TokenReward, tiny_config, tiny_dataset
from trl_plugins.algos import OnPolicyDistillationAdvantage, teacher_advantages
from trl_plugins.contracts import check_advantage_contract, make_trajectory
from trl_plugins.datum import build_datum
from trl_plugins.pipeline.batch import assign_advantages
from trl_plugins.protocols import as_advantage
from trl_plugins.tiny import build_tiny_model, build_tokenizer
from trl_plugins.types import AdvantageInput, TokenSource


def test_the_teacher_signal_is_the_negative_reverse_kl_estimate_per_action_token():
    behaviour = torch.tensor([[-1.0, -0.5, -2.0, -0.1, -3.0]])
    teacher = torch.tensor([[-0.2, -9.0, -1.0, -0.3, -0.5]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    out = teacher_advantages(behaviour, teacher, mask)
    assert out[0].tolist() == pytest.approx([0.8, 0.0, 1.0, -0.2, 0.0])
    # Discounted over the following action tokens of the row: gamma per action token, other tokens skipped.
    out = teacher_advantages(behaviour, teacher, mask, discount=0.5)
    assert out[0].tolist() == pytest.approx([0.8 + 0.5 * (1.0 + 0.5 * -0.2), 0.0, 1.0 + 0.5 * -0.2, -0.2, 0.0])


def test_opd_weighs_the_group_advantage_and_the_teacher_signal():
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    mask = (torch.rand(4, 6, generator=g) < 0.7).double()
    behaviour, teacher = -torch.rand(4, 6, generator=g).double(), -torch.rand(4, 6, generator=g).double() * 2
    inp = AdvantageInput(
        rewards=rewards,
        group_ids=groups,
        action_mask=mask,
        behaviour_logprobs=behaviour * mask,
        teacher_logprobs=teacher * mask,
    )
    est = OnPolicyDistillationAdvantage(coef=0.3, reward_weight=2.0)
    adv = est(inp).advantages
    group = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (0.5**0.5 + 1e-6)  # unbiased std of {1, 0}
    expected = (2.0 * group[:, None] + 0.3 * (teacher - behaviour)) * mask
    assert torch.allclose(adv, expected, atol=1e-6)
    metrics = est.step_metrics()
    kl = ((behaviour - teacher) * mask).sum() / mask.sum()
    assert metrics["teacher_kl"] == pytest.approx(float(kl))
    assert est.step_metrics() == {}  # read once per step
    # Its other settings reach their parts: the discount the teacher's signal, scale_by_std the group advantage.
    est = OnPolicyDistillationAdvantage(coef=0.3, reward_weight=2.0, discount=0.5, scale_by_std=False)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)[:, None] * mask
    discounted = teacher_advantages(behaviour * mask, teacher * mask, mask, discount=0.5)
    assert torch.allclose(est(inp).advantages, 2.0 * centred + 0.3 * discounted, atol=1e-9)
    assert not torch.allclose(discounted, (teacher - behaviour) * mask)
    with pytest.raises(ValueError, match="discount is a factor in"):
        OnPolicyDistillationAdvantage(discount=1.5)
    # Declarations follow the weights: plain OPD compares no group; coef 0 (plain RL) asks no teacher forward.
    plugin = as_advantage(OnPolicyDistillationAdvantage(reward_weight=0.0), "opd")
    assert plugin.needs_teacher_logprobs and not plugin.needs_groups
    plugin = as_advantage(OnPolicyDistillationAdvantage(coef=0.0), "opd")
    assert not plugin.needs_teacher_logprobs and plugin.needs_groups
    with pytest.raises(ValueError, match="not both 0"):
        OnPolicyDistillationAdvantage(coef=0.0, reward_weight=0.0)
    check_advantage_contract("opd")


def test_prompt_tool_output_and_template_tokens_carry_exactly_zero():
    rng = random.Random(3)
    trajs = [make_trajectory(rng, num_turns=3, group_id=0, sample_index=i) for i in range(2)]
    datums = [build_datum(t) for t in trajs]
    for i, d in enumerate(datums):
        d.trajectory_index = i
        d.teacher_logprobs = [(-0.25 * (k % 5)) if m else 0.0 for k, m in enumerate(d.action_mask)]
    est = as_advantage(OnPolicyDistillationAdvantage(reward_weight=0.0), "opd")
    assign_advantages(est, trajs, datums)
    for d in datums:
        assert {TokenSource.PROMPT, TokenSource.OBSERVATION, TokenSource.GLUE} <= set(d.sources) and any(d.action_mask)
        for a, m, b, t in zip(d.advantages, d.action_mask, d.behaviour_logprobs, d.teacher_logprobs):
            assert a == (pytest.approx(t - b) if m else 0.0)


def _save_teacher(tmp_path, tok, seed=1):
    path = tmp_path / "teacher"
    build_tiny_model(tok, seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _trainer(tmp_path, tok, **overrides):
    from trl_plugins.trainers import MultiTurnGRPOTrainer

    torch.manual_seed(0)
    return MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(tmp_path / "out", **overrides),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
    )


def test_a_distilled_run_trains_on_the_teachers_logprobs_of_the_sampled_tokens(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer("qwen2_5")
    teacher_path = _save_teacher(tmp_path, tok)
    trainer = _trainer(
        tmp_path,
        tok,
        teacher_model_name_or_path=teacher_path,
        advantage="opd",
        advantage_kwargs={"reward_weight": 0.0},
        temperature=0.7,
        viewer_steps=2,
        viewer_trajectories=2,
    )
    trainer.train()
    records = [
        json.loads(line)
        for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        if "reward/total" in line
    ]
    assert len(records) == 2 and all(r["timing/teacher_forward_s"] > 0 for r in records)
    # Another model (seed 1; near-uniform as tiny random models are): far more than the float noise (~1e-6) of one.
    assert all(r["advantage/teacher_kl"] > 0.01 for r in records) and records[0]["train/update_skipped"] == 0.0
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    datums = trainer.last_batch.datums
    assert datums
    for d in datums:
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([d.input_ids])).logits[0].double() / 0.7
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_ids)[:, None])[:, 0]
        for k, m in enumerate(d.action_mask):
            if m:
                assert d.teacher_logprobs[k] == pytest.approx(float(lp[k]), abs=2e-4)
                assert d.advantages[k] == pytest.approx(d.teacher_logprobs[k] - d.behaviour_logprobs[k], abs=1e-6)
            else:
                assert d.teacher_logprobs[k] == 0.0 and d.advantages[k] == 0.0
    # The saved batch keeps them and the viewer's page shows them on hover.
    from trl_plugins.viewer import datum_from_dict, load_batch

    out = tmp_path / "out" / "trajectories"
    saved = load_batch(out / "step-000002.json")["trajectories"][0]["datum"]
    by_index = {d.trajectory_index: d for d in datums}
    assert datum_from_dict(saved).teacher_logprobs == by_index[saved["trajectory_index"]].teacher_logprobs
    page = (out / "step-000002.html").read_text()
    assert "data-teacher=" in page and "teacher log-prob" in page
    # The run's version names the teacher (its path and weights), so a saved batch names where its log-probs came from.
    from trl_plugins.rollout.weights import weights_digest

    assert trainer.run.version.plugin_versions["teacher"] == f"{teacher_path} weights {weights_digest(teacher)}"
    # The teacher is frozen: its weights after training are the saved ones.
    saved = dict(teacher.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in trainer._teacher.named_parameters())
    # The replay command re-derives the teacher's log-probs of the saved batch with the teacher its version names.
    from trl_plugins.replay.cli import main as replay

    batch_file = str(out / "step-000002.json")
    assert replay([batch_file, "--teacher"]) == 0
    report = capsys.readouterr().out
    assert f"teacher: {len(load_batch(batch_file)['trajectories'])} trajectories compared, all equal" in report
    # Another teacher is refused by its weights digest; a saved log-prob changed is named, token and both values.
    other = _save_teacher(tmp_path / "other", tok, seed=2)
    assert replay([batch_file, "--teacher", other]) == 2
    assert "not the one the batch was distilled from: teacher weights digest" in capsys.readouterr().err
    tampered = load_batch(batch_file)
    entry = tampered["trajectories"][0]["datum"]
    k = entry["action_mask"].index(1)
    entry["teacher_logprobs"][k] += 0.01
    (tmp_path / "tampered").mkdir()
    (tmp_path / "tampered" / "step.json").write_text(json.dumps(tampered))
    code = replay([str(tmp_path / "tampered" / "step.json"), "--teacher", "--run", str(tmp_path / "out")])
    assert code == 1 and "[teacher] trajectory 0" in capsys.readouterr().out


def test_opd_without_a_teacher_and_a_teacher_nothing_reads_are_refused_naming_the_setting(tmp_path):
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match="set teacher_model_name_or_path"):
        resolve_run(tiny_config(tmp_path, advantage="opd"), reward_components={"length": TokenReward()})
    with pytest.raises(ValueError, match="read by nothing.*advantage='opd'"):
        resolve_run(
            tiny_config(tmp_path, teacher_model_name_or_path=str(tmp_path)), reward_components={"length": TokenReward()}
        )
    with pytest.raises(ValueError, match="teacher_model_name_or_path is empty"):
        tiny_config(tmp_path, teacher_model_name_or_path=" ")
    with pytest.raises(ValueError, match="teacher_request_timeout_s=5.0 configure distillation's teacher.*has none"):
        tiny_config(tmp_path, teacher_request_timeout_s=5.0)


def test_a_teacher_with_another_tokenizer_or_none_at_all_is_refused_at_start_up(tmp_path):
    from trl_plugins.trainers.teacher import tokenizer_difference

    tok = build_tokenizer("qwen2_5")
    other_template = build_tokenizer("llama3")
    assert tokenizer_difference(tok, other_template) is not None
    # Same vocabulary, a template that renders a tool call differently: found token by token, with both texts.
    edited = build_tokenizer("qwen2_5")
    edited.chat_template = edited.chat_template.replace("<tool_call>\\n", "<tool_call>\\n\\n")
    assert edited.chat_template != tok.chat_template
    difference = tokenizer_difference(tok, edited)
    assert "render a conversation with a tool call differently from token" in difference
    bigger = build_tokenizer("qwen2_5")
    bigger.add_tokens(["<extra>"])
    assert "vocabularies differ in size" in tokenizer_difference(tok, bigger)
    assert tokenizer_difference(tok, build_tokenizer("qwen2_5")) is None

    path = tmp_path / "teacher-llama"
    build_tiny_model(other_template, seed=1).save_pretrained(path)
    other_template.save_pretrained(path)
    kwargs = dict(teacher_model_name_or_path=str(path), advantage="opd", advantage_kwargs={"reward_weight": 0.0})
    with pytest.raises(ValueError, match="does not share the student's tokenizer.*cross-tokenizer"):
        _trainer(tmp_path, tok, **kwargs)
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        _trainer(tmp_path, tok, **{**kwargs, "teacher_model_name_or_path": str(tmp_path / "missing")})


# -- the generalised JSD loss (policy_loss 'jsd') against TRL 1.16's DistillationTrainer --------------------------------


def _jsd_setup(tiny_model_factory, *, n=6, seed=5, shared=False):
    from conftest import tiny_qwen2  # noqa: F401  (the student's build; the teacher is the same shape, reseeded)

    student = tiny_model_factory(torch.float32)
    teacher = tiny_model_factory(torch.float32)
    with torch.no_grad():  # another model, far enough from the student that every divergence is well above noise
        g = torch.Generator().manual_seed(11)
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 200) for _ in range(9)] if shared else None
    datums = [
        build_datum(
            make_trajectory(rng, num_turns=rng.randint(2, 3), prompt=prompt),
            advantage=rng.choice([-1.0, 0.0, 1.0]),
            trajectory_index=i,
        )
        for i in range(n)
    ]
    return student, teacher, datums


def _jsd_update(student, teacher, datums, loss, **settings):
    from accelerate import Accelerator

    from support.settings import update_settings
    from trl_plugins.trainers.update import policy_update

    config = update_settings(
        **{
            "aggregation": "token_mean",
            "packer": "optimal",
            "max_items_per_micro_batch": 2,
            "max_padded_tokens_per_micro_batch": 400,
            "rebalance_ranks": False,
            "norm_length": None,
            "temperature": 1.0,
            "max_grad_norm": None,
            "drop_zero_advantage": True,
            "padding_free": False,
            **settings,
        }
    )
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(student, optimizer)
    result = policy_update(
        accelerator, model, optimizer, datums, loss, config, pad_token_id=0, step_optimizer=False, teacher=teacher
    )
    return result, {n: p.grad.clone() for n, p in student.named_parameters()}


def _trl_jsd(student, teacher, datums, *, beta, temperature):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from trl_plugins.datum import collate

    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    student.zero_grad(set_to_none=True)
    hidden = student.model(input_ids=full.input_ids, attention_mask=full.attention_mask).last_hidden_state
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=full.input_ids, attention_mask=full.attention_mask).last_hidden_state
    mask = full.action_mask  # TRL's completion_mask x tool_mask: the sampled tokens (see the test below)
    loss, _, _ = _chunked_divergence_loss(
        hidden,
        teacher_hidden,
        student.lm_head.weight,
        teacher.lm_head.weight,
        mask,
        beta,
        num_items_in_batch=int(mask.sum()),
        temperature=temperature,
    )
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in student.named_parameters()}


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_jsd_loss_and_its_gradient_equal_trls_chunked_divergence_loss(tiny_model_factory, beta, temperature):
    import copy

    from trl_plugins.algos import GeneralizedJSDLoss

    student, teacher, datums = _jsd_setup(tiny_model_factory)
    trl_student = copy.deepcopy(student)
    # drop_zero_advantage is on: a datum with advantage 0 still carries its divergence, so it is forwarded.
    result, grads = _jsd_update(student, teacher, datums, GeneralizedJSDLoss(beta=beta), temperature=temperature)
    want, want_grads = _trl_jsd(trl_student, teacher, datums, beta=beta, temperature=temperature)
    assert want > 1e-3 and result.num_forwarded == len(datums)
    assert result.loss == pytest.approx(want, rel=1e-5)
    for name, g in want_grads.items():
        scale = float(g.abs().max())
        assert scale > 0 or "teacher" in name
        assert float((grads[name] - g).abs().max()) <= 1e-5 * max(scale, 1e-6), name


@pytest.mark.parametrize("layout", ["padding_free", "shared_prefix"])
def test_the_jsd_loss_is_the_same_in_every_micro_batch_layout_and_aggregation(tiny_model_factory, layout):
    import copy

    from trl_plugins.algos import GeneralizedJSDLoss, aggregate
    from trl_plugins.datum import collate
    from trl_plugins.modeling import micro_batch_logprobs_and_divergence

    student, teacher, datums = _jsd_setup(tiny_model_factory, shared=layout == "shared_prefix")
    padded = copy.deepcopy(student)
    loss = GeneralizedJSDLoss(beta=0.5)
    # Three rows a micro-batch: a packed row's positions then differ from the padded ones from the third row on.
    settings = {"temperature": 0.7, "aggregation": "seq_mean_token_mean", "max_items_per_micro_batch": 3, layout: True}
    result, grads = _jsd_update(student, teacher, datums, loss, **settings)
    assert loss.step_metrics()["teacher_divergence"] > 1e-3
    want, want_grads = _jsd_update(padded, teacher, datums, loss, **{**settings, layout: False})
    assert result.loss == pytest.approx(want.loss, rel=1e-5)
    for name, g in want_grads.items():
        assert float((grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-6), name
    # By hand: the per-token divergence (exactly 0 on prompt, tool-output and glue tokens), averaged per sequence.
    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    with torch.no_grad():
        _, _, per_token = micro_batch_logprobs_and_divergence(
            padded, teacher, full, "cpu", beta=0.5, temperature=0.7, needed=full.action_mask
        )
    action = full.action_mask.bool()
    assert bool((per_token[action] > 0).all()) and bool((per_token[~action] == 0).all())
    by_hand = aggregate(per_token, full.action_mask, "seq_mean_token_mean", num_tokens=1, num_sequences=len(datums))
    assert want.loss == pytest.approx(float(by_hand), rel=1e-5)


def test_the_jsd_loss_adds_the_ppo_term_by_its_weight_and_is_refused_where_it_cannot_run(tiny_model_factory, tmp_path):
    import copy

    from trl_plugins.algos import GeneralizedJSDLoss, PPOClipLoss
    from trl_plugins.protocols import as_policy_loss
    from trl_plugins.run import resolve_run

    student, teacher, datums = _jsd_setup(tiny_model_factory)
    copies = [copy.deepcopy(student) for _ in range(2)]
    both, grads = _jsd_update(student, teacher, datums, GeneralizedJSDLoss(rl_weight=0.5))
    jsd, jsd_grads = _jsd_update(copies[0], teacher, datums, GeneralizedJSDLoss())
    ppo, ppo_grads = _jsd_update(copies[1], teacher, datums, PPOClipLoss())
    assert both.loss == pytest.approx(jsd.loss + 0.5 * ppo.loss, rel=1e-5, abs=1e-7)
    for name, g in grads.items():
        want = jsd_grads[name] + 0.5 * ppo_grads[name]
        assert float((g - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1e-6), name
    # Declarations: the divergence's beta; a zero-advantage datum still counts.
    plugin = as_policy_loss(GeneralizedJSDLoss(beta=0.25), "jsd")
    assert plugin.teacher_divergence == 0.25 and plugin.per_token_terms
    assert as_policy_loss(PPOClipLoss(), "ppo_clip").teacher_divergence is None
    with pytest.raises(ValueError, match="0 <= beta <= 1"):
        GeneralizedJSDLoss(beta=1.5)
    rewards = {"length": TokenReward()}
    with pytest.raises(ValueError, match="policy_loss 'jsd' distils.*set teacher_model_name_or_path"):
        resolve_run(tiny_config(tmp_path, policy_loss="jsd"), reward_components=rewards)
    with pytest.raises(ValueError, match="read by nothing.*policy_loss='jsd'"):
        resolve_run(tiny_config(tmp_path, teacher_model_name_or_path=str(tmp_path)), reward_components=rewards)
    with pytest.raises(ValueError, match="does not run under sequence parallelism yet: set sequence_parallel_size=1"):
        resolve_run(
            tiny_config(
                tmp_path, policy_loss="jsd", teacher_model_name_or_path=str(tmp_path), sequence_parallel_size=2
            ),
            reward_components=rewards,
        )


class _LocalTeacherAsServer:
    """A stand-in for a server teacher's client (not a server: tests/test_vllm_real.py asks the real engine): a local
    teacher's log-probs of each sequence's tokens and its top-k at each position, as vLLM's prompt log-probs give."""

    def __init__(self, teacher):
        self.teacher = teacher

    def sequence_top_logprobs(self, sequences, *, top_k, what=""):
        out = []
        for seq in sequences:
            with torch.no_grad():
                lp = torch.log_softmax(self.teacher(input_ids=torch.tensor([seq[:-1]])).logits[0].float(), -1)
            top = lp.topk(top_k, -1) if top_k else None
            actual = lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
            out.append(
                (actual, [list(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)] if top_k else [])
            )
        return out


def _trl_server_jsd(student, datums, *, beta, top_k, tail):
    # TRL's ServerDistillationTrainer loss on the same student, with the teacher's answers the datums carry.
    import types
    import warnings

    from trl_plugins.datum import collate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.server_distillation.server_distillation_trainer import ServerDistillationTrainer as S

    full = collate(datums, list(range(len(datums))), pad_token_id=0)
    rows, width = full.target_ids.shape
    top_ids, top_lps = torch.zeros(rows, width, top_k, dtype=torch.long), torch.zeros(rows, width, top_k)
    actual = torch.zeros(rows, width)
    for b, d in enumerate(datums):
        actual[b, : d.num_tokens] = torch.tensor(d.teacher_logprobs)
        for t, top in enumerate(d.teacher_top):
            for k, (tok, lp) in enumerate(top):
                top_ids[b, t, k], top_lps[b, t, k] = tok, lp
    labels = torch.where(full.action_mask.bool(), full.target_ids, torch.full_like(full.target_ids, -100))
    student.zero_grad(set_to_none=True)
    logp = torch.log_softmax(student(input_ids=full.input_ids, attention_mask=full.attention_mask).logits, -1)
    trl = types.SimpleNamespace(
        beta=beta,
        loss_add_tail=tail,
        _reduce_divergence_loss=S._reduce_divergence_loss,
        reverse_kl_top_1_mode="sampled",
    )
    if beta == 0.0:
        loss = S._compute_server_forward_kl_loss(
            trl, {"topk_logprobs": top_lps, "topk_token_ids": top_ids}, logp, labels
        )
    else:
        trl._get_reverse_kl_top_1_tokens = lambda scores, tokens: tokens
        loss = S._compute_sparse_top_1_divergence_loss(
            trl, logp, top_ids[..., 0], top_lps[..., 0], full.target_ids, actual, labels
        )
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in student.named_parameters()}


@pytest.mark.parametrize(
    ("beta", "top_k", "tail"),
    [(0.0, 1, True), (0.0, 5, True), (0.0, 5, False), (0.5, 1, True), (0.5, 1, False), (1.0, 1, True)],
)
def test_a_server_teachers_divergence_and_its_gradient_equal_trls_server_distillation_loss(
    tiny_model_factory, beta, top_k, tail
):
    import copy

    from accelerate import Accelerator

    from support.settings import update_settings
    from trl_plugins.algos import GeneralizedJSDLoss
    from trl_plugins.trainers.update import teacher_logprobs

    student, teacher, datums = _jsd_setup(tiny_model_factory)
    server = _LocalTeacherAsServer(teacher)
    teacher_logprobs(Accelerator(cpu=True), server, datums, update_settings(), pad_token_id=0, top_k=top_k)
    for d in datums:  # the top tokens at the action positions only, best first
        assert [len(t) for t in d.teacher_top] == [top_k * m for m in d.action_mask]
        assert all(a[1] >= b[1] for t in d.teacher_top for a, b in zip(t, t[1:]))
    trl_student = copy.deepcopy(student)
    loss = GeneralizedJSDLoss(beta=beta, top_k=top_k if top_k > 1 else None, tail=tail)
    result, grads = _jsd_update(student, server, datums, loss)
    want, want_grads = _trl_server_jsd(trl_student, datums, beta=beta, top_k=top_k, tail=tail)
    assert want > 1e-4 and result.num_forwarded == len(datums)
    assert result.loss == pytest.approx(want, rel=1e-5)
    for name, g in want_grads.items():
        assert float((grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-6), name
    if (beta, top_k, tail) == (0.5, 1, True):  # the other layouts give the same update
        for layout in ("padding_free", "shared_prefix"):
            other, other_grads = _jsd_update(copy.deepcopy(trl_student), server, datums, loss, **{layout: True})
            assert other.loss == pytest.approx(want, rel=1e-5), layout
            for name, g in want_grads.items():
                assert float((other_grads[name] - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-6), name


def test_a_server_teachers_support_and_settings_are_trls_and_refused_where_they_mean_nothing(tmp_path):
    from trl_plugins.algos import GeneralizedJSDLoss
    from trl_plugins.datum import collate
    from trl_plugins.run import resolve_run
    from trl_plugins.trainers.update import server_support

    datum = build_datum(make_trajectory(random.Random(0), num_turns=2), advantage=1.0)
    on = [t for t, m in enumerate(datum.action_mask) if m]
    datum.teacher_logprobs = [-0.5 if m else 0.0 for m in datum.action_mask]
    datum.teacher_top = [[(7, -0.1), (9, -2.5)] if m else [] for m in datum.action_mask]
    datum.teacher_top[on[0]] = [(datum.target_ids[on[0]], -0.5), (9, -2.5)]  # the sampled token is the teacher's top
    mb = collate([datum], [0], pad_token_id=0)
    forward = server_support([datum], mb, beta=0.0, top_k=2)
    assert forward["support_ids"][0, on[1]].tolist() == [7, 9] and bool(forward["support_mask"][0, on].all())
    assert not bool(forward["support_mask"][0, [t for t, m in enumerate(datum.action_mask) if not m]].any())
    reverse = server_support([datum], mb, beta=1.0, top_k=1)
    assert reverse["support_ids"][0, on, 0].tolist() == [datum.target_ids[t] for t in on]
    assert reverse["teacher_support"][0, on, 0].tolist() == [-0.5] * len(on)
    mixed = server_support([datum], mb, beta=0.5, top_k=1)
    assert mixed["support_ids"][0, on[1]].tolist() == [7, datum.target_ids[on[1]]]
    assert mixed["support_mask"][0, on[1]].tolist() == [True, datum.target_ids[on[1]] != 7]
    assert mixed["support_mask"][0, on[0]].tolist() == [True, False]  # the same token once
    datum.teacher_top = None
    with pytest.raises(ValueError, match="has no server teacher's top tokens"):
        server_support([datum], mb, beta=0.0, top_k=2)
    # Settings: as TRL, top_k > 1 only at beta 0; no one-token support renormalised (always 0); none with a local teacher.
    with pytest.raises(ValueError, match="top_k=4 needs beta=0"):
        GeneralizedJSDLoss(beta=0.5, top_k=4)
    with pytest.raises(ValueError, match="renormalises over a one-token support.*always 0"):
        GeneralizedJSDLoss(beta=1.0, tail=False)
    with pytest.raises(ValueError, match="top_k >= 1"):
        GeneralizedJSDLoss(beta=0.0, top_k=0)
    with pytest.raises(ValueError, match="sets top_k=4, which only a server teacher reads.*drop them"):
        resolve_run(
            tiny_config(
                tmp_path,
                policy_loss="jsd",
                policy_loss_kwargs={"beta": 0.0, "top_k": 4},
                teacher_model_name_or_path=str(tmp_path),
            ),
            reward_components={"length": TokenReward()},
        )


def test_a_jsd_run_forwards_its_teacher_in_the_update_and_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    from trl_plugins.trainers.teacher import check_divergence_models

    tok = build_tokenizer("qwen2_5")
    trainer = _trainer(
        tmp_path,
        tok,
        teacher_model_name_or_path=_save_teacher(tmp_path, tok),
        policy_loss="jsd",
        policy_loss_kwargs={"beta": 0.5},
        temperature=0.7,
        max_steps=1,
    )
    trainer.train()
    (record,) = [
        json.loads(line)
        for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        if "reward/total" in line
    ]
    # The divergence is computed in the update's micro-batches: no teacher phase before it, no teacher log-probs.
    assert record["policy_loss/teacher_divergence"] > 0.01 and record["train/update_skipped"] == 0.0
    assert "timing/teacher_forward_s" not in record
    assert all(d.teacher_logprobs is None for d in trainer.last_batch.datums)
    # Where it does not run, refused at start-up naming what to use instead.
    student, teacher = trainer.accelerator.unwrap_model(trainer.model), trainer._teacher
    teacher.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="the teacher's logits are more than its output head's.*advantage='opd'"):
        check_divergence_models(trainer.run.policy_loss, student, teacher)
    teacher.config.final_logit_softcapping = None
    monkeypatch.setattr("transformers.integrations.deepspeed.is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="does not run under DeepSpeed ZeRO-3 yet: use DDP or ZeRO-2"):
        check_divergence_models(trainer.run.policy_loss, student, teacher)


def test_a_lora_student_distils_from_a_full_teacher(tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    teacher_path = _save_teacher(tmp_path, tok)
    torch.manual_seed(0)
    trainer = MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        tiny_config(
            tmp_path / "out",
            teacher_model_name_or_path=teacher_path,
            advantage="opd",
            advantage_kwargs={"reward_weight": 0.0},
            policy_loss="jsd",  # both signals: opd's per-token advantage in the PPO term, and the divergence
            policy_loss_kwargs={"rl_weight": 1.0},
            learning_rate=1e-2,
            max_steps=1,
        ),
        train_dataset=tiny_dataset(),
        processing_class=tok,
        reward_components={"length": TokenReward()},
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    student = trainer.accelerator.unwrap_model(trainer.model)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    trainer.train()
    (record,) = [
        json.loads(line)
        for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        if "reward/total" in line
    ]
    assert record["advantage/teacher_kl"] > 0.01 and record["policy_loss/teacher_divergence"] > 0.01
    # The teacher is the full model, not the student's base with its adapter off: its log-probs are its own.
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path).eval()
    d = next(d for d in trainer.last_batch.datums if any(d.action_mask))
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([d.input_ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(d.target_ids)[:, None])[:, 0]
    assert all(d.teacher_logprobs[k] == pytest.approx(float(lp[k]), abs=2e-4) for k, m in enumerate(d.action_mask) if m)
    # Only the adapter trained; the teacher and the student's base weights are as loaded.
    after = dict(student.named_parameters())
    changed = {n for n, p in after.items() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    saved = dict(teacher.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in trainer._teacher.named_parameters())


def test_a_server_teacher_without_prompt_logprobs_or_at_another_temperature_is_refused(tmp_path):
    # A fake OpenAI-compatible server (not vLLM: tests/test_vllm_real.py runs the real one) that lists a model and
    # tokenizes as the student does, but answers completions without prompt log-probs.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trl_plugins.run import resolve_run
    from trl_plugins.trainers.teacher import render_sample
    from trl_plugins.trainers.teacher_server import ServerTeacher, TeacherServerError

    tok = build_tokenizer("qwen2_5")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer(200, {"data": [{"id": "fake"}]} if self.path == "/v1/models" else {"error": "no"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                self._answer(200, {"tokens": tok(body["prompt"], add_special_tokens=False)["input_ids"]})
            else:
                self._answer(200, {"choices": [{"index": i, "text": "x"} for i in range(len(body["prompt"]))]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1"
    try:
        with pytest.raises(TeacherServerError, match="returned no prompt log-probs.*vLLM's prompt_logprobs"):
            ServerTeacher.connect(url, tokenizer=tok, sample=render_sample(tok, []), timeout_s=5)
    finally:
        server.shutdown()
    rewards = {"length": TokenReward()}
    with pytest.raises(ValueError, match="is a server, whose prompt log-probs are the untempered.*temperature=1.0"):
        tiny_config(tmp_path, teacher_model_name_or_path=url, advantage="opd", temperature=0.7)
    # jsd with a server teacher reads its top-k (tests above; against the real engine in tests/test_vllm_real.py).
    resolve_run(
        tiny_config(tmp_path, teacher_model_name_or_path=url, policy_loss="jsd", temperature=1.0),
        reward_components=rewards,
    )


def test_several_teachers_each_score_the_rows_their_route_field_names(tmp_path, capsys):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    paths = {"sums": _save_teacher(tmp_path / "a", tok, seed=1), "products": _save_teacher(tmp_path / "b", tok, seed=2)}
    rows = [
        {"prompt": f"What is {i} {'+' if i % 2 else '*'} {i}?", "source": "sums" if i % 2 else "products"}
        for i in range(4)
    ]
    config = dict(
        teacher_model_name_or_path=json.dumps(paths),
        teacher_route_field="source",
        advantage="opd",
        advantage_kwargs={"reward_weight": 0.0},
        max_steps=1,
        viewer_steps=1,
        viewer_trajectories=2,
    )

    def trainer(data, **overrides):
        torch.manual_seed(0)
        return MultiTurnGRPOTrainer(
            build_tiny_model(tok),
            tiny_config(tmp_path / "out", **{**config, **overrides}),
            train_dataset=Dataset.from_list(data),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )

    run = trainer(rows)
    run.train()
    teachers = {r: AutoModelForCausalLM.from_pretrained(p).eval() for r, p in paths.items()}
    batch = run.last_batch
    seen = set()
    for d in batch.datums:
        route = batch.rows[batch.trajectories[d.trajectory_index].group_id]["source"]
        seen.add(route)
        with torch.no_grad():
            lps = {
                r: torch.log_softmax(t(input_ids=torch.tensor([d.input_ids])).logits[0].double(), -1).gather(
                    -1, torch.tensor(d.target_ids)[:, None]
                )[:, 0]
                for r, t in teachers.items()
            }
        other = next(r for r in paths if r != route)
        action = [k for k, m in enumerate(d.action_mask) if m]
        assert all(d.teacher_logprobs[k] == pytest.approx(float(lps[route][k]), abs=2e-4) for k in action)
        assert max(abs(d.teacher_logprobs[k] - float(lps[other][k])) for k in action) > 1e-2  # not the other's
    assert seen == set(paths)
    # The run's version names each teacher by its route.
    from trl_plugins.rollout.weights import weights_digest

    versions = run.run.version.plugin_versions
    assert {k: v for k, v in versions.items() if k.startswith("teacher")} == {
        f"teacher/{r}": f"{p} weights {weights_digest(teachers[r])}" for r, p in paths.items()
    }
    # The replay names what it cannot re-derive yet.
    from trl_plugins.replay.cli import main as replay

    assert replay([str(tmp_path / "out" / "trajectories" / "step-000001.json"), "--teacher"]) == 2
    assert "routed by a row field (teacher/products, teacher/sums)" in capsys.readouterr().err
    # Refused at start-up, before any teacher loads: a row no teacher is named for, a dataset without the field, a
    # mapping without a route field and a route field with one teacher, the jsd loss with several teachers.
    with pytest.raises(ValueError, match="rows with 'quotients' reach no teacher"):
        trainer([*rows, {"prompt": "What is 4 / 2?", "source": "quotients"}])
    with pytest.raises(ValueError, match="'source' is not a field of the training dataset"):
        trainer([{"prompt": r["prompt"]} for r in rows])
    with pytest.raises(ValueError, match="names 2 teachers .*: set teacher_route_field"):
        tiny_config(tmp_path, **{**config, "teacher_route_field": None})
    with pytest.raises(ValueError, match="names one: give a mapping"):
        tiny_config(tmp_path, **{**config, "teacher_model_name_or_path": paths["sums"]})
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match="distils from one teacher, and teacher_model_name_or_path names 2"):
        resolve_run(tiny_config(tmp_path, **config, policy_loss="jsd"), reward_components={"length": TokenReward()})


def test_self_distillation_scores_the_students_tokens_under_the_privileged_prompt(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from trl_plugins.trainers import MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    # The teacher is the student's own starting model (the same build), shown the row's answer.
    base = tmp_path / "base"
    torch.manual_seed(0)
    build_tiny_model(tok).save_pretrained(base)
    tok.save_pretrained(base)
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    config = dict(
        teacher_model_name_or_path=str(base),
        teacher_privileged_field="answer",
        advantage="opd",
        advantage_kwargs={"reward_weight": 0.0},
        max_steps=1,
    )

    def trainer(data, **overrides):
        return MultiTurnGRPOTrainer(
            AutoModelForCausalLM.from_pretrained(base),
            tiny_config(tmp_path / "out", **{**config, **overrides}),
            train_dataset=Dataset.from_list(data),
            processing_class=tok,
            reward_components={"length": TokenReward()},
        )

    run = trainer(rows)
    run.train()
    teacher = AutoModelForCausalLM.from_pretrained(base).eval()
    batch = run.last_batch
    for d in batch.datums:
        traj = batch.trajectories[d.trajectory_index]
        row = batch.rows[traj.group_id]
        own = len(traj.turns[0].prompt_ids)
        message = f"{row['prompt']}\n\n(Reference answer, for the teacher only: {row['answer']})"
        privileged = run.run.chat.initial_prompt_ids([{"role": "user", "content": message}])
        assert run.run.chat.initial_prompt_ids([{"role": "user", "content": row["prompt"]}]) == traj.turns[0].prompt_ids
        full = list(privileged) + list(d.input_ids[own:]) + [d.target_ids[-1]]
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([full[:-1]])).logits[0].double()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
        shift = len(privileged) - own
        action = [k for k, m in enumerate(d.action_mask) if m]
        assert action and min(action) >= own - 1
        assert all(d.teacher_logprobs[k] == pytest.approx(float(lp[k + shift]), abs=2e-4) for k in action)
        assert all(d.teacher_logprobs[k] == 0.0 for k, m in enumerate(d.action_mask) if not m)
    # The same weights without the privileged prompt would score the student's tokens as it sampled them (the KL ~0):
    # what the teacher signal holds is the answer's effect.
    gaps = [
        abs(d.teacher_logprobs[k] - d.behaviour_logprobs[k])
        for d in batch.datums
        for k in range(d.num_tokens)
        if d.action_mask[k]
    ]
    assert max(gaps) > 1e-3
    with pytest.raises(ValueError, match="teacher_privileged_field='answer' is not a field of the training dataset"):
        trainer([{"prompt": r["prompt"]} for r in rows])
    with pytest.raises(ValueError, match="teacher_privileged_field='answer' configure distillation's teacher"):
        tiny_config(tmp_path, teacher_privileged_field="answer")
    with pytest.raises(ValueError, match="must hold \\{content\\}"):
        tiny_config(tmp_path, **config, teacher_privileged_template="{value}")


def test_a_server_teacher_that_never_answers_ends_the_run_at_its_configured_deadline(tmp_path):
    # A listener that accepts connections and never answers (not a teacher server: tests/test_vllm_real.py stops the
    # real one): the run's teacher_request_timeout_s reaches the client, and the start-up check ends there, named.
    import socket
    import time

    from trl_plugins.trainers.teacher_server import TeacherServerError

    silent = socket.create_server(("127.0.0.1", 0))  # its backlog takes the connection; nothing reads the request
    try:
        start = time.monotonic()
        with pytest.raises(TeacherServerError, match=r"gave no answer to the model list .*deadline 1 s, teacher_requ"):
            _trainer(
                tmp_path,
                build_tokenizer("qwen2_5"),
                teacher_model_name_or_path=f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
                teacher_request_timeout_s=1.0,
                advantage="opd",
                temperature=1.0,
            )
        assert time.monotonic() - start < 10  # the deadline, and the trainer's construction before it
    finally:
        silent.close()
