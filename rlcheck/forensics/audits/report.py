"""The console lines of a stress run's engine self-audits (`rlcheck.forensics.audits`): the decode vs
prefill verdict beside the reference's, and the batch-invariance table."""

from __future__ import annotations

from typing import Any

from rlcheck.forensics.stress.results import StressResult


def render_audits(r: StressResult, console: Any, top: int = 20) -> None:
    """One verdict line per audit (the decode-prefill one only when the reference judged the table),
    and the first `top` requests that differ between the batch-invariance runs."""
    dp, bi = r.audits.get("decode_prefill"), r.audits.get("batch_invariance")
    if dp is not None and r.judge == "reference":
        console.print(_decode_prefill_line(r, dp))
    if bi is not None:
        _render_invariance(r, bi, console, top)


def _decode_prefill_line(r: StressResult, dp: Any) -> str:
    failing, worst = dp.failing_request_ids, max(dp.max_abs_diff, default=0.0)
    if not failing:
        return (f"[green]audit decode vs prefill: OK[/]: every request's decode logprobs within {dp.threshold:g} of a "
                f"fresh prefill (max |d| {worst:.3g})")
    ref = set(r.failing_request_ids)
    only_audit, only_ref = len(set(failing) - ref), len(ref - set(failing))
    agree = "the same requests as the reference" if not only_audit and not only_ref else (
        f"{only_audit} only in the audit, {only_ref} only in the reference")
    return (f"[bold red]audit decode vs prefill: FAIL[/]: {len(failing)} of {len(dp.request_ids)} requests over "
            f"{dp.threshold:g} (max |d| {worst:.3g}): {agree}")


def _render_invariance(r: StressResult, bi: Any, console: Any, top: int) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    differing = bi.differing
    runs = "; ".join(bi.runs)
    worst = max(bi.max_abs_diff, default=0.0)
    if not differing:
        console.print(f"[green]audit batch invariance: OK[/]: every request the same over {len(bi.runs)} runs ({runs}); "
                      f"max |d| {worst:.3g}")
        return
    t = Table(title=f"requests that differ between runs (first {min(top, len(differing))} of {len(differing)})",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("request", "arrival", "outputs", "1st diff", "max |d| before"):
        t.add_column(col)
    for i in differing[:top]:
        first = bi.first_difference[i]
        t.add_row(escape(bi.request_ids[i]), str(r.contexts[i].arrival), str(bi.distinct[i]),
                  "-" if first is None else str(first), f"{bi.max_abs_diff[i]:.3g}")
    console.print(t)
    tokens = sum(k > 1 for k in bi.distinct)
    console.print(f"[bold red]audit batch invariance: FAIL[/]: {len(differing)} of {len(bi.request_ids)} requests differ "
                  f"over {runs} ({tokens} in their tokens, up to {bi.distinct_outputs} distinct outputs; max |d| before "
                  f"the first differing token {worst:.3g}, threshold {bi.threshold:g})")
