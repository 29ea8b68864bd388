"""Token-in, token-out chat for one tokenizer and chat template: :class:`ChatFormat` (:mod:`.format`), its start-up
checks of the template (:mod:`.checks`), how it reads a sampled turn back (:mod:`.parsing`) and the vocabulary they
exchange (:mod:`.vocab`)."""

from trl_plugins.rollout.chat.format import ChatFormat
from trl_plugins.rollout.chat.vocab import (
    ChatTemplateError,
    ParsedCall,
    ParsedTurn,
    ToolTurn,
    TurnKind,
    tokenizer_digest,
)

__all__ = ["ChatTemplateError", "TurnKind", "ParsedCall", "ParsedTurn", "ToolTurn", "ChatFormat", "tokenizer_digest"]
