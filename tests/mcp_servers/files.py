"""A real MCP server for the sandbox tests (the SDK's MCPServer, stdio): it does what the model asks with files and
sockets, as a shell or files server would. ``python files.py [DIR]`` (DIR: work there). Each tool answers
``ERR <exception name>`` instead of failing, so a test reads what was refused."""

import os
import socket
import sys

from mcp.server.mcpserver import MCPServer

app = MCPServer("files")


@app.tool(description="The text of the file at path.")
def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return f"ERR {type(exc).__name__}"


@app.tool(description="Write text to the file at path.")
def write(path: str, text: str) -> str:
    try:
        with open(path, "w") as f:
            f.write(text)
        return "ok"
    except OSError as exc:
        return f"ERR {type(exc).__name__}"


@app.tool(description="Open a TCP connection to 127.0.0.1:port and close it.")
def connect(port: int) -> str:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return "ok"
    except OSError as exc:
        return f"ERR {type(exc).__name__}"


@app.tool(description="Allocate mb megabytes and let them go.")
def alloc(mb: int) -> str:
    try:
        bytearray(mb << 20)
        return "ok"
    except MemoryError as exc:
        return f"ERR {type(exc).__name__}"


@app.tool(description="The working directory and its files.")
def where() -> str:
    return f"{os.getcwd()}|{','.join(sorted(os.listdir('.')))}"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.chdir(sys.argv[1])
    app.run()
