"""Jobs for ``retool.launch.run_in_child`` tests, in a module that imports nothing heavy: a child that unpickles one
of them imports only this (a job defined in test_recipe.py would import torch and TRL first, seconds per child)."""

from __future__ import annotations

import os


def double(x):
    return {"twice": 2 * x, "threads": os.environ.get("OMP_NUM_THREADS"), "rank": os.environ.get("RANK")}


def fail():
    raise RuntimeError("child says no")


def exit_without_a_word():
    os._exit(3)


def whoami():
    return {"pid": os.getpid(), "wandb_mode": os.environ.get("WANDB_MODE"), "rank": os.environ.get("RANK")}
