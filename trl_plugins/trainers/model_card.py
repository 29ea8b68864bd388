"""The model card TRL writes beside each checkpoint, naming the base model also when it was a local folder."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["UNNAMED_BASE_MODEL", "UNNAMED_QUICK_START", "name_local_base_model", "name_quick_start_model"]

UNNAMED_BASE_MODEL = "[None](https://huggingface.co/None)"
"""What TRL's card template (``trl/templates/lm_model_card.md``) renders when it names no base model: TRL
names one only when ``model.config._name_or_path`` is a Hub id, not a local folder."""


UNNAMED_QUICK_START = 'model="None"'
"""What the card's quick-start code says when the run pushes to no Hub repo (TRL fills in ``hub_model_id``)."""


def name_quick_start_model(card_path: str | os.PathLike, model_path: str | None) -> bool:
    """Make the card's quick-start load the trained model from ``model_path`` where TRL wrote ``model="None"``.
    Returns True when the card was changed."""
    return bool(model_path) and _fill_in(card_path, UNNAMED_QUICK_START, f"model={str(model_path)!r}".replace("'", '"'))


def name_local_base_model(card_path: str | os.PathLike, name_or_path: str | None) -> bool:
    """Name the base model in the card at ``card_path`` where TRL left it unnamed: a local folder is named by
    its path (no Hub link: it is not on the Hub). Returns True when the card was changed."""
    return bool(name_or_path) and _fill_in(card_path, UNNAMED_BASE_MODEL, f"the local model `{name_or_path}`")


def _fill_in(card_path: str | os.PathLike, placeholder: str, text: str) -> bool:
    """Replace ``placeholder`` with ``text`` in the card at ``card_path``; False when there is no card or no
    placeholder."""
    path = Path(card_path)
    if not path.is_file():
        return False
    card = path.read_text()
    if placeholder not in card:
        return False
    path.write_text(card.replace(placeholder, text))
    return True
