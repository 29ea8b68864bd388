"""The run-level half of a policy version: what stays fixed for a whole run (stored once, referenced by digest)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["AdapterSpec", "RunVersion"]


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter the policy trains or samples with (a LoRA adapter)."""

    name: str
    """Adapter name (PEFT's ``"default"`` for the one adapter a run trains)."""
    kind: str
    """PEFT's type, e.g. ``"LORA"``."""
    rank: int | None
    """``r`` (None for an adapter type without one)."""
    targets: tuple[str, ...]
    """The modules it wraps, sorted."""


@dataclass(frozen=True)
class RunVersion:
    """What, besides the step and the weights, fixes the distribution a trajectory was sampled from and how it was
    scored. ``"latest"`` is not a version: a plugin that declares none is recorded as ``None`` (unversioned)."""

    tokenizer_digest: str
    """Digest of the tokenizer vocabulary and chat template (the one on :class:`PolicyVersion`)."""
    dtype: str
    """Parameter dtype of the sampler's weights, e.g. ``"float32"``."""
    quantization: str | None = None
    """The quantization method of the weights (``config.quantization_config.quant_method``), None: none."""
    adapters: tuple[AdapterSpec, ...] = ()
    """The adapter set, by name; empty for full fine-tuning."""
    sampler: str = ""
    """The sampler's kind (``hf_generate``, ``continuous_batching``, ``vllm_colocate``, ``vllm_server``)."""
    packages: Mapping[str, str | None] = field(default_factory=dict)
    """Versions of the packages the sampler and the trainer run on (torch, transformers, trl, vllm, trl_plugins)."""
    tool_schemas_digest: str = ""
    """Digest of the tool schemas the model was shown (canonical JSON, in the order shown)."""
    plugin_versions: Mapping[str, str | None] = field(default_factory=dict)
    """Each reward component's and tool's declared ``version`` (``"reward/<name>"``, ``"tool/<name>"``); a package
    plugin that declares none gets its distribution's version, a local one ``None``."""
    weights_sample: str = ""
    """Which values ``PolicyVersion.weights_digest`` hashes (so that two digests are comparable)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what a saved batch and a checkpoint store); :meth:`from_dict` reads it back."""
        out = dataclasses.asdict(self)
        out["adapters"] = [dict(a) for a in out["adapters"]]
        out["packages"], out["plugin_versions"] = dict(self.packages), dict(self.plugin_versions)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunVersion":
        """The record :meth:`to_dict` wrote (unknown keys ignored, so a newer file still reads)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["adapters"] = tuple(
            AdapterSpec(a["name"], a["kind"], a.get("rank"), tuple(a.get("targets", ())))
            for a in data.get("adapters", ())
        )
        return cls(**kwargs)

    @property
    def digest(self) -> str:
        """16 hex digits of the SHA-256 of :meth:`to_dict` as canonical JSON (what a trajectory refers to)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
