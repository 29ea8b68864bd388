"""Trajectory viewer: a step's trajectories and their datums, saved as JSON and drawn as one HTML page.

It shows what the datum builder did: every token of each trajectory, coloured by its provenance
(:class:`~trl_plugins.types.TokenSource`: prompt, sampled action, tool observation, template glue), with
the datum's behaviour log-prob, advantage and loss mask on hover; turn boundaries, the stop reason,
the reward components and whether the update trained on it. The page is self-contained (inline CSS
and JS, nothing fetched), so it opens from disk, from a W&B ``Html`` panel or from a CI artifact.

A *saved batch* is a JSON file (``FORMAT``) written by :func:`save_batch`; the trainer writes one every
``viewer_steps`` steps under ``output_dir/trajectories/`` next to its page (:func:`write_step_pages`).
Any saved batch can be drawn again, e.g. with fewer trajectories::

    python -m trl_plugins.viewer outputs/run/trajectories/step-000010.json -o page.html --max-trajectories 4

Every token span carries machine-readable attributes: ``data-pos`` (place in the whole sequence
``full``), ``data-index`` (datum position ``t``, whose target is ``full[t + 1]``; absent on the first
token, which is context only), ``data-source``, ``data-mask``, ``data-logprob``, ``data-adv`` and
``data-id``; numbers are written as Python's ``repr`` of the datum's float, so they compare exactly.
"""

from trl_plugins.viewer.batch import (
    FORMAT,
    UpdateRole,
    ViewerError,
    datum_from_dict,
    load_batch,
    make_batch,
    save_batch,
)
from trl_plugins.viewer.cli import main
from trl_plugins.viewer.page import SOURCE_COLOURS, display_text, render_html, write_step_pages

__all__ = [
    "FORMAT",
    "SOURCE_COLOURS",
    "UpdateRole",
    "ViewerError",
    "make_batch",
    "save_batch",
    "load_batch",
    "datum_from_dict",
    "display_text",
    "render_html",
    "write_step_pages",
    "main",
]
