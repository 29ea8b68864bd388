"""A verifiers environment with a tool (a ``vf.Toolset`` served over MCP, as verifiers serves it), built with the
pinned verifiers' own classes: the model calls ``calc_add`` and answers with what it returned."""

import re

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return f"sum={a + b}"


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r"\\boxed\{([^}]*)\}", trace.last_reply or "")
        return float(bool(found) and found[-1].strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any("sum=" in vf.types.content_text(m.content) for m in trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [CalcTask(CalcData(idx=0, prompt="Use the tool: what is 20 + 22?", answer="42"), self.config.task)]


__all__ = ["CalcTaskset"]


if __name__ == "__main__":
    CalcToolset.run()
