"""verl's tool agent loop (`ToolAgentLoop`, agent_name "tool_agent") on rlcheck's calculator task, for the
model zoo's tiny Llama trained on it (runs/models/llama-calculator): a verl plugin of the test support
(`VERL_USE_EXTERNAL_MODULES`, loaded in every verl process) and the pieces a verl user writes for a tool:

- a tool parser (verl's `ToolParser` registry, `actor_rollout_ref.rollout.multi_turn.format=calculator`)
  that reads the model's own call syntax, `<think>12+7</think>add(a=12, b=7)<|eos|>`: the tiny model
  never writes hermes `<tool_call>` JSON;
- the `add` tool, a verl `BaseTool` (`AddTool`, declared in TOOL_CONFIG, the file of
  `actor_rollout_ref.rollout.multi_turn.tool_config_path`), replying as `rlcheck.loop.agent.calculator`'s
  environment does;
- the overrides of a multi-turn run (`OVERRIDES`) and the reward (`compute_score`, tests/verl_cpu/reward.py).

verl's agent loop renders the tool's reply with the model's chat template (a "tool" message: a user turn
`<|user|>\\n19<|eos|>\\n<|assistant|>\\n`, mask 0, engine logprob 0.0) after the sampled `<|eos|>`; its
generic Continuous Token builder (the model type "llama" has no family of its own) does not insert the
"\\n" the template writes after `<|eos|>`, so the model sees `<|eos|><|user|>` where it trained on
`<|eos|>\\n<|user|>`: it still calls the tool (measured in docs/integrations/verl.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from rlcheck.integrations.verl.imports import after_import

PARSER = "calculator"
AGENT = "tool_agent"
TOOL_CONFIG = Path(__file__).with_name("calculator_tools.yaml")
MAX_TURNS = 3  # the problem needs 2 calls and an answer

OVERRIDES = (
    f"actor_rollout_ref.rollout.multi_turn.format={PARSER}",
    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOL_CONFIG}",
    f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={MAX_TURNS}",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=1",
    "data.max_prompt_length=32",
    "data.max_response_length=128",
)
"""The overrides of a multi-turn run (after run.SMALL_OVERRIDES, which they replace where they overlap)."""


def _register_parser(module: ModuleType) -> None:
    from rlcheck.loop.agent.calculator import CALL

    @module.ToolParser.register(PARSER)
    class CalculatorToolParser(module.ToolParser):
        """The calculator model's `add(a=12, b=7)`: one call a turn, the text around it the content."""

        async def extract_tool_calls(self, responses_ids, tools=None):
            text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
            found = CALL.search(text)
            if found is None:
                return text, []
            args = json.dumps({"a": int(found.group(1)), "b": int(found.group(2))})
            return text[: found.start()] + text[found.end():], [module.FunctionCall(name="add", arguments=args)]


after_import("verl.experimental.agent_loop.tool_parser", _register_parser)
