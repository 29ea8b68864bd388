"""The recipe's arguments: ``ScriptArguments`` (task, model and LoRA, evaluation) beside ``MultiTurnGRPOConfig``,
parsed from ``recipes/retool_ppo.yaml`` and the command line by both entry points."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig

__all__ = ["DEFAULT_CONFIG", "ScriptArguments", "parse_args"]

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "retool_ppo.yaml"
"""The recipe's YAML, read when no ``--config`` is given."""


@dataclass
class ScriptArguments(ModelConfig):
    """The task, model and evaluation; TRL's ``ModelConfig`` brings ``--use_peft`` and the ``--lora_*``
    fields (``trl_plugins.trainers.lora`` honours or refuses each one)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Hub name or local path; default: the embedded tiny model after its cold-start SFT."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout: 0 (TRL's default 0.05 is refused: dropout in the update but not in generation biases every importance ratio)."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset or local file/dir; default: the bundled arithmetic task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str = field(default="test", metadata={"help": "Held-out split for the before/after evaluation; never the training split. A dataset without it (a single local file always) holds out held_out_fraction of the training split instead."})
    held_out_fraction: float = field(default=0.1, metadata={"help": "When the dataset has no dataset_test_split (a single local file has none): the share of the training split held out for evaluation, chosen by a hash of the prompt (the same rows every run); training leaves them out. 0: hold out nothing (the held-out evaluation is then refused)."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column with the question."})
    answer_column: str = field(default="answer", metadata={"help": "Column with the reference answer."})
    train_size: int | None = field(default=None, metadata={"help": "Training questions (bundled task: generated; Hub: subsampled)."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the bundled task and of the embedded model's build."})
    eval_problems: int = field(default=128, metadata={"help": "Held-out problems for the before/after evaluation (0: skip it)."})
    eval_samples: int = field(default=4, metadata={"help": "Samples per held-out problem."})
    eval_temperature: float = field(default=1.0, metadata={"help": "Evaluation temperature (0 = greedy, with eval_samples 1)."})
    eval_every_steps: int = field(default=0, metadata={"help": "Held-out evaluation of the live policy every N steps, logged as heldout/* (0: only before and after)."})
    eval_every_problems: int = field(default=64, metadata={"help": "Held-out problems of each periodic evaluation (the first of the held-out split), eval_samples each."})
    embedded: str = field(default="{}", metadata={"help": "EmbeddedSettings overrides (JSON), e.g. '{\"cold_start_epochs\": 3}'."})
    rebuild_embedded: bool = field(default=False, metadata={"help": "Rebuild the cached embedded default."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start afresh in an output_dir an earlier run left files in: they are moved to output_dir/previous-<time>/ (nothing is deleted). Without it (or --resume_from_checkpoint) a non-empty output_dir is refused."})
    wandb_project: str | None = field(default="trl-plugins-retool", metadata={"help": "W&B project (offline when no API key is configured)."})
    plot: bool = field(default=True, metadata={"help": "Write a PNG of reward, accuracy and tool calls per step."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}.")


def parse_args(argv: list[str], *extra: type) -> tuple:
    """Parse ``argv`` into ``(*extra, ScriptArguments, MultiTurnGRPOConfig)`` with TrlParser, using the
    recipe's YAML when no ``--config`` is given, plus the CPU defaults (:func:`retool.launch.cpu_defaults`)."""
    import yaml
    from trl import TrlParser

    from retool.launch import cpu_defaults
    from trl_plugins.trainers import MultiTurnGRPOConfig

    argv = list(argv)
    if "--config" not in argv:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    config_path = argv[argv.index("--config") + 1]
    try:
        config_values = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"cannot read the config {config_path}: {exc}") from exc
    argv += cpu_defaults(argv, config_values)
    parser = TrlParser((*extra, ScriptArguments, MultiTurnGRPOConfig))
    return tuple(parser.parse_args_and_config(argv))
