"""The settings of training long trajectories: the chunked output head (always on; the head itself:
:mod:`trl_plugins.modeling.chunked_head`) and sequence parallelism (:mod:`trl_plugins.trainers.sequence_parallel`;
what it needs from the run: :mod:`trl_plugins.run.parallelism`). docs/training.md, long trajectories."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_plugins.modeling.chunked_head import DEFAULT_LOGPROB_MEMORY_BYTES, auto_chunk_size, logprob_chunk_size

__all__ = ["LongTrajectories"]

FIELDS = ("logprob_chunk_size", "logprob_chunk_memory_mb", "sequence_parallel_size")
"""The flat fields that configure it."""


@dataclass(frozen=True)
class LongTrajectories:
    """How a long datum's log-probs are computed and its tokens split over ranks."""

    chunk_size: int | None = None
    """Positions per chunk of the output projection (``logprob_chunk_size``; None: chosen from the vocabulary so a
    chunk's float32 tensors take about ``chunk_memory_mb``)."""
    chunk_memory_mb: int = DEFAULT_LOGPROB_MEMORY_BYTES // 2**20
    """The memory (MiB) one chunk's vocabulary-wide float32 tensors may take (``logprob_chunk_memory_mb``)."""
    sequence_parallel_size: int = 1
    """Ranks one datum's tokens are split over in the policy update (``sequence_parallel_size``, or TRL's
    ``parallelism_config``'s ``sp_size``; 1: off)."""

    @property
    def sequence_parallel(self) -> bool:
        """Whether the update splits a datum's tokens over ranks."""
        return self.sequence_parallel_size > 1

    def chunk_size_for(self, model: Any) -> int:
        """Positions per chunk for ``model`` (wrapped or not): :attr:`chunk_size`, or the one its vocabulary and
        :attr:`chunk_memory_mb` give."""
        return logprob_chunk_size(model, self.chunk_size, self.chunk_memory_mb * 2**20)

    def chunk_size_for_vocab(self, vocab_size: int) -> int:
        """Positions per chunk for a vocabulary of ``vocab_size`` (before the model loads)."""
        return self.chunk_size or auto_chunk_size(vocab_size, self.chunk_memory_mb * 2**20)

    @classmethod
    def from_config(cls, config: Any) -> LongTrajectories:
        """The settings of ``config``, whose ``parallelism_config`` was already taken over.

        Raises:
            ValueError: a chunk size or memory below 1, or a sequence-parallel size the config alone shows cannot run
                (:func:`~trl_plugins.run.parallelism.check_sequence_parallel`; the rest is checked before the model
                loads).
        """
        from trl_plugins.run.parallelism import check_sequence_parallel

        check_sequence_parallel(config)
        if config.logprob_chunk_size is not None and config.logprob_chunk_size < 1:
            raise ValueError(
                f"logprob_chunk_size must be a positive number of positions or None (chosen from the "
                f"vocabulary and logprob_chunk_memory_mb), got {config.logprob_chunk_size}"
            )
        if config.logprob_chunk_memory_mb < 1:
            raise ValueError(f"logprob_chunk_memory_mb must be at least 1, got {config.logprob_chunk_memory_mb}")
        return cls(
            chunk_size=config.logprob_chunk_size,
            chunk_memory_mb=config.logprob_chunk_memory_mb,
            sequence_parallel_size=config.sequence_parallel_size,
        )
