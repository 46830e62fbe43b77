"""The HTML report: the run it collects, the periodic detector's periodogram, the plots and the page."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from rlcheck.core import metrics as K
from rlcheck.core.detect import PeriodicConfig, PeriodicDetector
from rlcheck.core.monitor import Monitor, MonitorConfig
from rlcheck.errors import InputError, MismatchHalt
from rlcheck.report import write_report
from rlcheck.report.data import PANELS, collect
from rlcheck.report.periodogram import periodogram, replay_z
from rlcheck.report.plots import alarm_steps, downsample, to_svg
from rlcheck.synthetic import SyntheticConfig, synthetic_batch
from rlcheck.synthetic.streams import metric_stream

PERIOD = 4
EVIL = "<script>alert('x')</script>"
DATA = SyntheticConfig(num_sequences=24, mean_length=40, spike_every=PERIOD, spike_start=36, spike_scale=3.0)


def record_run(run_dir: Path, steps: int = 120) -> Path:
    """A synthetic run with a spike every 4 steps from step 36, request ids holding markup, a loop.jsonl
    beside it; the periodic detector halts it with a dump."""
    cfg = MonitorConfig(run_dir=run_dir, sinks=("jsonl",), context={"source": "test", "model": "m<1>"})
    with Monitor(cfg) as mon, open(run_dir / "loop.jsonl", "w") as loop:
        for step in range(steps):
            b = synthetic_batch(DATA, step)
            ids = [f"{EVIL}-s{step}-r{i}" for i in range(b.num_sequences)]
            batch = type(b).from_packed(b.logp_rollout, b.logp_train, b.cu_seqlens, ids, tokens=b.tokens)
            loop.write(json.dumps({"step": step, "sync_skipped": step % PERIOD == PERIOD - 1,
                                   "seconds": {"total": 0.1}}) + "\n")
            try:
                mon.observe(step, batch)
            except MismatchHalt:
                break
    return run_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return record_run(tmp_path_factory.mktemp("report") / "run")


@pytest.fixture(scope="module")
def page(run) -> str:
    return write_report(run).read_text()


class TestCollect:
    def test_reads_the_run(self, run):
        """Steps, series, the periodic alarm, the dump with its context and the loop lines are all collected."""
        data = collect(run)
        assert data.steps.tolist() == list(range(data.steps.size)) and data.steps.size > 40
        assert K.ABS_DIFF_MEAN in data.series and data.series[K.ABS_DIFF_MEAN].shape == data.steps.shape
        assert any(a["kind"] == "periodic" for a in data.alarms)
        assert len(data.dumps) == 1 and data.dumps[0].step == data.steps[-1] and len(data.dumps[0].files) == 2
        assert data.context["model"] == "m<1>" and len(data.loop) == data.steps.size
        assert not data.diagnosis.healthy

    def test_histograms_and_offenders(self, run):
        """The summed histogram counts every token; offenders come worst first, each with its step."""
        data = collect(run)
        tokens = sum(json.loads(line)["metrics"][K.TOKEN_COUNT] for line in (run / "metrics.jsonl").open())
        assert sum(data.hist_run["counts"]) == tokens
        worst = max(range(data.steps.size), key=lambda i: data.series[K.ABS_DIFF_MEAN][i])
        assert data.worst_step == data.steps[worst] and data.hist_worst["counts"]
        diffs = [o["max_abs_diff"] for o in data.offenders]
        assert diffs == sorted(diffs, reverse=True) and all("step" in o for o in data.offenders)

    def test_missing_run_dir(self, tmp_path):
        """A directory that does not exist, or one without metrics.jsonl, is an InputError that says so."""
        with pytest.raises(InputError, match="does not exist"):
            collect(tmp_path / "nope")
        with pytest.raises(InputError, match="metrics.jsonl"):
            collect(tmp_path)


class TestPeriodogram:
    def test_replay_reproduces_the_live_decision(self, run):
        """The replayed z history gives the alarm's period back, and that period scores highest, above the level."""
        data = collect(run)
        alarm = next(a for a in data.alarms if a["kind"] == "periodic")
        assert alarm["metric"] == K.ABS_DIFF_CLIPPED_MEAN  # what the periodic detector watches by default
        z = replay_z(data.steps, data.series[alarm["metric"]], alarm["metric"], alarm["step"], PeriodicConfig())
        assert PeriodicDetector()._best_period(z)[0][0] == alarm["details"]["period"] == PERIOD
        (pg,) = data.periodograms
        assert pg.step == alarm["step"] and pg.period == PERIOD and pg.message == alarm["message"]
        assert pg.scores[PERIOD - pg.periods[0]] == pg.scores.max() >= pg.threshold

    @pytest.mark.parametrize("stride", [1, 2])
    def test_bounded_replay_equals_full_replay(self, stride):
        """Replaying only the last window + history steps leaves the detector with the z history (on
        its grid of steps) of a full replay, with consecutive steps and with TRL's every other step."""
        cfg = PeriodicConfig()
        stream = metric_stream(2500, seed=1, spike_every=7, spike_start=100)
        metric = cfg.metrics[0]
        values = np.array([m[metric] for m in stream.metrics])
        steps = stride * np.arange(values.size)
        full = PeriodicDetector(dataclasses.replace(cfg, trigger=math.inf))
        for step, x in zip(steps.tolist(), values.tolist(), strict=True):
            full.update(step, {metric: x})
        z = replay_z(steps, values, metric, int(steps[-1]), cfg)
        assert z.size == cfg.history and full.grid(metric)[1] == stride
        np.testing.assert_array_equal(z, full.grid(metric)[0])

    def test_too_short_and_clean(self):
        """Before the warm-up there is no periodogram; a clean series gets one with no period and scores below the level."""
        stream = metric_stream(400, seed=2)
        values = np.array([m[K.ABS_DIFF_MEAN] for m in stream.metrics])
        steps = np.arange(values.size)
        assert periodogram(steps[:40], values[:40], K.ABS_DIFF_MEAN, []) is None
        pg = periodogram(steps, values, K.ABS_DIFF_MEAN, [])
        assert pg.period is None and pg.step == 399 and pg.scores.max() < pg.threshold


class TestPlots:
    def test_downsample_keeps_extremes(self):
        """A long series is thinned to the limit, in order, with its largest and smallest values kept."""
        x = np.arange(100_000)
        y = np.random.default_rng(0).normal(size=x.size)
        y[12_345] = 50.0
        xs, ys = downsample(x, y, 1000)
        assert xs.size <= 1000 and np.all(np.diff(xs) > 0)
        assert ys.max() == 50.0 and ys.min() == y.min()

    def test_alarm_steps_group_by_step(self):
        """Alarms of one step become one marker with the worst severity, its text listing every alarm."""
        alarms = [{"step": 5, "severity": "warn", "kind": "robust_z", "metric": "m", "message": "a"},
                  {"step": 5, "severity": "critical", "kind": "periodic", "metric": "m", "message": "b"},
                  {"step": 2, "severity": "info", "kind": "drift", "metric": "m", "message": "c"}]
        (s2, sev2, _), (s5, sev5, text5) = alarm_steps(alarms)
        assert (s2, sev2, s5, sev5) == (2, "info", 5, "critical")
        assert text5.index("periodic") < text5.index("robust_z")

    def test_svg_is_inline_with_escaped_titles(self):
        """The SVG has no XML header or metadata, and hover text goes in escaped."""
        from matplotlib.figure import Figure

        fig = Figure()
        fig.add_subplot().plot([1], [1], "o", gid="marker")
        svg = to_svg(fig, "t", {"marker": EVIL})
        assert svg.startswith("<svg") and "<metadata" not in svg and "<?xml" not in svg
        assert "<title>&lt;script&gt;" in svg and "<script" not in svg


def long_run(run_dir: Path, steps: int) -> Path:
    """A metrics.jsonl of `steps` records (every standard metric, no histogram), a warn alarm every third step."""
    rng = np.random.default_rng(0)
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(steps):
            x = float(rng.lognormal(-6, 0.3))
            alarms = [{"kind": "robust_z", "metric": K.ABS_DIFF_MEAN, "step": step, "severity": "warn",
                       "message": f"spike {step}", "details": {}}] if step % 3 == 0 else []
            metrics = {**dict.fromkeys(K.ALWAYS, 0.0), K.ABS_DIFF_MEAN: x, K.ABS_DIFF_MAX: 10 * x, K.KL_K3: x * x}
            f.write(json.dumps({"step": step, "metrics": metrics, "alarms": alarms, "offenders": []}) + "\n")
    return run_dir


class TestWriteReport:
    def test_default_path_and_sections(self, run, page):
        """report.html lands in the run directory with every plot, the alarm markers and the period."""
        assert (run / "report.html").is_file()
        assert page.count("<svg") == len(PANELS) - 1 + 2  # no reward in this run; the periodogram; the histogram
        assert re.search(r"<title>step \d+: critical periodic on rlcheck/token/abs_diff_clipped_mean", page)
        assert f"detected period {PERIOD}" in page and f"P = {PERIOD}" in page
        assert "weight sync skipped at steps" in page and "m&lt;1&gt;" in page

    def test_offenders_escaped(self, run, page):
        """Request ids holding markup appear escaped in the offenders table; no script tag reaches the page."""
        data = collect(run)
        assert "<script" not in page.lower()
        for o in data.offenders[:5]:
            assert f'<td class="mono">{html.escape(o["request_id"])}</td>' in page

    def test_dump_links_resolve(self, run, page):
        """Every link is relative and points at an existing file of the dump."""
        hrefs = re.findall(r'<a href="([^"]+)"', page)
        assert {Path(h).name for h in hrefs} == {"meta.json", "sequences.parquet"}
        for h in hrefs:
            assert not h.startswith("/") and (run / unquote(h)).is_file()

    def test_nothing_loaded_from_the_network(self, page):
        """No src= or href= names a remote resource, CSS imports nothing, and SVG references stay in the page."""
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, flags=re.I)
        assert "@import" not in page and not re.search(r"url\((?!#)", page)
        assert set(re.findall(r'xlink:href="(.)', page)) <= {"#"}

    def test_out_elsewhere(self, run, tmp_path):
        """--out puts the page elsewhere; its dump links still resolve from there."""
        out = write_report(run, tmp_path / "sub" / "r.html")
        hrefs = re.findall(r'<a href="([^"]+)"', out.read_text())
        assert hrefs and all((out.parent / unquote(h)).resolve().is_file() for h in hrefs)

    def test_cli(self, run, tmp_path, monkeypatch, capsys):
        """`rlcheck report` prints the path; a directory without a run exits 2 with a one-line error."""
        from rlcheck.cli import main

        monkeypatch.setattr("sys.argv", ["rlcheck", "report", str(run), "--out", str(tmp_path / "r.html")])
        with pytest.raises(SystemExit) as done:
            main()
        assert done.value.code in (0, None) and f"report: {tmp_path / 'r.html'}" in capsys.readouterr().out
        monkeypatch.setattr("sys.argv", ["rlcheck", "report", str(tmp_path)])
        with pytest.raises(SystemExit) as failed:
            main()
        assert failed.value.code == 2 and "rlcheck: error:" in capsys.readouterr().err

    def test_long_run_stays_small(self, tmp_path):
        """8,000 steps with 2,667 alarm steps: lines thinned, the first MAX_TIPS markers with hover text, the rest one
        raster per plot, and the page stays under 1 MB."""
        from rlcheck.report.plots import MAX_TIPS

        page = write_report(long_run(tmp_path / "long", 8_000)).read_text()
        assert len(page.encode()) < 1_000_000
        assert page.count("<title>step ") == MAX_TIPS and page.count("data:image/png;base64,") == 1


OPEN_COUNTER = """
import collections, os, sys
run_dir = os.path.realpath(sys.argv[1])
opened = collections.Counter()

def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        writing = isinstance(args[1], str) and any(c in args[1] for c in "wax+")
        if path.startswith(run_dir + os.sep) and not writing and not (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR)):
            opened[os.path.relpath(path, run_dir)] += 1

sys.addaudithook(hook)
from rlcheck.cli import main
sys.argv = ["rlcheck", "report", run_dir, "--out", sys.argv[2]]
try:
    main()
except SystemExit as done:
    assert done.code in (0, None), done.code
for name, n in sorted(opened.items()):
    print("opened", n, name)
"""


class TestReadsOnce:
    def test_report_reads_each_file_of_the_run_once(self, run, tmp_path):
        """`rlcheck report RUN_DIR` (summary, diagnosis, panels, dumps, loop, guard) opens every file of
        the run directory it reads exactly once (an audit hook counts the opens)."""
        import shutil
        import subprocess
        import sys

        run_dir = tmp_path / "run"
        shutil.copytree(run, run_dir)
        guard = run_dir / "guard"
        guard.mkdir()
        (guard / "summary.json").write_text(json.dumps({"checks": {}}))
        (guard / "violations.jsonl").write_text("")
        done = subprocess.run([sys.executable, "-c", OPEN_COUNTER, str(run_dir), str(tmp_path / "r.html")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        out = done.stdout
        counts = {line.split(" ", 2)[2]: int(line.split(" ", 2)[1]) for line in out.splitlines()
                  if line.startswith("opened ")}
        dump = next(p.relative_to(run_dir) for p in (run_dir / "dumps").glob("step_*"))
        must = {"metrics.jsonl", "state.json", "loop.jsonl", "guard/summary.json", "guard/violations.jsonl",
                f"{dump}/meta.json", f"{dump}/sequences.parquet"}
        assert must <= counts.keys(), counts
        assert {name: n for name, n in counts.items() if n != 1} == {}
