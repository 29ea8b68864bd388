"""Trajectory viewer: saved batch round trip, the page's spans against the datum token for token, escaping,
the CLI's errors, a real headless Chromium that loads the page, and the trainer writing pages."""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from trl_plugins.datum import build_datum
from trl_plugins.pipeline.batch import left_out_reasons
from trl_plugins.rollout import ChatFormat, MultiTurnRollout, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.tiny import build_tokenizer
from trl_plugins.tools.base import ToolOutput
from trl_plugins.types import LeftOutReason, RewardComponent, StopReason, TokenSource
from trl_plugins.viewer import (
    FORMAT,
    SOURCE_COLOURS,
    UpdateRole,
    ViewerError,
    datum_from_dict,
    display_text,
    load_batch,
    main,
    make_batch,
    render_html,
    save_batch,
)

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
# Tool output with markup, an entity, a carriage return and newlines: all must reach the page as text.
TOOL_TEXT = "<b>x</b> & y\r\n1 < 2\n"


class MarkupTool:
    """Returns TOOL_TEXT; fails in the infrastructure when the code says so."""

    name = "code_interpreter"

    def schema(self) -> dict:
        return SCHEMA

    async def __call__(self, arguments: dict) -> ToolOutput:
        if "crash" in arguments["code"]:
            return ToolOutput(text="", ok=False, infra_error="SandboxError: could not start")
        return ToolOutput(text=TOOL_TEXT, ok=True)


class VaryingLogprobs(ScriptedBackend):
    """ScriptedBackend whose log-prob differs per token (so a misplaced log-prob would show)."""

    def generate(self, prompts, max_new_tokens, *, seeds):
        samples = super().generate(prompts, max_new_tokens, seeds=seeds)
        for s in samples:
            s.logprobs = [-0.05 - 0.37 * ((tok * 7 + k) % 11) for k, tok in enumerate(s.token_ids)]
        return samples


def _script(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt):
        text = tok.decode(prompt)
        if "ramble" in text:  # never stops: cut at max_assistant_tokens
            return tok(" and so on" * 60, add_special_tokens=False)["input_ids"]
        code = "crash()" if "crash" in text else "print('<b>x</b> & y')"
        if "<tool_response>" not in text:
            call = {"name": "code_interpreter", "arguments": {"code": code}}
            body = f"Let me compute.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            body = "The answer is \\boxed{4}."
        return tok(body, add_special_tokens=False)["input_ids"] + [end]

    return script


def realistic_batch():
    """A step's worth of real rollouts on the Qwen2.5 template: group 0 calls the tool then answers (rewards
    differ: trained), group 1 rambles until the turn budget (truncated, equal rewards: zero advantage),
    group 2's tool fails in the infrastructure (environment_error: left out of the update)."""
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [SCHEMA])
    rows = [
        {"id": "add", "prompt": "What is 2 + 2?", "answer": "4"},
        {"id": "ramble", "prompt": "ramble about 3 & 4 <please>", "answer": "7"},
        {"id": "crash", "prompt": "crash the tool", "answer": "0"},
    ]
    questions = [
        RolloutQuestion(
            r["id"],
            chat.initial_prompt_ids(
                [{"role": "system", "content": "Solve it."}, {"role": "user", "content": r["prompt"]}]
            ),
            group_id=k,
        )
        for k, r in enumerate(rows)
    ]
    backend = VaryingLogprobs(_script(tok), stop_token_ids=chat.stop_token_ids)
    rollout = MultiTurnRollout(max_turns=3, max_assistant_tokens=100, max_trajectory_tokens=900, tool_retries=0)
    trajs = rollout(
        RolloutRequest(questions, 2, backend, chat, {"code_interpreter": MarkupTool()}, policy_step=3, seed=1)
    ).trajectories
    for t in trajs:
        if not t.world_failure:
            correct = 1.0 if (t.group_id == 0 and t.sample_index == 0) else 0.0
            t.reward_components = [RewardComponent("correct", correct, 1.0), RewardComponent("format", 0.5, 0.1)]
    left_out = left_out_reasons(trajs, mask_truncated=False)
    masked = [r is not None for r in left_out]
    for g in {t.group_id for t in trajs}:  # group-relative advantage over the members kept
        members = [t for t, m in zip(trajs, masked) if t.group_id == g and not m]
        mean = sum(t.reward for t in members) / max(len(members), 1)
        for t, m in zip(trajs, masked):
            if t.group_id == g:
                t.advantage = 0.0 if m else t.reward - mean
    datums = [build_datum(t, trajectory_index=i) for i, t in enumerate(trajs) if not masked[i]]
    return trajs, datums, tok, rows, left_out


@pytest.fixture(scope="module")
def batch_parts():
    trajs, datums, tok, rows, left_out = realistic_batch()
    # The fixture is what the test relies on: a tool call, a truncation, a world failure, a zero advantage.
    assert trajs[0].num_tool_calls == 1 and trajs[0].stop_reason == StopReason.FINAL_ANSWER
    assert trajs[2].stop_reason == StopReason.TURN_LENGTH and trajs[2].truncated
    assert (
        trajs[4].stop_reason == StopReason.ENVIRONMENT_ERROR
        and left_out == [None] * 4 + [LeftOutReason.WORLD_FAILURE] * 2
    )
    return trajs, datums, tok, rows, left_out


@pytest.fixture(scope="module")
def batch(batch_parts):
    trajs, datums, tok, rows, left_out = batch_parts
    return make_batch(trajs, datums, tok, step=10, rows=rows, left_out=left_out, forwarded={0, 1})


class _Spans(html.parser.HTMLParser):
    """Every token span (attributes and text) of a page, per trajectory section, and the body's attributes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: dict[int, list[dict]] = {}
        self.body: dict = {}
        self.swatches: dict[str, dict] = {}
        self.errors_text = ""
        self._section = None
        self._open: dict | None = None
        self._in_errors = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "section" and "data-trajectory" in a:
            self._section = int(a["data-trajectory"])
            self.sections[self._section] = []
        cls = (a.get("class") or "").split()
        if tag == "span" and "tok" in cls:
            self._open = {**a, "class": cls, "text": ""}
            self.sections[self._section].append(self._open)
        if tag == "span" and "sw" in cls:
            self.swatches[a["data-source"]] = a
        if a.get("id") == "js-errors":
            self._in_errors = True

    def handle_endtag(self, tag):
        if tag == "span":
            self._open = None
        if tag == "div":
            self._in_errors = False

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data
        if self._in_errors:
            self.errors_text += data


def parse(page: str) -> _Spans:
    p = _Spans()
    p.feed(page)
    return p


def assert_spans_match_datums(spans: list[dict], datum, strings: list[str], first_source: str) -> None:
    """The page's spans of one trajectory against its datum: every datum position exactly once, in order,
    with its source, mask, log-prob and advantage; the first token (context only) before them."""
    first, rest = spans[0], spans[1:]
    assert "data-index" not in first and first["data-pos"] == "0" and first["data-source"] == first_source
    assert [int(s["data-index"]) for s in rest] == list(range(len(datum.target_ids)))
    assert [int(s["data-id"]) for s in spans] == datum.input_ids + [datum.target_ids[-1]]
    assert [s["data-source"] for s in rest] == [TokenSource(x).name.lower() for x in datum.sources]
    assert [int(s["data-mask"]) for s in rest] == datum.action_mask
    assert [float(s["data-logprob"]) for s in rest] == datum.behaviour_logprobs
    assert [float(s["data-adv"]) for s in rest] == datum.advantages
    assert [f"s-{s['data-source']}" in s["class"] for s in spans] == [True] * len(spans)
    assert [s["text"] for s in spans] == [display_text(x) for x in strings]


def test_saved_batch_round_trips_the_datums_and_says_what_the_update_did(batch_parts, batch, tmp_path):
    trajs, datums, tok, rows, left_out = batch_parts
    path = tmp_path / "trajectories" / "step-000010.json"
    save_batch(path, trajs, datums, tok, step=10, rows=rows, left_out=left_out, forwarded={0, 1})
    loaded = load_batch(path)
    assert loaded["format"] == FORMAT and loaded["step"] == 10 and len(loaded["trajectories"]) == 6
    saved = loaded["trajectories"]
    # Update datums are stored as the update had them; masked ones are built for display.
    for d in datums:
        assert datum_from_dict(saved[d.trajectory_index]["datum"]) == d
        assert saved[d.trajectory_index]["datum_for_display"] is False
    assert [t["datum_for_display"] for t in saved] == [False] * 4 + [True] * 2
    assert datum_from_dict(saved[4]["datum"]) == build_datum(trajs[4], trajectory_index=4)
    assert [t["update_role"] for t in saved] == [UpdateRole.TRAINED] * 2 + [UpdateRole.ZERO_ADVANTAGE] * 2 + [
        UpdateRole.LEFT_OUT
    ] * 2
    assert "forward/backward was skipped" in saved[2]["update_note"]
    assert "environment_error" in saved[4]["update_note"] and "SandboxError" in saved[4]["update_note"]
    assert saved[0]["question"] == "What is 2 + 2?" and saved[0]["reference_answer"] == "4"
    assert saved[0]["reward_components"] == [
        {"name": "correct", "value": 1.0, "weight": 1.0},
        {"name": "format", "value": 0.5, "weight": 0.1},
    ]
    assert [t["stop_reason"] for t in saved] == [str(t.stop_reason) for t in trajs]
    # Turn boundaries index the whole sequence: each turn's completion is where the datum says it is.
    t0, full = saved[0], saved[0]["tokens"]["ids"]
    assert len(t0["turns"]) == 2 and t0["turns"][0]["tool_calls"][0]["output"] == TOOL_TEXT
    for turn, src in zip(t0["turns"], trajs[0].turns):
        assert full[turn["completion_start"] : turn["completion_end"]] == src.completion_ids
    assert t0["turns"][1]["prompt_start"] == t0["turns"][0]["completion_end"]
    assert "".join(t0["tokens"]["strings"]) == tok.decode(full, skip_special_tokens=False)


def test_every_datum_token_appears_once_with_its_mask_logprob_and_advantage(batch_parts, batch):
    trajs, datums, tok, _, _ = batch_parts
    p = parse(render_html(batch))
    assert sorted(p.sections) == list(range(6))
    by_index = {d.trajectory_index: d for d in datums}
    for i, traj in enumerate(trajs):
        # The update's datum (the masked ones: the datum builder's, as the page builds it for display).
        d = by_index.get(i) or build_datum(traj, trajectory_index=i)
        full = d.input_ids + [d.target_ids[-1]]
        assert_spans_match_datums(
            p.sections[i], d, [tok.decode([x], skip_special_tokens=False) for x in full], "prompt"
        )
    # Every provenance appears on the page.
    seen = {s["data-source"] for spans in p.sections.values() for s in spans}
    assert seen == {"prompt", "action", "observation", "glue"}
    # Negative control: the checker notices one wrong mask.
    d0 = datum_from_dict(batch["trajectories"][0]["datum"])
    d0.action_mask[3] = 1 - d0.action_mask[3]
    with pytest.raises(AssertionError):
        assert_spans_match_datums(p.sections[0], d0, batch["trajectories"][0]["tokens"]["strings"], "prompt")


def test_page_escapes_markup_and_shows_turns_stop_reasons_rewards(batch):
    page = render_html(batch)
    # The tool's markup and the question's reach the page as text, never as tags.
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt; &amp; y" in page
    assert "<please>" not in page and "ramble about 3 &amp; 4 &lt;please&gt;" in page
    assert "\r" not in page and "\u240d" in page  # a carriage return shows as a symbol
    p = parse(page)
    texts = "".join(s["text"] for s in p.sections[0])
    assert "<b>x</b> & y" in texts  # parsed back, the tokens' text is the tool output again
    assert page.count('class="turn-mark"') == sum(len(t["turns"]) for t in batch["trajectories"])
    for reason in ("final_answer", "turn_length", "environment_error"):
        assert f'data-stop="{reason}"' in page
    assert page.count('data-component="correct"') == 4  # the two failed ones were not scored
    assert "not trained on: the world failed" in page and "datum built for display" in page
    # Self-contained: nothing is fetched.
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "@import" not in page


def test_display_text_keeps_whitespace_and_shows_control_characters():
    assert display_text("a\nb\tc") == "a\nb\tc"
    assert display_text("\r\x00\x7f") == "\u240d\u2400\u2421"


def test_cli_draws_a_saved_batch_and_refuses_bad_files_losing_nothing(batch, tmp_path, capsys):
    path = tmp_path / "step-000010.json"
    path.write_text(json.dumps(batch))
    out = tmp_path / "page.html"
    assert main([str(path), "-o", str(out), "--max-trajectories", "2"]) == 0
    assert sorted(parse(out.read_text()).sections) == [0, 1]
    assert main([str(path)]) == 0 and (tmp_path / "step-000010.html").is_file()

    before = out.read_text()
    assert main([str(tmp_path / "missing.json"), "-o", str(out)]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    cut = tmp_path / "cut.json"
    cut.write_text(path.read_text()[:500])
    assert main([str(cut), "-o", str(out)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err and cut.read_text() == path.read_text()[:500]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    assert main([str(other), "-o", str(out)]) == 2
    assert "is not a saved trajectory batch" in capsys.readouterr().err
    assert out.read_text() == before  # no failed run touched the page
    with pytest.raises(SystemExit):
        main([str(path), "-o", str(path)])  # would overwrite the batch itself
    assert json.loads(path.read_text()) == batch
    with pytest.raises(SystemExit):
        main([str(path), "--max-trajectories", "0"])
    # The module runs as a command.
    done = subprocess.run(
        [sys.executable, "-m", "trl_plugins.viewer", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2 and "missing.json: no such file" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "trl_plugins.viewer", str(path), "-o", str(tmp_path / "cmd.html")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0 and "wrote" in done.stdout and (tmp_path / "cmd.html").read_text() == render_html(batch)
    with pytest.raises(ViewerError, match="disagree in length"):
        damaged = json.loads(path.read_text())
        damaged["trajectories"][0]["datum"]["action_mask"].pop()
        path.write_text(json.dumps(damaged))
        load_batch(path)


# -- a real browser ----------------------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium binary on PATH (.ci/run installs the system package 'chromium')")


def dump_dom(page_path, *, fragment: str = "") -> str:
    """The DOM after the page's scripts ran, from headless Chromium (its own profile: tests may run in parallel)."""
    profile = page_path.parent / f"{page_path.stem}-profile"
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        page_path.as_uri() + fragment,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def test_page_runs_in_headless_chromium_and_draws_the_datum_token_for_token(batch, tmp_path):
    page_path = tmp_path / "page.html"
    page_path.write_text(render_html(batch))
    dom = dump_dom(page_path, fragment="#selftest")
    p = parse(dom)
    # The page's script ran to its end and collected no error.
    assert p.body.get("data-ready") == "1" and p.body.get("data-js-errors") == "0" and p.errors_text == ""
    assert int(p.body["data-tokens"]) == sum(len(t["datum"]["target_ids"]) + 1 for t in batch["trajectories"])
    # The colours the browser drew: each source its legend colour; the spans match the datums token for token.
    for source, colour in SOURCE_COLOURS.items():
        assert p.swatches[source.name.lower()]["data-bg"] == _rgb(colour)
    for i, t in enumerate(batch["trajectories"]):
        spans = p.sections[i]
        assert_spans_match_datums(spans, datum_from_dict(t["datum"]), t["tokens"]["strings"], "prompt")
        assert [s["data-bg"] for s in spans] == [
            _rgb(SOURCE_COLOURS[TokenSource[s["data-source"].upper()]]) for s in spans
        ]
        assert [s["data-bg"] == _rgb(SOURCE_COLOURS[TokenSource.ACTION]) for s in spans[1:]] == [
            bool(m) for m in t["datum"]["action_mask"]
        ]


def test_the_browser_check_sees_a_script_error(batch, tmp_path):
    # Negative control: a page whose script throws is reported as such.
    page_path = tmp_path / "broken.html"
    page_path.write_text(render_html(batch).replace("</body>", "<script>undefinedFunction();</script></body>"))
    p = parse(dump_dom(page_path))
    assert p.body.get("data-js-errors") == "1" and "undefinedFunction" in p.errors_text


# -- the trainer ---------------------------------------------------------------------------------------


class EchoCodeTool:
    """A code interpreter stand-in: returns a fixed output with markup (no sandbox needed)."""

    name = "code_interpreter"

    def schema(self):
        return SCHEMA

    async def __call__(self, arguments):
        return ToolOutput(text="<1>\n", ok=True)


class BoxedDigit:
    """Scores the boxed digit (varies per sample, so groups get non-zero advantages)."""

    def __call__(self, trajectory, example) -> float:
        text = trajectory.turns[-1].text
        return float(text.split("\\boxed{")[1][0]) if "\\boxed{" in text else 0.0


def _trainer(tmp_path, **overrides):
    from datasets import Dataset

    from trl_plugins.tiny import build_tiny_model
    from trl_plugins.trainers import MultiTurnGRPOConfig, MultiTurnGRPOTrainer

    tok = build_tokenizer("qwen2_5")
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=5e-3,
        seed=0,
        disable_tqdm=True,
        bf16=False,
        rollout="support.trainer:ScriptedToolRollout",
        rollout_kwargs={},
        reward_components=["digit"],
        max_padded_tokens_per_micro_batch=4000,
        max_items_per_micro_batch=2,
        viewer_steps=2,
        viewer_trajectories=3,
    )
    kwargs.update(overrides)
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    return MultiTurnGRPOTrainer(
        build_tiny_model(tok),
        MultiTurnGRPOConfig(**kwargs),
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        tools={"code_interpreter": EchoCodeTool()},
        reward_components={"digit": BoxedDigit()},
    )


def test_the_trainer_writes_a_page_at_every_viewer_step_and_logs_it_to_wandb(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "trl-plugins-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    trainer = _trainer(out, report_to=["wandb"])
    trainer.train()
    wandb.finish()
    wandb.teardown()
    # viewer_steps=2 over 2 steps: the page of step 2 only.
    assert sorted(p.name for p in (out / "trajectories").iterdir()) == ["step-000002.html", "step-000002.json"]
    batch = load_batch(out / "trajectories" / "step-000002.json")
    assert batch["step"] == 2 and batch["num_trajectories"] == 4 and len(batch["trajectories"]) == 3
    by_index = {d.trajectory_index: d for d in trainer.last_batch.datums}
    page = (out / "trajectories" / "step-000002.html").read_text()
    p = parse(page)
    for i, t in enumerate(batch["trajectories"]):
        traj = trainer.last_batch.trajectories[i]
        assert t["question_id"] == traj.question_id and t["advantage"] == traj.advantage
        assert datum_from_dict(t["datum"]) == by_index[i]  # the update's own datum, advantages included
        assert len(t["turns"]) == 2 and t["turns"][0]["tool_calls"][0]["name"] == "code_interpreter"
        row = trainer.last_batch.rows[traj.group_id]  # the question and answer are the trajectory's own row's
        assert (t["question"], t["reference_answer"]) == (row["prompt"], row["answer"])
        assert t["question"] in "".join(t["tokens"]["strings"])
        assert_spans_match_datums(p.sections[i], by_index[i], t["tokens"]["strings"], "prompt")
    assert "&lt;1&gt;" in page and "<1>" not in page
    # The same page went to W&B as HTML.
    htmls = list(tmp_path.glob("wandb/offline-run-*/files/media/html/trajectories/viewer_*.html"))
    assert len(htmls) == 1 and htmls[0].read_text() == page


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(viewer_steps=-1), "viewer_steps and viewer_trajectories must be >= 0"),
        (dict(viewer_trajectories=-2), "viewer_steps and viewer_trajectories must be >= 0"),
        (dict(viewer_steps=5, viewer_trajectories=0), "set viewer_trajectories >= 1, or viewer_steps=0"),
    ],
)
def test_viewer_settings_are_checked_when_the_config_is_built(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, **overrides)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # refused before anything was written


def test_viewer_steps_zero_writes_no_pages(tmp_path):
    trainer = _trainer(tmp_path, viewer_steps=0, viewer_trajectories=0, max_steps=1)
    trainer.train()
    assert trainer.last_batch.trajectories and not (tmp_path / "trajectories").exists()


def test_a_page_that_cannot_be_written_is_reported_and_training_goes_on(tmp_path, caplog):
    # A file where the trajectories folder should be: the page cannot be written.
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "trajectories").write_text("not a folder")
    trainer = _trainer(tmp_path, viewer_steps=1, max_steps=1)
    with caplog.at_level("ERROR", logger="trl_plugins.trainers.viewer_pages"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert "the page of step 1 could not be written" in caplog.text
    assert (tmp_path / "trajectories").read_text() == "not a folder"  # nothing was overwritten


def test_a_trajectory_without_a_datum_is_shown_with_the_reason():
    import random

    from trl_plugins.contracts import make_trajectory

    rng = random.Random(0)
    good, bad = make_trajectory(rng, num_turns=2), make_trajectory(rng, num_turns=2, group_id=1)
    bad.turns[1].prompt_ids[0] += 1  # the history was re-tokenised: no datum can be built
    batch = make_batch(
        [good, bad], [build_datum(good, trajectory_index=0)], None, left_out=[None, LeftOutReason.GROUP_TOO_SMALL]
    )
    assert batch["trajectories"][1]["datum"] is None and "does not extend" in batch["trajectories"][1]["datum_error"]
    page = render_html(batch)
    p = parse(page)
    assert len(p.sections[0]) == len(batch["trajectories"][0]["tokens"]["ids"]) and p.sections[1] == []
    assert "no datum:</b> trajectory 1" in page and "does not extend the previous turns" in page
    # Without a tokenizer the tokens show as their ids.
    assert [s["text"] for s in p.sections[0]] == [f"\u27e8{i}\u27e9" for i in batch["trajectories"][0]["tokens"]["ids"]]


def test_the_page_says_the_reason_the_batch_builder_recorded(batch_parts):
    # The viewer reads why a trajectory was left out; it does not work it out again from the trajectory.
    trajs, datums, tok, rows, left_out = batch_parts
    assert trajs[2].truncated and left_out[2] is None
    recorded = list(left_out)
    recorded[2] = LeftOutReason.TRUNCATED  # as truncated_policy='mask' would have decided
    by_index = [d for d in datums if d.trajectory_index != 2]
    notes = [t["update_note"] for t in make_batch(trajs, by_index, tok, left_out=recorded)["trajectories"]]
    assert notes[2] == "not trained on: truncated, and truncated_policy='mask'"
    assert notes[4].startswith("not trained on: the world failed (environment_error")
    recorded[4] = LeftOutReason.GROUP_TOO_SMALL  # negative control: the recorded reason wins over the stop reason
    batch = make_batch(trajs, by_index, tok, left_out=recorded)["trajectories"]
    assert (
        batch[4]["update_note"]
        == ("not trained on: too few members of its group survived the infrastructure (min_valid_group_fraction)")
        and batch[4]["left_out"] == "group_too_small"
    )


def test_a_step_without_a_policy_update_marks_its_trajectories_so(batch_parts, tmp_path):
    trajs, datums, tok, rows, left_out = batch_parts
    batch = make_batch(trajs, datums, tok, step=1, rows=rows, left_out=left_out, update_skipped="the critic's warm-up")
    roles = [t["update_role"] for t in batch["trajectories"]]
    assert roles == [UpdateRole.UPDATE_SKIPPED] * 4 + [UpdateRole.LEFT_OUT] * 2  # masked ones keep their own reason
    assert batch["trajectories"][0]["update_note"] == (
        "not trained on: the step's policy update was skipped (the critic's warm-up)"
    )
    assert 'class="badge r-update_skipped"' in render_html(batch)


def test_the_trainer_marks_a_critic_warm_up_step_as_not_trained_on(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1, viewer_steps=1, advantage="gae", critic_warmup_steps=5)
    trainer.train()
    saved = load_batch(tmp_path / "trajectories" / "step-000001.json")
    roles = {t["update_role"] for t in saved["trajectories"]}
    assert roles <= {UpdateRole.UPDATE_SKIPPED, UpdateRole.LEFT_OUT} and UpdateRole.UPDATE_SKIPPED in roles
    assert "critic_warmup_steps" in next(
        t["update_note"] for t in saved["trajectories"] if t["update_role"] == UpdateRole.UPDATE_SKIPPED
    )
