"""A verifiers environment that needs what the agent endpoint does not serve (built with the pinned verifiers' own
classes): two agents, one with sampling settings of its own, an image in a prompt, a task in a container image, a judge
model. Refused at start-up, each named."""

import verifiers.v1 as vf


class PlainTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def one(self, trace: vf.Trace) -> float:
        return 1.0


class RefusedTaskset(vf.Taskset[PlainTask, vf.TasksetConfig]):
    def load(self) -> list[PlainTask]:
        picture = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
        judged = vf.TaskConfig(judges=[{"id": "reference"}])
        return [
            PlainTask(vf.TaskData(idx=0, prompt=picture), self.config.task),
            PlainTask(vf.TaskData(idx=1, prompt="Build it.", image="python:3.12"), self.config.task),
            PlainTask(vf.TaskData(idx=2, prompt="Judged."), judged),
        ]


class DuetConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig(sampling={"temperature": 0.2})
    critic: vf.AgentConfig = vf.AgentConfig()


class DuetEnv(vf.Env[DuetConfig]):
    async def run(self, task, agents):  # never played: refused at start-up
        await agents.solver.run(task)


__all__ = ["DuetEnv", "RefusedTaskset"]
