"""Where the HF reference of the forensic tools runs, and in what dtype: `ReferenceConfig`, taken by
`rlcheck replay`, `localize`, `stress` and `sweep` (`--reference-dtype`, `--device`).

    scorer = load_reference("runs/models/qwen-7b", ReferenceConfig(dtype="bfloat16", device="cuda"))

The default, float32 on the CPU, judges at float32's precision but holds 4 bytes a parameter in host
memory (28 GB for a 7B); bfloat16 halves that, and a GPU takes it off the host. A coarser reference
brings its own rounding, so the tolerance that judges against it is the coarser dtype's
(`rlcheck.core.limits.logprob_tolerance` for logprobs, `rlcheck.forensics.localize.compare.tolerance_for`
for hidden states).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rlcheck.core.limits import PRECISIONS, dtype_name
from rlcheck.errors import ConfigError, InputError

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class ReferenceConfig:
    dtype: str = "float32"
    """float32, bfloat16 or float16 (short names too: bf16, fp16, fp32)."""
    device: str = "cpu"
    """"cpu", "cuda" or "cuda:N": where the model's weights and forward passes go."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.dtype not in PRECISIONS:
            raise ConfigError(f"reference dtype must be one of {', '.join(PRECISIONS)}, got {self.dtype!r}")
        if not _DEVICE.match(str(self.device)):
            raise ConfigError(f"reference device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")

    def check_device(self) -> None:
        """A ConfigError when the device is a GPU this process cannot see (before any weight is read)."""
        if self.device == "cpu":
            return
        import torch

        index = int(self.device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"reference device {self.device!r}: this process sees "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s); "
                              "use --device cpu (with --reference-dtype bfloat16 to halve its memory)")


def load_reference(model_dir: Any, reference: ReferenceConfig | None = None):
    """The `HFScorer` of `model_dir` in `reference`'s dtype on its device; an InputError when the folder
    does not hold a model transformers can load."""
    from rlcheck.engines.hf import HFScorer, HFScorerConfig

    reference = reference or ReferenceConfig()
    reference.check_device()
    try:
        return HFScorer(HFScorerConfig(model=str(model_dir), dtype=reference.dtype, device=reference.device))
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"cannot load the model in {model_dir}: {exc}") from exc
