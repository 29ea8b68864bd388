"""The ``judge`` reward component against the scripted judge server (examples/judges/scripted_judge.py, loopback):
its scores, the cache, group ranking, every fault's documented outcome within its deadline, and the verifier errors a
failing judge gives a batch (docs/rewards.md)."""

from __future__ import annotations

import pickle
import random
import socket
import time

import pytest

from support.judges import scripted_judge as scripted_judge_module
from trl_plugins.rewards.judge import JudgeError, JudgeReward
from trl_plugins.types import StopReason, ToolCall, Trajectory, Turn

pytestmark = pytest.mark.xdist_group("scripted_judge")  # one server's state per worker: these run on one

ROW = {"prompt": "What is 6 * 7?", "answer": "42"}


@pytest.fixture(scope="module")
def judge_server():
    scripted_judge = scripted_judge_module()
    server, _ = scripted_judge.serve(0)
    yield scripted_judge, f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


@pytest.fixture
def judge(judge_server, tmp_path):
    """The scripted judge's module (its state reset) and a factory of judge components on it."""
    module, url = judge_server
    module._state.update(fault="ok", count=0, latency_s=0.0, requests=0, keys=[], in_flight=0, max_in_flight=0)

    def make(**kwargs):
        kwargs.setdefault("cache_path", str(tmp_path / "judge.sqlite"))
        return JudgeReward(base_url=url, model="scripted-judge", **kwargs)

    return module, make


def _fault(module, fault: str, count: int = -1, **kw) -> None:
    module._state.update(fault=fault, count=count, **kw)


def _traj(text: str, group: int = 0, sample: int = 0, **kw) -> Trajectory:
    return Trajectory(
        [Turn([1, 2], [3], [-0.1], text=text, **kw)],
        question_id=f"q{group}",
        group_id=group,
        sample_index=sample,
        stop_reason=StopReason.FINAL_ANSWER,
    )


def test_pointwise_scores_map_the_scale_onto_0_1_and_a_second_judge_reads_the_cache(judge):
    module, make = judge
    first = make()
    trajs = [_traj("so \\boxed{42}"), _traj("42? no: \\boxed{41}"), _traj("\\boxed{7}")]
    assert first.score_batch(trajs, [ROW] * 3) == [1.0, 0.5, 0.0]
    figures = first.step_metrics()
    assert figures["judge/calls"] == 3 and figures["judge/cache_hits"] == 0 and figures["judge/tokens_in"] > 0
    assert module._state["requests"] == 3
    # A resumed run (or a replay) builds the judge afresh: the same requests come from the cache, no call made.
    resumed = pickle.loads(pickle.dumps(first))
    assert resumed.score_batch(trajs, [ROW] * 3) == [1.0, 0.5, 0.0]
    assert module._state["requests"] == 3 and resumed.step_metrics()["judge/cache_hits"] == 3
    # Another rubric is another request: the cache does not answer it.
    assert make(high=5.0).score_batch(trajs[:1], [ROW]) == [1.0] and module._state["requests"] == 4


def test_the_judge_sees_the_turns_with_their_tool_calls_when_asked(judge):
    from trl_plugins.rewards.judge import render_trajectory

    traj = _traj("\\boxed{42}")
    traj.turns.insert(
        0,
        Turn([1], [2], [-0.1], text="<tool_call>...</tool_call>", tool_calls=[ToolCall("code", {"c": "6*7"}, "42")]),
    )
    assert render_trajectory(traj, "final_answer") == "\\boxed{42}"
    shown = render_trajectory(traj, "turns")
    assert '[tool code({"c": "6*7"}) returned]\n42' in shown and shown.endswith("[assistant turn 2]\n\\boxed{42}")


@pytest.mark.parametrize("parser", ["json", "regex"])
def test_group_ranking_makes_one_call_per_group_and_its_scores_do_not_depend_on_the_order(judge, parser):
    module, make = judge
    texts = ["\\boxed{42}", "\\boxed{41}", "it is 42", "\\boxed{42}"]  # two identical: shown to the judge once
    rows = [
        ROW,
        ROW,
        ROW,
        ROW,
        {"prompt": "What is 2 + 2?", "answer": "4"},
        {"prompt": "What is 2 + 2?", "answer": "4"},
    ]
    trajs = [_traj(t, 0, k) for k, t in enumerate(texts)] + [_traj("\\boxed{4}", 1, 0), _traj("\\boxed{5}", 1, 1)]
    scores = make(mode="group", parser=parser, cache_path=None).score_batch(trajs, rows)
    assert scores == [1.0, 0.0, 0.5, 1.0, 1.0, 0.0] and module._state["requests"] == 2
    order = list(range(6))
    random.Random(0).shuffle(order)
    shuffled = make(mode="group", parser=parser, cache_path=None).score_batch(
        [trajs[i] for i in order], [rows[i] for i in order]
    )
    assert shuffled == [scores[i] for i in order]
    ranks = make(mode="group", group_value="rank", cache_path=None).score_batch(trajs, rows)
    assert ranks == [2.5 / 3, 0.0, 1 / 3, 2.5 / 3, 1.0, 0.0]  # ties share their mean rank


def test_the_concurrency_limit_holds_and_is_used(judge):
    module, make = judge
    module._state["latency_s"] = 0.1
    scores = make(concurrency=4, cache_path=None).score_batch([_traj(f"\\boxed{{{i}}}") for i in range(12)], [ROW] * 12)
    assert scores == [0.0] * 12 and module._state["max_in_flight"] == 4


@pytest.mark.parametrize(
    ("fault", "settings", "kind", "requests"),
    [
        ("500", {"max_retries": 2}, "http_500", 3),  # retried, then given up
        ("malformed", {}, "malformed", 1),  # an answer came back: never retried
        ("truncated", {}, "truncated", 1),
        ("unparsable", {}, "unparsable", 1),
        ("out_of_scale", {}, "out_of_scale", 1),
        ("429", {"timeout_s": 5.0}, "retry_after", 1),  # Retry-After 100 s, beyond the deadline: at once
        ("hang", {"timeout_s": 1.0}, "timeout", 1),
    ],
)
def test_each_fault_ends_as_its_documented_failure_within_the_deadline(judge, fault, settings, kind, requests):
    module, make = judge
    _fault(module, fault, retry_after=100)
    component = make(**settings)
    start = time.monotonic()
    (result,) = component.score_batch([_traj("\\boxed{42}")], [ROW])
    took = time.monotonic() - start
    assert isinstance(result, JudgeError) and result.kind == kind, result
    assert module._state["requests"] == requests and took < component.timeout_s + 0.5
    assert "the judge 'scripted-judge' at http://127.0.0.1:" in str(result)
    assert component.step_metrics()["judge/errors"] == 1
    # Nothing failed is cached: the judge is asked again once it answers.
    _fault(module, "ok")
    assert component.score_batch([_traj("\\boxed{42}")], [ROW]) == [1.0]


@pytest.mark.parametrize("fault", ["500", "429"])
def test_a_passing_fault_is_retried_and_a_retry_after_is_honoured(judge, fault):
    module, make = judge
    _fault(module, fault, count=1, retry_after=0.3)
    component = make()
    start = time.monotonic()
    assert component.score_batch([_traj("\\boxed{42}")], [ROW]) == [1.0]
    assert module._state["requests"] == 2 and component.step_metrics()["judge/retries"] == 1
    if fault == "429":
        assert time.monotonic() - start >= 0.3


def test_a_judge_that_is_down_fails_after_its_retries_within_the_deadline(judge):
    _, make = judge
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    component = JudgeReward(base_url=f"http://127.0.0.1:{port}/v1", model="m", cache_path=None, timeout_s=3.0)
    start = time.monotonic()
    (result,) = component.score_batch([_traj("x")], [ROW])
    assert isinstance(result, JudgeError) and result.kind == "connect" and time.monotonic() - start < 3.5
    assert component.step_metrics()["judge/retries"] == 3


def test_a_failing_judge_ends_its_trajectories_as_verifier_error_with_its_text_and_spares_the_rest(judge):
    from trl_plugins.pipeline.batch import score_trajectories
    from trl_plugins.protocols import as_reward
    from trl_plugins.rewards.math import FormatReward

    module, make = judge
    rewards = [as_reward(FormatReward(), "format", 0.1), as_reward(make(cache_path=None), "judge", 1.0)]
    trajs = [_traj(text, 0, k) for k, text in enumerate(["\\boxed{42}", "so \\boxed{42}", "it is \\boxed{42}"])]
    _fault(module, "unparsable", count=2)
    examples: dict[str, str] = {}
    failures = score_trajectories(rewards, trajs, [ROW], examples=examples)
    assert failures == {"judge": 2}
    failed = [t for t in trajs if t.stop_reason == StopReason.VERIFIER_ERROR]
    assert len(failed) == 2 and all(t.reward_components == [] for t in failed)
    assert all("I cannot grade this." in t.error and "unparsable" in t.error for t in failed)  # the judge's text
    (scored,) = [t for t in trajs if t.stop_reason == StopReason.FINAL_ANSWER]
    assert [(c.name, c.value, c.weight) for c in scored.reward_components] == [
        ("format", 1.0, 0.1),
        ("judge", 1.0, 1.0),
    ]
    assert list(examples) == ["judge: unparsable"]


def test_settings_are_checked_when_built_and_the_key_is_never_a_setting(judge, monkeypatch):
    _, make = judge
    for bad, words in [
        ({"base_url": "127.0.0.1:8000"}, "not an http(s) URL"),
        ({"model": ""}, "model is empty"),
        ({"low": 1, "high": 1}, "scale"),
        ({"group_value": "rank"}, "set mode: group"),
        ({"template": "{question} {nope}"}, "does not format"),
        ({"parser": "regex", "score_regex": "score"}, "no group"),
        ({"api_key_env": "NO_SUCH_JUDGE_KEY_VAR"}, "is not set"),
        ({"extra_body": {"max_tokens": 9, "top_k": 1}}, "extra_body sets ['max_tokens']"),
    ]:
        kwargs = {"base_url": "http://127.0.0.1:1/v1", "model": "m", **bad}
        with pytest.raises(ValueError, match="the judge's settings|template"):
            try:
                JudgeReward(**kwargs)
            except ValueError as exc:
                assert words in str(exc), (bad, str(exc))
                raise
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-secret-value")
    component = make(api_key_env="JUDGE_TEST_KEY")
    assert "sk-secret-value" not in repr(component) + repr(component.versions()) + str(pickle.dumps(component))
    # The rubric's digest names a change of the template, the scale or the parser; the model is named.
    assert component.versions()["model"].startswith("scripted-judge at http://127.0.0.1:")
    assert make(template="Rate {response} from {low} to {high}. {answer_format}").versions() != component.versions()


def test_the_start_up_contract_check_calls_the_judge(judge):
    from trl_plugins.contracts import ContractError, check_reward_contract

    module, make = judge
    check_reward_contract(make())
    assert module._state["requests"] > 0
    _fault(module, "500")
    with pytest.raises(ContractError, match="http_500"):
        check_reward_contract(make(cache_path=None, max_retries=0))


def test_identical_requests_are_asked_once(judge):
    module, make = judge
    trajs = [_traj("\\boxed{42}", 0, k) for k in range(4)] + [_traj("\\boxed{41}", 0, 4)]
    assert make(cache_path=None).score_batch(trajs, [ROW] * 5) == [1.0] * 4 + [0.0]
    assert module._state["requests"] == 2


@pytest.mark.parametrize("mode", ["pointwise", "group"])
def test_judging_during_the_rollout_warms_the_cache_and_hands_its_failures_over_once(judge, mode):
    """RolloutScorer (what rollout_rows runs as trajectories end): the judge's calls are made before the rollout
    returns, the scoring after it makes none; a failure met during the rollout is reported by that scoring without a
    second call (no second deadline), and the next ask calls the judge again."""
    from trl_plugins.pipeline.batch import score_trajectories
    from trl_plugins.pipeline.prescoring import RolloutScorer
    from trl_plugins.protocols import as_reward

    module, make = judge
    reward = as_reward(make(mode=mode), "judge")
    assert reward.scores_during_rollout == ("trajectory" if mode == "pointwise" else "group")
    assert as_reward(make(cache_path=None), "judge").scores_during_rollout is None  # nothing to hand over without one
    rows = [ROW, {"prompt": "What is 2 + 2?", "answer": "4"}]
    trajs = [_traj(f"{k} \\boxed{{42}}", 0, k) for k in range(2)] + [_traj(f"{k} \\boxed{{4}}", 1, k) for k in range(2)]
    scorer = RolloutScorer([reward], rows, group_size=2)
    for t in trajs[:3]:
        scorer.finished(t)
    if mode == "group":  # the second group is judged when its last member ends
        assert len(scorer._futures) == 1 and scorer._futures[0].result() == [1.0, 1.0]
        assert module._state["requests"] == 1
    scorer.finished(trajs[3])
    scorer.wait()
    asked = module._state["requests"]
    assert asked == (4 if mode == "pointwise" else 2)
    assert score_trajectories([reward], trajs, rows) == {} and module._state["requests"] == asked
    assert [t.reward_component("judge").value for t in trajs] == [1.0] * 4
    # A failure during the rollout: reported once by the scoring after it, without asking again.
    fresh = [_traj(f"again {k} \\boxed{{42}}", 0, k) for k in range(2)]
    _fault(module, "500")
    scorer = RolloutScorer([as_reward(make(mode=mode, max_retries=0), "judge")], rows, group_size=2)
    for t in fresh:
        scorer.finished(t)
    scorer.wait()
    asked = module._state["requests"]
    assert score_trajectories([reward], fresh, rows) == {"judge": 2} and module._state["requests"] == asked
    assert all("(during the rollout)" in t.error for t in fresh)
    _fault(module, "ok")
    again = [_traj(f"again {k} \\boxed{{42}}", 0, k) for k in range(2)]
    assert score_trajectories([reward], again, rows) == {} and module._state["requests"] > asked


def test_a_stop_request_ends_the_wait_for_the_judges_of_the_rollout_at_once(judge):
    # SIGTERM while the rollout waits for its last trajectories' judges: the wait ends, not at the judge's deadline.
    import threading

    from trl_plugins.pipeline.prescoring import RolloutScorer
    from trl_plugins.protocols import as_reward

    module, make = judge
    _fault(module, "hang")
    scorer = RolloutScorer([as_reward(make(timeout_s=3.0), "judge")], [ROW], group_size=1)  # its call ends by 3 s
    scorer.finished(_traj("\\boxed{42}"))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    assert scorer.wait(stop) is False and time.monotonic() - start < 1.5
