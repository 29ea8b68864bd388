"""The agents of examples/agents/, each written with a framework as its docs teach, against the real endpoint with
scripted samples: what each framework sends (route, streaming, ``tool_choice``, ``stop``), that its tool call is
executed and its output observed, and that its trajectories are token for token those of a plain ``openai`` agent
sending the same system prompt and tools (one segment per trajectory) where the framework does not rewrite history.

Each framework is skipped where it is not installed (the ``agents`` and ``dev`` extras install them). AutoGen's and
DSPy's examples run as commands in an interpreter of their own (:data:`MAKE_AUTOGEN`, which ``.ci/run`` runs); their
tests skip, naming that command, where it is absent."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path

import pytest

from support.endpoint import SCHEMA, EchoTool, endpoint_chat, run_code
from trl_plugins.rollout import ChatFormat, RolloutQuestion, RolloutRequest, ScriptedBackend
from trl_plugins.rollout.endpoint import AgentEndpointRollout
from trl_plugins.rollout.endpoint.agent import NOTHING_ASKED, _load
from trl_plugins.tiny import build_tokenizer
from trl_plugins.types import StopReason


@pytest.fixture(scope="module")
def chat():
    return endpoint_chat()


ROOT = Path(__file__).resolve().parents[1]


def _benchmark():
    spec = importlib.util.spec_from_file_location("agent_frameworks_benchmark", ROOT / "benchmarks/agent_frameworks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _benchmark()
"""benchmarks/agent_frameworks.py, which finds AutoGen's and DSPy's interpreter for the tests too (one copy)."""
MAKE_AUTOGEN = bench.MAKE_OWN_PYTHON
"""The one command (in the repository's root) that makes the interpreter of AutoGen's and DSPy's examples, whose pins
conflict with the project's (constraints/autogen.txt); ``.ci/run`` runs it."""
own_python = bench.own_python
"""That interpreter: ``$TRL_PLUGINS_AUTOGEN_PYTHON``, else ``.venv-autogen/bin/python`` here (None: neither)."""

OWN_PYTHON = own_python()
needs_own_python = pytest.mark.skipif(
    OWN_PYTHON is None, reason=f"no AutoGen/DSPy interpreter: make it with {MAKE_AUTOGEN}"
)
PROMPTS = ["calls=2", "calls=0 think", "calls=1 think"]


def script_for(chat):
    """Scripted samples: ``calls=N`` code calls (``print(k)``), then the answer: ``\\boxed{7}`` as text, or through the
    framework's own answer tool where the request offers one (pydantic-ai's ``final_result``, smolagents'
    ``final_answer``). ``think`` opens each turn with a reasoning block. Calls done are counted by their outputs."""
    tok = chat.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def call(name: str, arguments: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        question = re.findall(r"user\n(.*?)<\|im_end\|>", text, re.DOTALL)[0]
        think = "<think>I should compute.</think>\n" if "think" in question else ""
        done = len(set(re.findall(r"ran print\((\d+)\)", text)))
        calls = int(re.search(r"calls=(\d+)", question).group(1))
        if "[[ ## next_tool_name ## ]]" in text:  # a step of DSPy's ReAct: its fields as text, no tools offered
            name, arguments = ("code_interpreter", {"code": f"print({done})"}) if done < calls else ("finish", {})
            return tok(
                f"[[ ## next_thought ## ]]\nStep {done}.\n\n[[ ## next_tool_name ## ]]\n{name}\n\n"
                f"[[ ## next_tool_args ## ]]\n{json.dumps(arguments)}\n\n[[ ## completed ## ]]",
                add_special_tokens=False,
            )["input_ids"] + [im_end]
        if "[[ ## answer ## ]]" in text:  # its extraction of the answer from the trajectory
            return tok(
                "[[ ## reasoning ## ]]\nDone.\n\n[[ ## answer ## ]]\n\\boxed{7}\n\n[[ ## completed ## ]]",
                add_special_tokens=False,
            )["input_ids"] + [im_end]
        if done < calls:
            body = f"Step {done}.\n" + call(*bench.code_call(text, done))
            if "observe" in question:  # the model goes on to write the observation itself
                body += "\nObservation: ran print(9)"
        elif '"name": "final_result"' in text:
            body = call("final_result", {"answer": "7"})
        elif '"name": "final_answer"' in text:
            body = call("final_answer", {"answer": "\\boxed{7}"})
        else:
            body = "The answer is \\boxed{7}."
        return tok(think + body, add_special_tokens=False)["input_ids"] + [im_end]

    return script


def request(chat, prompts=PROMPTS, tools=None) -> RolloutRequest:
    questions = [
        RolloutQuestion(
            f"q{i}", chat.initial_prompt_ids([{"role": "user", "content": p}]), i, row={"prompt": p, "answer": "7"}
        )
        for i, p in enumerate(prompts)
    ]
    return RolloutRequest(
        questions,
        1,
        ScriptedBackend(script_for(chat), stop_token_ids=chat.stop_token_ids),
        chat,
        tools or {},
        policy_step=2,
        seed=5,
    )


@pytest.fixture
def wire(monkeypatch):
    """Every request the endpoint serves, as (route, body)."""
    seen: list[tuple[str, dict]] = []
    serve = AgentEndpointRollout._serve

    async def spy(self, http, *args, **kwargs):
        seen.append((http.path.split("/v1/", 1)[-1], http.json() if http.method == "POST" else {}))
        return await serve(self, http, *args, **kwargs)

    monkeypatch.setattr(AgentEndpointRollout, "_serve", spy)
    return seen


def example(framework: str, fn: str, module: str, monkeypatch):
    """The example agent's function, loaded as ``agent: examples/agents/<framework>/agent.py:<fn>`` loads it, with its
    sandboxed ``run_python`` replaced by the scripted tool (``ran <code>``)."""
    pytest.importorskip(module)
    agent = _load(f"{ROOT}/examples/agents/{framework}/agent.py:{fn}")

    async def run_python(code: str) -> str:
        return run_code({"code": code})

    def run_python_sync(code: str) -> str:  # smolagents' tools are plain functions
        return run_code({"code": code})

    sync = not inspect.iscoroutinefunction(agent.__globals__["run_python"])
    monkeypatch.setitem(agent.__globals__, "run_python", run_python_sync if sync else run_python)
    return agent


def reference(system: str, tools: list[dict]):
    """A plain ``openai`` chat-completions agent sending ``system`` and ``tools``: what the framework should train."""

    async def agent(client, row):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": row["prompt"]}]
        while True:
            reply = await client.chat.completions.create(model="m", messages=messages, tools=tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or message.tool_calls[0].function.name in ("final_result", "final_answer"):
                return 1.0
            for c in message.tool_calls:
                output = run_code(json.loads(c.function.arguments))
                messages.append({"role": "tool", "tool_call_id": c.id, "content": output})

    return agent


def chat_tools(route: str, body: dict) -> tuple[str, list[dict]]:
    """The system prompt and tools of a framework's first request, as chat completions sends them."""
    if route == "responses":
        tools = [
            {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
            for t in body["tools"]
        ]
        if "instructions" in body:
            return body["instructions"], tools
        system = body["input"][0]  # pydantic-ai: a system message item
        assert system["role"] == "system", system
        content = system["content"]
        return (content if isinstance(content, str) else "".join(p["text"] for p in content)), tools
    return body["messages"][0]["content"], body["tools"]


def two_rollouts(chat, agent, wire):
    """Two rollouts of ``agent`` (two training steps: each runs its agents on an event loop of its own); the second's
    result, and the requests it served."""
    AgentEndpointRollout(agent=agent)(request(chat))
    wire.clear()
    result = AgentEndpointRollout(agent=agent)(request(chat))
    return result, list(wire)


def check_trajectories(chat, got, wire, *, stop_reason=StopReason.FINAL_ANSWER):
    """Every agent answered with 1.0, observed its calls' outputs, and trained exactly the reference's tokens."""
    route, first = wire[0]
    ref = AgentEndpointRollout(agent=reference(*chat_tools(route, first)))(request(chat)).trajectories
    for traj, want, prompt in zip(got, ref, PROMPTS):
        assert traj.error is None and traj.stop_reason == stop_reason == want.stop_reason
        assert {c.name: c.value for c in traj.reward_components}["agent_return"] == 1.0
        calls = int(prompt[6])
        assert len(traj.turns) == calls + 1 and traj.num_segments == 1
        last = chat.tokenizer.decode(traj.turns[-1].prompt_ids)
        assert all(f"ran print({k})" in last for k in range(calls))  # each call ran, its output observed
        for before, after in zip(traj.turns, traj.turns[1:]):  # each prompt continues the previous turn
            seen = before.prompt_ids + before.completion_ids
            assert after.prompt_ids[: len(seen)] == seen and not after.segment_start
        assert [(t.prompt_ids, t.completion_ids, t.segment_start) for t in traj.turns] == [
            (t.prompt_ids, t.completion_ids, t.segment_start) for t in want.turns
        ]


@pytest.mark.parametrize("fn", ["solve", "solve_streamed"])
def test_openai_agents_sdk_runs_on_the_responses_api_streaming_or_not(chat, wire, monkeypatch, fn):
    agent = example("openai_agents_sdk", fn, "agents", monkeypatch)
    assert os.environ["OPENAI_AGENTS_DISABLE_TRACING"] == "1"  # set by the example: no trace uploads
    result, ours = two_rollouts(chat, agent, wire)
    assert {route for route, _ in ours} == {"responses"}  # the SDK's default: the Responses API
    assert not any("previous_response_id" in body for _, body in ours)  # the whole conversation, every turn
    assert {bool(body.get("stream")) for _, body in ours} == {fn == "solve_streamed"}
    assert not any("tool_choice" in body or "stop" in body for _, body in ours)
    check_trajectories(chat, result.trajectories, wire)
    assert result.counters == {}


@pytest.mark.parametrize("fn", ["solve", "solve_streamed"])
def test_langgraph_react_agent_runs_on_chat_completions_invoked_or_streamed(chat, wire, monkeypatch, fn):
    pytest.importorskip("langchain_openai")
    agent = example("langgraph", fn, "langgraph", monkeypatch)
    result, ours = two_rollouts(chat, agent, wire)
    assert {route for route, _ in ours} == {"chat/completions"}
    assert {bool(body.get("stream")) for _, body in ours} == {fn == "solve_streamed"}
    assert not any("tool_choice" in body or "stop" in body for _, body in ours)
    check_trajectories(chat, result.trajectories, wire)
    assert result.counters == {}


def test_pydantic_ai_typed_output_runs_on_the_responses_api_with_tool_choice_served_unforced(chat, wire, monkeypatch):
    agent = example("pydantic_ai", "solve", "pydantic_ai", monkeypatch)
    result, ours = two_rollouts(chat, agent, wire)
    assert {route for route, _ in ours} == {"responses"}  # 'openai:' models are OpenAIResponsesModel
    assert {body.get("tool_choice") for _, body in ours} == {"required"}  # the typed output's final_result tool
    assert result.counters == {"endpoint/tool_choice_unforced": float(len(ours))}
    # the answer is the output tool's call, which the agent does not answer: the turn ends the trajectory as a call
    check_trajectories(chat, result.trajectories, wire, stop_reason=StopReason.NO_TOOL_CALL)


def test_smolagents_tool_calling_agent_sends_stop_and_required_and_rewrites_every_turn(chat, wire, monkeypatch):
    agent = example("smolagents", "solve", "smolagents", monkeypatch)
    result, ours = two_rollouts(chat, agent, wire)
    assert {route for route, _ in ours} == {"chat/completions"} and not any(body.get("stream") for _, body in ours)
    assert all(body["stop"] == ["Observation:", "Calling tools:"] for _, body in ours)
    assert all(body["tool_choice"] == "required" for _, body in ours)
    assert result.counters == {"endpoint/tool_choice_unforced": float(len(ours))}
    # earlier turns come back as text ("Calling tools: [...]" as the assistant, "Observation: ..." as the user), not as
    # our reply's tool calls: every turn is a rewrite, a segment of its own
    resent = [m for _, body in ours for m in body["messages"][2:]]
    assert any(m["role"] == "user" and m["content"][0]["text"] == "Observation:\nran print(0)" for m in resent)
    assert any(m["role"] == "assistant" and "Calling tools:" in m["content"][0]["text"] for m in resent)
    assert not any(m["role"] == "tool" or m.get("tool_calls") for m in resent)
    tok = chat.tokenizer
    for traj, prompt in zip(result.trajectories, PROMPTS):
        calls = int(prompt[6])
        assert traj.error is None and traj.stop_reason == StopReason.NO_TOOL_CALL  # it answers by its final_answer call
        assert {c.name: c.value for c in traj.reward_components}["agent_return"] == 1.0
        assert len(traj.turns) == traj.num_segments == calls + 1 and all(t.segment_start for t in traj.turns[1:])
        assert all(f"ran print({k})" in tok.decode(traj.turns[-1].prompt_ids) for k in range(calls))


def test_smolagents_stop_ends_the_turn_where_the_model_writes_an_observation(chat, wire, monkeypatch):
    agent = example("smolagents", "solve", "smolagents", monkeypatch)
    traj = AgentEndpointRollout(agent=agent)(request(chat, ["calls=1 observe"])).trajectories[0]
    (turn,) = traj.turns
    text = chat.tokenizer.decode(turn.completion_ids)
    # generation ended at the stop: nothing sampled after it is in the trajectory, the stop's own text stays as sampled
    assert text.endswith("</tool_call>\nObservation:") and "ran print(9)" not in text
    # ... after the call, where the endpoint parses it as text after a tool call (docs/agents.md, smolagents' traps)
    assert traj.stop_reason == StopReason.INVALID_ACTION and traj.error == "text after the tool call"


def test_claude_agent_sdk_runs_its_loop_in_the_bundled_cli_on_the_messages_api(chat, wire, monkeypatch, tmp_path):
    agent = example("claude_agent_sdk", "solve", "claude_agent_sdk", monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # the CLI's home is the agent's own temporary one, not the caller's
    result = AgentEndpointRollout(agent=agent, client="anthropic")(request(chat))
    assert {route.split("?")[0] for route, _ in wire} == {"messages"} and all(body["stream"] for _, body in wire)
    first = wire[0][1]
    system = first["system"] if isinstance(first["system"], str) else "".join(b["text"] for b in first["system"])
    assert agent.__globals__["SYSTEM"] in system  # the recipe's system prompt replaces Claude Code's
    assert [t["name"] for t in first["tools"]] == ["DeferredToolPlaceholder", bench.SDK_CODE_TOOL]
    assert not any("tool_choice" in body or "stop_sequences" in body for _, body in wire)
    tok = chat.tokenizer
    for traj, prompt in zip(result.trajectories, PROMPTS):
        calls = int(prompt[6])
        assert traj.error is None and traj.stop_reason == StopReason.FINAL_ANSWER, traj.error
        assert {c.name: c.value for c in traj.reward_components}["agent_return"] == 1.0
        assert len(traj.turns) == calls + 1 and traj.num_segments == 1
        assert [c.name for t in traj.turns for c in t.tool_calls] == [bench.SDK_CODE_TOOL] * calls
        assert all(f"ran print({k})" in tok.decode(traj.turns[-1].prompt_ids) for k in range(calls))
        for before, after in zip(traj.turns, traj.turns[1:]):  # each prompt continues the previous turn
            seen = before.prompt_ids + before.completion_ids
            assert after.prompt_ids[: len(seen)] == seen and not after.segment_start
    assert list(home.iterdir()) == []  # nothing written to the caller's home (~/.claude, ~/.claude.json)
    # Token for token what a plain chat-completions agent trains when it sends the same conversation: the CLI's first
    # request of each trajectory (its system blocks, the question, its environment reminder) as the chat dialect
    # receives it, then each reply and tool output.
    from trl_plugins.rollout.endpoint.messages import chat_body

    firsts = {body["messages"][0]["content"]: body for _, body in wire if len(body["messages"]) == 2}

    async def plain(client, row):
        opening = chat_body(firsts[row["prompt"]], max_assistant_tokens=4096)
        messages = list(opening["messages"])
        while True:
            reply = await client.chat.completions.create(model="m", messages=messages, tools=opening["tools"])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return 1.0
            for c in message.tool_calls:
                output = run_code({"code": json.loads(c.function.arguments)["code"]})
                messages.append({"role": "tool", "tool_call_id": c.id, "content": output})

    wanted = AgentEndpointRollout(agent=plain)(request(chat)).trajectories
    for traj, want in zip(result.trajectories, wanted):
        assert want.error is None and [(t.prompt_ids, t.completion_ids, t.segment_start) for t in traj.turns] == [
            (t.prompt_ids, t.completion_ids, t.segment_start) for t in want.turns
        ]
    env = agent.__globals__["options"]("http://127.0.0.1:1", "key", str(tmp_path)).env
    assert {k: env[k] for k in agent.__globals__["QUIET"]} == dict.fromkeys(agent.__globals__["QUIET"], "1")
    # Its recipe layer resolves before any model loads, the rollout handing the agent an Anthropic client.
    from trl_plugins.run import resolve_run

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from retool.config import parse_args

    _, training_args = parse_args(["--config", "examples/agents/claude_agent_sdk/retool_agent.yaml"])
    run = resolve_run(training_args)
    assert run.rollout.impl.agent == "examples/agents/claude_agent_sdk/agent.py:solve"
    assert run.rollout.impl.client == "anthropic" and run.rollout.impl.max_trajectory_tokens == 2048


@pytest.mark.parametrize(
    "framework,fn,module",
    [
        ("openai_agents_sdk", "solve", "agents"),
        ("openai_agents_sdk", "solve_streamed", "agents"),
        ("langgraph", "solve", "langgraph"),
        ("langgraph", "solve_streamed", "langgraph"),
        ("pydantic_ai", "solve", "pydantic_ai"),
        ("smolagents", "solve", "smolagents"),
        ("anthropic_sdk", "solve", "anthropic"),
        ("claude_agent_sdk", "solve", "claude_agent_sdk"),
    ],
)
def test_each_example_returns_0_when_a_budget_ends_its_trajectory(chat, monkeypatch, framework, fn, module):
    agent = example(framework, fn, module, monkeypatch)
    # the first turn calls the tool and is the last turn allowed: the agent's next request is refused (trajectory_ended)
    client = bench.CLIENTS.get(framework, "openai")
    (traj,) = AgentEndpointRollout(agent=agent, max_turns=1, client=client)(request(chat, ["calls=1"])).trajectories
    assert traj.stop_reason == StopReason.MAX_TURNS and len(traj.turns) == 1
    assert {c.name: c.value for c in traj.reward_components}.get("agent_return") == 0.0  # it returned, did not raise


@pytest.fixture(scope="module")
def chat_qwen3():
    return ChatFormat(build_tokenizer("qwen3"), [SCHEMA], final_answer_pattern=r"\\boxed\{", calls_per_turn=2)


@pytest.mark.parametrize(
    "framework,module,restore,segments,counters",
    [
        ("openai_agents_sdk", "agents", False, 1, {}),  # the reasoning items go back as input
        ("pydantic_ai", "pydantic_ai", False, 1, {"endpoint/tool_choice_unforced": 3.0}),  # its reasoning goes back too
        ("langgraph", "langgraph", False, 3, {"endpoint/reasoning_dropped_rewrites": 2.0}),  # LangChain drops it
        ("langgraph", "langgraph", True, 1, {"endpoint/reasoning_restored": 2.0}),
    ],
)
def test_a_thinking_model_on_a_qwen3_style_template_keeps_one_segment_where_the_framework_sends_reasoning_back(
    chat_qwen3, monkeypatch, framework, module, restore, segments, counters
):
    agent = example(framework, "solve", module, monkeypatch)
    rollout = AgentEndpointRollout(agent=agent, restore_dropped_reasoning=restore)
    result = rollout(request(chat_qwen3, ["calls=2 think"]))
    (traj,) = result.trajectories
    assert traj.error is None and len(traj.turns) == 3 and traj.num_segments == segments
    assert {c.name: c.value for c in traj.reward_components}["agent_return"] == 1.0
    assert result.counters == counters


@pytest.mark.parametrize(
    "framework,module,rewards",
    [
        ("openai_agents_sdk", "agents", ["correct", "format"]),
        ("langgraph", "langgraph", ["correct", "format"]),
        ("pydantic_ai", "pydantic_ai", ["agent_reward"]),
        ("smolagents", "smolagents", ["agent_reward"]),
    ],
)
def test_each_framework_config_resolves_before_any_model_loads(monkeypatch, framework, module, rewards):
    pytest.importorskip(module)
    from trl_plugins.run import resolve_run

    monkeypatch.chdir(ROOT)  # the config names the agent by its path from the repository root
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from retool.config import parse_args

    _, training_args = parse_args(["--config", f"examples/agents/{framework}/retool_agent.yaml"])
    run = resolve_run(training_args)
    assert run.rollout.name == "agent_endpoint" and run.rollout.agent_conversation
    assert run.rollout.impl.agent == f"examples/agents/{framework}/agent.py:solve"
    assert list(training_args.reward_components) == rewards
    assert callable(_load(run.rollout.impl.agent))


def test_the_autogen_interpreter_is_made_by_ci_before_the_suite_and_its_command_is_documented():
    ci = (ROOT / ".ci" / "run").read_text()
    assert MAKE_AUTOGEN in ci.splitlines() and ci.index(MAKE_AUTOGEN) < ci.index("python -m pytest")
    assert MAKE_AUTOGEN in (ROOT / "docs" / "agents.md").read_text()
    assert f"#   {MAKE_AUTOGEN}" in (ROOT / "constraints" / "autogen.txt").read_text()


def test_the_frameworks_benchmark_measures_every_example_and_names_how_to_make_a_missing_interpreter(
    monkeypatch, tmp_path, capsys
):
    # docs/agents.md's table has a row per example: the benchmark runs each one (autogen and dspy as commands)
    assert sorted(bench.FRAMEWORKS) == sorted(p.parent.name for p in (ROOT / "examples/agents").glob("*/*.yaml"))
    assert bench.HARNESSES == ["claude_code"] and not (ROOT / "examples/agents/claude_code/agent.py").exists()
    assert set(bench.COMMANDS) == {"autogen", "dspy"}
    monkeypatch.setenv("TRL_PLUGINS_AUTOGEN_PYTHON", str(tmp_path / "absent"))
    assert bench.own_python() is None
    # more calls than the command examples' 4 iterations allow: refused, naming the limit
    monkeypatch.setattr(sys, "argv", ["agent_frameworks.py", "--calls", "4", "--frameworks", "dspy"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "at most 3 calls" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["agent_frameworks.py", "--frameworks", "autogen", "dspy"])
    bench.main()  # both skipped: nothing is measured
    lines = capsys.readouterr().out.splitlines()
    for framework in ("autogen", "dspy"):
        (line,) = [line for line in lines if line.startswith(framework)]
        assert "skipped" in line and MAKE_AUTOGEN in line


@pytest.mark.slow  # ~5 s: three processes that import AutoGen
@needs_own_python
@pytest.mark.parametrize("stream", [False, True])
def test_autogen_assistant_agent_runs_as_a_command_on_chat_completions_streamed_or_not(chat, wire, stream):
    # the example as its YAML runs it: a command in AutoGen's interpreter, its tool the run's (through tools/call)
    command = [OWN_PYTHON, str(ROOT / "examples/agents/autogen/agent.py"), *(["--stream"] if stream else [])]
    result = AgentEndpointRollout(command=command)(request(chat, tools={"code_interpreter": EchoTool()}))
    ours = [(route, body) for route, body in wire if route != "tools/call"]
    calls = [body for route, body in wire if route == "tools/call"]
    assert {route for route, _ in ours} == {"chat/completions"}
    assert {bool(body.get("stream")) for _, body in ours} == {stream}
    assert {body.get("tool_choice") for _, body in ours} == {"auto"} and not any("stop" in body for _, body in ours)
    assert sorted(c["arguments"]["code"] for c in calls) == ["print(0)", "print(0)", "print(1)"]  # 2 + 0 + 1 calls
    check_trajectories(chat, result.trajectories, ours)
    assert result.counters == {}


@pytest.mark.parametrize("framework,rewards", [("autogen", ["correct", "format"]), ("dspy", ["agent_reward"])])
def test_the_autogen_and_dspy_configs_run_their_example_as_a_command_with_the_runs_tool(
    monkeypatch, framework, rewards
):
    from trl_plugins.run import resolve_run

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    from retool.config import parse_args

    _, training_args = parse_args(["--config", f"examples/agents/{framework}/retool_agent.yaml"])
    run = resolve_run(training_args)
    try:
        assert run.rollout.name == "agent_endpoint" and run.rollout.agent_conversation and run.rollout.offers_tools
        assert run.rollout.impl.command == [".venv-autogen/bin/python", f"examples/agents/{framework}/agent.py"]
        assert list(run.tools) == ["code_interpreter"]  # the recipe's sandbox, which the agent asks for by name
        assert list(training_args.reward_components) == rewards
    finally:
        run.close()


@pytest.mark.slow  # ~6 s: four processes that import DSPy
@needs_own_python
@pytest.mark.parametrize("cache", [True, False])
def test_dspy_replays_an_earlier_runs_completions_from_its_cache_unless_its_lm_is_built_with_cache_false(
    chat, wire, monkeypatch, tmp_path, cache
):
    monkeypatch.setenv("DSPY_CACHEDIR", str(tmp_path))  # DSPy's disk cache (~/.dspy_cache), shared by the two runs
    example_py = ROOT / "examples/agents/dspy/agent.py"
    # cache=False: the example as its YAML runs it; cache=True: the same program on DSPy's default LM
    command = (
        [OWN_PYTHON, str(example_py)]
        if not cache
        else [
            OWN_PYTHON,
            "-c",
            (
                f"import json, sys; sys.path.insert(0, {str(example_py.parent)!r}); import agent; "
                "print(json.dumps(agent.solve(json.load(sys.stdin), agent.build_lm(cache=True))))"
            ),
        ]
    )
    tools = {"code_interpreter": EchoTool()}
    runs = []
    for _ in range(2):  # two runs of the same question, each against its own endpoint (another base URL and key)
        wire.clear()
        (traj,) = AgentEndpointRollout(command=command)(request(chat, ["calls=1"], tools=tools)).trajectories
        runs.append((traj, [route for route, _ in wire]))
        sent = [body for route, body in wire if route == "chat/completions"]
        assert all(
            set(body) == {"model", "messages"} and [m["role"] for m in body["messages"]] == ["system", "user"]
            for body in sent
        )
    (first, first_wire), (second, second_wire) = runs
    # a ReAct step, the tool (the run's, through tools/call), a step that finishes, the answer's extraction; DSPy sends
    # no tools (its fields are text) and the trajectory so far inside a user message: every request is a rewrite
    assert first_wire == ["chat/completions", "tools/call", "chat/completions", "chat/completions"]
    assert first.error is None and first.stop_reason == StopReason.FINAL_ANSWER
    assert len(first.turns) == first.num_segments == 3
    assert {c.name: c.value for c in first.reward_components}["agent_return"] == 1.0
    if cache:
        # the second run's LM calls are answered from the first run's completions: the endpoint sees only the tool,
        # the policy samples nothing, and the trajectory says why
        assert second_wire == ["tools/call"]
        assert second.stop_reason == StopReason.ENVIRONMENT_ERROR and second.error == NOTHING_ASKED
        assert "DSPy" in NOTHING_ASKED and "dspy.LM(..., cache=False)" in NOTHING_ASKED
        assert not any(t.completion_ids for t in second.turns)
    else:
        assert second_wire == first_wire and second.error is None and len(second.turns) == 3
        assert [t.completion_ids for t in second.turns] == [t.completion_ids for t in first.turns]  # sampled afresh
