"""The preflight on the model families people train: each folder's config.json written as the model card
ships it (`tests/data/model_cards/<family>/config.json`, its sizes shrunk to a tiny model), tiny random
weights and the tiny tokenizer beside it. The trainer side is the model loaded in memory (its config as
transformers built it), the engine side the folder: the same model gives no finding at all, and a real
difference in the folder is still found.

The cards left out two fields of the originals: DeepSeek-V3's `quantization_config` (fp8 weights) and
`auto_map` (remote code transformers no longer needs for it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlcheck.preflight import PreflightConfig, load_side, run_static, side_of_model

CARDS = Path(__file__).parent.parent / "data" / "model_cards"
FAMILIES = sorted(p.name for p in CARDS.iterdir())


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """family -> a model folder: the card's config.json, tiny bfloat16 weights, zeros (the preflight
    reads configs; saved, then the card's config.json written back over the one save_pretrained
    writes), the tiny llama's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    tokenizer = tiny_model("llama")
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        card = (CARDS / family / "config.json").read_text()
        (folder / "config.json").write_text(card)
        with no_init_weights():  # a random init of the cards' real vocabularies is most of the time
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.save_pretrained(folder)
        (folder / "config.json").write_text(card)
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, folder / f.name)
        out[family] = folder
    return out


def trainer_side(folder: Path):
    from transformers import AutoModelForCausalLM

    return side_of_model("trainer", AutoModelForCausalLM.from_pretrained(folder))


def static(folder: Path, engine: Path | None = None):
    cfg = PreflightConfig(model=str(folder), engine_model=str(engine or folder), dtype="bfloat16",
                          trainer_dtype="bfloat16", resets_prefix_cache=True)
    return run_static(cfg, trainer=trainer_side(folder), engine=load_side("engine", engine or folder))


class TestFamilies:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_the_same_model_gives_no_finding(self, folders, family):
        """The model in memory against its own folder: no finding at all (before, Qwen2.5 gave a
        sliding_window error, Gemma 3 a rope_theta error, DeepSeek-V3 a rope_scaling error, and
        layer_types / head_dim / tie_word_embeddings warnings, from fields transformers fills in)."""
        result = static(folders[family])
        assert result.findings == (), [(f.key, f.severity, f.trainer, f.engine) for f in result.findings]

    @pytest.mark.parametrize("family, fields, key", [
        ("qwen2.5", {"use_sliding_window": True}, "sliding_window"),
        ("gemma3", {"rope_local_base_freq": 20000}, "rope_theta"),
        ("deepseek-v3", {"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 20, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"}}, "rope_scaling"),
        ("llama3", {"rms_norm_eps": 1e-06}, "rms_norm_eps"),
        ("mistral", {"sliding_window": None}, "sliding_window"),
    ])
    def test_a_real_difference_is_still_found(self, folders, tmp_path, family, fields, key):
        """An engine folder whose card differs in a field that changes the function is an error there."""
        engine = tmp_path / "engine"
        shutil.copytree(folders[family], engine)
        card = json.loads((engine / "config.json").read_text())
        (engine / "config.json").write_text(json.dumps({**card, **fields}))
        result = static(folders[family], engine)
        assert key in [f.key for f in result.findings] and {f.severity for f in result.findings} == {"error"}
