"""``PYTHONPATH=recipes python -m retool.teacher_cli [--from_run DIR] RECIPE ARGS``: build (or adopt a finished run of
its build's command as) the ``embedded-rl`` teacher of a run's arguments (:mod:`retool.teacher`), and print its model
folder."""

from __future__ import annotations

import argparse
import sys

from retool.teacher import EMBEDDED_RL, ensure_embedded_teacher


def main(argv: list[str] | None = None) -> int:
    from retool.config import parse_args

    parser = argparse.ArgumentParser(
        description="Build (or adopt) the embedded-rl teacher of a run's arguments; prints its model folder.",
        epilog="Every other argument is the recipe's (retool_ppo.py), e.g. --config recipes/retool_distill.yaml.",
    )
    parser.add_argument("--from_run", help="A finished run of the build's command to adopt instead of running it.")
    ns, rest = parser.parse_known_args(argv)
    script_args, _ = parse_args([*rest, "--teacher_model_name_or_path", EMBEDDED_RL])
    print(ensure_embedded_teacher(script_args.embedded_teacher, from_run=ns.from_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
