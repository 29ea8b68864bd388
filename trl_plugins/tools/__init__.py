"""Tool plugins (registry: ``TOOLS``) and the Python sandbox they run code in."""

from trl_plugins.tools.base import Tool, ToolOutput, check_arguments

__all__ = ["Tool", "ToolOutput", "check_arguments", "CodeInterpreter"]


def __getattr__(name: str):
    # The sandbox is imported lazily so that `trl_plugins.tools` stays cheap to import.
    if name == "CodeInterpreter":
        from trl_plugins.tools.code_interpreter import CodeInterpreter

        return CodeInterpreter
    raise AttributeError(name)
