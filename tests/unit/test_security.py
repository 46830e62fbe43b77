"""Security: no code path that executes data (pickle, eval, shell strings), evidence written as
parquet and JSON only, and `MonitorConfig.redact` keeping prompt and response text out of it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlcheck
from rlcheck import MismatchHalt, Monitor, MonitorConfig, StepBatch
from rlcheck.core.run.dump import TOKEN_COLUMNS, read_dump
from rlcheck.core.run.journal import read_jsonl
from rlcheck.errors import InputError
from rlcheck.forensics.replay import load_sequences
from rlcheck.sinks.wandb import OFFENDER_COLUMNS
from rlcheck.synthetic import SyntheticConfig, synthetic_batch

PACKAGE = Path(rlcheck.__file__).parent
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
ALLOWED: dict[tuple[str, str], str] = {}
"""(file relative to rlcheck/, finding) -> why it is safe. Empty: nothing needs an exception today."""
SECRET = "SECRET-PROMPT-TEXT"


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _call_finding(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    if name in ("eval", "exec", "compile", "__import__"):
        return f"{name}()"
    if name in ("os.system", "os.popen") or name.startswith("os.exec") or name.startswith("os.spawn"):
        return f"{name}()"
    if _is_true(_kw(call, "shell")):
        return f"{name}(shell=True)"
    if name == "torch.load" and not _is_true(_kw(call, "weights_only")):
        return "torch.load() without weights_only=True"
    if name in ("np.load", "numpy.load") and _is_true(_kw(call, "allow_pickle")):
        return f"{name}(allow_pickle=True)"
    if name in ("yaml.load", "yaml.unsafe_load") and "Safe" not in ast.unparse(call):
        return f"{name}() without SafeLoader"
    if _is_true(_kw(call, "trust_remote_code")):
        return f"{name}(trust_remote_code=True)"
    if name.endswith("read_pickle") or (name.endswith(".loads") and name.split(".")[0] in UNSAFE_MODULES):
        return f"{name}()"
    return None


def findings(source: str) -> list[str]:
    """What in `source` could execute data: unsafe imports and calls (see the checks above)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            out.append(f"from {node.module} import")
        elif isinstance(node, ast.Call) and (found := _call_finding(node)):
            out.append(found)
    return out


class TestNoCodeFromData:
    @pytest.mark.parametrize("source, found", [
        ("import pickle", "import pickle"),
        ("from cloudpickle import loads", "from cloudpickle import"),
        ("torch.load(p)", "torch.load() without weights_only=True"),
        ("np.load(p, allow_pickle=True)", "np.load(allow_pickle=True)"),
        ("eval(s)", "eval()"),
        ("subprocess.run(cmd, shell=True)", "subprocess.run(shell=True)"),
        ("os.system(cmd)", "os.system()"),
        ("AutoModel.from_pretrained(p, trust_remote_code=True)", "AutoModel.from_pretrained(trust_remote_code=True)"),
    ])
    def test_scanner_catches(self, source, found):
        """The scanner flags each pattern it is meant to."""
        assert findings(source) == [found]

    @pytest.mark.parametrize("source", [
        "torch.load(p, weights_only=True)", "np.load(p)", "model.eval()", "subprocess.run(['wandb', '--help'])",
        "json.loads(s)",
    ])
    def test_scanner_passes_safe_code(self, source):
        """Safe look-alikes (a model's .eval(), list-argument subprocess, weights_only loads) pass."""
        assert findings(source) == []

    def test_package_is_clean(self):
        """No module of rlcheck imports pickle-like modules, evals, runs shell strings or loads unsafely."""
        found = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            rel = str(path.relative_to(PACKAGE))
            bad = [f for f in findings(path.read_text()) if (rel, f) not in ALLOWED]
            if bad:
                found[rel] = bad
        assert found == {}


def _batch(step: int, halting: bool = True) -> StepBatch:
    """A step with tokens, prompt tokens, trainer tokens and per-sequence meta holding text and ids."""
    b = synthetic_batch(SyntheticConfig(num_sequences=12, mean_length=10), step)
    n = b.num_sequences
    return StepBatch.from_packed(
        b.logp_rollout, b.logp_train - (2.0 if halting else 0.0), b.cu_seqlens, b.request_ids,
        tokens=b.tokens, tokens_train=b.tokens, prompt_tokens=[[5, 6, 7]] * n,
        meta={"prompt_text": [f"{SECRET}-{i}" for i in range(n)], "messages": [[{"content": SECRET}]] * n,
              "vllm_request_id": [f"v{i}" for i in range(n)], "uid": [f"u{i}" for i in range(n)],
              "weight_version": [3] * n, "sampling": [{"temperature": 1.0}] * n},
    )


def _halt(run_dir: Path, redact: bool) -> str:
    mon = Monitor(MonitorConfig(run_dir=run_dir, sinks=("jsonl",), redact=redact))
    with pytest.raises(MismatchHalt) as info:
        mon.observe(0, _batch(0))
    mon.close()
    return info.value.dump_dir


class TestEvidenceFormats:
    def test_parquet_and_json_only(self, tmp_path):
        """A halt leaves JSON (metrics.jsonl, state.json, meta.json) and parquet, nothing else but the
        run dir's lock file (the holder's pid and host)."""
        where = Path(_halt(tmp_path, redact=False))
        assert sorted(os.listdir(where)) == ["meta.json", "sequences.parquet"]
        assert (where / "sequences.parquet").read_bytes()[:4] == b"PAR1"
        for path in (where / "meta.json", tmp_path / "state.json"):
            assert isinstance(json.loads(path.read_text()), dict)
        assert read_jsonl(tmp_path / "metrics.jsonl").num_skipped == 0
        assert sorted(os.listdir(tmp_path)) == [".lock", "dumps", "metrics.jsonl", "state.json"]  # .lock: a pid


class TestRedact:
    def test_dump_holds_no_tokens_or_text(self, tmp_path):
        """redact=True: token columns are null, text meta columns are gone (ids and numbers stay),
        meta.json says so, and no file under the run dir holds the prompt text."""
        rows, meta = read_dump(_halt(tmp_path, redact=True))
        assert meta["redacted"] is True and meta["redacted_columns"] == ["prompt_text", "messages"]
        assert all(r[c] is None for r in rows for c in TOKEN_COLUMNS if c in r)
        assert "prompt_text" not in rows[0] and "messages" not in rows[0]
        assert (rows[0]["vllm_request_id"], rows[0]["uid"], rows[0]["weight_version"]) == ("v0", "u0", 3)
        assert rows[0]["sampling"] == {"temperature": 1.0}
        assert [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()] == []

    def test_unredacted_dump_keeps_them(self, tmp_path):
        """Without redaction the same step's dump keeps tokens and text (what the test above removes)."""
        rows, meta = read_dump(_halt(tmp_path, redact=False))
        assert meta["redacted"] is False and meta["redacted_columns"] == []
        assert rows[0]["prompt_tokens"].tolist() == [5, 6, 7] and rows[0]["prompt_text"] == f"{SECRET}-0"

    def test_jsonl_and_wandb_rows_carry_no_text(self, tmp_path):
        """metrics.jsonl records and the W&B offenders columns hold ids and numbers, never tokens or text."""
        Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))).observe(0, _batch(0, halting=False))
        (record,) = read_jsonl(tmp_path / "metrics.jsonl")
        assert set(record) == {"step", "time", "metrics", "alarms", "offenders", "abs_diff_hist"}
        assert set(record["offenders"][0]) == set(OFFENDER_COLUMNS)
        assert SECRET not in json.dumps(record)
        assert not [c for c in OFFENDER_COLUMNS if any(w in c for w in ("token", "text", "prompt", "response"))]

    def test_replay_refuses_redacted_dump(self, tmp_path):
        """Replay's loader gives its clear error on a redacted dump from the Monitor."""
        with pytest.raises(InputError, match="no token ids.*redact"):
            load_sequences(_halt(tmp_path, redact=True))

    @pytest.mark.slow
    def test_replay_cli_on_redacted_dump(self, tmp_path):
        """`rlcheck replay` on a redacted dump exits 2 with that one-line error, no traceback."""
        where = _halt(tmp_path, redact=True)
        cli = Path(sys.executable).parent / "rlcheck"
        (tmp_path / "model").mkdir()  # never loaded: the dump is refused first
        out = subprocess.run([str(cli), "replay", where, "--model", str(tmp_path / "model")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and "no token ids" in out.stderr and "Traceback" not in out.stderr
