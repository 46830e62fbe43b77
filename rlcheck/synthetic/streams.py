"""Helpers for testing rlcheck and integrations with it: heavy-tailed metric streams with injected
periodic spikes, the shape the detectors must tell apart from noise.

    from rlcheck.synthetic.streams import metric_stream
    stream = metric_stream(2000, seed=0, noise="t5", spike_every=12, spike_start=500, spike_mad=5)
    for step, metrics in enumerate(stream.metrics): ...
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlcheck.core import metrics as K
from rlcheck.errors import ConfigError

NOISES = ("gaussian", "t5", "contaminated", "ar1")
AR1_COEF = 0.7
"""Step-to-step autocorrelation of the "ar1" noise: the field streams' (BENCHMARKS.md, "Field fidelity")."""


def heavy_tailed_noise(rng: np.random.Generator, size: int | tuple[int, ...], kind: str = "t5") -> np.ndarray:
    """Zero-centred noise: "gaussian", "t5" (Student-t, 5 dof), "contaminated" (Gaussian with 2%
    of the draws 8x wider) or "ar1" (autocorrelated along the first axis: AR(1) with coefficient
    AR1_COEF and Student-t 5 innovations, unit stationary scale)."""
    if kind == "gaussian":
        return rng.standard_normal(size)
    if kind == "t5":
        return rng.standard_t(5, size)
    if kind == "contaminated":
        x = rng.standard_normal(size)
        return np.where(rng.random(size) < 0.02, 8.0 * x, x)
    if kind == "ar1":
        e = rng.standard_t(5, size) * np.sqrt(1.0 - AR1_COEF**2)
        x = np.empty_like(e)
        x[0] = e[0] / np.sqrt(1.0 - AR1_COEF**2)
        for t in range(1, x.shape[0]):
            x[t] = AR1_COEF * x[t - 1] + e[t]
        return x
    raise ConfigError(f"noise kind must be one of {NOISES}, got {kind!r}")


@dataclass
class MetricStream:
    metrics: list[dict[str, float]]
    spike_steps: list[int]
    mad: float  # MAD of the clean noise of the primary metric


def metric_stream(
    num_steps: int,
    seed: int = 0,
    noise: str = "t5",
    spike_every: int | None = None,
    spike_phase: int = 0,
    spike_start: int = 0,
    spike_mad: float = 5.0,
    level: float = 3e-3,
    rel_noise: float = 0.1,
) -> MetricStream:
    """Per-step metrics around `level` with `rel_noise` relative noise of the given kind. Spikes add
    `spike_mad` MADs of that noise to every metric at steps = spike_phase mod spike_every (from
    spike_start on). Other keys the detectors read are filled with healthy constant-ish values."""
    rng = np.random.default_rng(seed)
    x = heavy_tailed_noise(rng, (num_steps, 3), noise)  # (S, 3)
    mad = float(np.median(np.abs(x[:, 0] - np.median(x[:, 0]))))
    spikes = []
    if spike_every is not None:
        spikes = [s for s in range(spike_start, num_steps) if s % spike_every == spike_phase % spike_every]
        x[spikes] += spike_mad * mad
    out = []
    for s in range(num_steps):
        mean = level * (1.0 + rel_noise * x[s, 0])
        out.append({
            K.ABS_DIFF_MEAN: mean,
            K.ABS_DIFF_CLIPPED_MEAN: mean,
            K.CATASTROPHIC_TOKEN_FRAC: 0.0,
            K.ABS_DIFF_P99: 8.0 * level * (1.0 + rel_noise * x[s, 1]),
            K.KL_K3: 0.5 * level * level * (1.0 + rel_noise * x[s, 2]),
            K.MULT_PROB_ERROR: 1.0 + mean,
            K.PROB_ABS_DIFF_MEAN: 0.5 * mean,
            K.TOKEN_COUNT: 50_000.0,
            K.NONFINITE_COUNT: 0.0,
            K.SEQ_CATASTROPHIC_COUNT: 0.0,
            K.SEQ_CATASTROPHIC_FRAC: 0.0,
            K.SIG_SLOPE: 0.0,
            K.SIG_SLOPE_CORR: float(0.05 * rng.standard_normal()),
            K.SIG_SHIFT_BASE: mean,
            K.SIG_SHIFT_GAIN: 0.002,
            K.SIG_SHIFT_DIRECTION: 1.0,
            K.SIG_EARLY_DIV_COUNT: 0.0,
        })
    return MetricStream(out, spikes, mad)


# Small in-memory HF causal LMs for tests (no files, no tokenizer): the three families rlcheck
# cares about. `rlcheck make-model` builds the on-disk ones vLLM can load.
_TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, n_groups=1, expand=2,
        chunk_size=16)),
    "hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
        mamba_expand=1, mamba_chunk_size=16, shared_intermediate_size=128, num_local_experts=0)),
}


def tiny_causal_lm(arch: str, *, vocab_size: int = 512, seed: int = 0, **overrides):
    """A random in-memory HF causal LM ("llama", "mamba2" or "hybrid" = GraniteMoeHybrid with one
    Mamba2 and one attention layer), seeded; `overrides` go to its config."""
    import torch
    import transformers

    if arch not in _TINY:
        raise ConfigError(f"arch must be one of {sorted(_TINY)}, got {arch!r}")
    config_cls, model_cls, sizes = _TINY[arch]
    config = getattr(transformers, config_cls)(vocab_size=vocab_size, **{**sizes, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(config)
