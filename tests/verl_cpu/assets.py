"""What a verl run here trains on: the model zoo's tiny Qwen2, trained briefly on the addition task
(a real BPE tokenizer with a chat template, EOS after an answer), and parquet files of addition
problems in verl's RL dataset format (`prompt` as chat messages, `reward_model.ground_truth`); for the
multi-turn runs, the tiny Llama trained on the calculator task and its problems, each row naming verl's
tool agent loop (`agent_name`)."""

from __future__ import annotations

from pathlib import Path

from rlcheck.loop.agent.calculator import CalculatorTask
from rlcheck.loop.task import AdditionTask
from rlcheck.modelzoo import ensure_trained

DATA_SOURCE = "rlcheck/addition"
CALCULATOR_SOURCE = "rlcheck/calculator"


def model(root: Path) -> Path:
    """runs/models/qwen2-trained (built once: ~1 CPU minute)."""
    return ensure_trained(Path(root) / "qwen2-trained", "qwen2")


def problems(path: Path, num_prompts: int, seed: int) -> Path:
    """A parquet of `num_prompts` addition problems as verl's RLHFDataset reads them."""
    import pandas as pd

    rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": text}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(answer)}, "extra_info": {"index": i}}
            for i, (text, answer) in enumerate(AdditionTask(num_prompts=num_prompts, seed=seed).prompts(0))]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def calculator_model(root: Path) -> Path:
    """runs/models/llama-calculator (built once: a few CPU minutes)."""
    return ensure_trained(Path(root) / "llama-calculator", "llama", task="calculator")


def calculator_problems(path: Path, num_prompts: int, seed: int, agent_name: str = "tool_agent") -> Path:
    """A parquet of `num_prompts` calculator problems ("12+7+5", a sum of three) for verl's agent loop
    `agent_name`; the prompt is the user turn alone (verl's agent loop renders the chat template)."""
    import pandas as pd

    task = CalculatorTask(num_prompts=num_prompts, seed=seed)
    rows = [{"data_source": CALCULATOR_SOURCE, "agent_name": agent_name, "ability": "math",
             "prompt": [{"role": "user", "content": text.split("\n")[1].removesuffix("<|eos|>")}],
             "reward_model": {"style": "rule", "ground_truth": str(answer)}, "extra_info": {"index": i}}
            for i, (text, answer) in enumerate(task.prompts(0))]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path
