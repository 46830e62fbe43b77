"""`rlcheck localize` without an engine: the layer-by-layer comparison on synthetic hidden states (the
relative error, the first divergent layer and position, the tolerances), the result's JSON, the choice
of requests and the errors on bad input, what diagnose and the report make of a localize.json, the
console table, and the perturb-layer fault's spec and its hook on a stand-in engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from rlcheck.core.batch import StepBatch
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.core.run.dump import write_dump
from rlcheck.errors import ConfigError, InputError, MismatchHalt
from rlcheck.faults import PerturbLayer, parse_inject
from rlcheck.forensics.diagnose import diagnose
from rlcheck.forensics.diagnose.findings import Finding
from rlcheck.forensics.diagnose.localized import localized_weights, name_layer
from rlcheck.forensics.localize import choose, localize
from rlcheck.forensics.localize.compare import (
    RESULT_FILE,
    TOLERANCES,
    LocalizeResult,
    localize_request,
    read_localization,
    relative_errors,
    tolerance_for,
)
from rlcheck.forensics.localize.report import render_localization, summary_line
from rlcheck.forensics.replay import load_sequences
from rlcheck.forensics.stress.config import StressConfig
from rlcheck.forensics.stress.config import parse_inject as parse_stress_inject
from rlcheck.report.localize import localize_section

TYPES = ("mamba", "mamba", "attention", "mamba")
TOL = TOLERANCES["float32"]


def states(num_layers=4, num_positions=12, hidden=16, seed=0):
    """(L, T, H) reference hidden states, and the engine's: the same up to float32 rounding noise."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(num_layers, num_positions, hidden))
    return ref * (1 + 1e-7 * rng.normal(size=ref.shape)), ref


def perturbed(layer, position, scale=1.01, **kw):
    """Engine states off by `scale` at `layer` from `position` on, and at every later layer (as a wrong
    layer's error flows up the stack)."""
    engine, ref = states(**kw)
    engine[layer:, position:] *= scale
    return engine, ref


class TestTolerance:
    def test_per_dtype(self):
        """float32 is tight, bfloat16 loose, float16 between; torch and short names map onto them."""
        assert tolerance_for("float32") < tolerance_for("float16") < tolerance_for("bfloat16")
        assert tolerance_for("torch.bfloat16") == tolerance_for("bf16") == TOLERANCES["bfloat16"]
        assert tolerance_for("auto") == tolerance_for(None) == max(TOLERANCES.values())  # not recorded: the loosest

    def test_the_looser_of_engine_and_reference(self):
        """A float32 engine judged against a bfloat16 reference gets the bfloat16 tolerance."""
        assert tolerance_for("float32", "float32") == TOLERANCES["float32"]
        assert tolerance_for("float32", "bf16") == tolerance_for("bfloat16", "float32") == TOLERANCES["bfloat16"]

    def test_unknown_dtype(self):
        """A dtype without a tolerance is refused, saying to pass one."""
        with pytest.raises(ValueError, match="--tolerance"):
            tolerance_for("int8")


class TestRelativeErrors:
    def test_values(self):
        """Equal states give 0, a 1% scale gives 0.01, a non-finite engine row gives inf, per layer and position."""
        engine, ref = states()
        engine = ref.copy()
        engine[2, 5] *= 1.01
        engine[3, 7, 0] = np.nan
        rel = relative_errors(engine, ref)
        assert rel.shape == (4, 12) and rel[0].max() == 0.0
        assert rel[2, 5] == pytest.approx(0.01) and np.isinf(rel[3, 7])

    def test_shapes_must_match(self):
        engine, ref = states()
        with pytest.raises(ValueError, match="shape"):
            relative_errors(engine[:, :5], ref)


class TestLocalizeRequest:
    @pytest.mark.parametrize("layer", range(4))
    def test_names_the_perturbed_layer(self, layer):
        """A 1% error from layer K at position 0 names layer K, its type and position 0; the layers
        below stay within the tolerance."""
        rel = relative_errors(*perturbed(layer, 0))
        loc = localize_request("r", rel, TYPES, prompt_len=5, tolerance=TOL)
        assert (loc.first_divergent_layer, loc.layer_type, loc.position) == (layer, TYPES[layer], 0)
        assert loc.phase == "prefill" and loc.response_position is None
        assert [lay.first_position is not None for lay in loc.layers] == [i >= layer for i in range(4)]
        assert all(lay.max_rel_err < TOL for lay in loc.layers[:layer])

    def test_decode_position(self):
        """A divergence from a response position is a decode, counted from the first response token."""
        loc = localize_request("r", relative_errors(*perturbed(0, 7)), TYPES, prompt_len=5, tolerance=TOL)
        assert (loc.position, loc.response_position, loc.phase) == (7, 2, "decode")

    def test_teacher_forced_is_prefill(self):
        """Teacher-forced, a response position was computed in a prefill."""
        loc = localize_request("r", relative_errors(*perturbed(0, 7)), TYPES, 5, TOL, decoded=False)
        assert (loc.response_position, loc.phase) == (2, "prefill")

    def test_lowest_layer_wins(self):
        """The lowest divergent layer is named even when a higher one diverges earlier in the sequence."""
        engine, ref = states()
        engine[3, 1:] *= 1.5
        engine[1, 6:] *= 1.01
        loc = localize_request("r", relative_errors(engine, ref), TYPES, 4, TOL)
        assert (loc.first_divergent_layer, loc.position) == (1, 6)

    def test_clean_names_none(self):
        """Float32 noise stays under the tolerance: no layer, no position."""
        loc = localize_request("r", relative_errors(*states()), TYPES, 5, TOL)
        assert not loc.diverged and loc.position is None and loc.phase is None
        assert max(lay.max_rel_err for lay in loc.layers) < TOL

    def test_nan_counts_as_divergent(self):
        rel = relative_errors(*states())
        rel[2, 3] = np.nan
        loc = localize_request("r", rel, TYPES, 5, TOL)
        assert (loc.first_divergent_layer, loc.position) == (2, 3) and loc.layers[2].max_rel_err == np.inf

    def test_positions_with_gaps(self):
        """Columns map onto the positions the engine computed (a prefix-cached start left out)."""
        rel = relative_errors(*perturbed(1, 3, num_positions=6))
        loc = localize_request("r", rel, TYPES, 8, TOL, positions=np.arange(4, 10))
        assert (loc.position, loc.response_position) == (7, None) and loc.layers[1].worst_position >= 7

    def test_bad_shapes(self):
        rel = relative_errors(*states())
        with pytest.raises(ValueError, match="layer types"):
            localize_request("r", rel, TYPES[:3], 5, TOL)
        with pytest.raises(ValueError, match="positions"):
            localize_request("r", rel, TYPES, 5, TOL, positions=np.arange(3))


def result(*requests, path="dump", tolerance=TOL) -> LocalizeResult:
    return LocalizeResult(path=str(path), model="m", dtype="float32", tolerance=tolerance, tolerance_from="dtype",
                          mode="stress re-run", fault="none", layer_types=TYPES, requests=tuple(requests),
                          seconds={"engine": 1.0})


def loc(rid, layer=None, position=0, prompt_len=5):
    """A request localized at `layer` from `position` (None: clean)."""
    rel = relative_errors(*(states() if layer is None else perturbed(layer, position)))
    return localize_request(rid, rel, TYPES, prompt_len, TOL)


class TestResultFile:
    def test_round_trip(self, tmp_path):
        """localize.json holds the per-request list (inf as "inf"); read back as written."""
        bad = loc("a", 2)
        rel = relative_errors(*states())
        rel[0, 0] = np.inf
        worst = localize_request("b", rel, TYPES, 5, TOL)
        path = result(bad, worst, loc("c"), path=tmp_path).write(tmp_path)
        data = read_localization(tmp_path)
        assert path.name == RESULT_FILE and data == json.loads(path.read_text())
        assert [r["first_divergent_layer"] for r in data["requests"]] == [2, 0, None]
        assert data["requests"][1]["layers"][0]["max_rel_err"] == "inf" and data["num_divergent"] == 2
        keys = {"request_id", "first_divergent_layer", "layer_type", "position", "response_position", "layers"}
        assert keys <= data["requests"][0].keys() and data["requests"][0]["layers"][2]["type"] == "attention"

    def test_missing_or_broken(self, tmp_path):
        assert read_localization(tmp_path) is None
        (tmp_path / RESULT_FILE).write_text("{not json")
        assert read_localization(tmp_path) is None


def write_test_dump(path: Path, context=None, n=6) -> Path:
    """A dump of n requests of a 2048-token vocabulary; request i's rollout is off by i/10 nats."""
    rng = np.random.default_rng(0)
    lp = [-rng.random(5) for _ in range(n)]
    batch = StepBatch.from_ragged(logp_rollout=lp, logp_train=[x - i / 10 for i, x in enumerate(lp)],
                                  request_ids=[f"r{i}" for i in range(n)], tokens=[rng.integers(3, 2000, 5) for _ in range(n)],
                                  prompt_tokens=[rng.integers(3, 2000, 4) for _ in range(n)])
    return write_dump(path, batch, step=3, context=context or {})


class TestChoose:
    def test_worst_first_and_named(self, tmp_path):
        """Without ids, the `top` worst by max |d|; with ids, those, in the order given, once each."""
        seqs = load_sequences(write_test_dump(tmp_path / "d"))
        assert choose(seqs, None, 3) == [5, 4, 3]
        assert choose(seqs, ["r1", "r4", "r1"], 3) == [1, 4]

    def test_unknown_request(self, tmp_path):
        seqs = load_sequences(write_test_dump(tmp_path / "d"))
        with pytest.raises(InputError, match="'nope' not in the dump"):
            choose(seqs, ["r1", "nope"], 3)


class TestBadInput:
    def test_missing_dump(self, tmp_path):
        with pytest.raises(InputError, match="not a dump directory"):
            localize(tmp_path / "none")

    def test_model_dir_missing(self, tmp_path):
        dump = write_test_dump(tmp_path / "d", context={"model": str(tmp_path / "gone")})
        with pytest.raises(InputError, match="not a local model directory"):
            localize(dump)
        with pytest.raises(InputError, match="no model"):
            localize(write_test_dump(tmp_path / "e"))

    def test_unknown_request_and_tolerance(self, tmp_path):
        model = tmp_path / "m"
        model.mkdir()
        (model / "config.json").write_text("{}")
        dump = write_test_dump(tmp_path / "d", context={"model": str(model)})
        with pytest.raises(InputError, match="not in the dump"):
            localize(dump, request_ids=["x"])
        with pytest.raises(InputError, match="tolerance"):
            localize(dump, tolerance=0)

    def test_cli_exit_2(self, tmp_path):
        """`rlcheck localize` on a missing path or an unknown request: one error line, exit code 2."""
        from typer.testing import CliRunner

        from rlcheck.cli import app

        runner = CliRunner()
        done = runner.invoke(app, ["localize", str(tmp_path / "none")])
        assert done.exit_code == 2 and "does not exist" in done.output
        dump = write_test_dump(tmp_path / "d", context={"model": str(tmp_path)})
        (tmp_path / "config.json").write_text("{}")
        done = runner.invoke(app, ["localize", str(dump), "--request", "zz"])
        assert done.exit_code == 2 and "'zz' not in the dump" in done.output


def stress_rows(reused: bool, n=4):
    return [{"request_id": f"s{i}", "failed": True, "slot_reused": reused} for i in range(n)]


class TestDiagnose:
    def test_one_layer_from_position_0_is_weights(self):
        """Every localized request wrong from layer 2 at position 0: weights of layer 2, named, with the ids."""
        data = result(loc("a", 2), loc("b", 2), loc("c")).to_dict()
        found = localized_weights([data], [])
        assert found.cause == "weights_out_of_sync" and found.affected_request_ids == ["a", "b"]
        assert "decoder layer 2 (attention)" in found.evidence[0]

    def test_mamba_layer_on_reused_slots_is_the_slot_contexts(self):
        """A Mamba layer wrong from position 0 while every failing request reused a slot: no weights
        finding (stale state); with a fresh slot failing too, it is one."""
        data = result(loc("s0", 0), loc("s1", 0)).to_dict()
        assert localized_weights([data], stress_rows(True)) is None
        assert localized_weights([data], stress_rows(True) + [{"request_id": "f", "failed": True,
                                                              "slot_reused": False}]) is not None

    def test_later_position_or_mixed_layers_is_not_weights(self):
        assert localized_weights([result(loc("a", 0, position=7)).to_dict()], []) is None
        assert localized_weights([result(loc("a", 0), loc("b", 2)).to_dict()], []) is None
        assert localized_weights([result(loc("a")).to_dict()], []) is None

    def test_state_verdict_names_the_mamba_layer(self):
        """A stale-state verdict gets the Mamba layer and the position; an attention layer is flagged as not fitting."""
        verdict = Finding("stale_state", 0.95, ["slots reused"])
        name_layer(verdict, [result(loc("a", 0), loc("b", 0)).to_dict()])
        assert "decoder layer 0 (mamba), at position 0" in verdict.evidence[-1] and "read the wrong state" in verdict.evidence[-1]
        verdict = Finding("index_aliasing", 0.95, ["shared"])
        name_layer(verdict, [result(loc("a", 2, position=5)).to_dict()])
        assert "does not fit" in verdict.evidence[-1] and "first decode step" in verdict.evidence[-1]

    def test_healthy_verdict_says_none(self):
        verdict = Finding("healthy", 0.6, ["no alarm"])
        name_layer(verdict, [result(loc("a"), loc("b")).to_dict()])
        assert "none of 2 requests diverges" in verdict.evidence[-1]

    def test_diagnose_reads_the_dump_localization(self, tmp_path):
        """`rlcheck diagnose DUMP` with a localize.json naming layer 1 for every request: weights, layer 1."""
        dump = write_test_dump(tmp_path / "d", n=2)
        result(loc("r0", 1), loc("r1", 1), path=dump).write(dump)
        verdict = diagnose(dump).verdict
        assert verdict.cause == "weights_out_of_sync" and "layer 1 (mamba)" in verdict.evidence[0]


def halted_run(run_dir: Path) -> Path:
    """A run that halts at step 0 (mean |d| of 2 nats, over the hard limit), with its dump."""
    lp = [np.full(5, -1.0) for _ in range(4)]
    batch = StepBatch.from_ragged(logp_rollout=lp, logp_train=[x - 2.0 for x in lp], request_ids=list("abcd"))
    with Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",))) as mon, pytest.raises(MismatchHalt):
        mon.observe(0, batch)
    return run_dir


class TestReport:
    def test_section_and_one_read(self, tmp_path, monkeypatch):
        """A run whose dump was localized: the report has the section (layer, position, escaped ids, the
        plot) and the verdict names the layer; localize.json is read once for both."""
        import rlcheck.forensics.diagnose.localized as ld
        from rlcheck.report import write_report

        run = halted_run(tmp_path / "run")
        dump = next((run / "dumps").glob("step_*"))
        result(loc("<b>x</b>", 2), loc("y"), path=dump).write(dump)
        reads = []
        real = ld.read_localization
        monkeypatch.setattr(ld, "read_localization", lambda d: reads.append(d) or real(d))
        page = write_report(run).read_text()
        assert reads == [dump]
        assert "Where did it diverge?" in page and "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
        assert "1 of 2 requests diverge" in page and page.count("<svg") >= 2

    def test_no_section_without_localization(self):
        assert localize_section([], lambda p: str(p)) == ""


class TestRender:
    def test_table_and_summary(self):
        """The table lists each request's layer, type and position and every layer's error; the summary counts them."""
        data = result(loc("a", 2), loc("b", 0, position=7), loc("c")).to_dict()
        console = Console(record=True, width=120)
        render_localization(data, console)
        text = console.export_text()
        assert "attention" in text and "1e-02" in text
        assert "decode" in text and "prefill" in text and "2 of 3 requests diverge" in text
        assert summary_line(data) == "2 of 3 requests diverge (tolerance 3e-05), first at layer 2 (attention) in 1, layer 0 (mamba) in 1"


class TestPerturbLayerSpec:
    def test_parse_and_round_trip(self):
        """perturb-layer=K is the engine fault (perturb-layer, {layer: K}) and describes itself back."""
        fault = parse_inject("perturb-layer=2")
        assert fault == PerturbLayer(layer=2) and fault.engine_fault() == ("perturb-layer", {"layer": 2})
        assert parse_inject(fault.describe()) == fault and fault.cause == "weights_out_of_sync"

    @pytest.mark.parametrize("spec", ["perturb-layer=-1", "perturb-layer=x", "perturb-layer=1@3"])
    def test_bad_specs(self, spec):
        with pytest.raises(ConfigError):
            parse_inject(spec)

    def test_stress_inject(self):
        """`rlcheck stress --inject perturb-layer=K` needs K; StressConfig takes it as `layer`, only for that fault."""
        assert parse_stress_inject("perturb-layer=3") == ("perturb-layer", 3)
        assert parse_stress_inject("perturb-layer=0") == ("perturb-layer", 0)
        for bad in ("perturb-layer", "perturb-layer=a", "stale-state=2", "index-wrap=0"):
            with pytest.raises(ConfigError):
                parse_stress_inject(bad)
        assert StressConfig(model="m", fault="perturb-layer", layer=1).layer == 1
        for kw in ({"fault": "perturb-layer"}, {"fault": "none", "layer": 1}, {"fault": "perturb-layer", "layer": -1}):
            with pytest.raises(ConfigError):
                StressConfig(model="m", **kw)

    def test_inject_needs_the_layer(self):
        from rlcheck.engines.vllm_faults import inject

        with pytest.raises(ConfigError, match="layer is required"):
            inject(object(), "perturb-layer")
        with pytest.raises(ConfigError, match="layer is required"):
            inject(object(), "stale-state", layer=1)


class FakeLLM:
    """Stands in for `vllm.LLM`: `apply_model(fn)` runs fn on a two-layer torch model, as in-process."""

    def __init__(self):
        import torch

        class Attn(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.o_proj = torch.nn.Linear(4, 4, bias=False)

            def forward(self, x):
                return self.o_proj(x)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.self_attn = Attn()

            def forward(self, x):
                return x + self.self_attn(x)

        torch.manual_seed(0)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer(), Layer()])

    def apply_model(self, fn):
        return [fn(self.model)]


class FakeEngine:
    def __init__(self):
        self.llm, self.synced = FakeLLM(), 0

    def sync_weights(self, weights, version):
        self.synced += 1
        for layer in self.llm.model.layers:  # a reload that replaces the modules drops their hooks
            proj = layer.self_attn.o_proj
            fresh = type(proj)(4, 4, bias=False)
            fresh.load_state_dict(proj.state_dict())
            layer.self_attn.o_proj = fresh


class TestPerturbHandle:
    def test_scales_layer_k_only_and_survives_syncs(self):
        """Layer 1's o_proj gives 1.01 x its output, layer 0's is untouched; after a sync that replaced
        the modules the scale is back; remove() undoes it and the wrap."""
        import torch

        from rlcheck.engines.vllm_faults import inject

        engine = FakeEngine()
        layers = engine.llm.model.layers
        x = torch.randn(3, 4)
        clean = [layer.self_attn.o_proj(x).detach() for layer in layers]
        handle = inject(engine, "perturb-layer", layer=1)
        assert handle.target == "decoder layer 1 (attention) self_attn.o_proj"
        assert torch.equal(layers[0].self_attn.o_proj(x), clean[0])
        assert torch.allclose(layers[1].self_attn.o_proj(x), 1.01 * clean[1])
        engine.sync_weights([], 1)
        assert engine.synced == 1 and handle.syncs == 1
        assert torch.allclose(layers[1].self_attn.o_proj(x), 1.01 * clean[1])
        handle.apply()  # idempotent: still one factor of 1.01
        assert torch.allclose(layers[1].self_attn.o_proj(x), 1.01 * clean[1])
        handle.remove()
        assert "sync_weights" not in engine.__dict__ and torch.allclose(layers[1].self_attn.o_proj(x), clean[1])

    def test_layer_out_of_range(self):
        from rlcheck.engines.vllm_faults import inject

        with pytest.raises(ConfigError, match=r"decoder layers 0\.\.1"):
            inject(FakeEngine(), "perturb-layer", layer=5)


class TestDumpFault:
    """The fault a teacher-forced re-run injects: the dump's, or the one asked for, never a silent none."""

    def test_engine_fault_of_the_dump(self):
        from rlcheck.forensics.localize.engine import DumpFault, dump_fault

        assert dump_fault({"context": {"fault": "perturb-layer=2"}}) == DumpFault("perturb-layer=2", ("perturb-layer", {"layer": 2}))
        assert dump_fault({"context": {"fault": "none"}}) == dump_fault({}) == DumpFault()

    def test_unparsable_fault_is_refused_not_dropped(self, tmp_path):
        """A spec this rlcheck cannot parse (a newer fault, a bad value) is an InputError naming it, from
        localize before anything loads; fault="none" re-runs without it."""
        from rlcheck.forensics.localize.engine import DumpFault, dump_fault

        with pytest.raises(InputError, match="'perturb-layer=two'.*--fault"):
            dump_fault({"context": {"fault": "perturb-layer=two"}})
        assert dump_fault({"context": {"fault": "perturb-layer=two"}}, "none") == DumpFault()
        model = tmp_path / "m"
        model.mkdir()
        (model / "config.json").write_text("{}")
        dump = write_test_dump(tmp_path / "d", context={"model": str(model), "fault": "future-fault@3"})
        with pytest.raises(InputError, match="the dump's fault .* 'future-fault@3' does not parse"):
            localize(dump)

    @pytest.mark.parametrize("spec", ["skip-sync-every=3", "stale-buffer", "off-by-one@2"])
    def test_fault_outside_the_forward_pass_is_named(self, spec):
        """A sync, data or trainer fault has nothing to re-inject: the name says which and why."""
        from rlcheck.forensics.localize.engine import dump_fault

        got = dump_fault({"context": {"fault": spec}})
        assert got.inject is None and got.name.startswith(f"none ({spec} is not re-injected")


class TestForcedCache:
    def test_recorded_budget_is_kept(self, tmp_path):
        from rlcheck.forensics.localize.engine import forced_cache_bytes

        assert forced_cache_bytes(8 << 20, tmp_path, "float32", 256) == 8 << 20

    def test_a_7b_gets_room_for_its_sequences(self, tmp_path):
        """A GPU dump records no budget: a Qwen2.5-7B-shaped model (28 layers x 4 KV heads x 128) at 32k
        tokens gets four sequences' worth (7.5 GiB in bfloat16), not 64 MiB that vLLM refuses."""
        import json

        from rlcheck.forensics.localize.engine import MIN_CACHE_BYTES, forced_cache_bytes

        (tmp_path / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064}))
        per_sequence = 2 * 28 * 4 * 128 * 2 * 32768
        assert forced_cache_bytes(None, tmp_path, "bfloat16", 32768) == 4 * per_sequence
        assert forced_cache_bytes(None, tmp_path, "bfloat16", 256) == MIN_CACHE_BYTES
