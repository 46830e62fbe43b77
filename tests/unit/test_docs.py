"""The README states the defaults the code has: halt limits and threshold gates."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcheck.core.detect import ThresholdConfig
from rlcheck.core.monitor import DEFAULT_HARD_LIMITS, HaltConfig

README = (Path(__file__).parents[2] / "README.md").read_text()


class TestReadme:
    def test_hard_limits_match(self):
        """Every default hard limit appears in the README table with its value."""
        for key, limit in DEFAULT_HARD_LIMITS.items():
            assert f"| `{key}` | {limit:g} |" in README, key
        assert dict(HaltConfig().hard_limits) == DEFAULT_HARD_LIMITS

    def test_threshold_gates_match(self):
        """Every default threshold gate appears in the README with its value."""
        for rule in ThresholdConfig().rules:
            short = rule.metric.removeprefix("rlcheck/token/")
            assert f"`{short}` > {rule.limit:g}" in README, rule.metric

    def test_patience_and_severity_match(self):
        """The README's HaltConfig table matches the dataclass defaults."""
        h = HaltConfig()
        assert f"| `patience` | `{h.patience}` |" in README
        assert f"| `min_severity` | `{h.min_severity}` |" in README


class TestReplayDocs:
    def test_replay_defaults_match(self):
        """The README's replay threshold and divergence level are the code's defaults."""
        from rlcheck.forensics import DEFAULT_TAU, DEFAULT_THRESHOLD

        assert f"`--threshold` (default {DEFAULT_THRESHOLD:g} nats)" in README
        assert f"`--tau`, {DEFAULT_TAU:g}," in README


class TestStressDocs:
    def test_stress_and_sweep_defaults_match(self):
        """The README's stress defaults, fp32 threshold and sweep request count are the code's."""
        from rlcheck.forensics.render import show_value
        from rlcheck.forensics.stress import FP32_THRESHOLD, StressConfig
        from rlcheck.forensics.sweep import SWEEP_REQUESTS

        text = " ".join(README.split())
        c = StressConfig(model="m")
        assert (f"Defaults: {c.num_requests} requests, {c.samples_per_prompt} per prompt, {c.max_tokens} tokens, "
                f"max_num_seqs {c.max_num_seqs}, {show_value('kv_cache_bytes', c.kv_cache_bytes)[:-3]} MiB") in text
        assert f"(default {FP32_THRESHOLD:g} nats in float32" in text
        assert f"`--requests` defaults to {SWEEP_REQUESTS} per value" in text


def _python_block_after(heading: str) -> str:
    """The first ```python block after `heading` in the README."""
    rest = README[README.index(heading):]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start:rest.index("```", start)]


class TestWrapYourLoopDocs:
    def test_padded_example_runs(self, tmp_path, monkeypatch, capsys):
        """The README's padded-tensor loop runs as printed: 5 steps logged, no alarm, metrics on disk."""
        pytest.importorskip("torch")
        code = _python_block_after("### Padded tensors")
        assert len(code.strip().splitlines()) <= 25
        monkeypatch.chdir(tmp_path)
        exec(compile(code, "README.md", "exec"), {})
        lines = (tmp_path / "runs/padded-example/metrics.jsonl").read_text().splitlines()
        assert len(lines) == 5
        out = capsys.readouterr().out
        assert "halted" not in out and out.count("[]") == 5


class TestQuarantineDocs:
    def test_defaults_match(self):
        """The README's QuarantineConfig table is the dataclass's defaults."""
        from rlcheck.core.quarantine import REASONS, QuarantineConfig

        q = QuarantineConfig()
        assert q.rules == REASONS and "| `rules` | all six |" in README and len(REASONS) == 6
        assert f"| `max_frac` | {q.max_frac:g} |" in README
        assert f"| `patience` | `{q.patience}` |" in README
        assert f"| `max_dumped` | {q.max_dumped} |" in README

    def test_example_runs(self, tmp_path, monkeypatch, capsys):
        """The README's quarantine example runs as printed: req-7 quarantined, nothing else, no alarm."""
        code = _python_block_after("### Halt or quarantine")
        monkeypatch.chdir(tmp_path)
        exec(compile(code, "README.md", "exec"), {})
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "req-7 catastrophic" and out[1].startswith("1.0 ")
        record = (tmp_path / "runs/quarantine-example/metrics.jsonl").read_text()
        assert '"alarms":[]' in record and (tmp_path / "runs/quarantine-example/quarantine/step_000000").is_dir()


class TestReliabilityDocs:
    def test_every_named_test_exists(self):
        """Every `file::Class::test` RELIABILITY.md names is a test in that file (parameters stripped)."""
        import ast
        import re

        root = Path(__file__).parents[1]
        text = (root.parent / "RELIABILITY.md").read_text()
        refs = re.findall(r"`((?:unit|integration)/[\w/]+\.py)((?:::[\w\[\]\-.,]+)*)`", text)
        assert len(refs) > 30
        for path, chain in refs:
            tree = ast.parse((root / path).read_text())
            scope = tree.body
            for part in [p.split("[")[0] for p in chain.split("::") if p]:
                found = [n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part]
                assert found, f"RELIABILITY.md names {path}{chain}: no {part!r}"
                scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
