"""The embedded default: a tiny tokenizer, a tiny model and a bundled task, all built locally, no network."""

from trl_plugins.embedded.model import build_tiny_model
from trl_plugins.embedded.task import arithmetic_problems
from trl_plugins.embedded.tokenizer import CHAT_TEMPLATES, build_tokenizer, load_trl_chat_template

__all__ = ["CHAT_TEMPLATES", "arithmetic_problems", "build_tiny_model", "build_tokenizer", "load_trl_chat_template"]
