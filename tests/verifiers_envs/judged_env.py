"""A verifiers environment whose rubric has a judge (built with the pinned verifiers' own classes): verifiers'
built-in reference judge, plugged on the taskset's task config as verifiers documents it, scores each reply against
the task's answer beside a reward function of the task's own. Run with the judge pointed at the scripted judge
(examples/judges/scripted_judge.py), which cannot grade the task without a reference answer (its trajectory must be a
verifier_error); refused at start-up without an endpoint for it."""

import verifiers.v1 as vf


class QuestionData(vf.TaskData):
    answer: str


class QuestionTask(vf.Task[QuestionData]):
    @vf.reward(weight=0.1)
    async def boxed(self, trace: vf.Trace) -> float:
        return float("\\boxed{" in (trace.last_reply or ""))


class JudgedConfig(vf.TasksetConfig):
    task: vf.TaskConfig = vf.TaskConfig(judges=[{"id": "reference"}])


class JudgedTaskset(vf.Taskset[QuestionTask, JudgedConfig]):
    def load(self) -> list[QuestionTask]:
        rows = [("What is 3 + 4?", "7"), ("Is 7 right?", "")]
        return [
            QuestionTask(QuestionData(idx=i, prompt=p, answer=a), self.config.task) for i, (p, a) in enumerate(rows)
        ]


__all__ = ["JudgedTaskset"]
