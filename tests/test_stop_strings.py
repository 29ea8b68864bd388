"""Stop strings token-exact: the first token whose text completes a stop ends the turn (kept as sampled), the rest
is never part of it. Each backend that ends a turn at a stop (HF generate, continuous batching: streamed and
cancelled) is compared with the same backend run without the stop and cut by a linear reference scan."""

from __future__ import annotations

import functools

import pytest

from support.rollout import SCHEMA, make_backend
from trl_plugins.rollout import ChatFormat
from trl_plugins.rollout.stops import StopStrings
from trl_plugins.tiny import build_tiny_model, build_tokenizer


def reference_cut(decode, ids, stops):
    """The first k (linear scan) whose prefix ids[:k + 1] decodes to a text holding a stop; None if none does."""
    for k in range(len(ids)):
        if any(s in decode(ids[: k + 1]) for s in stops):
            return k
    return None


def test_the_cut_is_the_first_token_that_completes_a_stop_and_keeps_a_straddling_token():
    tok = build_tokenizer("qwen2_5")
    decode = functools.partial(tok.decode, skip_special_tokens=True)
    ids = tok("Thought: add them.\nAction: sum\nObservation: 12\nmore text", add_special_tokens=False)["input_ids"]
    for stops in [("Observation:",), ("ation: su", "zzz"), ("\nmore",), ("nothing here",), ("Obs", "Action")]:
        s = StopStrings(stops, decode)
        k = reference_cut(decode, ids, stops)
        got = s.cut(ids)
        if k is None:
            assert got is None
            continue
        assert got[0] == k
        text = decode(ids[: k + 1])
        # the content is cut before the earliest stop; token k's text may run past the stop (a straddling token)
        assert text[: got[1]] == text[: min(text.find(x) for x in stops if x in text)]
        assert not any(x in decode(ids[:k]) for x in stops)
    # "Obs" and "Action": "Action" completes first (earlier in the text), so the cut is there
    assert decode(ids[: StopStrings(("Obs", "Action"), decode).cut(ids)[0] + 1]).rstrip().endswith("Action")


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer("qwen2_5")
    chat = ChatFormat(tok, [SCHEMA])
    model = build_tiny_model(tok, hidden_size=64, num_layers=2)
    prompts = [
        chat.initial_prompt_ids([{"role": "user", "content": "What is 2 + 2?"}]),
        chat.initial_prompt_ids([{"role": "user", "content": "What is 123 * 456 + 789?"}]),
    ]
    return tok, chat, model, prompts


@pytest.mark.parametrize("kind", ["hf", "continuous_batching"])
def test_a_backend_ends_the_turn_at_the_stop_with_the_tokens_it_would_have_sampled(setup, kind):
    tok, _, _, prompts = setup
    decode = functools.partial(tok.decode, skip_special_tokens=True)
    be = make_backend(kind, setup, temperature=1.0)
    with be.session():
        free = be.generate(prompts, [40, 40], seeds=[3, 4])
        # a stop that the free run's first row completes at its 6th token (its text there); none for the second row
        k0 = 5
        piece = decode(free[0].token_ids[k0 - 1 : k0 + 1]).strip() or decode(free[0].token_ids[: k0 + 1])
        stop = StopStrings((piece,), decode)
        cancelled = []
        if kind == "continuous_batching":  # the manager has no stop strings: the backend must cancel the request
            manager = be._active
            original = manager.cancel_request
            manager.cancel_request = lambda rid: (cancelled.append(rid), original(rid))
        stopped = be.generate(prompts, [40, 40], seeds=[3, 4], stop=[stop, None])
    assert len(cancelled) == (kind == "continuous_batching")
    k = reference_cut(decode, free[0].token_ids, (piece,))
    assert k is not None and k <= k0
    assert stopped[0].token_ids == free[0].token_ids[: k + 1] and stopped[0].finished
    assert stopped[0].logprobs == pytest.approx(free[0].logprobs[: k + 1], abs=1e-5)
    assert stopped[1].token_ids == free[1].token_ids  # a row without stops is untouched by its neighbour's
    assert len(free[0].token_ids) > k + 1  # negative control: without the stop the turn went on


# -- through the agent endpoint ------------------------------------------------------------------------------------

SMOL_TURN = "Thought: add them.\nAction: sum\nObservation: made up 99\n"


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(build_tokenizer("qwen2_5"), [SCHEMA], final_answer_pattern=r"\\boxed\{", calls_per_turn=2)


def smol_policy(chat):
    """A text agent's policy (smolagents style): it writes an action, then (wrongly) goes on with an observation of
    its own; once a real observation is in the prompt, it answers."""
    from trl_plugins.rollout import ScriptedBackend

    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def script(prompt):
        text = tok.decode(prompt)
        body = "The answer is \\boxed{7}." if "Observation: 12" in text else SMOL_TURN
        return tok(body, add_special_tokens=False)["input_ids"] + [im_end]

    return ScriptedBackend(script, stop_token_ids=chat.stop_token_ids)


@pytest.mark.parametrize("stop", [["Observation:"], None])
def test_the_endpoint_cuts_a_turn_at_its_stop_and_the_next_request_continues_the_segment(chat, stop):
    from support.endpoint import request
    from trl_plugins.rollout.endpoint import AgentEndpointRollout
    from trl_plugins.types import TokenSource

    seen = []

    async def agent(client, row):
        messages = [
            {"role": "system", "content": "Answer in Thought/Action/Observation steps."},
            {"role": "user", "content": row["prompt"]},
        ]
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, stop=stop)
            choice = reply.choices[0]
            seen.append((choice.message.content, choice.finish_reason))
            messages += [
                {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": "Observation: 12"},
            ]
        return 1.0

    (traj,) = AgentEndpointRollout(agent=agent)(request(chat, ["add 5 and 7"], backend=smol_policy(chat))).trajectories
    tok = chat.tokenizer
    decode = functools.partial(tok.decode, skip_special_tokens=True)
    full = tok(SMOL_TURN, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    first, second = traj.turns[0], traj.turns[1]
    if stop is None:  # negative control: the made-up observation is the model's and goes back to the agent
        assert first.completion_ids == full and "made up 99" in seen[0][0]
        return
    k = reference_cut(decode, full, stop)
    assert first.completion_ids == full[: k + 1] and len(first.completion_logprobs) == k + 1  # as sampled, none after
    assert seen[0] == (SMOL_TURN[: SMOL_TURN.index("Observation:")], "stop")  # cut before the stop, as OpenAI does
    assert traj.num_segments == 1  # the cut content came back without the end token: the record continues
    assert second.prompt_ids[: len(first.prompt_ids) + k + 1] == first.prompt_ids + first.completion_ids
    # the template's end token, not sampled: glue (prompt_sources covers what the turn appended to the record)
    assert (
        second.prompt_sources[0] == TokenSource.GLUE
        and second.prompt_ids[len(first.prompt_ids) + k + 1] in chat.stop_token_ids
    )
    assert seen[1] == ("The answer is \\boxed{7}.", "stop")


def test_stop_is_checked(chat):
    from support.endpoint import request
    from trl_plugins.rollout.endpoint import AgentEndpointRollout

    errors = []

    async def agent(client, row):
        import openai

        for bad in (["a", "b", "c", "d", "e"], [""], [3]):
            try:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}], stop=bad
                )
            except openai.BadRequestError as exc:
                errors.append(exc.body["param"])
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], stop="x")
        return 1.0

    AgentEndpointRollout(agent=agent)(request(chat, ["calls=0"], backend=smol_policy(chat)))
    assert errors == ["stop"] * 3


@pytest.mark.parametrize("refuse", [False, True])
def test_tool_choice_other_than_auto_is_served_unforced_counted_and_logged_once(chat, refuse, caplog, monkeypatch):
    import logging

    from support.endpoint import request
    from trl_plugins.rollout.endpoint import AgentEndpointRollout
    from trl_plugins.rollout.endpoint import agent as agent_module
    from trl_plugins.rollout.metrics import rollout_metrics

    monkeypatch.setattr(agent_module, "_UNFORCED_LOGGED", set())
    outcomes = []
    choices = [
        "required",
        "required",
        "none",
        {"type": "function", "function": {"name": "code_interpreter"}},
        "auto",
        {"type": "function", "function": {"name": "not_a_tool"}},
    ]

    async def agent(client, row):
        import openai

        for choice in choices:
            try:
                reply = await client.chat.completions.create(
                    model="policy",
                    tools=[SCHEMA],
                    tool_choice=choice,
                    messages=[{"role": "user", "content": row["prompt"]}],
                )
                outcomes.append(reply.choices[0].finish_reason)
            except openai.BadRequestError as exc:
                outcomes.append(exc.body["message"])
        return 1.0

    with caplog.at_level(logging.WARNING, logger=agent_module.logger.name):
        result = AgentEndpointRollout(agent=agent, refuse_unforced_tool_choice=refuse)(request(chat, ["calls=0"]))
    assert "not among the tools" in outcomes[-1] and outcomes[-2] == "stop"  # auto: honoured either way
    if refuse:
        assert all("refuse_unforced_tool_choice is set" in o for o in outcomes[:4])
        assert result.counters == {} and len(result.trajectories[0].turns) == 1
        return
    assert outcomes[:4] == ["stop"] * 4  # served as auto: the model chose (it answered)
    assert result.counters == {"endpoint/tool_choice_unforced": 4.0}
    assert rollout_metrics(result)["endpoint/tool_choice_unforced"] == 4.0
    logged = [r.getMessage() for r in caplog.records if "served as 'auto'" in r.getMessage()]
    assert len(logged) == 3 and all("refuse_unforced_tool_choice" in m for m in logged)  # once per kind
