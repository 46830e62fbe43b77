"""`build_model`: a tiny random-weight model and its tokenizer, written as a Hugging Face model folder."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlcheck.errors import ConfigError, InputError
from rlcheck.modelzoo.models import ARCHS, DEFAULT_LAYERS, MAX_POSITIONS, hf_config, init_model
from rlcheck.modelzoo.tokenizer import save_tokenizer

DTYPES = ("float32", "bfloat16")
MANIFEST = "rlcheck_model.json"


@dataclass(frozen=True)
class ModelSpec:
    """What `build` makes. The same spec always gives byte-identical files."""

    arch: str = "hybrid"
    """One of `ARCHS`: "llama" (attention), "mamba2" (SSM), "hybrid" (GraniteMoeHybrid: Mamba2
    layers around one attention layer), "moe" (Qwen3-MoE: 8 experts, top-2, every layer) or "qwen2"
    (Qwen2: attention with q/k/v biases, 2 layers)."""
    seed: int = 0
    """Seed of the weight init; the tokenizer does not depend on it."""
    dtype: str = "float32"
    """Dtype of the saved weights: "float32" or "bfloat16" (the float32 init, rounded)."""
    vocab_size: int = 2048
    """Tokenizer and embedding size, 512..4096 (the corpus yields at most ~4300 BPE tokens)."""
    num_layers: int | None = None
    """Decoder layers, 2..8; unset: the arch's `DEFAULT_LAYERS` (4, the moe 2)."""
    logit_std: float = 3.0
    """Std of the initial logits; 0 gives a flat next-token distribution, 3 a mean entropy of ~3-4 nats."""
    max_positions: int = MAX_POSITIONS
    """Context length (`max_position_embeddings`, the tokenizer's `model_max_length`), 64..32768:
    vLLM's `max_model_len` may not exceed it, so runs with 1k+ token responses need 2048 or more."""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if not 512 <= self.vocab_size <= 4096:
            raise ConfigError(f"vocab_size={self.vocab_size} is outside 512..4096")
        if self.num_layers is None:
            object.__setattr__(self, "num_layers", DEFAULT_LAYERS[self.arch])
        if not 2 <= self.num_layers <= 8:
            raise ConfigError(f"num_layers={self.num_layers} is outside 2..8")
        if not (math.isfinite(self.logit_std) and self.logit_std >= 0):
            raise ConfigError(f"logit_std={self.logit_std} must be a finite number >= 0")
        if not 64 <= self.max_positions <= 32768:
            raise ConfigError(f"max_positions={self.max_positions} is outside 64..32768")


def publish(folder: Path, out: Path) -> None:
    """Move a finished model `folder` to `out` in one rename, its files world-readable (mkdtemp and
    safetensors make private files), replacing whatever `out` held."""
    for path in folder.iterdir():
        os.chmod(path, 0o644)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(folder, out)


def build(spec: ModelSpec, out_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the model of `spec` into `out_dir` (config.json, generation_config.json,
    model.safetensors, tokenizer files, rlcheck_model.json) and return its path.

    `out_dir` must not exist or be empty unless `force`, which replaces it. The folder is built beside
    `out_dir` and renamed into place, so a failed build leaves nothing behind.
    """
    import torch

    out = Path(out_dir)
    is_empty_dir = out.is_dir() and not any(out.iterdir())
    if out.exists() and not is_empty_dir and not force:
        raise InputError(f"{out} exists and is not empty; pass force=True (--force) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        # transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which adds an unknown token
        # ("<|endoftext|>", one id past the embeddings) unless the folder names one
        unk = {"unk_token": "<|pad|>"} if spec.arch == "qwen2" else {}
        tokenizer = save_tokenizer(spec.vocab_size, spec.max_positions, tmp, **unk)
        special_ids = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        config = hf_config(spec.arch, spec.vocab_size, spec.num_layers, special_ids, spec.max_positions)
        model = init_model(config, spec.seed, spec.logit_std).to(getattr(torch, spec.dtype))
        model.save_pretrained(tmp)
        manifest = {**asdict(spec), "num_params": sum(p.numel() for p in model.parameters())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp (and safetensors) make private files
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_model(arch: str, out_dir: str | os.PathLike, *, force: bool = False, **options) -> Path:
    """`build(ModelSpec(arch, **options), out_dir, force=force)`; options: any other `ModelSpec` field
    (seed, dtype, vocab_size, num_layers, logit_std, max_positions)."""
    return build(ModelSpec(arch=arch, **options), out_dir, force=force)


def describe(model_dir: str | os.PathLike) -> dict:
    """The manifest `build` wrote: the spec's fields and `num_params`."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        raise InputError(f"{model_dir} has no {MANIFEST}; it was not made by rlcheck make-model")
    return json.loads(path.read_text())
