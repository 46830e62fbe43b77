"""The calculator's `add` tool as a verl `BaseTool` (tests/verl_cpu/calculator_tools.yaml names it; verl's
tool registry imports this module in its agent-loop workers). It replies as the calculator task's
environment does (`rlcheck.loop.agent.calculator.CalculatorEnv`): the sum, or an error for operands
past `MAX_RESULT`."""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from rlcheck.loop.agent.calculator import MAX_RESULT


class AddTool(BaseTool):
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        a, b = int(parameters["a"]), int(parameters["b"])
        text = str(a + b) if max(abs(a), abs(b)) <= MAX_RESULT else "error: number too large"
        return ToolResponse(text=text), 0.0, {}
