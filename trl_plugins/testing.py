"""Deprecated module name: the contract checks are :mod:`trl_plugins.contracts`, the tiny model and tokenizer
builders :mod:`trl_plugins.tiny`. Importing from here still works and warns once."""

import warnings

from trl_plugins.contracts import *  # noqa: F401,F403
from trl_plugins.contracts import __all__ as _contracts
from trl_plugins.tiny import *  # noqa: F401,F403
from trl_plugins.tiny import __all__ as _tiny

__all__ = [*_contracts, *_tiny]

warnings.warn(
    "trl_plugins.testing is deprecated: import the contract checks from trl_plugins.contracts and the tiny "
    "model and tokenizer builders from trl_plugins.tiny.",
    DeprecationWarning,
    stacklevel=2,
)
