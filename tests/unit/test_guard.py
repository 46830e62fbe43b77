"""The engine guard's pure parts on synthetic step records: the five invariant checks, the slot
history, the config, the files it writes and reads back, its alarms, its snapshot encoder, and how
diagnose and the report use its output (the real vLLM engine: tests/integration/test_guard.py)."""

from __future__ import annotations

import dataclasses
import enum
import json

import numpy as np
import pytest

from rlcheck.core.run.guard_files import GuardOutput, load_guard, record_to_dict, safe_name
from rlcheck.core.run.guard_record import CHECKS, GroupOffsets, PoolInfo, Ragged, StepRecord, Violation
from rlcheck.engines.guard import SIGNATURE, GuardConfig, violations_to_alarms
from rlcheck.engines.guard.checks import (
    InvariantChecker,
    SlotHistory,
    check_in_pool,
    check_offset_fits,
    check_prefill_from_zero,
    check_slot_unique,
)
from rlcheck.engines.guard.reader import MAX_LIST, to_json
from rlcheck.errors import ConfigError, GuardViolation

POOL = PoolInfo(num_blocks=16, offsets={0: GroupOffsets(stride=1000, extent=800, itemsize=4, layer="layers.0.mixer")})


def rec(step, ids, slot, *, computed=None, assigned=None, decode=None, init=None, new=None, blocks=(),
        finished=(), prompt=8) -> StepRecord:
    """A step of len(ids) requests on one Mamba group (column lists per request); decode rows by
    default when computed >= prompt, prefill from zeros otherwise."""
    n = len(ids)
    slot = np.array(slot, dtype=np.int64).reshape(n, -1)
    computed = np.array(computed if computed is not None else [prompt] * n, dtype=np.int64)
    dec = np.array(decode if decode is not None else computed >= prompt, dtype=bool).reshape(n, -1)
    dec = np.broadcast_to(dec, slot.shape).copy()
    ini = dec.copy() if init is None else np.broadcast_to(np.array(init, dtype=bool).reshape(n, -1), slot.shape).copy()
    return StepRecord(
        step=step, request_ids=tuple(ids), computed=computed, scheduled=np.where(computed == 0, prompt, 1),
        prompt_len=np.full(n, prompt), new=np.array(new if new is not None else computed == 0, dtype=bool),
        groups=tuple(range(slot.shape[1])), slot=slot,
        assigned=slot.copy() if assigned is None else np.array(assigned, dtype=np.int64).reshape(slot.shape),
        decode=dec, initial_state=ini, attn_groups=tuple(range(slot.shape[1], slot.shape[1] + len(blocks))),
        blocks=tuple(Ragged.of(b) for b in blocks), finished=tuple(finished), call_step=7)


class TestStepRecord:
    def test_phases(self):
        """computed 0 is a prefill, under the prompt length a chunked prefill, past it a decode."""
        r = rec(1, ["a", "b", "c"], [1, 2, 3], computed=[0, 4, 9])
        assert [r.phase(i) for i in range(3)] == ["prefill", "chunked prefill", "decode"]
        assert [r.kernel_phase(i, 0) for i in range(3)] == ["prefill from zeros", "prefill from zeros", "decode"]

    def test_ragged_rows(self):
        """Ragged.of packs rows and row(i) gives each back."""
        rag = Ragged.of([[1, 2], [], [5]])
        assert [rag.row(i).tolist() for i in range(3)] == [[1, 2], [], [5]]


class TestCheckPrefillFromZero:
    def test_clean_prefill_and_decode(self):
        """A first prefill from zeros and a decode with computed tokens break nothing."""
        assert check_prefill_from_zero(rec(1, ["a", "b"], [1, 2], computed=[0, 9])) == []

    def test_prefill_from_old_state(self):
        """A request with no computed tokens whose prefill starts from the slot's state is named, with step and slot."""
        (v,) = check_prefill_from_zero(rec(4, ["a", "17"], [1, 5], computed=[9, 0], init=[True, True]))
        assert (v.check, v.request_id, v.step, v.slot, v.invariant) == ("prefill_from_zero", "17", 4, 5, "(i)")
        assert "has_initial_state True" in v.message and "request 17" in v.message and v.call_step == 7

    def test_decode_before_prefill(self):
        """A request with no computed tokens that the kernels run as decode: the Jamba bug."""
        (v,) = check_prefill_from_zero(rec(2, ["8854"], [3], computed=[0], decode=[True]))
        assert "ran as decode" in v.message and v.evidence["kernel"] == "decode"


class TestCheckSlotUnique:
    def test_distinct_slots_pass(self):
        """Every request on its own assigned slot, none in an attention table: nothing."""
        assert check_slot_unique(rec(1, ["a", "b"], [1, 2], blocks=[[[3], [4]]])) == []

    def test_two_requests_one_slot(self):
        """Two live requests on one slot: both are named, each with the other."""
        out = check_slot_unique(rec(3, ["a", "b", "c"], [1, 1, 2], assigned=[1, 5, 2]))
        assert {(v.request_id, v.others) for v in out} == {("a", ("b",)), ("b", ("a",))}
        assert all(v.slot == 1 and v.step == 3 for v in out)
        assert "assigned it 5" in next(v for v in out if v.request_id == "b").message

    def test_slot_not_assigned(self):
        """Layers told a slot the block table did not give the request: named even with no other user."""
        (v,) = check_slot_unique(rec(1, ["a"], [9], assigned=[3]))
        assert v.slot == 9 and v.evidence["assigned"] == 3 and v.others == ()

    def test_slot_in_another_requests_attention_table(self):
        """A Mamba slot that another request holds as an attention block aliases it (the groups share the pool)."""
        (v,) = check_slot_unique(rec(1, ["a", "b"], [4, 2], blocks=[[[6], [4, 7]]]))
        assert v.request_id == "a" and v.others == ("b",)

    def test_shared_attention_blocks_are_legal(self):
        """Attention blocks shared by two requests (a prefix-cache hit) are no violation."""
        assert check_slot_unique(rec(1, ["a", "b"], [1, 2], blocks=[[[5, 6], [5, 7]]])) == []


class TestCheckInPool:
    def test_inside(self):
        """Slots 1..num_blocks-1 and attention blocks 0..num_blocks-1 pass."""
        assert check_in_pool(rec(1, ["a", "b"], [1, 15], blocks=[[[0, 3], [14]]]), POOL) == []

    @pytest.mark.parametrize("slot", [0, 16, -1])
    def test_outside(self, slot):
        """The null block, one past the pool, a negative id: each named with its slot."""
        (v,) = check_in_pool(rec(1, ["a", "b"], [2, slot]), POOL)
        assert (v.request_id, v.slot, v.check) == ("b", slot, "in_pool") and "16 blocks" in v.message

    def test_attention_block_outside(self):
        """An attention block id past the pool is named with its group."""
        (v,) = check_in_pool(rec(1, ["a"], [2], blocks=[[[3, 99]]]), POOL)
        assert v.slot == 99 and v.group == 1


class TestCheckOffsetFits:
    def test_small_offsets_pass(self):
        """slot x stride far under the limit: nothing."""
        assert check_offset_fits(rec(1, ["a"], [15]), POOL, 2**31, 0.5) == []

    def test_offset_past_the_margin(self):
        """An end offset past margin x limit is named with the offset computed from the stride."""
        pool = PoolInfo(1 << 40, {0: GroupOffsets(stride=2**20, extent=1000, itemsize=2, layer="m")})
        (v,) = check_offset_fits(rec(1, ["a", "b"], [5, 1024]), pool, 2**31, 0.5)
        assert v.request_id == "b" and v.slot == 1024
        assert v.evidence["end_offset"] == 1024 * 2**20 + 1000 and v.evidence["end_offset_bytes"] == 2 * v.evidence["end_offset"]
        assert check_offset_fits(rec(1, ["b"], [1024]), pool, 2**31, 1.0) == []

    def test_max_safe_slot(self):
        """max_safe_slot is the last slot whose end offset stays at the bound."""
        o = GroupOffsets(stride=100, extent=30, itemsize=4, layer="m")
        assert o.end_offset(o.max_safe_slot(1000)) <= 1000 < o.end_offset(o.max_safe_slot(1000) + 1)


class TestSlotHistory:
    def test_fresh_request_after_free(self):
        """A slot freed by one request and reinitialised by the next one's prefill from zeros: nothing."""
        h = SlotHistory()
        for r in (rec(1, ["a"], [3], computed=[0]), rec(2, ["a"], [3], computed=[8]),
                  rec(3, ["b"], [3], computed=[0], finished=["a"]), rec(4, ["b"], [3], computed=[8])):
            assert h.check(r) == []
            h.update(r)

    def test_stale_read(self):
        """A new request that starts from a freed slot's state is named with the previous writer and the release."""
        h = SlotHistory()
        for r in (rec(1, ["a"], [3], computed=[0]), rec(2, ["a"], [3], computed=[8])):
            h.update(r)
        (v,) = h.check(rec(5, ["b"], [3], computed=[0], init=[True], finished=["a"]))
        assert (v.check, v.request_id, v.slot, v.others) == ("freed_reinit", "b", 3, ("a",))
        assert v.evidence["freed_by"] == "a" and v.evidence["freed_at"] == 5 and v.evidence["written_at"] == 2

    def test_prefix_hit_and_moved_slot_are_legal(self):
        """A request admitted with computed tokens (prefix cache), or whose slot moved (align mode), may read."""
        h = SlotHistory()
        h.update(rec(1, ["a", "c"], [3, 4], computed=[0, 0]))
        assert h.check(rec(2, ["b"], [3], computed=[8], new=[True])) == []
        assert h.check(rec(2, ["c"], [3], computed=[8])) == []

    def test_unknown_slot_is_not_judged(self):
        """A read of a slot the guard never saw written (installed mid-run) is not a violation."""
        assert SlotHistory().check(rec(1, ["a"], [3], computed=[8])) == []


class TestInvariantChecker:
    def test_stale_state_breaks_i_and_v(self):
        """The stale-state shape breaks (i) and (v) for the same request and step, nothing else."""
        chk = InvariantChecker(POOL)
        chk.check(rec(1, ["a"], [3], computed=[0]))
        chk.check(rec(2, ["a"], [3], computed=[8]))
        out = chk.check(rec(3, ["b"], [3], computed=[0], init=[True], finished=["a"]))
        assert [(v.check, v.request_id, v.step) for v in out] == [("prefill_from_zero", "b", 3), ("freed_reinit", "b", 3)]

    def test_aliasing_breaks_ii_only(self):
        """A wrapped slot shared with a live request breaks (ii) for both, not (v)."""
        chk = InvariantChecker(POOL)
        chk.check(rec(1, ["a", "b"], [1, 1], assigned=[1, 5], computed=[0, 0]))
        out = chk.check(rec(2, ["a", "b"], [1, 1], assigned=[1, 5], computed=[8, 8]))
        assert {(v.check, v.request_id) for v in out} == {("slot_unique", "a"), ("slot_unique", "b")}


class TestGuardConfig:
    @pytest.mark.parametrize("kw", [{"policy": "halt"}, {"policies": {"nope": "warn"}}, {"policies": {"in_pool": "x"}},
                                    {"capacity": 0}, {"offset_margin": 0.0}, {"offset_margin": 1.5},
                                    {"break_on": "17"}, {"break_on": ("",)}])
    def test_rejects(self, kw):
        """Unknown policies or checks, empty buffers, margins outside (0, 1], a bare string of ids."""
        with pytest.raises(ConfigError):
            GuardConfig(**kw)

    def test_policy_per_check(self):
        """A per-check policy overrides the default."""
        cfg = GuardConfig(policy="record", policies={"slot_unique": "raise"})
        assert cfg.policy_for("slot_unique") == "raise" and cfg.policy_for("in_pool") == "record"

    def test_env(self):
        """RLCHECK_BREAK_ON adds comma-separated ids; RLCHECK_BREAK_PDB=1 turns pdb on."""
        cfg = GuardConfig(break_on=("3",)).with_env({"RLCHECK_BREAK_ON": " 17, 3,8854 ", "RLCHECK_BREAK_PDB": "1"})
        assert cfg.break_on == ("3", "17", "8854") and cfg.break_pdb
        assert not GuardConfig().with_env({}).break_pdb


class TestViolation:
    def test_round_trip(self):
        """to_dict / from_dict keep every field; the invariant number comes from the check."""
        (v,) = check_slot_unique(rec(1, ["a"], [9], assigned=[3]))
        v = dataclasses.replace(v, rollout_request_id="e0/s7/a")
        assert Violation.from_dict(json.loads(json.dumps(v.to_dict()))) == v and v.invariant == "(ii)"

    def test_error_carries_the_report(self):
        """GuardViolation names the invariant, request and step, and keeps the violations."""
        vs = check_prefill_from_zero(rec(4, ["a", "b"], [1, 2], computed=[0, 0], init=[True, True]))
        err = GuardViolation(vs, "run/guard")
        assert err.violations == tuple(vs) and "(i) prefill_from_zero" in str(err) and "request a" in str(err)
        assert "+1 more" in str(err) and "run/guard" in str(err) and err.report.count("\n") == 1


class TestGuardFiles:
    def test_write_and_load(self, tmp_path):
        """GuardOutput.write then load_guard gives the summary and violations back; the trace is JSON lines."""
        r = rec(1, ["a/1", "b"], [1, 1], assigned=[1, 5], blocks=[[[2], [3, 4]]])
        vs = tuple(check_slot_unique(r))
        out = GuardOutput({"num_steps": 1, "counts": {"slot_unique": 2}}, vs, (r,)).write(tmp_path)
        data = load_guard(tmp_path)
        assert data.violations == list(vs) and data.summary["num_steps"] == 1 and data.path == out
        line = json.loads((out / "trace.jsonl").read_text())
        assert line == record_to_dict(r) and line["blocks"] == [[[2], [3, 4]]]
        assert list(data.by_check()) == ["slot_unique"]

    def test_no_guard(self, tmp_path):
        """A directory without guard/ has no guard data."""
        assert load_guard(tmp_path) is None

    def test_safe_name(self):
        """Request ids become harmless folder names."""
        assert safe_name("e0/s3/../7") == "e0_s3_.._7" and safe_name("") == "_"


class TestViolationsToAlarms:
    def test_one_alarm_per_check(self):
        """Violations (objects or dicts) become one critical signature alarm per check, with the rollout ids."""
        vs = check_slot_unique(rec(2, ["a", "b"], [1, 1], assigned=[1, 5]))
        dicts = [{**vs[0].to_dict(), "rollout_request_id": "e0/s7/a"}, vs[1]]
        (alarm,) = violations_to_alarms(7, dicts)
        assert (alarm.kind, alarm.step, alarm.severity, alarm.details["signature"]) == ("signature", 7, "critical", SIGNATURE)
        assert alarm.details["request_ids"] == ["e0/s7/a", "b"] and alarm.details["check"] == "slot_unique"
        assert "(ii) slot_unique" in alarm.message and json.dumps(alarm.to_dict())


class TestDeadGuard:
    def test_first_step_must_show_the_scheduled_work(self):
        """The guard's first traced step: no request, or scheduled tokens that do not add up to the
        scheduler's total, is a RuntimeError (the guard stops, named), never an empty clean trace."""
        from types import SimpleNamespace

        from rlcheck.engines.guard import check_real_work

        two = rec(1, ["a", "b"], [1, 2], computed=[0, 0])  # two prefills of 8 tokens
        check_real_work(two, SimpleNamespace(total_num_scheduled_tokens=16))
        empty = dataclasses.replace(two, request_ids=(), scheduled=np.zeros(0, dtype=np.int64))
        for record, total in ((two, 17), (empty, 5)):
            with pytest.raises(RuntimeError, match="does not understand this vLLM"):
                check_real_work(record, SimpleNamespace(total_num_scheduled_tokens=total))

    def test_dead_guard_is_a_warn_alarm_once(self):
        """A report with the guard's error gives its alarm (warn, the error and traceback in details)
        beside the violations'; a report after it (error taken) gives none."""
        from rlcheck.engines.guard import ALIVE_METRIC, DEAD_SIGNATURE, guard_alarms

        vs = [v.to_dict() for v in check_slot_unique(rec(2, ["a", "b"], [1, 1], assigned=[1, 5]))]
        alarms = guard_alarms(3, {"violations": vs, "alive": False, "error": "engine step 9: KeyError: 'x'",
                                  "error_trace": "Traceback ...", "steps": 9, "skipped_steps": 0})
        assert [a.details["signature"] for a in alarms] == [SIGNATURE, DEAD_SIGNATURE]
        dead = alarms[1]
        assert (dead.kind, dead.severity, dead.metric, dead.step) == ("signature", "warn", ALIVE_METRIC, 3)
        assert "KeyError" in dead.message and dead.details["traceback"] == "Traceback ..."
        assert guard_alarms(4, {"violations": [], "alive": False, "error": None, "steps": 9, "skipped_steps": 0}) == []


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Meta:
    indices: object
    flags: set
    color: Color
    nested: dict


class TestToJson:
    def test_vllm_like_objects(self):
        """Dataclasses, tensors, arrays, sets and enums become plain JSON; long arrays are cut."""
        torch = pytest.importorskip("torch")
        m = Meta(torch.arange(6, dtype=torch.int32).reshape(2, 3), {"b", "a"}, Color.RED,
                 {"big": np.arange(MAX_LIST + 5), "x": float("inf"), 3: object()})
        out = json.loads(json.dumps(to_json(m)))
        assert out["__type__"] == "Meta" and out["indices"] == {"dtype": "torch.int32", "shape": [2, 3],
                                                                 "values": [0, 1, 2, 3, 4, 5]}
        assert out["flags"] == ["a", "b"] and out["color"] == "RED" and out["nested"]["x"] == "inf"
        assert out["nested"]["big"]["truncated"] and len(out["nested"]["big"]["values"]) == MAX_LIST
        assert out["nested"]["3"].startswith("<object")


def _run_dir(tmp_path, violations, alarms=()):
    """A one-step run directory (metrics.jsonl) with the guard's files beside it."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "metrics": {}, "alarms": list(alarms),
                                                        "offenders": []}) + "\n")
    if violations:
        GuardOutput({"num_steps": 3, "counts": {}}, tuple(violations)).write(tmp_path)
    return tmp_path


class TestDiagnoseGuard:
    def test_shared_slot_is_index_aliasing(self, tmp_path):
        """(ii) violations give index_aliasing, confidence 0.97, the guard's request ids and evidence."""
        from rlcheck.forensics.diagnose import diagnose

        vs = check_slot_unique(rec(2, ["a", "b"], [1, 1], assigned=[1, 5]))
        d = diagnose(_run_dir(tmp_path, vs))
        assert (d.verdict.cause, d.verdict.confidence) == ("index_aliasing", 0.97)
        assert d.verdict.affected_request_ids == ["a", "b"] and d.verdict.affected_steps == [7]
        assert "(ii) slot_unique" in d.verdict.evidence[0]

    def test_stale_read_is_stale_state(self, tmp_path):
        """(i) violations give stale_state from the loop's guard alarms alone (no guard folder)."""
        from rlcheck.forensics.diagnose import diagnose

        vs = check_prefill_from_zero(rec(4, ["a"], [1], computed=[0], init=[True]))
        alarm = violations_to_alarms(0, [{**vs[0].to_dict(), "rollout_request_id": "e0/s0/a"}])[0].to_dict()
        d = diagnose(_run_dir(tmp_path, [], [alarm]))
        assert d.verdict.cause == "stale_state" and d.verdict.affected_request_ids == ["e0/s0/a"]


class TestReportGuardSection:
    def test_section(self):
        """The section lists every check, the violations escaped, and links the snapshots."""
        from pathlib import Path

        from rlcheck.core.run.guard_files import GuardData
        from rlcheck.report.guard import guard_section

        vs = check_slot_unique(rec(2, ["<b>", "c"], [1, 1], assigned=[1, 5]))
        data = GuardData(Path("g"), {"num_steps": 2, "counts": {"slot_unique": 2}, "pool": {"num_blocks": 16}},
                         vs, [Path("g/break/c/step_000002.json")])
        page = guard_section(data, lambda p: f"<a href='{p.name}'>{p.name}</a>")
        assert "Engine guard" in page and all(c in page for c in CHECKS) and "&lt;b&gt;" in page and "<b>" not in page
        assert "step_000002.json" in page and guard_section(None, str) == ""

    def test_report_page(self, tmp_path):
        """`rlcheck report` on a run directory holding guard output shows the guard section and its verdict."""
        from rlcheck.core.monitor import Monitor, MonitorConfig
        from rlcheck.report import write_report
        from rlcheck.synthetic import SyntheticConfig, synthetic_batch

        with Monitor(MonitorConfig(run_dir=tmp_path, sinks=("jsonl",))) as mon:
            for step in range(3):
                mon.observe(step, synthetic_batch(SyntheticConfig(num_sequences=4, mean_length=8), step))
        GuardOutput({"num_steps": 9, "counts": {"prefill_from_zero": 1}},
                    tuple(check_prefill_from_zero(rec(4, ["r9"], [1], computed=[0], init=[True])))).write(tmp_path)
        page = write_report(tmp_path).read_text()
        assert "<h2>Engine guard</h2>" in page and "request r9 has no computed tokens" in page
        assert "stale recurrent state" in page  # the verdict, from the guard's evidence


class TestUnaddressedPool:
    def test_groups_without_a_block_dimension_are_said_to_be_unchecked(self):
        """A KV group whose cache tensors have no dimension of num_blocks (CUDA: attention split into
        kernel blocks) gets no offsets; the pool's record says check (iv) did not run for it."""
        from types import SimpleNamespace

        import torch

        from rlcheck.engines.guard.reader import pool_info

        mamba, attention = torch.zeros(16, 4, 8), torch.zeros(2, 64, 32, 8)  # 16 blocks; 64 kernel blocks
        runner = SimpleNamespace(
            kv_cache_config=SimpleNamespace(num_blocks=16, kv_cache_groups=[SimpleNamespace(layer_names=["m"]),
                                                                            SimpleNamespace(layer_names=["a"])]),
            compilation_config=SimpleNamespace(static_forward_context={"m": SimpleNamespace(kv_cache=[mamba]),
                                                                       "a": SimpleNamespace(kv_cache=[attention])}))
        pool = pool_info(runner)
        assert set(pool.offsets) == {0} and pool.unaddressed == (1,)
        record = pool.to_dict(limit=2**31, margin=0.5)
        assert [g["group"] for g in record["offset_fits_not_run"]] == [1] and list(record["groups"]) == ["0"]
