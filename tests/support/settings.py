"""The update's settings as a namespace: the flat fields a test states, with the run's ``features`` built from the
fields of the features the update reads (what ``MultiTurnGRPOConfig.__post_init__`` builds for a real config)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from trl_plugins.run.settings import Features, LongTrajectories, MismatchCorrection
from trl_plugins.types import ImportanceSamplingMode

_MISMATCH = {
    "vllm_importance_sampling_mode": "mode",
    "vllm_importance_sampling_clip_min": "clip_min",
    "vllm_importance_sampling_clip_max": "clip_max",
    "mismatch_correction_scope": "scope",
}
_LONG = {
    "logprob_chunk_size": "chunk_size",
    "logprob_chunk_memory_mb": "chunk_memory_mb",
    "sequence_parallel_size": "sequence_parallel_size",
}


def update_settings(**fields: Any) -> SimpleNamespace:
    """``fields`` as a namespace with ``features``: a mismatch correction when any ``vllm_importance_sampling_*``
    field is given (scope ``'foreign'`` unless given; a mode of None: off), the long-trajectory settings from theirs (defaults otherwise).
    The flat fields stay on the namespace too (a test may read them back)."""
    mismatch = {_MISMATCH[k]: v for k, v in fields.items() if k in _MISMATCH}
    correction = None
    if mismatch.get("mode", "sequence_mask") is not None and mismatch:
        correction = MismatchCorrection(
            mode=ImportanceSamplingMode(mismatch.get("mode", "sequence_mask")),
            clip_min=mismatch.get("clip_min"),
            clip_max=mismatch.get("clip_max"),
            scope=mismatch.get("scope", "foreign"),
        )
    long = LongTrajectories(**{_LONG[k]: v for k, v in fields.items() if k in _LONG})
    features = Features(mismatch_correction=correction, long_trajectories=long)
    return SimpleNamespace(**fields, features=features)
