"""A scripted judge: an OpenAI-compatible ``/v1/chat/completions`` server that scores without a model, for the judge
recipe layer (recipes/retool_judge.yaml), its tests and ``benchmarks/judge.py``; an example of the protocol a judge
speaks (docs/rewards.md). Standard library only; it binds 127.0.0.1.

    python examples/judges/scripted_judge.py --port 8011 [--latency_s 0.2]

How it scores (deterministic, so a group's scores do not depend on the order it sees the responses in): a response
whose last ``\\boxed{}`` holds the reference answer gets the top of the scale, one that mentions the reference
elsewhere the middle, any other the bottom. It reads the scale, the reference and the responses from the default
rubrics of :mod:`trl_plugins.rewards.judge`, and answers in JSON when the request asks for a JSON schema, else with
``Score: x`` lines. A prompt that asks for a verdict the way verifiers' reference judge does (``Reference answer:``
and ``Response:`` in fenced blocks, ending ``Respond either "yes" or "no" only.``; docs/environments.md) gets the
positive label for a response whose last ``\\boxed{}`` holds the reference, else the negative one; with an empty
reference, a reply that holds no verdict (a judge that cannot grade).

Faults for tests: ``POST /control`` with ``{"fault": F, "count": N, "retry_after": S, "latency_s": L}`` makes the
next ``N`` requests (``-1``: all) fail with ``F``: ``500``, ``429`` (with ``Retry-After: S``), ``hang`` (answers after
600 s), ``malformed`` (200 with no completion), ``truncated`` (``finish_reason: length``), ``unparsable`` (an answer
with no score), ``out_of_scale``; ``ok`` clears it. ``GET /stats`` returns ``{"requests": n, "keys": [...], "max_in_flight": m}`` (the
``Authorization`` headers seen, for the test that the key reaches only the judge; the most requests it held at once).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_lock = threading.Lock()
_state: dict[str, Any] = {
    "fault": "ok",
    "count": 0,
    "retry_after": 1.0,
    "latency_s": 0.0,
    "requests": 0,
    "keys": [],
    "in_flight": 0,
    "max_in_flight": 0,
}


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth, i = 1, start + len("\\boxed{")
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start + len("\\boxed{") : i - 1] if depth == 0 else None


def _score(response: str, reference: str, low: float, high: float) -> float:
    if reference and _boxed(response) is not None and _boxed(response).strip() == reference.strip():
        return high
    if reference and reference.strip() in response:
        return (low + high) / 2
    return low


def score_prompt(prompt: str) -> tuple[list[float], bool]:
    """The scores the scripted judge gives the responses in ``prompt`` (a default rubric), and whether it is a group."""
    scale = re.search(r"from (-?[\d.]+) \(wrong or unhelpful\) to (-?[\d.]+)", prompt)
    low, high = (float(scale.group(1)), float(scale.group(2))) if scale else (0.0, 10.0)
    ref = re.search(r"Reference answer: (.*?)\n", prompt)
    reference = ref.group(1) if ref and ref.group(1) != "none given" else ""
    parts = re.split(r"\n\nResponse (\d+):\n", prompt)
    if len(parts) > 1:  # a group: "Response i:" sections, the last one ends at the scoring line
        responses = [parts[k].rsplit("\n\nScore every response", 1)[0] for k in range(2, len(parts), 2)]
        return [_score(r, reference, low, high) for r in responses], True
    body = prompt.split("Response:\n", 1)[-1].rsplit("\n\nScore the response", 1)[0]
    return [_score(body, reference, low, high)], False


_VERDICT = re.compile(
    r"Reference answer:\n```\n(?P<reference>.*?)\n```\n.*?Response:\n```\n(?P<response>.*?)\n```\n+"
    r'Respond either "(?P<positive>[^"\n]+)" or "(?P<negative>[^"\n]+)" only\.\s*$',
    re.S,
)


def verdict(prompt: str) -> str | None:
    """The scripted judge's reply to a verifiers reference-judge prompt (the positive label for a response that boxes
    the reference answer, else the negative one; with an empty reference, no verdict), or None for any other prompt."""
    found = _VERDICT.search(prompt)
    if found is None:
        return None
    if not found["reference"].strip():
        return "I cannot grade this without a reference answer."
    right = _score(found["response"], found["reference"], 0.0, 1.0) == 1.0
    return found["positive"] if right else found["negative"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: with Nagle, each answer waited ~40 ms

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/stats":
            with _lock:
                self._send(200, {k: _state[k] for k in ("requests", "keys", "max_in_flight")})
        elif self.path.rstrip("/").endswith("/models"):
            self._send(200, {"object": "list", "data": [{"id": "scripted-judge", "object": "model"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path.rstrip("/") == "/control":
            with _lock:
                _state.update({k: body[k] for k in ("fault", "count", "retry_after", "latency_s") if k in body})
                if body.get("fault") == "ok":
                    _state["count"] = 0
            self._send(200, {"ok": True})
            return
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        with _lock:
            _state["requests"] += 1
            if self.headers.get("Authorization"):
                _state["keys"].append(self.headers["Authorization"])
            fault = _state["fault"] if _state["count"] != 0 else "ok"
            if _state["count"] > 0:
                _state["count"] -= 1
            latency, retry_after = _state["latency_s"], _state["retry_after"]
            _state["in_flight"] += 1
            _state["max_in_flight"] = max(_state["max_in_flight"], _state["in_flight"])
        try:
            time.sleep(600 if fault == "hang" else latency)
        finally:
            with _lock:
                _state["in_flight"] -= 1
        if fault == "500":
            self._send(500, {"error": {"message": "scripted failure"}})
            return
        if fault == "429":
            self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": f"{retry_after:g}"})
            return
        if fault == "malformed":
            self._send(200, b'{"id": "x", "object": "chat.completion"')
            return
        prompt = body["messages"][-1]["content"]
        judged = verdict(prompt)
        scores, group = score_prompt(prompt) if judged is None else ([], False)
        if fault == "out_of_scale":
            scores = [s + 1000 for s in scores]
        if judged is not None:
            text = judged
        elif body.get("response_format", {}).get("type") == "json_schema":
            text = json.dumps({"scores": scores} if group else {"score": scores[0]})
        elif group:
            text = "\n".join(f"Response {i + 1} score: {s:g}" for i, s in enumerate(scores))
        else:
            text = f"The response is graded.\nScore: {scores[0]:g}"
        if fault == "unparsable":
            text = "I cannot grade this."
        finish = "length" if fault == "truncated" else "stop"
        if fault == "truncated":
            text = text[: len(text) // 2]
        self._send(
            200,
            {
                "id": "chatcmpl-scripted",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "scripted-judge"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": len(text.split()),
                    "total_tokens": len(prompt.split()) + len(text.split()),
                },
            },
        )


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # the listen backlog: a judge at concurrency 32+ connects at once (the default is 5)


def serve(port: int = 0, latency_s: float = 0.0) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start the scripted judge on 127.0.0.1:``port`` (0: a free port) in a daemon thread; ``server.server_port``
    is the port. Its state (faults, counters) is this module's, shared by every server it starts."""
    with _lock:
        _state.update(fault="ok", count=0, latency_s=latency_s, requests=0, keys=[], in_flight=0, max_in_flight=0)
    server = _Server(("127.0.0.1", port), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="scripted-judge", daemon=True)
    thread.start()
    return server, thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--latency_s", type=float, default=0.0, help="seconds before each answer")
    args = parser.parse_args()
    server, thread = serve(args.port, args.latency_s)
    print(f"scripted judge on http://127.0.0.1:{server.server_port}/v1", flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
