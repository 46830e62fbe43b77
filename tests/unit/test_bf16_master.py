"""Why the FSDP2 backend keeps float32 master weights under a bfloat16 dtype (`FSDP2Backend`): AdamW
on bfloat16 parameters at a GPU learning rate rounds nearly every update away."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def share_moved(dtype: torch.dtype, steps: int = 10, lr: float = 1e-6) -> float:
    """The share of 100k weights ~N(0, 0.02), stored in `dtype`, that `steps` AdamW steps of random
    gradients change."""
    w0 = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 0.02
    p = torch.nn.Parameter(w0.to(dtype))
    start = p.detach().clone()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(w0.shape, generator=g).to(dtype)
        opt.step()
    return float((p.detach() != start).float().mean())


class TestBf16Updates:
    def test_bf16_parameters_barely_move(self):
        """10 steps at lr 1e-6 change ~2% of bf16 weights (steps of ~1e-6 under half a bf16 spacing,
        6e-5 at |w| = 0.02), all but a few float32 ones."""
        assert share_moved(torch.bfloat16) < 0.05
        assert share_moved(torch.float32) > 0.999
