"""The Mamba conv-buffer repair after `reload_weights` (rlcheck.engines.vllm_sync), on plain torch
modules laid out as vLLM's MambaMixer2 is: a `conv_weights` buffer viewing `conv1d.weight`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rlcheck.engines.vllm_sync import (  # noqa: E402
    UNPACKED_ATTR,
    conv_mixers,
    pack_standin,
    refresh_conv_weights,
    refresh_mamba_conv_weights,
    stale_conv_mixers,
)

DIM, WIDTH = 6, 4


class Mixer(torch.nn.Module):
    """MambaMixer2's conv layout: conv1d.weight (dim, 1, width) and its (dim, width) view as a
    non-persistent buffer (vllm/model_executor/layers/mamba/mamba_mixer2.py:472-476)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.conv1d = torch.nn.Module()
        g = torch.Generator().manual_seed(seed)
        self.conv1d.weight = torch.nn.Parameter(torch.randn(DIM, 1, WIDTH, generator=g, dtype=torch.bfloat16),
                                                requires_grad=False)
        w = self.conv1d.weight
        self.register_buffer("conv_weights", w.view(w.size(0), w.size(2)), persistent=False)


def pack(mixer: Mixer, new: torch.Tensor) -> None:
    """What vLLM's load (and reload) does on an AVX512-BF16 CPU: keep an unpacked copy, pack into new storage."""
    setattr(mixer.conv1d, UNPACKED_ATTR, new.clone())
    mixer.conv1d.weight.data = pack_standin(new)


def model(*mixers: Mixer) -> torch.nn.Module:
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2)), *mixers])
    return m


class TestRefreshConvWeights:
    def test_alias_intact_is_left_alone(self):
        """Without packing (AVX2, fp32, GPU) the buffer still aliases the parameter: nothing to do."""
        m = model(Mixer(0), Mixer(1))
        with torch.no_grad():
            m.layers[1].conv1d.weight.add_(1.0)  # an in-place reload, as reload_weights does there
        assert [n for n, _ in conv_mixers(m)] == ["layers.1", "layers.2"]
        assert stale_conv_mixers(m) == []
        assert refresh_conv_weights(m) == 0

    def test_packed_reload_is_refreshed_in_place(self):
        """After a packed reload the buffer holds the first load's weights; the refresh copies the
        unpacked new ones into the same buffer, and only into mixers that need it."""
        fresh, packed = Mixer(0), Mixer(1)
        m = model(fresh, packed)
        pack(packed, packed.conv_weights.clone())  # first load: buffer and unpacked copy agree
        assert stale_conv_mixers(m) == []
        new = torch.randn(DIM, WIDTH).to(torch.bfloat16)
        buffer = packed.conv_weights
        pack(packed, new)  # the reload: new weights packed, old buffer put back
        assert stale_conv_mixers(m) == ["layers.2"]
        assert refresh_conv_weights(m) == 1
        assert packed.conv_weights is buffer and torch.equal(buffer, new)
        assert refresh_conv_weights(m) == 0

    def test_layout_change_is_an_error(self):
        """A vLLM whose buffer no longer matches the conv weights' shape is named, not silently copied."""
        mixer = Mixer(0)
        setattr(mixer.conv1d, UNPACKED_ATTR, torch.zeros(DIM, WIDTH + 1, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="Another vLLM version"):
            refresh_conv_weights(model(mixer))

    def test_counts_over_workers(self):
        """refresh_mamba_conv_weights adds up what each worker refreshed (apply_model: one result each)."""
        workers = []
        for seed in (0, 1):
            mixer = Mixer(seed)
            pack(mixer, torch.ones(DIM, WIDTH, dtype=torch.bfloat16))
            workers.append(model(mixer))

        class LLM:
            def apply_model(self, fn):
                return [fn(w) for w in workers]

        assert refresh_mamba_conv_weights(LLM()) == 2
        assert refresh_mamba_conv_weights(LLM()) == 0


class TestPackStandin:
    def test_new_storage_same_values(self):
        """The stand-in gives new storage in another layout holding the same taps."""
        w = torch.arange(DIM * WIDTH, dtype=torch.float32).reshape(DIM, WIDTH)
        p = pack_standin(w)
        assert p.shape == (WIDTH // 2, DIM, 2)
        assert p.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
        assert torch.equal(p.transpose(0, 1).reshape(DIM, WIDTH), w)
        assert not torch.equal(p.reshape(DIM, WIDTH), w)  # read as (dim, width) it is wrong
