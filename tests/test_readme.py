"""The README opens with the two set-up commands, and CI runs the test one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_opens_with_main_then_test_command():
    main, test = readme_commands()[:2]
    assert main.endswith("accelerate launch recipes/retool_ppo.py")
    assert test.endswith("python -m pytest")
    assert (ROOT / "recipes" / "retool_ppo.py").is_file()
    assert (ROOT / "constraints" / "cpu.txt").is_file()


def test_ci_runs_the_readme_test_command_verbatim():
    test = readme_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test in ci_lines
    assert "set -euo pipefail" in ci_lines


def test_cpu_constraints_pin_the_cpu_torch_wheel():
    pins = (ROOT / "constraints" / "cpu.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M)
    assert re.search(r"^trl==1\.16\.\d+$", pins, re.M)
