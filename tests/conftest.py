"""Shared fixtures: registry isolation, seeded multi-turn trajectories, a tiny local Qwen2 model."""

from __future__ import annotations

import copy
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# The ReTool application (recipes/retool/) is imported as `retool`, as the recipe scripts do.
sys.path.insert(0, str(ROOT / "recipes"))

from trl_plugins.contracts import make_trajectory  # noqa: E402, F401  (tests import it from here)
from trl_plugins.registry import ALL_REGISTRIES  # noqa: E402

ASSETS = Path(__file__).parent / "assets"


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _workers_per_cpu() -> float:
    """How many pytest-xdist workers share one core (0 when not under xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) / _cpus()


SUITE_MINUTES = 15
"""The whole suite's wall time in ``.ci/run`` on this project's 2-core machine (README: the test command)."""
QUICK_MINUTES = 3
"""``-m "not slow"`` on the same machine: everything but the real launches."""


def pytest_report_header(config):
    """The first lines a newcomer's ``python -m pytest`` prints: how long it will take and the quick loop."""
    if config.getoption("markexpr", ""):
        return None  # they chose a subset already
    return [
        f"trl-plugins: the whole suite takes about {SUITE_MINUTES} minutes on 2 CPU cores (one xdist worker per "
        f'core; more cores, less time). A quick loop without the real launches: python -m pytest -m "not slow" '
        f"(about {QUICK_MINUTES} minutes)."
    ]


def pytest_configure(config):
    if (
        not hasattr(config, "workerinput")
        and config.pluginmanager.hasplugin("xdist")
        and config.getvalue("dist") == "loadgroup"
    ):
        import tempfile

        os.environ[GROUPS_FILE_ENV] = os.path.join(tempfile.mkdtemp(prefix="trl-plugins-test-groups-"), "groups.json")
    # Under pytest -n, each worker gets its share of the cores for its own torch threads (and, through
    # OMP_NUM_THREADS, for the processes it starts), unless the caller set OMP_NUM_THREADS: N workers
    # each running one thread per core spin against each other and run several times slower than 1/N.
    if _workers_per_cpu() and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, round(1 / _workers_per_cpu()))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    _pin_worker(config)


def _pin_worker(config) -> None:
    """With one xdist worker per core, worker ``gwN`` and everything it starts run on core N only.

    The processes a test starts size their threads from the cores they may use, as they should on a machine of their
    own: the recipe's single process and its child evaluations take every core (``retool.launch.available_cpus``),
    a launch's ranks their share. On the suite's shared cores each such thread spins against the other worker's:
    measured here, a torch-bound test module took 4x the CPU time with two threads per worker as with one. Pinned,
    each worker's processes see one core and run one thread each. ``TRL_PLUGINS_TEST_PIN=0`` turns this off."""
    if not hasattr(config, "workerinput") or os.environ.get("TRL_PLUGINS_TEST_PIN", "1") == "0":
        return
    if not hasattr(os, "sched_setaffinity") or _workers_per_cpu() != 1:
        return
    cores = sorted(os.sched_getaffinity(0))
    index = int(config.workerinput["workerid"].removeprefix("gw"))
    os.sched_setaffinity(0, {cores[index % len(cores)]})


SLOW_TEST_COST_S = 30.0
"""Rough cost of one ``slow`` test for the schedule below (the slow set's median is ~20-30 s here, mostly launches)."""
TEST_COST_S = 0.5
"""Rough cost of one other test."""


GROUPS_FILE_ENV = "TRL_PLUGINS_TEST_GROUPS"
"""Where the workers write each test's group for the controller's scheduler (set by the controller)."""


def schedule_groups(items) -> list[list]:
    """The tests in groups, longest first (LPT; ties keep the collection order), each group in collection order.

    A group is what must run in one process: the tests linked by a module- or class-scoped fixture (a launch that
    several tests read, e.g. test_distributed's one launch per accelerate config, runs once); each other slow test
    alone (its launch may run beside another file's); a file's other tests together, in file order.
    """
    parent = {item.nodeid: item.nodeid for item in items}

    def find(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    owner: dict[tuple[str, str], str] = {}  # (file, shared fixture) -> the first test using it
    for item in items:
        file = item.nodeid.split("::", 1)[0]
        info = getattr(item, "_fixtureinfo", None)
        shared = [
            name
            for name, defs in (info.name2fixturedefs.items() if info else ())
            if defs and defs[-1].scope in ("module", "class", "package")
        ]
        if not shared and item.get_closest_marker("slow") is None:
            shared = ["<file>"]
        for name in shared:
            other = owner.setdefault((file, name), item.nodeid)
            parent[find(item.nodeid)] = find(other)
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(find(item.nodeid), []).append(item)

    def cost(group: list) -> float:
        return sum(SLOW_TEST_COST_S if i.get_closest_marker("slow") else TEST_COST_S for i in group)

    return sorted(groups.values(), key=cost, reverse=True)


def pytest_collection_modifyitems(config, items):
    # The schedule of `-n auto --dist loadgroup` (pyproject.toml): the groups of schedule_groups() go to the workers in
    # order, a worker taking the next group when it is nearly done. With whole files per worker (`loadfile`) one file
    # of launches bounded the wall time (14:51 on 2 cores, 2026-12-03). xdist's own loadgroup reads `xdist_group`
    # marks by renaming nodeids, which pytest 9 no longer allows: the workers write the groups to a file and the
    # controller's scheduler (pytest_xdist_make_scheduler below) reads it.
    ordered = schedule_groups(items)
    items[:] = [item for group in ordered for item in group]
    path = os.environ.get(GROUPS_FILE_ENV)
    if path and hasattr(config, "workerinput"):
        import json

        names = {item.nodeid: f"group-{n}" for n, group in enumerate(ordered) for item in group}
        tmp = f"{path}.{config.workerinput['workerid']}"
        Path(tmp).write_text(json.dumps(names))
        os.replace(tmp, path)  # every worker writes the same groups


def pytest_collection_finish(session):
    # What the test modules imported (torch, transformers, TRL, DeepSpeed: ~480,000 objects) lives as long as the
    # process; out of the collector's reach it is no longer traversed by every full collection: Trainer.train() starts
    # with one (accelerate's free_memory), ~0.25-0.4 s each, a third of tests/test_trainer.py's time before this.
    import gc

    import trl_plugins.trainers.multi_turn_trainer  # noqa: F401  (the trainer's imports: TRL, transformers' Trainer)

    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    path = os.environ.get(GROUPS_FILE_ENV)
    if path and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling over schedule_groups(), in the workers' (longest-first) order."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # called once every worker has collected (and written the file)
                self.groups = json.loads(Path(os.environ[GROUPS_FILE_ENV]).read_text())
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the workers' order: longest group first
    return GroupScheduling(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # TRL_PLUGINS_TEST_CPU=FILE appends one JSON line per test: its CPU seconds (this worker and the processes it
    # started and waited for) beside its wall time. On a 2-core machine the suite is CPU-bound: this, not wall time
    # under another worker's load, says which tests to make cheaper.
    path = os.environ.get("TRL_PLUGINS_TEST_CPU")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start_cpu, start = cpu(), time.perf_counter()
    yield
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "test": item.nodeid,
                    "cpu_s": round(cpu() - start_cpu, 2),
                    "wall_s": round(time.perf_counter() - start, 2),
                }
            )
            + "\n"
        )


def hang_guard_s(seconds: float) -> float:
    """A guard against a hung launch (``seconds``, sized for a run that has the machine to itself), scaled by
    the xdist workers per core: under ``pytest -n 4`` on 2 cores a launch gets half a core at best."""
    return seconds * max(1.0, _workers_per_cpu())


def accelerate_launch(config: str, script: str | Path, *args: str) -> list[str]:
    """argv of ``accelerate launch --config_file accelerate_configs/<config> <script> <args>`` for a test.

    ``--main_process_port 0`` makes the launcher pick a free rendezvous port itself. With the default (29500),
    two launches at once (``pytest -n``, or another suite on the machine) race for one port: accelerate
    moves to another port only if 29500 is taken when it checks, seconds before torchrun binds it.
    """
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "accelerate_configs" / config),
        "--main_process_port",
        "0",
        str(script),
        *args,
    ]


def cpu_launch_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``, with no GPU visible: for launching a ``cpu*.yaml`` config.

    Those configs run gloo ranks on the CPU. On a machine with a GPU, DeepSpeed would put rank ``i`` on
    ``cuda:i`` (no ``cuda:1`` on a one-GPU machine) and the recipe, which adds its CPU settings only where
    CUDA is absent, would run NCCL ranks and bf16: not what these tests check.
    """
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


def tiny_recipe_inputs(tmp_path: Path, rows: int = 40) -> tuple[Path, Path]:
    """``(model folder, data file)`` for running the recipe on a tiny model: a tiny Qwen2 with its tokenizer saved
    locally, and ``rows`` questions "What is i + i?" as JSON lines."""
    import json

    from trl_plugins.tiny import build_tiny_model, build_tokenizer

    model_dir = tmp_path / "model"
    tok = build_tokenizer("qwen2_5")
    build_tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "arith.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(rows))
    )
    return model_dir, data


def code_schema() -> dict:
    """The built-in code_interpreter's JSON schema (what the chat template shows the model)."""
    from trl_plugins.tools.code_interpreter import CodeInterpreter

    return CodeInterpreter().schema()


def refusing(calls: list[str], what: str):
    """A stand-in that records ``what`` in ``calls`` and fails the test: for a code path a test says is not reached."""

    def _refuse(*a, **k):
        calls.append(what)
        raise AssertionError(f"{what} was reached")

    return _refuse


@pytest.fixture
def no_model_no_eval(monkeypatch):
    """main() may not load a model, build the embedded default or start an evaluation: each attempt is recorded
    and stops the test."""
    import transformers

    import retool.default_model
    import retool.launch

    calls: list[str] = []

    def refuse(what):
        return refusing(calls, what)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse("model load"))
    monkeypatch.setattr(retool.launch, "run_in_child", refuse("evaluation"))
    monkeypatch.setattr(retool.launch, "prepare_child", lambda *a, **k: None)  # no spare interpreter to start
    monkeypatch.setattr(retool.default_model, "ensure_embedded_default", refuse("embedded default build"))
    return calls


@pytest.fixture
def isolated_registries():
    """Snapshot every global registry and restore it afterwards (entry-point discovery included)."""
    for reg in ALL_REGISTRIES.values():
        reg._load_builtins()
    saved = {name: (dict(reg._entries), reg._entry_points_loaded) for name, reg in ALL_REGISTRIES.items()}
    for reg in ALL_REGISTRIES.values():
        reg._entries = dict(reg._entries)
        reg._entry_points_loaded = False
    yield ALL_REGISTRIES
    for name, reg in ALL_REGISTRIES.items():
        reg._entries, reg._entry_points_loaded = saved[name]


def tiny_qwen2(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded 2-layer Qwen2 causal LM (vocab 200) built from config, in eval mode; no download."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    model.config._attn_implementation = "eager"
    model.eval()  # no dropout: gradients must be deterministic
    return model


@pytest.fixture(scope="session")
def tiny_model_factory():
    """Build (and cache) :func:`tiny_qwen2` per dtype; each call returns a fresh copy."""
    cache: dict[str, torch.nn.Module] = {}

    def build(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = str(dtype)
        if key not in cache:
            cache[key] = tiny_qwen2(dtype)
        return copy.deepcopy(cache[key])

    return build


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def isclose(a: float, b: float, tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
