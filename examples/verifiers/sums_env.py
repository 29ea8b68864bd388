"""A verifiers environment written only with verifiers' own classes (``verifiers.v1``): sums of three numbers, one
reply each, scored by a rubric of two weighted reward functions. Trained by the recipe through the ``verifiers``
rollout (``verifiers.yaml`` beside it; docs/environments.md). It runs in verifiers' interpreter, never in ours."""

import random
import re

import verifiers.v1 as vf

SYSTEM = "Add the numbers. End with the answer as \\boxed{...}."


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r"\\boxed\{([^}]*)\}", trace.last_reply or "")
        return float(bool(found) and found[-1].strip() == self.data.answer)

    @vf.reward(weight=0.1)
    async def boxed(self, trace: vf.Trace) -> float:
        return float("\\boxed{" in (trace.last_reply or ""))


class SumConfig(vf.TasksetConfig):
    size: int = 200
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.size):
            a, b, c = (rng.randint(10, 99) for _ in range(3))
            tasks.append(
                SumTask(
                    SumData(idx=i, prompt=f"What is {a} + {b} + {c}?", system_prompt=SYSTEM, answer=str(a + b + c)),
                    self.config.task,
                )
            )
        return tasks


__all__ = ["SumTaskset"]
