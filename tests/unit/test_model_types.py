"""What a run's context says of its model (`rlcheck.core.model_types`): recurrent state and routed experts, which
decide whether a group of twins off together is a stale state's shape (`SignatureDetector.state_model`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rlcheck.core.model_types import dense_state_model, experts_at, experts_of, routes_no_experts


def test_experts_of_configs():
    """Dense configs count 0 (num_local_experts 0 as the tiny hybrid's); MoE configs their routed experts, as an HF
    config object or its dict."""
    assert experts_of({"model_type": "llama"}) == 0
    assert experts_of({"model_type": "granitemoehybrid", "num_local_experts": 0, "num_experts_per_tok": 2}) == 0
    assert experts_of({"model_type": "qwen3_moe", "num_experts": 8}) == 8
    assert experts_of(SimpleNamespace(model_type="deepseek_v3", n_routed_experts=64)) == 64
    assert experts_of({"num_experts": True, "num_local_experts": "8"}) == 0  # not counts


def test_experts_at_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "granitemoehybrid", "num_local_experts": 4}))
    assert experts_at(tmp_path) == 4
    assert experts_at(tmp_path / "missing") is None and experts_at("org/hub-name") is None


def test_dense_state_model(tmp_path):
    """True for a recurrent model type with no experts (named, or read at the context's model path); False for a
    model without state or with experts; None where the type is unknown or the experts cannot be told."""
    assert dense_state_model({"model_type": "granitemoehybrid", "experts": 0}) is True
    assert dense_state_model({"model_type": "mamba2", "experts": 8}) is False
    assert dense_state_model({"model_type": "llama", "experts": 0}) is False
    assert dense_state_model({"model_type": "qwen3_moe"}) is False
    assert dense_state_model({}) is None and dense_state_model({"model_type": "mamba2"}) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    assert dense_state_model({"model_type": "mamba2", "model": str(tmp_path)}) is True


def test_routes_no_experts(tmp_path):
    """True for a model the context names with 0 experts (any type), False with experts, None where it cannot tell:
    what the threshold detector's `dense_only` rule (the engine against the trainer's measured floor) needs."""
    assert routes_no_experts({"model_type": "llama", "experts": 0}) is True
    assert routes_no_experts({"model_type": "qwen3_moe", "experts": 8}) is False
    assert routes_no_experts({}) is None and routes_no_experts({"model_type": "llama"}) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert routes_no_experts({"model": str(tmp_path)}) is True
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    assert routes_no_experts({"model": str(tmp_path)}) is False
