"""The output folder of `rlcheck repro`:

    repro.py        the reproducer (`rlcheck.forensics.repro.standalone` with CASE filled in): vllm,
                    torch and transformers only; exit 1 when it reproduces, 0 when not
    inputs.json     the same CASE: token ids, sampling, engine settings, weight update, threshold, fault
    expected.json   per batch request: Transformers' greedy continuation and its logprobs (expected),
                    vLLM's tokens and logprobs and the reference's on them (observed)
    REPORT.md       the upstream bug report draft (`rlcheck.forensics.repro.report`)
    model/          the model folder, when it is small (`ReproConfig.copy_model_limit`)
    repro.json      what repro did and found, whatever the verdict (the only file when nothing reproduced)
    engine.log      vLLM's own output during the probes (the CLI's)
"""

from __future__ import annotations

import json
import os
import pprint
import shutil
import subprocess
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlcheck.forensics.repro import standalone
from rlcheck.forensics.repro.case import Case
from rlcheck.forensics.repro.config import ReproConfig, ReproResult

RESULT_FILE = "repro.json"
CASE_LINE = "CASE: dict[str, Any] = {}  # rlcheck repro writes the case here"
SCRIPT_TIMEOUT_S = 900


def write_reproducer(result: ReproResult, config: ReproConfig, scorer_model: Any) -> None:
    """Write every file of a reproduced case into `result.out` (and run repro.py when `config.verify`)."""
    from rlcheck.forensics.repro.report import render_report

    out, case = result.out, result.shrunk.case
    out.mkdir(parents=True, exist_ok=True)
    model = _place_model(Path(case.model), out, config.copy_model_limit)
    payload = case.standalone(model=model)
    _write(out / "inputs.json", json.dumps(payload, indent=1))
    _write(out / "repro.py", script(payload))
    expected = expected_outputs(case, result.shrunk.probe, scorer_model)
    _write(out / "expected.json", json.dumps(expected, indent=1))
    if config.verify:
        result.script = verify(out, case.fault)
    _write(out / "REPORT.md", render_report(result, expected, model))
    result.files = sorted({str(p.relative_to(out)) for p in out.iterdir()} | {RESULT_FILE})


def write_result(result: ReproResult) -> Path:
    """repro.json: the verdict and everything repro found (written for every verdict)."""
    result.out.mkdir(parents=True, exist_ok=True)
    path = result.out / RESULT_FILE
    _write(path, json.dumps(to_dict(result), indent=1, default=_plain))
    return path


def script(payload: dict[str, Any]) -> str:
    """repro.py: the standalone module's source with CASE filled in."""
    source = Path(standalone.__file__).read_text()
    if CASE_LINE not in source:
        raise RuntimeError(f"{standalone.__file__} lost its CASE line; cannot write repro.py")
    case = "CASE: dict[str, Any] = " + pprint.pformat(payload, width=110, sort_dicts=False)
    header = '"""Written by `rlcheck repro`: `python repro.py` (exit 1: it reproduces). The rest of this docstring says what it does.\n\n'
    return source.replace('"""', header, 1).replace(CASE_LINE, case, 1)


def _place_model(model: Path, out: Path, limit: int) -> str:
    """The model path repro.py names: "model" (a copy beside it) when the folder is small, else its absolute path."""
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    if size > limit:
        return str(model.resolve())
    target = out / "model"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(model, target)
    return "model"


def expected_outputs(case: Case, probe: Any, model: Any) -> dict[str, Any]:
    """expected.json: Transformers' greedy continuation of each batch prompt (argmax, no cache, float32)
    and its logprobs, beside what vLLM generated and both sides' logprobs of vLLM's tokens."""
    import torch

    requests = []
    for i, r in enumerate(case.batch):
        ids, logps = list(r.prompt), []
        with torch.no_grad():
            for _ in range(r.max_tokens):
                logits = model(input_ids=torch.tensor([ids], device=model.device), use_cache=False).logits[0, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                ids.append(int(logp.argmax()))
                logps.append(float(logp[ids[-1]]))
        first = probe.first_divergence[i]
        requests.append({
            "index": i, "prompt_len": len(r.prompt), "prompt_token_ids": list(r.prompt),
            "expected": {"token_ids": ids[len(r.prompt):], "logprobs": logps},
            "observed": {"token_ids": list(probe.tokens[i]), "logprobs": [float(x) for x in probe.logprobs[i]],
                         "reference_logprobs": [float(x) for x in probe.reference[i]],
                         "max_abs_diff": float(probe.max_abs_diff[i]), "first_divergence": first},
        })
    return {"threshold": case.threshold, "source": "Transformers greedy decode of the batch prompts (expected); "
            "vLLM's run of the case (observed)", "requests": requests}


def verify(out: Path, fault: str | None) -> dict[str, dict[str, Any]]:
    """Run the written repro.py in a child process: with the injected fault (when there is one) and,
    for a fault, once without it; {name: {"command", "exit_code", "output"}}."""
    runs = {"as written": None} if fault is None else {"with the fault": fault, "without the fault": None}
    results = {}
    for name, spec in runs.items():
        env = {k: v for k, v in os.environ.items() if k != standalone.FAULT_ENV}
        if spec:
            env[standalone.FAULT_ENV] = spec
        command = f"{standalone.FAULT_ENV}={spec} python repro.py" if spec else "python repro.py"
        try:
            done = subprocess.run([sys.executable, "repro.py"], cwd=out, env=env, capture_output=True, text=True,
                                  timeout=SCRIPT_TIMEOUT_S)
            code, output = done.returncode, done.stdout + ("" if done.returncode in (0, 1) else done.stderr[-4000:])
        except subprocess.TimeoutExpired:
            code, output = -1, f"timed out after {SCRIPT_TIMEOUT_S} s"
        results[name] = {"command": command, "exit_code": code, "output": output}
    return results


def to_dict(result: ReproResult) -> dict[str, Any]:
    shrunk, source = result.shrunk, result.source
    out: dict[str, Any] = {
        "verdict": result.verdict, "message": result.message, "exit_code": result.exit_code,
        "source": {"kind": source.kind, "path": str(source.path), "dump": str(source.dump) if source.dump else None,
                   "fault": source.fault, "fault_note": source.fault_note, "recorded": list(source.recorded)},
        "confirmed": result.confirmed, "confirmations": result.confirmations, "probes": result.probes,
        "budget": result.budget, "seconds": result.seconds, "files": result.files,
        "recorded_case": source.case.standalone() if source.case is not None else None,
    }
    if result.first_probe is not None:
        out["recorded_probe"] = _probe(result.first_probe)
    if shrunk is not None:
        out["minimal"] = {"case": shrunk.case.standalone(), "describe": shrunk.case.describe(),
                          "probe": _probe(shrunk.probe), "minimal": shrunk.minimal, "stopped": shrunk.stopped,
                          "axes": list(shrunk.axes), "steps": [asdict(s) for s in shrunk.steps]}
    out["table"] = [r.to_dict() for r in result.table]
    out["localized"] = [loc.to_dict() for loc in result.localized]
    out["audits"] = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in result.audits.items()}
    out["sides"] = asdict(result.sides) if is_dataclass(result.sides) else None
    out["diagnosis"], out["script"] = result.diagnosis, result.script
    return out


def _probe(probe: Any) -> dict[str, Any]:
    return {"describe": probe.describe(), "failing": list(probe.failing), "max_abs_diff": list(probe.max_abs_diff),
            "first_divergence": list(probe.first_divergence), "error": probe.error, "info": probe.info,
            "seconds": probe.seconds}


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
