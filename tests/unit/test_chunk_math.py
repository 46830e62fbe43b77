"""The chunked kernel's float32 path is exact whatever reduced-precision matmuls the process turned on
(TF32 on CUDA, oneDNN's bfloat16 passes on CPU: `torch.set_float32_matmul_precision`), and puts the
setting back (`rlcheck.trainers.chunk_math.exact_fp32`)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rlcheck.trainers.chunk_math import exact_fp32
from rlcheck.trainers.chunked_logprobs import chunked_token_logprobs

MATMULS = {torch.bmm, torch.matmul, torch.mm, torch.nn.functional.linear, torch.Tensor.addmm_,
           torch.Tensor.__matmul__, torch.Tensor.matmul}


class Precisions(TorchFunctionMode):
    """Records, at every matmul-family call, the float32 precision each backend would use."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.seen.append((getattr(func, "__name__", str(func)), torch.backends.cuda.matmul.fp32_precision,
                              torch.backends.mkldnn.matmul.fp32_precision))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def reduced_precision():
    """The process asks for TF32 / bfloat16 float32 matmuls ("medium"), as many trainers do; put back after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    yield
    torch.set_float32_matmul_precision(before)


def inputs(n=96, h=64, v=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5 * 3).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g)


class TestExactFp32:
    def test_every_matmul_runs_ieee_and_the_setting_comes_back(self, reduced_precision, monkeypatch):
        """Forward (logits, entropy's bmm): every matmul sees "ieee" on both backends; so does the
        backward (grad_hidden, grad_W's addmm_, after each chunk's gradient); the process's "tf32" /
        "bf16" are back afterwards."""
        from rlcheck.trainers import chunked_logprobs as kernel

        backward, real_grad = [], kernel.chunk_grad
        monkeypatch.setattr(kernel, "chunk_grad", lambda *a: backward.append(
            (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)) or real_grad(*a))
        hidden, weight, targets = inputs()
        with Precisions() as mode:
            out = chunked_token_logprobs(hidden, weight, targets, with_entropy=True, chunk_size=32, keep_bytes=0)
        (out.logp.sum() + out.entropy.sum()).backward()
        assert {"bmm", "linear"} <= {name for name, _, _ in mode.seen}
        assert {(cuda, cpu) for _, cuda, cpu in mode.seen} == set(backward) == {("ieee", "ieee")}
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision) == ("tf32", "bf16")

    def test_values_equal_float64_under_reduced_precision(self, reduced_precision):
        """logp, entropy and both gradients within 1e-4 of the float64 naive formula with "medium" set
        (on a CPU with AMX/AVX512-BF16 the unguarded bmm and addmm_ are ~1e-2 off; elsewhere the setting
        changes nothing and this holds all the same)."""
        hidden, weight, targets = inputs()
        out = chunked_token_logprobs(hidden, weight, targets, with_entropy=True, chunk_size=32, keep_bytes=0)
        (out.logp.sum() + out.entropy.sum()).backward()
        h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        lp = (h64 @ w64.T).log_softmax(-1)
        logp, ent = lp.gather(-1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)
        (logp.sum() + ent.sum()).backward()
        for got, want in ((out.logp, logp), (out.entropy, ent), (hidden.grad, h64.grad), (weight.grad, w64.grad)):
            torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-4)

    def test_context_restores_on_error(self):
        """An exception inside leaves the settings as they were."""
        before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
        with pytest.raises(RuntimeError), exact_fp32():
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
            raise RuntimeError("boom")
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision) == before
