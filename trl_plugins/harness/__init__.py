"""Agent harnesses the endpoint runs as commands, each trajectory isolated: Claude Code (:mod:`.claude_code`), behind a
bridge that lets a process in a network namespace of its own reach the endpoint and nothing else (:mod:`.bridge`).

Nothing here imports the rest of the package (or torch): a harness starts once per trajectory."""
