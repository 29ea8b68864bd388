"""``python -m trl_plugins.viewer BATCH.json``: draw a saved batch again (e.g. with fewer trajectories)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from trl_plugins.viewer.batch import ViewerError, load_batch, write_atomic
from trl_plugins.viewer.page import render_html

__all__ = ["main"]


def _beside(path: str | None) -> dict | None:
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        marker = p / "checkpoint_complete.json"
        if not marker.is_file():
            raise ViewerError(
                f"{p} has no checkpoint_complete.json: give a complete checkpoint-N folder or a saved batch"
            )
        version = json.loads(marker.read_text()).get("version")
    else:
        version = load_batch(p).get("version")
    if version is None:
        raise ViewerError(f"{p} records no version (written before versions were saved): nothing to compare with")
    return version


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trl_plugins.viewer BATCH.json [-o OUT.html] [--max-trajectories N]``; exit 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m trl_plugins.viewer",
        description="Draw a saved trajectory batch (JSON) as a self-contained HTML page.",
    )
    parser.add_argument("batch", help="a saved batch, e.g. output_dir/trajectories/step-000010.json")
    parser.add_argument("-o", "--output", help="the page to write (default: the batch's path with .html)")
    parser.add_argument("--max-trajectories", type=int, default=None, help="draw only the first N trajectories")
    parser.add_argument(
        "--beside",
        help="a checkpoint folder (its checkpoint_complete.json) or another saved batch: the "
        "page flags every field of the batch's version that differs from that run's",
    )
    args = parser.parse_args(argv)
    if args.max_trajectories is not None and args.max_trajectories < 1:
        parser.error(f"--max-trajectories must be >= 1, got {args.max_trajectories}")
    source = Path(args.batch)
    out = Path(args.output) if args.output else source.with_suffix(".html")
    if out.resolve() == source.resolve():
        parser.error(f"the output {out} is the batch itself; give another -o")
    try:
        batch = load_batch(source)
        page = render_html(batch, max_trajectories=args.max_trajectories, beside=_beside(args.beside))
    except ViewerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        print(
            f"error: {source} is a saved batch but cannot be drawn ({type(exc).__name__}: {exc}); the file is damaged "
            f"or from another version of trl_plugins.",
            file=sys.stderr,
        )
        return 2
    write_atomic(out, page)
    shown = (
        len(batch["trajectories"])
        if args.max_trajectories is None
        else min(args.max_trajectories, len(batch["trajectories"]))
    )
    print(f"wrote {out} ({shown} trajectories)")
    return 0
