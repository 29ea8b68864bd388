"""docs/plugins.md stays true: its field tables are the dataclasses' fields, its config keys are
MultiTurnGRPOConfig's, the recipe's system prompt names every tool the recipe configures, and its example of how
to declare capabilities runs, declares what the text says and pickles to an equal copy."""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path

import pytest
import yaml

import trl_plugins.types as types_module
from trl_plugins.registry import ALL_REGISTRIES
from trl_plugins.tools.base import ToolOutput
from trl_plugins.trainers import MultiTurnGRPOConfig

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
DOCUMENTED = {name: getattr(types_module, name) for name in types_module.__all__} | {"ToolOutput": ToolOutput}
REQUIRED = [
    "Trajectory",
    "Turn",
    "ToolCall",
    "RewardComponent",
    "PolicyVersion",
    "StopReason",
    "TokenSource",
    "AdvantageInput",
    "AdvantageOutput",
    "PolicyLossInput",
    "PolicyLossOutput",
    "PolicyLossStats",
    "ToolOutput",
]


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row; ``\\|`` is a pipe inside a cell."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def _code(cell: str) -> str:
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"expected one `code` span, got {cell!r}"
    return match.group(1)


def _tables(text: str) -> dict[str, list[list[str]]]:
    """``#### `Name` `` heading -> the rows (cells) of the table under it (header and rule left out)."""
    out: dict[str, list[list[str]]] = {}
    name = None
    for line in text.splitlines():
        heading = re.fullmatch(r"#### `(\w+)`", line.strip())
        if heading:
            name = heading.group(1)
            assert name not in out, f"two tables for {name}"
            out[name] = []
        elif name is not None and line.startswith("|"):
            out[name].append(_cells(line))
        elif name is not None and out[name] and not line.strip():
            name = None
    return {k: rows[2:] for k, rows in out.items()}


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


TABLES = _tables(DOC.read_text(encoding="utf-8"))


def test_every_required_class_has_a_table():
    missing = [n for n in REQUIRED if n not in TABLES]
    assert not missing, f"docs/plugins.md has no '#### `Name`' table for {missing}"
    unknown = [n for n in TABLES if n not in DOCUMENTED]
    assert not unknown, f"tables for {unknown}, which are neither in trl_plugins.types.__all__ nor ToolOutput"


def _mismatch(name: str, rows: list[list[str]]) -> str | None:
    """What the table ``rows`` for ``name`` get wrong about the code, or None."""
    cls = DOCUMENTED[name]
    if not all(len(r) == 3 and r[2] for r in rows):
        return f"{name}: every row needs a name, a type (or value) and a meaning"
    documented = [(_code(r[0]), _code(r[1])) for r in rows]
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        actual = [(m.name, repr(m.value) if isinstance(m.value, int) else f'"{m.value}"') for m in cls]
    else:
        actual = [(f.name, f.type) for f in dataclasses.fields(cls)]
    if documented != actual:
        return f"docs/plugins.md's table for {name} is out of date:\n doc  {documented}\n code {actual}"
    return None


@pytest.mark.parametrize("name", sorted(TABLES))
def test_table_matches_the_code(name):
    problem = _mismatch(name, TABLES[name])
    assert problem is None, problem


def test_every_type_a_documented_field_uses_is_documented():
    used = set()
    for name in TABLES:
        cls = DOCUMENTED[name]
        if dataclasses.is_dataclass(cls):
            for f in dataclasses.fields(cls):
                used |= {word for word in re.findall(r"\w+", f.type) if word in DOCUMENTED}
    assert {"Turn", "ToolCall", "StopReason", "PolicyVersion", "TokenSource", "PolicyLossStats"} <= used
    missing = sorted(used - set(TABLES))
    assert not missing, f"documented fields use {missing}, which have no table in docs/plugins.md"


def test_a_missing_field_a_wrong_type_and_a_missing_member_are_found():
    # Negative controls: the docs with one row less, one type changed, one enum member dropped.
    text = DOC.read_text(encoding="utf-8")
    broken = _tables(
        text.replace("| `weight` | `float` |", "| `weight` | `int` |")
        .replace("| `all_reduce` |", "| `all_reduced` |")
        .replace("| `CANCELLED` |", "| `CANCELED` |")
    )
    assert "out of date" in _mismatch("RewardComponent", broken["RewardComponent"])
    assert "out of date" in _mismatch("AdvantageInput", broken["AdvantageInput"])
    assert "out of date" in _mismatch("StopReason", broken["StopReason"])
    rows = TABLES["PolicyLossStats"][:-1]  # ratio_max left out
    assert "('ratio_max', 'torch.Tensor')" in _mismatch("PolicyLossStats", rows)
    assert _cells("| `stop_reason` | `StopReason \\| None` | Why. |") == [
        "`stop_reason`",
        "`StopReason | None`",
        "Why.",
    ]


def _config_rows() -> list[list[str]]:
    section = _section(DOC.read_text(encoding="utf-8"), "Selecting and configuring plugins")
    rows = [_cells(line) for line in section.splitlines() if line.startswith("|")]
    assert rows[0][:4] == ["seam", "selected by", "configured by", "related settings"], rows[0]
    return rows[2:]


def _keys(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _config_problems(rows: list[list[str]]) -> list[str]:
    """What the config table gets wrong about ``MultiTurnGRPOConfig`` and the registries."""
    fields = {f.name: f for f in dataclasses.fields(MultiTurnGRPOConfig)}
    problems = []
    if sorted(r[0] for r in rows) != sorted(ALL_REGISTRIES):
        problems.append(
            f"seams {sorted(r[0] for r in rows)}, registries {sorted(ALL_REGISTRIES)}: one row per registry seam"
        )
    for seam, selected, configured, related, _notes in rows:
        problems += [
            f"config key {key!r} (seam {seam}) is not a MultiTurnGRPOConfig field"
            for key in _keys(selected) + _keys(configured) + _keys(related)
            if key not in fields
        ]
        selectors = _keys(selected)
        if len(selectors) != 1 or selectors[0] not in fields:
            problems.append(f"seam {seam}: 'selected by' must be one config field, got {selected!r}")
            continue
        field = fields[selectors[0]]
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        for name in default if isinstance(default, list) else [default]:
            if name not in ALL_REGISTRIES[seam].names():
                problems.append(f"seam {seam}: {selectors[0]!r} defaults to {name!r}, not one of its plugins")
    listed = {k for r in rows for k in _keys(r[2])}
    trl_fields = {f.name for f in dataclasses.fields(MultiTurnGRPOConfig.__mro__[1])}
    problems += [
        f"{f.name} is not listed under 'configured by'"
        for f in dataclasses.fields(MultiTurnGRPOConfig)
        if f.name not in trl_fields and f.name.endswith("_kwargs") and f.name not in listed
    ]
    return problems


def test_config_keys_in_the_docs_are_config_fields():
    rows = _config_rows()
    assert {r[1] for r in rows} >= {"`tools`", "`reward_components`", "`advantage`", "`policy_loss`"}
    assert _config_problems(rows) == []


def test_the_config_check_can_fail():
    rows = [list(r) for r in _config_rows()]
    by_seam = {r[0]: r for r in rows}
    by_seam["advantages"][1] = "`policy_loss`"  # a key that selects another seam
    by_seam["tools"][2] = "`tool_settings`"  # a key that does not exist, and tool_kwargs no longer listed
    problems = _config_problems(rows[:-1])  # and a seam left out
    assert any("one row per registry seam" in p for p in problems)
    assert "seam advantages: 'policy_loss' defaults to 'ppo_clip', not one of its plugins" in problems
    assert "config key 'tool_settings' (seam tools) is not a MultiTurnGRPOConfig field" in problems
    assert "tool_kwargs is not listed under 'configured by'" in problems


def test_recipe_system_prompt_names_every_configured_tool():
    config = yaml.safe_load((ROOT / "recipes" / "retool_ppo.yaml").read_text(encoding="utf-8"))
    unnamed = [t for t in config["tools"] if t not in config["system_prompt"]]
    assert not unnamed, (
        f"recipes/retool_ppo.yaml configures tools {unnamed} that its system_prompt does not mention; "
        f"add a line saying what each is for (docs/plugins.md, 'Tools and the system prompt')"
    )
    assert "a new tool needs a line in the system prompt" in " ".join(DOC.read_text(encoding="utf-8").lower().split())


def _declaration_example() -> str:
    """The python block of docs/plugins.md's "How to declare" paragraph."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("**How to declare.**") : text.index("**The adapters.**")]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def _declaration_problems(block: str, monkeypatch) -> list[str]:
    """What the declaration example gets wrong: run as a module, its classes read by the run's adapters and
    pickled by the contract checks' own rule."""
    import sys
    import types

    from trl_plugins.contracts import ContractError
    from trl_plugins.contracts._base import check_pickles
    from trl_plugins.protocols import PluginDeclarationError, as_advantage, as_policy_loss

    module = types.ModuleType("docs_plugins_declarations")  # a real module, so that pickle finds its classes
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(block, "docs/plugins.md", "exec"), module.__dict__)
    rank, cispo = module.RankAdvantage, module.CISPOLoss
    problems = []
    try:
        adv = as_advantage(rank(scale=0.5), "rank")
        loss, bonus = as_policy_loss(cispo(), "cispo"), as_policy_loss(cispo(entropy_coef=0.01), "cispo")
    except PluginDeclarationError as exc:
        return [str(exc)]
    if (adv.needs_values, adv.needs_groups) != (False, True):
        problems.append(f"RankAdvantage declares needs_values={adv.needs_values}, needs_groups={adv.needs_groups}")
    if (loss.needs_ref_logprobs, loss.needs_entropy, loss.supports_is_weights, bonus.needs_entropy) != (
        False,
        False,
        True,
        True,
    ):
        problems.append("CISPOLoss's declarations are not the ones the text describes")
    if [f.name for f in dataclasses.fields(cispo)] != ["max_weight", "entropy_coef"]:
        problems.append(
            f"CISPOLoss's fields are {[f.name for f in dataclasses.fields(cispo)]}: a declaration became a "
            f"constructor argument"
        )
    if dataclasses.is_dataclass(rank) or rank.__eq__ is not object.__eq__:
        problems.append("RankAdvantage is meant to be a plain class without __eq__")
    for plugin in (rank(scale=0.5), cispo(max_weight=3.0)):
        try:
            check_pickles(plugin, type(plugin).__name__)
        except ContractError as exc:
            problems.append(str(exc))
    return problems


def test_the_declaration_example_runs_and_declares_what_it_says(monkeypatch):
    # A plain class with class attributes, a dataclass with ClassVars and a property: the adapters read each, and
    # both pickle to an equal copy (the plain class compared by its attributes, the dataclass by ==).
    assert _declaration_problems(_declaration_example(), monkeypatch) == []


def test_the_declaration_check_can_fail(monkeypatch):
    block = _declaration_example()
    assert "needs_groups = True" in block and "needs_ref_logprobs: ClassVar[bool] = False" in block
    assert "self.scale = float(scale)" in block
    wrong_type = _declaration_problems(block.replace("needs_groups = True", 'needs_groups = "yes"'), monkeypatch)
    assert wrong_type == ["advantage 'rank' declares needs_groups='yes'; it must be a bool (docs/plugins.md)."]
    as_field = _declaration_problems(
        block.replace("needs_ref_logprobs: ClassVar[bool] = False", "needs_ref_logprobs: bool = False"), monkeypatch
    )
    assert any("a declaration became a constructor argument" in p for p in as_field)
    unpicklable = _declaration_problems(
        block.replace("self.scale = float(scale)", "self.scale = float(scale)\n        self.f = lambda x: x"),
        monkeypatch,
    )
    assert any("RankAdvantage: does not pickle" in p for p in unpicklable)
