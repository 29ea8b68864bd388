"""One "trainer node" for tests/test_sandbox_service.py: a separate process that builds the code interpreter with the
remote backend, checks the server at start-up as a run does, runs ``n`` calls at once whose outputs name this node,
and prints one JSON line: its pid and the outputs in call order.

    TRL_SANDBOX_TOKEN=... python tests/sandbox_service_node.py URL NODE N
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from trl_plugins.tools.code_interpreter import CodeInterpreter


async def calls(tool: CodeInterpreter, node: str, n: int) -> list[dict]:
    # A short sleep makes the two nodes' calls overlap on the server.
    codes = [f"import time\ntime.sleep(0.05)\nprint('{node}', {i}, {i} * {i})" for i in range(n)]
    outs = await asyncio.gather(*[tool({"code": code}) for code in codes])
    return [{"text": o.text, "ok": o.ok, "infra_error": o.infra_error} for o in outs]


def main(url: str, node: str, n: int) -> None:
    with CodeInterpreter(backend="remote", url=url, timeout_s=5.0, max_concurrency=4) as tool:
        banner = tool.start_up()
        outputs = asyncio.run(calls(tool, node, n))
    print(json.dumps({"pid": os.getpid(), "banner": banner, "outputs": outputs}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
