"""The model's forward passes for training and checks: per-token log-probs and entropies in every micro-batch layout
(:mod:`.logprobs`), the output projection applied in chunks of positions so no ``(T, V)`` logits are held
(:mod:`.chunked_head`), the divergence to a teacher known only on some tokens (:mod:`.sparse_divergence`), and the
dropout a training forward must switch off (:mod:`.dropout`). Import the log-prob functions from here."""

from trl_plugins.modeling.logprobs import *  # noqa: F403 - the wing's face: the log-prob functions
from trl_plugins.modeling.logprobs import __all__ as __all__
