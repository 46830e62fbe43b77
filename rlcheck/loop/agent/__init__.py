"""A multi-turn task in the loop: trajectories of several engine calls with a tool's replies between them
(`calculator`: the task and its environment; `episodes`: the turns against the engine; `view`: what the
trainer scores of them and the monitor's batch; `wiring`: their place in the loop's step)."""

from rlcheck.loop.agent.calculator import CalculatorEnv, CalculatorTask

__all__ = ["CalculatorEnv", "CalculatorTask"]
