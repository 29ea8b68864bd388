"""A multi-turn verifiers environment whose responses are not tools: a scripted user (the environment's ``run``)
asks a follow-up after each reply, built with the pinned verifiers' own classes."""

import verifiers.v1 as vf

FOLLOW_UPS = ["Are you sure?"]


class AskData(vf.TaskData):
    question: str
    follow_ups: list[str]


class AskTask(vf.Task[AskData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def answered_every_turn(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum("\\boxed{" in r for r in replies) / (1 + len(self.data.follow_ups))


class AskEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            for message in [task.data.question, *task.data.follow_ups]:
                if (await interaction.turn(message)).terminated:
                    break


class AskTaskset(vf.Taskset[AskTask, vf.TasksetConfig]):
    def load(self) -> list[AskTask]:
        return [
            AskTask(AskData(idx=0, prompt=None, question="What is 3 + 4?", follow_ups=FOLLOW_UPS), self.config.task)
        ]


__all__ = ["AskEnv", "AskTaskset"]
