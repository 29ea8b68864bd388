"""A verifiers taskset whose load() never ends, built with the pinned verifiers' own classes (run by its runner in
verifiers' interpreter, never imported by the suite): marked ``INFINITE`` (verifiers' flag for a generator of tasks)
or, with ``marked: false``, not marked at all. Either needs the rollout's max_rows."""

import itertools

import verifiers.v1 as vf


class CountData(vf.TaskData):
    answer: str


class CountTask(vf.Task[CountData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class CountConfig(vf.TasksetConfig):
    marked: bool = True


class CountTaskset(vf.Taskset[CountTask, CountConfig]):
    def __init__(self, config: CountConfig) -> None:
        super().__init__(config)
        self.INFINITE = config.marked

    def load(self):
        for i in itertools.count():
            yield CountTask(CountData(idx=i, prompt=f"What is {i} + 1?", answer=str(i + 1)), self.config.task)


__all__ = ["CountTaskset"]
