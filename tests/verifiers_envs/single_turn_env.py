"""A single-turn verifiers environment, built with the pinned verifiers' own classes (run by its runner in verifiers'
interpreter, never imported by the suite): a question, one reply, a rubric of two weighted reward functions. The
task asking for "boom" has a reward function that raises (its trajectory must be an environment_error)."""

import re

import verifiers.v1 as vf


class QuestionData(vf.TaskData):
    answer: str


class QuestionTask(vf.Task[QuestionData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if "boom" in self.data.prompt_text:
            raise RuntimeError("the scorer exploded")
        found = re.findall(r"\\boxed\{([^}]*)\}", trace.last_reply or "")
        return float(bool(found) and found[-1].strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") <= 40)


class QuestionTaskset(vf.Taskset[QuestionTask, vf.TasksetConfig]):
    def load(self) -> list[QuestionTask]:
        rows = [("What is 3 + 4?", "7"), ("Say boom.", "0")]
        return [
            QuestionTask(QuestionData(idx=i, prompt=p, answer=a), self.config.task) for i, (p, a) in enumerate(rows)
        ]


__all__ = ["QuestionTaskset"]
