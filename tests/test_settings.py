"""Each feature's settings as one typed object (``trl_plugins.run.settings``): built from the flat fields when the config
is checked, None when the feature is off, the derived rules on the object, and no library module reading a feature's
flat fields but the config and the object itself."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest

from support.trainer import tiny_config
from trl_plugins.run.settings import AsyncRollouts, DynamicSampling, LongTrajectories, MismatchCorrection
from trl_plugins.run.settings.async_rollouts import FIELDS as ASYNC_FIELDS
from trl_plugins.run.settings.critic import FIELDS as CRITIC_FIELDS
from trl_plugins.run.settings.distillation import FIELDS as DISTILLATION_FIELDS
from trl_plugins.run.settings.dynamic_sampling import FIELDS as DYNAMIC_SAMPLING_FIELDS
from trl_plugins.run.settings.long_trajectories import FIELDS as LONG_FIELDS
from trl_plugins.run.settings.mismatch_correction import FIELDS as MISMATCH_FIELDS
from trl_plugins.types import ImportanceSamplingMode

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "trl_plugins"


def test_a_feature_that_is_off_is_none(tmp_path):
    features = tiny_config(tmp_path).features
    assert features.async_rollouts is None and features.dynamic_sampling is None and not features.decoupled
    # Always there: the chunked head's settings (sequence parallelism off at size 1); the mismatch correction is on by
    # TRL's default, in scope 'foreign' (HF generate's own log-probs: no batch of this run gets it).
    assert features.long_trajectories == LongTrajectories(
        chunk_size=None, chunk_memory_mb=256, sequence_parallel_size=1
    )
    assert features.mismatch_correction == MismatchCorrection(
        mode=ImportanceSamplingMode.SEQUENCE_MASK, clip_min=None, clip_max=3.0, scope="foreign"
    )
    assert not features.correction_on_every_batch(foreign_sampler=False)
    assert features.correction_on_every_batch(foreign_sampler=True)  # vLLM's log-probs are never the trainer's own
    off = tiny_config(tmp_path, vllm_importance_sampling_correction=False).features
    assert off.mismatch_correction is None and not off.correction_on_every_batch(foreign_sampler=True)
    # max_staleness=0 is the synchronous loop, bit for bit: no replica, nothing stale, so no settings.
    assert tiny_config(tmp_path, async_rollouts=True, max_staleness=0).features.async_rollouts is None


def test_the_settings_hold_the_values_in_force_and_the_derived_rules(tmp_path):
    a = tiny_config(tmp_path, async_rollouts=True, max_staleness=2).features.async_rollouts
    assert a == AsyncRollouts(
        max_staleness=2,
        off_policy_objective="decoupled",
        streaming=True,  # None resolved: on with HF generate
        probe_tolerance=None,
        max_logprob_gap=2.0,
        min_importance_ess=0.2,
        replica_threads=None,
    )
    assert a.decoupled
    behaviour = tiny_config(tmp_path, async_rollouts=True, off_policy_objective="behaviour").features
    assert not behaviour.async_rollouts.decoupled and not behaviour.decoupled
    # The derived default the decoupled objective brings: per-token truncated importance weights.
    assert tiny_config(tmp_path, async_rollouts=True).vllm_importance_sampling_mode == "token_truncate"
    assert tiny_config(tmp_path).vllm_importance_sampling_mode == "sequence_mask"
    d = tiny_config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_groups=2.0).features.dynamic_sampling
    assert d == DynamicSampling(metric="reward", max_groups=2.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(max_staleness=2), "configure asynchronous rollouts, which are off"),
        (dict(async_replica_threads=2), "configure asynchronous rollouts, which are off"),
        (dict(dynamic_sampling_metric="correct"), "configure dynamic sampling, which is off"),
        (dict(dynamic_sampling=True, dynamic_sampling_metric="corect"), "Did you mean 'correct'"),
        (dict(dynamic_sampling=True, dynamic_sampling_max_groups=0.5), "must be >= 1"),
        (dict(vllm_importance_sampling_correction=False, mismatch_correction_scope="all"), "set one of them"),
        (dict(vllm_importance_sampling_mode="token_mask"), "HF generate records the trainer's own"),
        (
            dict(vllm_importance_sampling_correction=False, vllm_importance_sampling_clip_max=2.0),
            "configure the mismatch correction, which vllm_importance_sampling_correction=False turns off",
        ),
        (dict(mismatch_correction_scope="every"), "must be 'foreign' or 'all'"),
        (dict(logprob_chunk_memory_mb=0), "at least 1"),
        (dict(sequence_parallel_size=0), "positive number of ranks"),
    ],
)
def test_a_setting_of_a_feature_that_is_off_is_refused_where_the_object_is_built(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(tmp_path, reward_components=["correct"], **overrides)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(vf_coef=0.5), r"\['vf_coef'\] configure the critic, but advantage 'group' runs none"),
        (dict(critic_optim="sgd", critic_warmup_steps=2), r"\['critic_optim', 'critic_warmup_steps'\] configure"),
        (dict(truncated_policy="bootstrap"), "runs no critic"),
        (dict(advantage="gae", vf_clip=0.0), "vf_clip > 0"),
        (dict(advantage="gae", critic_optim="adam"), "critic_optim must be 'adamw' or 'sgd'"),
        (dict(advantage="gae", critic_learning_rate=0.0), "critic_learning_rate must be > 0"),
    ],
)
def test_the_critic_is_built_with_the_run_once_its_estimator_says_it_needs_values(tmp_path, overrides, message):
    from support.trainer import TokenReward
    from trl_plugins.run import resolve_run

    with pytest.raises(ValueError, match=message):
        resolve_run(tiny_config(tmp_path, **overrides), reward_components={"length": TokenReward()})


def test_the_critics_settings_hold_the_values_in_force(tmp_path):
    from support.trainer import TokenReward
    from trl_plugins.run import resolve_run
    from trl_plugins.run.settings import Critic

    def critic(**overrides):
        run = resolve_run(tiny_config(tmp_path, **overrides), reward_components={"length": TokenReward()})
        run.close()
        return run.critic

    assert critic() is None
    assert critic(advantage="gae", critic_optim="sgd", vf_coef=0.5) == Critic(
        learning_rate=None, optim="sgd", warmup_steps=0, vf_clip=0.2, vf_coef=0.5
    )


def test_the_settings_travel_with_the_config(tmp_path):
    config = tiny_config(tmp_path, async_rollouts=True, dynamic_sampling=True)
    copy = pickle.loads(pickle.dumps(config))  # a child process (the evaluation, the replica) gets it pickled
    assert copy.features == config.features
    # Not a field: no command-line flag, nothing in to_dict() or in the TRL-field table.
    assert "features" not in {f.name for f in dataclasses.fields(config)} and "features" not in config.to_dict()


FEATURE_FIELDS = {
    *ASYNC_FIELDS,
    *DYNAMIC_SAMPLING_FIELDS,
    *CRITIC_FIELDS,
    *DISTILLATION_FIELDS,
    *MISMATCH_FIELDS,
    *LONG_FIELDS,
    "async_rollouts",
    "dynamic_sampling",
    "vllm_importance_sampling_correction",
    "mismatch_correction_scope",
}
READERS = {
    "run/config.py",
    "run/trl_fields.py",
    "run/parallelism.py",
    *(
        f"run/settings/{m}.py"
        for m in ("async_rollouts", "dynamic_sampling", "critic", "mismatch_correction", "distillation")
    ),
    "run/settings/long_trajectories.py",
}
"""The config (which declares the flat fields and builds the objects), the table mapping TRL's fields onto them, the
check of what sequence parallelism needs (run by :class:`LongTrajectories`'s build and again on the loaded model), and
the objects that read their own fields."""


CONFIG_NAMES = {"config", "args", "training_args", "cfg"}
"""How the library names a config it reads (``config.x``, ``self.args.x``)."""


def _is_config(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in CONFIG_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES
    )


def flat_field_reads(source: str) -> list[str]:
    """The flat fields of a feature with settings that ``source`` reads off a config (``config.max_staleness``,
    ``self.args.dynamic_sampling``); the settings object's own attributes (``settings.max_staleness``) are not."""
    return sorted(
        {
            node.attr
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute)
            and node.attr in FEATURE_FIELDS
            and isinstance(node.ctx, ast.Load)
            and _is_config(node.value)
        }
    )


def test_no_library_module_reads_a_features_flat_fields_but_the_config_and_its_object():
    readers = {
        str(f.relative_to(PACKAGE_ROOT)): flat_field_reads(f.read_text()) for f in sorted(PACKAGE_ROOT.rglob("*.py"))
    }
    assert {name: found for name, found in readers.items() if found and name not in READERS} == {}
    # Negative control: the checker sees a read, and a read of the object is none.
    read = (
        "n = config.max_staleness\nm = config.features.async_rollouts.max_staleness\nd = self.args.dynamic_sampling\n"
    )
    assert flat_field_reads(read) == ["dynamic_sampling", "max_staleness"]
    assert flat_field_reads("s = config.features.async_rollouts.streaming\n") == []
