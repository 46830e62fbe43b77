"""The real loop: vLLM rollouts and a sharded trainer as Ray actors, with the monitor between them
(`rlcheck.loop.driver` has the step; `rlcheck.loop.config` the run's config and result;
`rlcheck.loop.recovery` what happens when an actor is lost; `rlcheck.loop.agent` the multi-turn
calculator task; `recipes/` holds runnable configurations)."""

from rlcheck.loop.agent import CalculatorTask
from rlcheck.loop.config import PHASES, LoopConfig, LoopResult
from rlcheck.loop.driver import GRPOLoop, run_grpo
from rlcheck.loop.placement import Placement, ray_session
from rlcheck.loop.recovery import EngineRestart
from rlcheck.loop.task import AdditionTask, reward

__all__ = ["PHASES", "AdditionTask", "CalculatorTask", "EngineRestart", "GRPOLoop", "LoopConfig", "LoopResult", "Placement",
           "ray_session", "reward", "run_grpo"]
