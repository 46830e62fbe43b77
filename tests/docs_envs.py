"""The environments of the docs' fast snippets (tests/docs_snippets.py): what a block gets that its page
only names (your engine and trainer, a process group, a model), and what is checked after it ran. The
environments that need vLLM, Ray, TRL or verl are in tests/docs_envs_slow.py."""

from __future__ import annotations

import contextlib
import os
import socket
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

Check = Callable[[dict[str, Any], str], None]


def _no_check(namespace: dict[str, Any], out: str) -> None:
    pass


@contextlib.contextmanager
def _nothing() -> Iterator[dict[str, Any]]:
    yield {}


@dataclass(frozen=True)
class Env:
    """What a snippet gets that its page only names, and what is checked after it ran."""

    setup: Callable[[], contextlib.AbstractContextManager[dict[str, Any]]] = _nothing
    """Entered in the snippet's working directory: the names given to the snippet."""
    check: Check = _no_check
    """After the run: the snippet's namespace and what it printed."""
    slow: bool = False
    """Needs vLLM, Ray, TRL or verl: marked slow, run in a process of its own."""


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Environment variables set for the block, restored after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def journal(run_dir: str) -> list[str]:
    return Path(run_dir, "metrics.jsonl").read_text().splitlines()


class ToyEngine:
    """Stands for your rollout engine: `generate(prompts)` gives one rollout per prompt, with a unique
    request id, its token ids and the sampling logprobs."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.num_requests = 0

    def generate(self, prompts: list[str]) -> list[types.SimpleNamespace]:
        rollouts = []
        for _ in prompts:
            n = int(self.rng.integers(4, 33))
            rollouts.append(types.SimpleNamespace(request_id=f"req-{self.num_requests}",
                                                  token_ids=self.rng.integers(0, 1000, n),
                                                  logprobs=-self.rng.exponential(1.0, n)))
            self.num_requests += 1
        return rollouts


class ToyTrainer:
    """Stands for your trainer: `logprobs(rollouts)` scores the same tokens (1e-4 nats off), `update`
    counts the updates."""

    def __init__(self, seed: int = 1):
        self.rng = np.random.default_rng(seed)
        self.num_updates = 0

    def logprobs(self, rollouts: list[types.SimpleNamespace]) -> list[np.ndarray]:
        return [np.minimum(r.logprobs + self.rng.normal(0.0, 1e-4, len(r.logprobs)), 0.0) for r in rollouts]

    def update(self, rollouts: list[types.SimpleNamespace]) -> None:
        self.num_updates += 1


@contextlib.contextmanager
def _own_loop() -> Iterator[dict[str, Any]]:
    with environ(WANDB_MODE="offline", WANDB_SILENT="true"):
        yield {"engine": ToyEngine(), "trainer": ToyTrainer(), "prompts": [f"{a}+{a}=" for a in range(8)],
               "num_steps": 3}


def _check_own_loop(ns: dict[str, Any], out: str) -> None:
    assert len(journal("runs/exp1")) == ns["num_steps"] == ns["trainer"].num_updates


def _check_quickstart(ns: dict[str, Any], out: str) -> None:
    assert len(journal("runs/quickstart")) == 3 and out.count("[]") == 3


def _check_padded(ns: dict[str, Any], out: str) -> None:
    assert len(journal("runs/padded-example")) == 5
    assert "halted" not in out and out.count("[]") == 5


def _check_quarantine(ns: dict[str, Any], out: str) -> None:
    lines = out.splitlines()
    assert lines[0] == "req-7 catastrophic" and lines[1].startswith("1.0 ")
    assert '"alarms":[]' in journal("runs/quarantine-example")[0]
    assert Path("runs/quarantine-example/quarantine/step_000000").is_dir()


def _check_halt(ns: dict[str, Any], out: str) -> None:
    assert "NaN/inf logprobs" in out and "[('threshold', 'critical')]" in out
    assert Path("runs/halt-example/dumps/step_000000/sequences.parquet").is_file()


def _check_preflight(ns: dict[str, Any], out: str) -> None:
    assert "ERROR    logprobs_mode: trainer T=0.7 | engine raw_logprobs (T=1)" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _distributed() -> Iterator[dict[str, Any]]:
    """A one-rank gloo process group, as every rank of a real run has one."""
    import torch.distributed as dist

    from rlcheck import StepBatch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    rng = np.random.default_rng(0)
    logp = [-rng.uniform(0.1, 3.0, 16) for _ in range(4)]
    batch = StepBatch.from_ragged(logp_rollout=logp, logp_train=[lp + 1e-4 for lp in logp],
                                  request_ids=[f"r0/{i}" for i in range(4)])
    try:
        yield {"its_batch": batch, "step": 0}
    finally:
        dist.destroy_process_group()


def _check_distributed(ns: dict[str, Any], out: str) -> None:
    assert ns["report"].alarms == [] and len(journal("runs/x")) == 1


@contextlib.contextmanager
def tiny_model(arch: str, where: str) -> Iterator[dict[str, Any]]:
    """A tiny random model (`rlcheck make-model`) at `where`, standing for the page's model folder."""
    from rlcheck.modelzoo import build_model

    build_model(arch, where)
    yield {}


@contextlib.contextmanager
def _token_logprobs() -> Iterator[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlcheck.modelzoo import build_model

    model = AutoModelForCausalLM.from_pretrained(build_model("llama", "models/llama"))
    vocab = model.config.vocab_size
    yield {"model": model, "input_ids": torch.randint(0, vocab, (2, 12)),
           "packed_ids": torch.randint(0, vocab, (1, 20)), "cu_seqlens": torch.tensor([0, 8, 20])}


def _check_token_logprobs(ns: dict[str, Any], out: str) -> None:
    import torch

    assert ns["out"].logp.numel() > 0 and bool(torch.isfinite(ns["out"].logp).all())


FAST_ENVS: dict[str, Env] = {
    "plain": Env(),
    "quickstart": Env(check=_check_quickstart),
    "own-loop": Env(_own_loop, _check_own_loop),
    "padded": Env(check=_check_padded),
    "quarantine": Env(check=_check_quarantine),
    "halt": Env(check=_check_halt),
    "preflight": Env(check=_check_preflight),
    "distributed": Env(_distributed, _check_distributed),
    "token-logprobs": Env(_token_logprobs, _check_token_logprobs),
}
