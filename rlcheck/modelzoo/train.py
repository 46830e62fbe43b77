"""`build_trained`: a tiny model *trained* on the loop's addition task, so that its next-token
distributions are peaked like a real LM's and GRPO starts from a non-zero, rising reward.

    from rlcheck.modelzoo import ensure_trained
    ensure_trained("runs/models/llama-trained", "llama")     # built on first use, then reused

A random tiny model (`build`) spreads its probability over thousands of tokens: every sampled token
is a surprise, and the rollout-vs-trainer mismatch of such a model says little about a real run,
where most tokens are near-certain and a few are not. `build_trained` takes the random model of the
same spec and trains it, next-token cross-entropy with AdamW, on rows of whole lines packed from
the start of the row: mostly addition problems exactly as the loop asks them (bos, "12+7=", then
the answer "19" and eos; `rlcheck.loop.task`), some sentences of the tokenizer corpus (so a prompt
that is not a problem, or a response that runs past eos, reads like text rather than noise). Every
line begins with bos and ends with eos, so a response stops after its answer, and with `ignore_eos`
the model goes on with more lines (the long-response runs).

Deterministic: the data and the init come from the seed, and training runs on one thread (a
thread count changes the order of float sums), so the same spec gives the same bytes on one
machine. Measured on this project's machine (AMD EPYC, AVX2, 1 thread): the default llama spec
(400 steps of 32 x 64 tokens) takes ~0.5 s a step alone, 3-4 minutes in all (7 minutes with the two
cores shared by other jobs), and ends at a loss of 1.61 (the operands of a problem are random digits,
~2.3 nats each), greedy accuracy 0.117 and mean task reward 0.58 on 256 problems (a random model:
accuracy 0, reward ~0.1). The hybrid's Mamba2 layers run HF's reference PyTorch kernels here, ~2-3x
slower a step, but it learns the task far better: its default 200 steps took 488 s with the cores
shared (load ~16) and end at loss 1.48, accuracy 0.887, reward 0.94 (400 steps: 0.953, 0.975).
The moe's default 600 steps take 76 s and end at loss 1.63, accuracy 0.125, reward 0.586.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rlcheck.errors import ConfigError, InputError
from rlcheck.modelzoo.build import MANIFEST, ModelSpec, build, publish

TEXT_LINES = 4000
"""Corpus sentences tokenised for the text share (a pool to draw from; the corpus has 20,000)."""
EVAL_PROMPTS = 256
TRAINED_SUFFIX = "-trained"
TASKS = ("addition", "calculator")
CALCULATOR_SUFFIX = "-calculator"
CALCULATOR_ROW_TOKENS = 128
CALCULATOR_STEPS = {"llama": 300, "hybrid": 200, "mamba2": 200, "moe": 400}
"""Training steps of the calculator model (rows of 128 tokens, one dialogue each) when not told."""
DEFAULT_STEPS = {"llama": 400, "hybrid": 200, "mamba2": 200, "moe": 600, "qwen2": 100}
"""Training steps `build_trained` takes when not told: the hybrid learns the task in fewer steps
(loss 1.48 after 200, the llama's 1.61 after 400) but each of its steps costs ~2-3x more here (HF's
reference Mamba2 kernels on CPU), so both builds take a few CPU minutes."""


@dataclass(frozen=True)
class TrainSpec:
    """What `build_trained` makes: a `ModelSpec`'s model, then `steps` AdamW steps on the task."""

    arch: str = "llama"
    """"llama", "hybrid" (the Mamba2 + attention GraniteMoeHybrid), "moe" (Qwen3-MoE) or "mamba2"."""
    seed: int = 0
    """Seed of the init, the training data and the order."""
    steps: int = 400
    batch_rows: int = 32
    row_tokens: int = 64
    """Rows of `row_tokens` tokens per step (whole lines from the row's start, padding masked)."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup over the first 5% of steps, then cosine to 10%)."""
    text_share: float = 0.15
    """Share of lines that are corpus sentences; the rest are addition problems with their answer."""
    max_operand: int = 99
    """Operands 0..max_operand, as `AdditionTask`'s."""
    max_positions: int = 2048
    """Context length of the saved model: room for 1k+ token responses in vLLM."""
    task: str = "addition"
    """"addition" (the loop's `AdditionTask` lines) or "calculator": whole tool-calling dialogues of the
    loop's `CalculatorTask`, one per row (`rlcheck.modelzoo.calculator`; rows of >= 128 tokens)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_rows < 1 or self.row_tokens < 16:
            raise ConfigError("need steps >= 1, batch_rows >= 1 and row_tokens >= 16 (a problem is ~11 tokens)")
        if not self.lr > 0 or not 0 <= self.text_share < 1:
            raise ConfigError(f"need lr > 0 and 0 <= text_share < 1, got {self.lr}, {self.text_share}")
        if self.max_operand < 1:
            raise ConfigError(f"max_operand must be >= 1, got {self.max_operand}")
        if self.task not in TASKS:
            raise ConfigError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.task == "calculator" and self.row_tokens < CALCULATOR_ROW_TOKENS:
            raise ConfigError(f"a calculator dialogue needs rows of >= {CALCULATOR_ROW_TOKENS} tokens, got {self.row_tokens}")
        ModelSpec(arch=self.arch, seed=self.seed, max_positions=self.max_positions)  # its checks

    def model_spec(self) -> ModelSpec:
        return ModelSpec(arch=self.arch, seed=self.seed, max_positions=self.max_positions)


def build_trained(arch: str = "llama", out_dir: str | os.PathLike = "runs/models/llama-trained", *,
                  force: bool = False, **options) -> Path:
    """`train(TrainSpec(arch, **options), out_dir, force=force)`, with `DEFAULT_STEPS[arch]` steps
    unless `steps` is given."""
    if options.get("task") == "calculator":
        options.setdefault("row_tokens", CALCULATOR_ROW_TOKENS)
        options.setdefault("steps", CALCULATOR_STEPS.get(arch, TrainSpec.steps))
    options.setdefault("steps", DEFAULT_STEPS.get(arch, TrainSpec.steps))
    return train(TrainSpec(arch=arch, **options), out_dir, force=force)


def ensure_trained(out_dir: str | os.PathLike, arch: str = "llama", **options) -> Path:
    """The trained model at `out_dir`, built there first (a few CPU minutes) if the folder holds none:
    the on-disk cache of `rlcheck demo`, the recipes and the benchmarks."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    return build_trained(arch, out, **options)


def ensure_model(out_dir: str | os.PathLike) -> Path:
    """The model at `out_dir`, built there first if the folder holds none, by its name: a folder
    named `<arch>-trained` (runs/models/hybrid-trained, the demo's) gets a model of that arch trained
    on the task (`ensure_trained`, a few CPU minutes), `<arch>-calculator` one trained on the
    multi-turn calculator (`task="calculator"`), any other the random hybrid (`build`, seconds)."""
    from rlcheck.modelzoo.models import ARCHS

    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    for suffix, task in ((TRAINED_SUFFIX, "addition"), (CALCULATOR_SUFFIX, "calculator")):
        if out.name.endswith(suffix):
            arch = out.name[: -len(suffix)]
            return ensure_trained(out, arch if arch in ARCHS else "hybrid", task=task)
    return build(ModelSpec(arch="hybrid"), out)


def train(spec: TrainSpec, out_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Build the random model of `spec`, train it, write it into `out_dir` (an HF folder as `build`
    writes, its manifest with a `training` entry: the spec, the final loss and the greedy accuracy
    and mean task reward on `EVAL_PROMPTS` problems). Atomic: built beside `out_dir`, renamed in."""
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise InputError(f"{out} exists and is not empty; pass force=True (--force) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.train.", dir=out.parent))
    try:
        folder = build(spec.model_spec(), work / "model")
        t0 = time.perf_counter()
        summary = _train_folder(spec, folder)
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest["training"] = {**asdict(spec), **summary}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        publish(folder, out)
        _log(f"trained {spec.arch} in {time.perf_counter() - t0:.0f} s: {summary}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _train_folder(spec: TrainSpec, folder: Path) -> dict:
    """Train the model saved in `folder` in place (one thread); returns loss, accuracy and reward."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            loss = _fit(model, spec, _rows(tok, spec))
            model.eval()
            accuracy, reward = _evaluate(model, tok, spec)
        model.save_pretrained(folder)
        if spec.task == "calculator":
            from rlcheck.modelzoo.calculator import install_templates

            install_templates(folder)
    finally:
        torch.set_num_threads(threads)
    return {"final_loss": round(loss, 4), "eval_accuracy": round(accuracy, 4), "eval_reward": round(reward, 4)}


def _rows(tok, spec: TrainSpec):
    if spec.task == "calculator":
        from rlcheck.modelzoo.calculator_train import CalculatorRows

        return CalculatorRows(tok, spec)
    return _Lines(tok, spec)


def _evaluate(model, tok, spec: TrainSpec) -> tuple[float, float]:
    if spec.task == "calculator":
        from rlcheck.modelzoo.calculator_train import evaluate as evaluate_calculator

        return evaluate_calculator(model, tok, spec.max_operand)
    return evaluate(model, tok, spec.max_operand)


def _fit(model, spec: TrainSpec, lines) -> float:
    """`spec.steps` AdamW steps, warmup then cosine; returns the mean loss of the last 20 steps."""
    import math

    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, spec.steps // 20)

    def lr_at(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warmup) / max(1, spec.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    recent: list[float] = []
    for i in range(spec.steps):
        ids, labels = lines.batch()
        loss = model(input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        if (i + 1) % max(1, spec.steps // 10) == 0:
            _log(f"train step {i + 1}/{spec.steps} loss {float(np.mean(recent)):.3f}")
    return float(np.mean(recent))


class _Lines:
    """Training rows: whole lines (bos ... eos) packed from each row's start, padding masked (-100)."""

    def __init__(self, tok, spec: TrainSpec):
        self.spec, self.bos, self.eos, self.pad = spec, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        self.rng = np.random.default_rng([spec.seed, 20_240])
        self.char_ids = {c: tok.convert_tokens_to_ids(c) for c in "0123456789+="}
        from rlcheck.modelzoo.corpus import corpus

        texts = corpus()[:TEXT_LINES]
        limit = spec.row_tokens - 2
        self.texts = [ids[:limit] for ids in tok(texts, add_special_tokens=False)["input_ids"]]

    def problem(self) -> list[int]:
        """bos "a+b=" "sum" eos, token by token as the loop encodes prompt and answer."""
        a, b = (int(x) for x in self.rng.integers(0, self.spec.max_operand + 1, 2))
        return [self.bos] + [self.char_ids[c] for c in f"{a}+{b}={a + b}"] + [self.eos]

    def line(self) -> list[int]:
        if self.rng.random() < self.spec.text_share:
            return [self.bos] + self.texts[int(self.rng.integers(len(self.texts)))] + [self.eos]
        return self.problem()

    def batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels), each (batch_rows, row_tokens) int64."""
        rows, width = self.spec.batch_rows, self.spec.row_tokens
        ids = np.full((rows, width), self.pad, dtype=np.int64)
        labels = np.full((rows, width), -100, dtype=np.int64)
        for r in range(rows):
            pos = 0
            while True:
                line = self.line()
                if pos + len(line) > width:
                    break
                ids[r, pos : pos + len(line)] = line
                labels[r, pos : pos + len(line)] = line
                pos += len(line)
        return ids, labels


def evaluate(model, tok, max_operand: int = 99, num_prompts: int = EVAL_PROMPTS, max_new: int = 5) -> tuple[float, float]:
    """Greedy accuracy and mean task reward on `num_prompts` problems of `AdditionTask(seed=12345)`
    (prompts encoded as the loop encodes them)."""
    import torch

    from rlcheck.loop.task import AdditionTask, encode_prompts, reward

    task = AdditionTask(max_operand=max_operand, num_prompts=num_prompts, seed=12345)
    items = task.prompts(0)
    prompts = encode_prompts(tok, [text for text, _ in items])
    scores, correct = [], 0
    with torch.no_grad():
        for length in sorted({len(p) for p in prompts}):  # equal lengths: a batch without padding
            idx = [i for i, p in enumerate(prompts) if len(p) == length]
            ids = torch.tensor([prompts[i] for i in idx])  # (B, P)
            for _ in range(max_new):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
                ids = torch.cat([ids, nxt], 1)
            for row, i in zip(ids[:, length:].tolist(), idx, strict=True):
                if tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id)]
                text = tok.decode(row, skip_special_tokens=True)
                score = reward(text, items[i][1])
                scores.append(score)
                correct += score == 1.0
    return correct / len(prompts), float(np.mean(scores))


def _log(message: str) -> None:
    if os.environ.get("RLCHECK_QUIET_BUILD") != "1":
        print(f"rlcheck.modelzoo: {message}", flush=True)
