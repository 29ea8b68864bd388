"""A real MCP server for tests (the SDK's MCPServer), over stdio or streamable HTTP.

``python toy.py [stdio|http PORT] [--prefix P]``. Tools: add, greet (structured), fail (isError), crash (exits
mid-call), hang, garbage (writes a non-JSON line on stdout), picture (an image), ask (asks for elicitation),
remember/recall (state in the process)."""

import os
import sys
import time

from mcp.server.mcpserver import Context, MCPServer
from pydantic import BaseModel

app = MCPServer("toy")
_memory: list[str] = []


class Greeting(BaseModel):
    greeting: str
    length: int


@app.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@app.tool(description="Greet someone, structured.")
def greet(name: str) -> Greeting:
    return Greeting(greeting=f"hello {name}", length=len(name))


@app.tool(description="Always fails.")
def fail(why: str) -> str:
    raise ValueError(f"failed because {why}")


@app.tool(description="Exits the server mid-call.")
def crash() -> str:
    os._exit(3)


@app.tool(description="Never answers.")
def hang() -> str:
    time.sleep(3600)
    return "never"


@app.tool(description="Writes garbage on stdout.")
def garbage() -> str:
    sys.stdout.write("this is not json\n")
    sys.stdout.flush()
    time.sleep(3600)
    return "never"


@app.tool(description="Returns an image.")
def picture() -> list:
    from mcp.server.mcpserver import Image

    return ["a red dot", Image(data=b"\x89PNG\r\n", format="png")]


@app.tool(description="Asks the user a question.")
async def ask(question: str, ctx: Context) -> str:
    class Answer(BaseModel):
        answer: str

    result = await ctx.elicit(question, Answer)
    return str(result)


_running = {"now": 0, "peak": 0}


@app.tool(description="Sleep a little; returns how many calls of it ran at once at most so far.")
async def nap(seconds: float) -> str:
    import asyncio

    _running["now"] += 1
    _running["peak"] = max(_running["peak"], _running["now"])
    await asyncio.sleep(seconds)
    _running["now"] -= 1
    return str(_running["peak"])


@app.tool(description="Remember a word (in the process and in ./memory.txt).")
def remember(word: str) -> str:
    _memory.append(word)
    with open("memory.txt", "a") as f:
        f.write(word + "\n")
    return "ok"


@app.tool(description="Words remembered: the process's, then the file's, and the files in the working directory.")
def recall() -> str:
    kept = open("memory.txt").read().split() if os.path.exists("memory.txt") else []
    return f"{','.join(_memory)}|{','.join(kept)}|{','.join(sorted(os.listdir('.')))}"


if __name__ == "__main__":
    print("toy server starting", file=sys.stderr, flush=True)
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "broken":
        print("cannot open the database: /nonexistent.db", file=sys.stderr, flush=True)
        sys.exit(2)
    else:
        if len(sys.argv) > 2:  # stdio DIR: work there
            os.chdir(sys.argv[2])
        app.run()
