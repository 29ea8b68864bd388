"""A minimal real MCP server over stdio, standard library only (starts in ~70 ms with ``python -I -S``).

It speaks the ``initialize`` handshake revisions (newline-delimited JSON-RPC on stdin/stdout) and answers
``server/discover`` with "method not found", so a client in ``auto`` mode falls back to the handshake, as it does
with any older server. ``python -I -S tiny.py [NAME VERSION]`` (default ``tiny 0.4.2``): the ``serverInfo`` it
announces. Tools: echo (its text back), media (a result holding only an image, audio, a resource link or an
embedded resource), pid (the server's process id),
oops (an isError result)."""

import json
import os
import sys

NAME, VERSION = (sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else ("tiny", "0.4.2")
TOOLS = [
    {
        "name": "echo",
        "description": "Say the text back.",
        "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
    {
        "name": "media",
        "description": "A result with no text: only one block of the kind asked for.",
        "inputSchema": {
            "type": "object",
            "properties": {"kind": {"enum": ["image", "audio", "resource_link", "resource"]}},
            "required": ["kind"],
        },
    },
    {"name": "pid", "description": "The server's process id.", "inputSchema": {"type": "object", "properties": {}}},
    {
        "name": "oops",
        "description": "Always an error result (isError).",
        "inputSchema": {"type": "object", "properties": {"why": {"type": "string"}}, "required": ["why"]},
    },
]
# TINY_ALSO_OFFERS=a,b: more tools of those names, each answering as echo does (a name another server offers too).
TOOLS += [
    dict(TOOLS[0], name=n, description=f"Say the text back (as {n}).")
    for n in os.environ.get("TINY_ALSO_OFFERS", "").split(",")
    if n
]
MEDIA = {
    "image": {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
    "audio": {"type": "audio", "data": "UklGRg==", "mimeType": "audio/wav"},
    "resource_link": {
        "type": "resource_link",
        "uri": "file:///srv/report.pdf",
        "name": "report",
        "mimeType": "application/pdf",
    },
    "resource": {
        "type": "resource",
        "resource": {"uri": "file:///srv/notes.txt", "mimeType": "text/plain", "text": "the notes"},
    },
}


def _result(method, params):
    if method == "initialize":
        return {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {}},
            "serverInfo": {"name": NAME, "version": VERSION},
        }
    if method == "ping":
        return {}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        name, args = params.get("name"), params.get("arguments") or {}
        if name == "echo" or name in os.environ.get("TINY_ALSO_OFFERS", "").split(","):
            return {"content": [{"type": "text", "text": args.get("text", "")}], "isError": False}
        if name == "media":
            return {"content": [MEDIA[args["kind"]]], "isError": False}
        if name == "oops":
            return {"content": [{"type": "text", "text": f"failed: {args.get('why', '')}"}], "isError": True}
        if name == "pid":
            return {"content": [{"type": "text", "text": str(os.getpid())}], "isError": False}
    return None


def main():
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "id" not in msg or "method" not in msg:  # a notification or a response: nothing to answer
            continue
        result = _result(msg["method"], msg.get("params") or {})
        reply = (
            {"jsonrpc": "2.0", "id": msg["id"], "result": result}
            if result is not None
            else {"jsonrpc": "2.0", "id": msg["id"], "error": {"code": -32601, "message": f"no method {msg['method']}"}}
        )
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
