"""zbpp.schedule as a user meets it: generate, import, check, simulate and export schedules.

Every expected value here is worked out in the test from the design (DESIGN.md section 3, the
zero-bubble paper's formulas, torch's CSV grammar), never copied from the library's output. Each
test closes the schedules it made (a `with` block), so a leaked handle would show up under ASan.
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from conftest import PYTHON_SRC
from zbpp import ZbError
from zbpp.schedule import Op, Schedule, SimResult, kinds, stack_svgs

P = 4
ZB_ERR_INVALID_ARGUMENT = 1
ZB_ERR_INVALID_SCHEDULE = 3
ZB_ERR_PARSE = 4


def generatable_kinds():
    return [name for name, _ in kinds() if name != "custom"]


def smallest_workable(kind, p=P):
    """The kind's schedule at the smallest m in (8, 16) it accepts."""
    errors = []
    for m in (8, 16):
        try:
            return Schedule.generate(kind, p, m)
        except ZbError as exc:
            errors.append(f"m={m}: {exc}")
    pytest.fail(f"{kind} generates for neither m=8 nor m=16 at p={p}: {errors}")


def placement_rank(stage, p, placement):
    """The rank of a stage by the header's placement rule, computed here independently."""
    if placement == "loop":
        return stage % p
    return stage if stage < p else 2 * p - 1 - stage


def all_ops(schedule):
    return [schedule.rank_ops(r) for r in range(schedule.ranks)]


def one_f_one_b(p, m):
    """A hand-built 1F1B for loop placement, v = 1, with split B and W: rank r warms up with
    p-1-r forwards, then alternates F and (B, W), then drains."""
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops = [Op("F", r, i) for i in range(warm)]
        f_next, b_next = warm, 0
        while b_next < m:
            if f_next < m:
                ops.append(Op("F", r, f_next))
                f_next += 1
            ops += [Op("B", r, b_next), Op("W", r, b_next)]
            b_next += 1
        ranks.append(ops)
    return ranks


# ---- kinds and generation -------------------------------------------------------------------------


def test_kinds_lists_every_kind_with_help():
    listed = kinds()
    names = [name for name, _ in listed]
    # The kinds DESIGN.md section 3 promises, plus "custom" for imported schedules.
    for expected in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min",
                     "zb-auto", "custom"):
        assert expected in names, f"{expected} missing from kinds(): {names}"
    assert len(set(names)) == len(names), f"duplicate kind names: {names}"
    for name, help_text in listed:
        assert isinstance(help_text, str) and len(help_text) > 10, f"{name} has no help: {help_text!r}"


@pytest.mark.parametrize("kind", generatable_kinds())
def test_every_kind_covers_every_op_once_on_the_right_rank(kind):
    with smallest_workable(kind) as s:
        assert s.validate() is s
        p, S, m = s.ranks, s.stages, s.microbatches
        assert (p, S) == (P, P * s.chunks)
        # Placement as the header defines it: V kinds in a V, everything else in a loop.
        expected_placement = "v" if kind in ("zb-v", "v-half", "v-min") else "loop"
        assert s.placement == expected_placement
        for stage in range(S):
            assert s.stage_rank(stage) == placement_rank(stage, p, s.placement), f"stage {stage}"
        for r in range(p):
            held = sorted(st for st in range(S) if placement_rank(st, p, s.placement) == r)
            assert s.rank_stages(r) == held
            ops = s.rank_ops(r)
            assert all(isinstance(op, Op) for op in ops)
            assert all(op.stage in held for op in ops), f"rank {r} runs a stage it does not hold"
            counts = Counter((op.stage, op.mb, op.type) for op in ops)
            for st in held:
                for i in range(m):
                    f, b, w, bw = (counts[(st, i, t)] for t in ("F", "B", "W", "BW"))
                    assert f == 1, f"rank {r} stage {st} mb {i}: {f} forwards"
                    assert (bw, b, w) in ((1, 0, 0), (0, 1, 1)), (
                        f"rank {r} stage {st} mb {i}: BW={bw} B={b} W={w}; need one BW or one B and one W")
            assert sum(counts.values()) == len(ops), f"rank {r} has ops outside its stages"


@pytest.mark.parametrize("torch_name, ours", [
    ("ZBVZeroBubble", "zb-v"),
    ("interleaved1f1b", "interleaved-1f1b"),
    ("Interleaved1F1B", "interleaved-1f1b"),
    ("GPipe", "gpipe"),
    ("ZB_H1", "zb-h1"),
    ("Schedule1F1B", "1f1b"),
])
def test_torch_and_spelling_variants_name_the_same_kind(torch_name, ours):
    with Schedule.generate(torch_name, P, 8) as a, Schedule.generate(ours, P, 8) as b:
        assert a.kind == ours
        assert all_ops(a) == all_ops(b)


def test_unknown_kind_is_a_zb_error_listing_valid_names():
    with pytest.raises(ZbError) as info:
        Schedule.generate("zero-bubble-please", P, 8)
    assert info.value.code == ZB_ERR_INVALID_ARGUMENT
    message = str(info.value)
    assert "zero-bubble-please" in message
    for name in ("1f1b", "zb-v", "zb-auto", "ZBVZeroBubble"):
        assert name in message, f"{name} not in: {message}"


def test_library_rejections_carry_the_library_message():
    # interleaved-1f1b takes m in torch's rounds: max(1, m // p) of equal size.
    with pytest.raises(ZbError) as info:
        Schedule.generate("interleaved-1f1b", 4, 9)
    assert info.value.code == ZB_ERR_INVALID_ARGUMENT
    assert "multiple of 2" in str(info.value), str(info.value)
    with pytest.raises(ZbError) as info:
        Schedule.generate("1f1b", P, 8, times=(1, -1, 1))
    assert "time_b" in str(info.value), str(info.value)
    with pytest.raises(ZbError) as info:
        Schedule.generate("1f1b", P, 8, w_share=1.5)
    assert "w_share" in str(info.value), str(info.value)


def test_messages_have_no_source_positions_unless_zbpp_debug():
    """A user reads what failed and why; the library's "gen_auto.c:336: " only with ZBPP_DEBUG set
    (read once per process, so each case runs in a fresh one)."""
    code = ("import zbpp\ntry:\n    zbpp.Schedule.generate('zb-auto', 4, 8, mem_limit=0.5)\n"
            "except zbpp.ZbError as e:\n    print(e)\n")
    import re

    for debug, want in (("", False), ("0", False), ("1", True)):
        env = dict(os.environ, PYTHONPATH=str(PYTHON_SRC), ZBPP_DEBUG=debug)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert "below what any schedule needs" in out.stdout, out.stdout + out.stderr
        assert bool(re.search(r"[a-z_]+\.c:\d+: ", out.stdout)) == want, (debug, out.stdout)


def test_mem_limit_spellings_agree():
    with Schedule.generate("zb-auto", P, 8, mem_limit="2p") as a, \
            Schedule.generate("zb-auto", P, 8, mem_limit=2 * P) as b, \
            Schedule.generate("zb-2p", P, 8) as c, \
            Schedule.generate("zb-auto", P, 8, mem_limit="1.5 p") as d, \
            Schedule.generate("zb-auto", P, 8) as none:
        assert a.mem_limit == b.mem_limit == c.mem_limit == 2 * P
        assert all_ops(a) == all_ops(b) == all_ops(c)
        assert d.mem_limit == 1.5 * P
        assert none.mem_limit is None
        # The limit holds, and the looser one buys no worse a schedule.
        assert a.simulate().max_peak_memory <= 2 * P + 1e-9
        assert d.simulate().max_peak_memory <= 1.5 * P + 1e-9
        assert a.simulate().cost <= d.simulate().cost + 1e-9


@pytest.mark.parametrize("bad", ["twice p", "p2", "", "-2p"])
def test_bad_mem_limit_strings_are_value_errors(bad):
    with pytest.raises(ValueError, match="mem_limit"):
        Schedule.generate("zb-auto", P, 8, mem_limit=bad)


def test_bad_arguments_are_python_errors_that_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"unknown key 'x'.*'f', 'b', 'w', 'bw'"):
        Schedule.generate("1f1b", P, 8, times={"x": 1.0})
    # 1F1B has one chunk: S = p = 4 per-stage values.
    with pytest.raises(ValueError, match=r"3 values.*S = 4"):
        Schedule.generate("1f1b", P, 8, times={"f": [1.0, 1.0, 1.0]})
    # zb-v defaults to two chunks in a V: S = 2p = 8.
    with pytest.raises(ValueError, match=r"4 values.*S = 8"):
        Schedule.generate("zb-v", P, 8, times={"F": [1.0] * P})
    with pytest.raises(ValueError, match=r"\(f, b, w\)"):
        Schedule.generate("1f1b", P, 8, times=(1.0, 2.0))
    with pytest.raises(TypeError, match="times"):
        Schedule.generate("1f1b", P, 8, times="fast")
    with pytest.raises(ValueError, match="p \\(ranks\\) must be >= 1, got -2"):
        Schedule.generate("1f1b", -2, 8)
    with pytest.raises(ValueError, match="m \\(microbatches\\) must be >= 1"):
        Schedule.generate("1f1b", P, 0)
    with pytest.raises(TypeError, match="integer"):
        Schedule.generate("1f1b", 4.5, 8)
    with pytest.raises(TypeError, match="kind"):
        Schedule.generate(5, P, 8)


def test_times_forms_set_the_op_times():
    # Scalars are per rank (a microbatch through all of a rank's layers): each of v chunks takes 1/v.
    with Schedule.generate("zb-v", P, 8, times=(2.0, 3.0, 4.0)) as s:
        for stage in range(s.stages):
            assert s.op_time("F", stage) == pytest.approx(1.0)
            assert s.op_time("B", stage) == pytest.approx(1.5)
            assert s.op_time("W", stage) == pytest.approx(2.0)
            assert s.op_time("BW", stage) == pytest.approx(3.5)  # bw not given: b + w
    # Per-stage lists are absolute, not divided by v; keys in either case; bw given explicitly.
    f = [1.0 + st for st in range(2 * P)]
    with Schedule.generate("zb-v", P, 8, times={"F": f, "b": 2.0, "bw": 5.0}) as s:
        assert [s.op_time("F", st) for st in range(s.stages)] == pytest.approx(f)
        assert s.op_time("b", 0) == pytest.approx(1.0)
        assert s.op_time("BW", 3) == pytest.approx(2.5)
        assert s.op_time("W", 3) == pytest.approx(0.5)  # w not given: 1 per rank


def test_out_of_range_ranks_and_stages_are_named():
    with Schedule.generate("1f1b", P, 8) as s:
        with pytest.raises(ZbError, match=rf"rank {P} is out of range.*0\.\.{P - 1}"):
            s.rank_ops(P)
        with pytest.raises(ZbError, match=rf"stage -1 is out of range.*0\.\.{P - 1}"):
            s.stage_rank(-1)
        with pytest.raises(ValueError, match="op type 'X'"):
            s.op_time("X", 0)


# ---- simulation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(4, 8), (2, 5), (8, 16)])
def test_1f1b_bubble_matches_the_formula(p, m):
    # With F = B = W = 1 (BW = 2), 1F1B takes (m + p - 1)(F + BW) and computes m(F + BW) per rank:
    # bubble rate (p - 1) / (m + p - 1) (the zero-bubble paper, section 2).
    with Schedule.generate("1f1b", p, m) as s:
        result = s.simulate()
        assert isinstance(result, SimResult)
        assert result.cost == pytest.approx((m + p - 1) * 3)
        assert result.busy == pytest.approx(m * 3)
        assert result.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
        assert result.max_peak_memory == pytest.approx(p)  # 1F1B holds p microbatches on rank 0


def test_zero_bubble_kinds_meet_their_claims():
    # ZB-H1 keeps 1F1B's memory and cuts the bubble to (p - 1)(F + B - W) (paper, section 3.1).
    with Schedule.generate("zb-h1", P, 8) as s:
        r = s.simulate()
        assert r.cost - r.busy == pytest.approx((P - 1) * (1 + 1 - 1))
        assert r.max_peak_memory <= P + 1e-9
    # ZB-H2 has no bubble at all once m is large enough, at 2p - 1 memory.
    with Schedule.generate("zb-h2", P, 16) as s:
        r = s.simulate()
        assert r.bubble_rate == pytest.approx(0.0, abs=1e-9)
        assert r.max_peak_memory <= 2 * P - 1 + 1e-9
    # ZB-V: no bubble once m >= 2p, at 1F1B's memory p.
    with Schedule.generate("zb-v", P, 2 * P) as s:
        r = s.simulate()
        assert r.bubble_rate == pytest.approx(0.0, abs=1e-9)
        assert r.max_peak_memory <= P + 1e-9


def test_cost_bound_says_when_a_schedule_is_shortest():
    # zb-auto at 1F1B's memory on the paper's 1.5B costs: the bound is met, so no order can do
    # better; 1F1B on the same costs and memory is well above it, and the gap is its lost time.
    times = {"f": 18.522, "b": 18.086, "w": 9.337}
    with Schedule.generate("zb-auto", 8, 24, times=times, comm=0.601, mem_limit="p") as s:
        cost, bound = s.simulate().cost, s.cost_bound()
        assert bound == pytest.approx(cost, rel=1e-12)
        assert s.bubble_bound() == pytest.approx(s.simulate().bubble_rate, abs=1e-12)
    with Schedule.generate("1f1b", 8, 24, times=times, comm=0.601) as s:
        r = s.simulate()
        assert s.cost_bound() < r.cost - 5 * times["w"]  # 1F1B idles about (p-1) W more per rank
        assert 0 <= s.bubble_bound() < r.bubble_rate
    # A V schedule: still a bound, never above its cost.
    with Schedule.generate("zb-v", 4, 8, times={"f": 1.3, "b": 0.9, "w": 0.6}, comm=0.1) as s:
        assert 0 < s.cost_bound() <= s.simulate().cost + 1e-9


def test_simulate_durations_runs_the_order_with_given_op_times():
    times = {"f": [1.0, 1.5], "b": [2.0, 2.5], "w": [0.5, 0.75]}
    with Schedule.generate("zb-h1", 2, 4, times=times, comm=0.25) as s:
        plain = s.simulate()
        ops = [s.rank_ops(r) for r in range(2)]
        own = [[times[op.type.lower()][op.stage] for op in rank] for rank in ops]
        same = s.simulate_durations(own)
        assert same.cost == pytest.approx(plain.cost) and same.bubble_rate == pytest.approx(plain.bubble_rate)
        # Rank 1's last op (a W, nothing waits on it) one unit longer: the cost grows by as much.
        longer = [list(own[0]), own[1][:-1] + [own[1][-1] + 1.0]]
        assert ops[1][-1].type == "W"
        got = s.simulate_durations(longer)
        assert got.cost == pytest.approx(max(plain.cost, s.rank_stats(1)[0] + 1.0))
        assert got.busy == pytest.approx(max(sum(longer[0]), sum(longer[1])))
        assert s.simulate().cost == plain.cost  # the handle's own simulation is kept
        with pytest.raises(ValueError, match="rank 1 has"):
            s.simulate_durations([own[0], own[1][:-1]])
        with pytest.raises(ZbError, match="finite and >= 0"):
            s.simulate_durations([own[0], own[1][:-1] + [-1.0]])


def memory_peak(ops, v, w_share):
    """A rank's activation peak by the design's accounting: F adds 1/v, B frees (1-w)/v, W frees
    w/v, BW frees 1/v."""
    delta = {"F": 1 / v, "B": -(1 - w_share) / v, "W": -w_share / v, "BW": -1 / v}
    level = peak = 0.0
    for op in ops:
        level += delta[op.type]
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("kind", ["zb-v", "1f1b", "interleaved-1f1b", "v-half"])
def test_simulated_timeline_obeys_the_model(kind):
    times = {"f": [1.0, 1.5, 1.0, 2.0, 1.0, 1.0, 1.25, 1.0], "b": 2.0, "w": 1.0}
    if kind == "1f1b":
        times["f"] = times["f"][:P]
    with Schedule.generate(kind, P, 8, times=times, comm=0.25, w_share=0.3) as s:
        v, S = s.chunks, s.stages
        assert s.time_comm == 0.25 and s.w_share == 0.3
        end = {}
        start = {}
        spans, peaks = [], []
        for r in range(s.ranks):
            ops = s.rank_ops(r)
            starts, ends = s.rank_times(r)
            assert len(starts) == len(ends) == len(ops)
            for k, op in enumerate(ops):
                # Each op lasts its op time and starts after the previous op on its rank.
                assert ends[k] - starts[k] == pytest.approx(s.op_time(op.type, op.stage))
                if k:
                    assert starts[k] >= ends[k - 1] - 1e-9
                start[(op.type, op.stage, op.mb)] = starts[k]
                end[(op.type, op.stage, op.mb)] = ends[k]
            span, busy, peak = s.rank_stats(r)
            assert busy == pytest.approx(sum(s.op_time(op.type, op.stage) for op in ops))
            assert span == pytest.approx(max(ends) - min(starts))
            assert peak == pytest.approx(memory_peak(ops, v, 0.3))
            spans.append(span)
            peaks.append(peak)

        def comm(a, b):
            return 0.25 if s.stage_rank(a) != s.stage_rank(b) else 0.0

        # Dependencies (DESIGN.md section 3), with the comm time across ranks.
        for (t, st, i), t0 in start.items():
            if t == "F" and st > 0:
                assert t0 >= end[("F", st - 1, i)] + comm(st - 1, st) - 1e-9
            if t in ("B", "BW"):
                assert t0 >= end[("F", st, i)] - 1e-9
                if st + 1 < S:
                    up = end.get(("B", st + 1, i), end.get(("BW", st + 1, i)))
                    assert t0 >= up + comm(st + 1, st) - 1e-9
            if t == "W":
                assert t0 >= end[("B", st, i)] - 1e-9
        result = s.simulate()
        assert result.cost == pytest.approx(max(spans))
        assert result.max_peak_memory == pytest.approx(max(peaks))


def test_stage_costs_of_a_simulated_schedule_are_the_op_times():
    f = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    with Schedule.generate("zb-v", P, 8, times={"f": f, "b": 2.0, "w": 1.0}) as s:
        costs = s.stage_costs()
        assert set(costs) == {"f", "b", "w", "bw"}
        assert costs["f"] == pytest.approx(f)
        assert costs["b"] == pytest.approx([1.0] * 8)  # per-rank 2.0 over v = 2 chunks
        assert costs["w"] == pytest.approx([0.5] * 8)
        assert costs["bw"] == [0.0] * 8  # zb-v never fuses B and W: no BW ops, so 0


def test_set_times_with_stretched_measurements():
    f = [1.0, 1.5, 1.0, 2.0, 1.0, 1.0, 1.25, 1.0]
    with Schedule.generate("zb-v", P, 8, times={"f": f, "b": 2.0, "w": 1.0}) as s:
        before = s.simulate()
        # Pretend a run measured every op twice as slow, in seconds, on a clock that started at
        # 100 s: starts and ends double and shift.
        starts, ends = [], []
        for r in range(s.ranks):
            a, b = s.rank_times(r)
            starts.append([100.0 + 2 * t for t in a])
            ends.append([100.0 + 2 * t for t in b])
        after = s.set_times(starts, ends)
        # Seconds in, milliseconds stored (include/zbpp.h): the cost doubles and reads in ms.
        assert after.cost == pytest.approx(2 * before.cost * 1e3)
        assert after.busy == pytest.approx(2 * before.busy * 1e3)
        assert after.bubble_rate == pytest.approx(before.bubble_rate, abs=1e-9)
        assert after.max_peak_memory == pytest.approx(before.max_peak_memory)
        assert s.simulate() == after, "simulate() must keep the measured figures"
        costs = s.stage_costs()
        assert costs["f"] == pytest.approx([2e3 * t for t in f])
        assert costs["b"] == pytest.approx([2e3 * 1.0] * 8)
        assert costs["w"] == pytest.approx([2e3 * 0.5] * 8)
        # The earliest start is the new zero.
        assert min(min(s.rank_times(r)[0]) for r in range(s.ranks)) == pytest.approx(0.0)


def test_set_times_checks_lengths_first():
    with Schedule.generate("1f1b", 2, 2) as s:
        n0, n1 = len(s.rank_ops(0)), len(s.rank_ops(1))
        with pytest.raises(ValueError, match="one list of times per rank \\(2 lists\\)"):
            s.set_times([[0.0] * n0], [[1.0] * n0])
        with pytest.raises(ValueError, match=rf"ends\[1\] has {n1 - 1} values; rank 1 has {n1} ops"):
            s.set_times([[0.0] * n0, [0.0] * n1], [[1.0] * n0, [1.0] * (n1 - 1)])
        # A time that runs backwards is the library's to reject.
        with pytest.raises(ZbError, match="end >= start"):
            s.set_times([[0.0] * n0, [0.0] * n1], [[1.0] * n0, [-1.0] * n1])


# ---- CSV ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "zb-v", "interleaved-1f1b", "zb-h2"])
def test_csv_round_trip_keeps_every_rank_list(kind):
    with Schedule.generate(kind, P, 8) as s, Schedule.from_csv(s.to_csv()) as t:
        assert t.kind == "custom"
        assert (t.ranks, t.chunks, t.stages, t.microbatches, t.placement) == (
            s.ranks, s.chunks, s.stages, s.microbatches, s.placement)
        assert all_ops(t) == all_ops(s)
        t.validate()
        assert t.simulate().cost == pytest.approx(s.simulate().cost)


def test_hand_written_torch_csv_loads():
    # torch's compute_only grammar: <stage><type><mb>; I is our B (input gradient), B is our BW
    # (torch's full backward); an empty cell is an idle step.
    text = ("0F0,0F1,,0I0,0W0,0I1,0W1\n"
            "1F0,1I0,1W0,1F1,1B1\n")
    with Schedule.from_csv(text) as s:
        assert (s.ranks, s.chunks, s.microbatches, s.placement) == (2, 1, 2, "loop")
        assert s.rank_ops(0) == [Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 0), Op("W", 0, 0),
                                 Op("B", 0, 1), Op("W", 0, 1)]
        assert s.rank_ops(1) == [Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0), Op("F", 1, 1),
                                 Op("BW", 1, 1)]
        s.validate()


def test_csv_infers_v_placement():
    # Stage p (= 2) on the last rank is the bottom of a V.
    text = "0F0,3F0,3I0,3W0,0I0,0W0\n1F0,2F0,2I0,2W0,1I0,1W0\n"
    with Schedule.from_csv(text) as s:
        assert (s.ranks, s.chunks, s.placement) == (2, 2, "v")
        assert s.rank_stages(0) == [0, 3] and s.rank_stages(1) == [1, 2]
        s.validate()


@pytest.mark.parametrize("text, says", [
    ("0F0,0X1\n1F0\n", "type 'X'"),
    ("0UNSHARD,0F0,0B0\n", "FSDP"),
    ("(0F0;0SEND_F0)OVERLAP_F_B,0B0\n", "inside an OVERLAP_F_B"),
    ("(0F0;1B0)OVERLAP\n", "not a pair"),
    ("0F0,F1\n", "<stage><type><microbatch>"),
    ("\n\n", "empty schedule"),
])
def test_broken_csv_is_a_zb_error_naming_the_problem(text, says):
    with pytest.raises(ZbError) as info:
        Schedule.from_csv(text)
    assert info.value.code == ZB_ERR_PARSE
    assert says in str(info.value), str(info.value)


def test_csv_reads_torchs_compute_comms_form_and_overlapped_pairs():
    # torch's lowered form: transfers skipped (the runner makes its own); DualPipeV's pair cell runs
    # its forward, then its backward.
    comms = ("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
             "1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n")
    with Schedule.from_csv(comms) as s, Schedule.from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n") as plain:
        assert all_ops(s) == all_ops(plain)
        s.validate()
    pair = "0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n"
    with Schedule.from_csv(pair) as s:
        assert [(o.type, o.stage, o.mb) for o in s.rank_ops(0)] == [
            ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("BW", 0, 0), ("BW", 0, 1), ("BW", 0, 2)]
        s.validate()


def test_from_ops_with_an_explicit_stage_map():
    # Stages 0, 1, 4 on rank 0 and 2, 3 on rank 1 (torch's unbalanced custom stage ids).
    ops = [[("F", 0, 0), ("F", 1, 0), ("F", 4, 0), ("BW", 4, 0), ("BW", 1, 0), ("BW", 0, 0)],
           [("F", 2, 0), ("F", 3, 0), ("BW", 3, 0), ("BW", 2, 0)]]
    with Schedule.from_ops(ops, m=1, placement=[0, 0, 1, 1, 0], times=(3, 3, 3)) as s:
        assert (s.placement, s.stages, s.ranks) == ("custom", 5, 2)
        assert s.rank_stages(0) == [0, 1, 4] and s.rank_stages(1) == [2, 3]
        s.validate()
        # a per-rank time is split among the rank's stages: 1 per stage on rank 0, 1.5 on rank 1
        assert s.op_time("F", 0) == pytest.approx(1.0) and s.op_time("F", 2) == pytest.approx(1.5)
        with Schedule.from_csv(s.to_csv()) as back:  # the CSV keeps the map
            assert back.placement == "custom" and all_ops(back) == all_ops(s)
    with pytest.raises(ZbError, match="no stage on rank 1"):
        Schedule.from_ops(ops, m=1, placement=[0, 0, 0, 0, 0])


def test_csv_that_parses_but_breaks_a_rule_fails_validate_not_import():
    # Stage 1's backward before its forward on the same rank.
    with Schedule.from_csv("0F0,0B0\n1B0,1F0\n") as s:
        with pytest.raises(ZbError) as info:
            s.validate()
        assert info.value.code == ZB_ERR_INVALID_SCHEDULE
        assert "rank 1" in str(info.value), str(info.value)


def test_from_csv_reads_a_file(tmp_path):
    with Schedule.generate("zb-v", P, 8) as s:
        path = tmp_path / "zbv.csv"
        path.write_text(s.to_csv())
        with Schedule.from_csv(path) as a, Schedule.from_csv(str(path)) as b:
            assert all_ops(a) == all_ops(b) == all_ops(s)
    with pytest.raises(FileNotFoundError):
        Schedule.from_csv(str(tmp_path / "missing.csv"))


def test_from_csv_takes_costs_and_limits():
    with Schedule.generate("zb-v", P, 8) as s:
        text = s.to_csv()
    f = [float(st + 1) for st in range(2 * P)]
    with Schedule.from_csv(text, times={"f": f}, comm=0.5, mem_limit="p") as t:
        assert [t.op_time("F", st) for st in range(t.stages)] == pytest.approx(f)
        assert t.time_comm == 0.5
        assert t.mem_limit == P
        t.validate()  # zb-v stays within p
    with pytest.raises(ValueError, match=r"5 values.*S = 8"):
        Schedule.from_csv(text, times={"f": [1.0] * 5})


# ---- explicit op lists ----------------------------------------------------------------------------


def test_hand_built_1f1b_validates_and_simulates():
    p, m = 2, 4
    rank_ops = one_f_one_b(p, m)
    # Tuples work as well as Op, in any case.
    rank_ops[1] = [(op.type.lower(), op.stage, op.mb) for op in rank_ops[1]]
    with Schedule.from_ops(rank_ops, m=m) as s:
        assert s.kind == "custom"
        assert (s.ranks, s.chunks, s.stages, s.microbatches, s.placement) == (p, 1, p, m, "loop")
        assert s.rank_ops(0) == one_f_one_b(p, m)[0]
        s.validate()
        # Split B and W with equal times: each rank computes 3 per microbatch.
        assert s.simulate().busy == pytest.approx(3 * m)


def test_missing_w_fails_validate():
    rank_ops = one_f_one_b(2, 2)
    dropped = rank_ops[1].pop()  # the last W of rank 1
    assert dropped == Op("W", 1, 1)
    with Schedule.from_ops(rank_ops, m=2) as s:
        with pytest.raises(ZbError) as info:
            s.validate()
        assert info.value.code == ZB_ERR_INVALID_SCHEDULE
        message = str(info.value)
        assert "stage 1 mb 1" in message and "no W" in message, message


def test_from_ops_v_placement_and_bad_ops():
    # A one-microbatch V over two ranks, fused backwards.
    v_ops = [[Op("F", 0, 0), Op("F", 3, 0), Op("BW", 3, 0), Op("BW", 0, 0)],
             [Op("F", 1, 0), Op("F", 2, 0), Op("BW", 2, 0), Op("BW", 1, 0)]]
    with Schedule.from_ops(v_ops, m=1, placement="v") as s:
        assert (s.chunks, s.placement) == (2, "v")
        s.validate()
    with pytest.raises(ValueError, match=r"rank_ops\[0\]\[1\].*'X'"):
        Schedule.from_ops([[("F", 0, 0), ("X", 0, 0)]], m=1)
    with pytest.raises(ValueError, match="placement must be 'loop', 'v' or a list"):
        Schedule.from_ops(v_ops, m=1, placement="zigzag")
    with pytest.raises(ValueError, match="rank_ops is empty"):
        Schedule.from_ops([], m=1)
    # The library's own shape rule: V placement needs two chunks.
    with pytest.raises(ZbError, match="v = 2"):
        Schedule.from_ops(v_ops, m=1, placement="v", v=1)


# ---- exports --------------------------------------------------------------------------------------


def test_svg_shows_every_rank_and_op():
    with Schedule.generate("zb-v", P, 8) as s:
        svg = s.to_svg()
        assert svg.lstrip().startswith(("<svg", "<?xml")), svg[:80]
        root = ET.fromstring(svg)
        texts = {"".join(el.itertext()).strip() for el in root.iter() if el.tag.endswith("text")}
        for r in range(P):
            assert f"rank {r}" in texts, f"no 'rank {r}' label in the SVG"
        boxes = [el for el in root.iter() if el.tag.endswith("rect") and el.get("class") == "op"]
        assert len(boxes) == sum(len(ops) for ops in all_ops(s))


def test_chrome_trace_has_one_event_per_op():
    with Schedule.generate("1f1b", P, 8) as s:
        trace = json.loads(s.to_chrome())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        ops = all_ops(s)
        assert len(events) == sum(len(o) for o in ops)
        assert {e["tid"] for e in events} == set(range(P))
        # Model times read as milliseconds; Chrome traces count microseconds.
        for e in events:
            assert e["dur"] == pytest.approx(s.op_time(e["cat"], e["args"]["stage"]) * 1e3)


def test_json_export_lists_every_rank():
    with Schedule.generate("zb-h1", P, 8) as s:
        doc = json.loads(s.to_json())
        assert len(doc["schedule"]) == P
        for r, row in enumerate(doc["schedule"]):
            assert [Op(e["op"], e["stage"], e["mb"]) for e in row] == s.rank_ops(r)
        assert doc["cost"] == pytest.approx(s.simulate().cost)


def test_text_export_and_format_names():
    with Schedule.generate("1f1b", P, 8) as s:
        text = s.to_text()
        for r in range(P):
            assert f"rank  {r}" in text or f"rank {r}" in text
        assert s.export("CSV") == s.to_csv()
        with pytest.raises(ZbError, match="valid formats: text, csv, json, chrome, svg"):
            s.export("png")


def test_save_that_fails_part_way_leaves_the_old_file(tmp_path):
    """Schedule.save under a 1 KiB file-size limit (a full disk, as a process sees it; StageCosts.save
    writes through the same helper, zbpp/_files.py): the write fails with OSError, the file keeps its old content, no temporary is left;
    before, the file was truncated to what fit. Without the limit the same save replaces it."""
    target = tmp_path / "plan.svg"
    target.write_text("the old plan")
    os.chmod(target, 0o640)
    script = (
        "import resource, sys\n"
        "from zbpp import Schedule\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"  # CPython ignores SIGXFSZ: EFBIG
        "with Schedule.generate('zb-v', 4, 16) as s:\n"
        "    try:\n"
        "        s.save(sys.argv[1])\n"
        "    except OSError as exc:\n"
        "        print('OSError', exc.errno)\n")
    env = dict(os.environ, PYTHONPATH=str(PYTHON_SRC))
    out = subprocess.run([sys.executable, "-c", script, str(target)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("OSError"), out.stdout + out.stderr
    assert target.read_text() == "the old plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.svg"]
    with Schedule.generate("zb-v", 4, 16) as s:
        s.save(target)
        assert target.read_text() == s.to_svg()
        link = tmp_path / "link.svg"  # written through, as the tool does: the link stays a link
        link.symlink_to(target)
        s.save(link, fmt="csv")
        assert link.is_symlink() and target.read_text() == s.to_csv()
        s.save("/dev/null", fmt="csv")  # a device is written in place, not renamed over
    assert os.stat(target).st_mode & 0o777 == 0o640


def test_save_picks_the_format_from_the_name(tmp_path):
    with Schedule.generate("zb-v", P, 8) as s:
        s.save(tmp_path / "a.svg")
        s.save(tmp_path / "a.csv")
        s.save(str(tmp_path / "a.json"))
        s.save(tmp_path / "a.trace.json")
        s.save(tmp_path / "b.trace")
        s.save(tmp_path / "a.txt")
        s.save(tmp_path / "a.dat", fmt="csv")
        assert (tmp_path / "a.svg").read_text().lstrip().startswith(("<svg", "<?xml"))
        assert (tmp_path / "a.csv").read_text() == s.to_csv()
        assert "schedule" in json.loads((tmp_path / "a.json").read_text())
        assert "traceEvents" in json.loads((tmp_path / "a.trace.json").read_text())
        assert "traceEvents" in json.loads((tmp_path / "b.trace").read_text())
        assert (tmp_path / "a.txt").read_text() == s.to_text()
        assert (tmp_path / "a.dat").read_text() == s.to_csv()
        with pytest.raises(ValueError) as info:
            s.save(tmp_path / "a.png")
        for ending in (".svg", ".csv", ".json", ".txt", "trace.json"):
            assert ending in str(info.value), str(info.value)
        assert not (tmp_path / "a.png").exists()


# ---- lifetime -------------------------------------------------------------------------------------


def test_close_is_idempotent_and_a_closed_schedule_says_so():
    s = Schedule.generate("1f1b", P, 8)
    assert repr(s) == f"<zbpp.Schedule 1f1b p={P} v=1 m=8>"
    assert s.handle.value
    s.close()
    s.close()
    assert "closed" in repr(s)
    for use in (lambda: s.rank_ops(0), s.simulate, lambda: s.handle, lambda: s.ranks, s.to_csv):
        with pytest.raises(ValueError, match="closed"):
            use()
    with Schedule.generate("zb-v", P, 8) as t:
        assert repr(t) == f"<zbpp.Schedule zb-v p={P} v=2 m=8>"
    with pytest.raises(ValueError, match="closed"):
        t.validate()


def test_schedules_work_without_torch():
    # sys.modules['torch'] = None makes any `import torch` fail, as if torch were not installed.
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from zbpp.schedule import Schedule\n"
        "with Schedule.generate('zb-v', 4, 8) as s:\n"
        "    s.validate()\n"
        "    print(s.simulate().bubble_rate)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_SRC) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert float(proc.stdout.strip()) == pytest.approx(0.0, abs=1e-9)


def test_stack_svgs_draws_pictures_one_above_the_other_under_their_captions():
    with Schedule.generate("zb-h1", 4, 8) as a, Schedule.generate("1f1b", 2, 3) as b:
        parts = [("plan <zb-h1> & co", a.to_svg()), ("measured", b.to_svg())]
    root = ET.fromstring(stack_svgs(parts))
    ns = "{http://www.w3.org/2000/svg}"
    inner = [c for c in root if c.tag == ns + "svg"]
    captions = [c.text for c in root if c.tag == ns + "text"]
    assert captions == ["plan <zb-h1> & co", "measured"]  # escaped in the file, the same text read back
    assert len(inner) == 2
    heights = [float(ET.fromstring(svg).attrib["height"]) for _, svg in parts]
    y0, y1 = float(inner[0].attrib["y"]), float(inner[1].attrib["y"])
    assert y1 >= y0 + heights[0]  # the second picture starts below the first
    assert float(root.attrib["height"]) >= y1 + heights[1]
    assert float(root.attrib["width"]) == max(float(ET.fromstring(svg).attrib["width"]) for _, svg in parts)
    with pytest.raises(ValueError, match="width and height"):
        stack_svgs([("x", "<g/>")])


def test_the_step_idle_share_counts_the_fill_and_drain_the_bubble_rate_leaves_out():
    """ZB-V at m = 2p: the paper's bubble rate is 0 (the busiest rank never waits) but the other
    ranks wait at the step's ends; idle_rate is that share of all ranks' time over the makespan,
    recomputed here from the ops' times. 1F1B: every rank waits, and both rates say so."""
    for kind in ("zb-v", "1f1b", "zb-h1"):
        with Schedule.generate(kind, P, 2 * P) as s:
            r = s.simulate()
            ops = [(a, b) for rank in range(P) for a, b in zip(*s.rank_times(rank))]
            span = max(b for _, b in ops) - min(a for a, _ in ops)
            work = sum(b - a for a, b in ops)
            assert r.makespan == pytest.approx(span)
            assert r.idle_rate == pytest.approx(1 - work / (P * span))
            if kind == "zb-v":
                assert r.bubble_rate == 0 and r.idle_rate > 0.03, r
            text, figures = s.to_text().splitlines()[:2]
            assert f"bubble {100 * r.bubble_rate:.2f}%  idle {100 * r.idle_rate:.2f}%" in text, text
            assert figures.startswith("figures: cost = the longest rank's span"), figures
            svg = ET.fromstring(s.to_svg())
            line = "".join(svg.find("{http://www.w3.org/2000/svg}text[@class='figures']").itertext())
            assert f"bubble {100 * r.bubble_rate:.2f}% (the paper's" in line and f"idle {100 * r.idle_rate:.2f}%" in line
            doc = json.loads(s.to_json())
            assert doc["idle_rate"] == pytest.approx(r.idle_rate) and doc["makespan"] == pytest.approx(span)


def test_pictures_say_what_they_show_and_share_one_scale_when_stacked():
    """set_display names the schedule and its time unit in every picture; stack_svgs draws the
    schedules it is given on one time scale (the longest makespan across the same width); a long
    schedule's picture grows so its shortest op keeps room for a number."""
    ns = "{http://www.w3.org/2000/svg}"
    with Schedule.generate("zb-v", 4, 8) as a, Schedule.generate("1f1b", 4, 8) as b:
        a.set_display("zb-v, measured step 3", "ms")
        root = ET.fromstring(a.to_svg())
        texts = ["".join(el.itertext()) for el in root.iter(ns + "text")]
        assert texts[0] == "zb-v, measured step 3, p=4 v=2 m=8" and "time (ms)" in texts
        assert json.loads(a.to_chrome())["traceEvents"][0]["args"]["name"] == "zbpp zb-v, measured step 3"
        assert a.to_text().startswith("zb-v, measured step 3: ")
        assert a.display() == ("zb-v, measured step 3", "ms", 0.0)
        stacked = ET.fromstring(stack_svgs([("a", a), ("b", b)]))
        inner = [c for c in stacked if c.tag == ns + "svg"]

        def px_per_unit(svg, sched):
            boxes = [float(el.attrib["width"]) for el in svg.iter(ns + "rect") if el.get("class") == "op"]
            ops = [e - st for r in range(4) for st, e in zip(*sched.rank_times(r))]
            return max(boxes) / max(ops)

        assert px_per_unit(inner[0], a) == pytest.approx(px_per_unit(inner[1], b), rel=1e-3)
        assert a.display() == ("zb-v, measured step 3", "ms", 0.0)  # stacking leaves the schedules as they were
    with Schedule.generate("zb-v", 8, 64) as long:
        root = ET.fromstring(long.to_svg())
        boxes = [float(el.attrib["width"]) for el in root.iter(ns + "rect") if el.get("class") == "op"]
        assert float(root.attrib["width"]) > 1200 and min(boxes) >= 15.9, (root.attrib["width"], min(boxes))


def test_chrome_trace_draws_transfers_and_memory():
    """Every activation and gradient that crosses ranks is a flow arrow (from the op that makes it
    to the op that reads it), and each rank's activation memory is a counter whose highest value
    is the rank's peak."""
    with Schedule.generate("1f1b", P, 8) as s:
        ev = json.loads(s.to_chrome())["traceEvents"]
        starts = [e for e in ev if e["ph"] == "s"]
        ends = {e["id"]: e for e in ev if e["ph"] == "f"}
        assert len(starts) == len(ends) == 2 * (P - 1) * 8  # each boundary, each microbatch, both ways
        ops = {(e["tid"], e["ts"], e["ts"] + e["dur"]): e for e in ev if e["ph"] == "X"}
        for a in starts:
            b = ends[a["id"]]
            assert a["tid"] != b["tid"] and a["ts"] < b["ts"] + 1e-6
            # Each end sits inside an op slice of its rank, so the viewer binds the arrow to it.
            for e in (a, b):
                assert any(t == e["tid"] and t0 <= e["ts"] <= t1 for t, t0, t1 in ops), e
        for r in range(P):
            values = [e["args"]["device"] for e in ev if e["ph"] == "C" and e["name"].startswith(f"rank {r} ")]
            assert max(values) == pytest.approx(s.rank_stats(r)[2]) and values[-1] == pytest.approx(0)
    # With copies: the device and host counters peak where the simulator counts the peaks.
    order = ["F0", "OFFLOAD0", "F1", "OFFLOAD1", "F2", "BW2", "RELOAD1", "BW1", "RELOAD0", "BW0"]
    ops = [Op(t.rstrip("0123456789"), 0, int(t[-1])) for t in order]
    times = {"f": 2, "b": 1, "w": 1, "bw": 3, "offload": 1, "reload": 1}
    with Schedule.from_ops([ops], m=3, times=times) as s:
        counters = [e["args"] for e in json.loads(s.to_chrome())["traceEvents"] if e["ph"] == "C"]
        dev, host = s.rank_memory(0)
        assert (dev, host) == (2, 2)
        assert max(c["device"] for c in counters) == pytest.approx(dev)
        assert max(c["host"] for c in counters) == pytest.approx(host)


def test_copies_from_python_run_on_their_own_lane():
    # PipeOffload's copies through the Python API: the same hand-worked case as test_copies.c
    # (one rank, T_F 2, T_BW 3, copies 1): the OFFLOADs take microbatches 0 and 1 off the device,
    # so the device peak is 2 where the order without copies holds 3, and the host holds 2.
    order = ["F0", "OFFLOAD0", "F1", "OFFLOAD1", "F2", "BW2", "RELOAD1", "BW1", "RELOAD0", "BW0"]
    ops = [Op(t.rstrip("0123456789"), 0, int(t[-1])) for t in order]
    times = {"f": 2, "b": 1, "w": 1, "bw": 3, "offload": 1, "reload": 1}
    with Schedule.from_ops([ops], m=3, times=times) as s:
        s.validate()
        assert [op.type for op in s.rank_ops(0)][:2] == ["F", "OFFLOAD"]
        assert s.rank_memory(0) == (2.0, 2.0)
        starts, ends = s.rank_times(0)
        assert (starts[6], ends[6]) == (6.0, 7.0)  # RELOAD1, issued at BW2's start
        assert s.simulate().cost == 15.0 and s.op_time("RELOAD", 0) == 1.0
        assert "0OFFLOAD0" in s.export("csv")
    plain = [op for op in ops if op.type in ("F", "BW")]
    with Schedule.from_ops([plain], m=3, times=times) as s:
        assert s.rank_memory(0) == (3.0, 0.0)
    with pytest.raises(ValueError, match="'OFFLOAD', 'RELOAD'"):
        Schedule.from_ops([[Op("COPY", 0, 0)]], m=1)


def test_zb_auto_plans_order_and_offload_together():
    """generate(offload=...): zb-auto held to 3 microbatches at p = 4, m = 8 steps 31 without copies;
    planned with them it takes an order for more memory down to 3 and steps 27. A fixed kind gets
    plan_offload's copies. Unknown keys are refused."""
    times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25}
    with Schedule.generate("zb-auto", 4, 8, times=times, mem_limit=3) as plain, \
            Schedule.generate("zb-auto", 4, 8, times=times, mem_limit=3, offload={"slowdown": 0.02}) as joint:
        joint.validate()
        assert joint.makespan() < plain.makespan()
        assert max(joint.rank_memory(r)[0] for r in range(4)) <= 3
        assert any(op.type == "OFFLOAD" for r in range(4) for op in joint.rank_ops(r))
    with Schedule.generate("1f1b", 4, 8, times=times, offload={}) as via, \
            Schedule.generate("1f1b", 4, 8, times=times) as base, base.plan_offload() as direct:
        assert [via.rank_ops(r) for r in range(4)] == [direct.rank_ops(r) for r in range(4)]
    with pytest.raises(ValueError, match="its keys are device_limit, slowdown, host_limit, stages and paired_lanes"):
        Schedule.generate("1f1b", 4, 8, times=times, offload={"limit": 2})


def test_plan_offload_halves_1f1b_memory_at_the_same_step():
    # 1F1B, p = 4, m = 8, F = B = W = 1, copies of 1/4: every rank's activations are resident
    # p - r microbatches deep without copies; the offload pass moves the ones that wait out to the
    # host, so no rank holds more than 2, and the step is as long as before.
    times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25}
    with Schedule.generate("1f1b", 4, 8, times=times) as base, base.plan_offload() as off:
        off.validate()
        assert off.simulate().cost == base.simulate().cost
        assert [base.rank_memory(r)[0] for r in range(4)] == [4.0, 3.0, 2.0, 1.0]  # 1F1B: p - r
        assert max(off.rank_memory(r)[0] for r in range(4)) <= 2.0
        compute = [[op for op in off.rank_ops(r) if op.type not in ("OFFLOAD", "RELOAD")] for r in range(4)]
        assert compute == [base.rank_ops(r) for r in range(4)]
        with base.plan_offload(device_limit=3) as lim:
            assert max(lim.rank_memory(r)[0] for r in range(4)) <= 3
            n = sum(op.type == "OFFLOAD" for r in range(4) for op in lim.rank_ops(r))
            assert 0 < n < sum(op.type == "OFFLOAD" for r in range(4) for op in off.rank_ops(r))
    with pytest.raises(ZbError, match="slowdown"):
        with Schedule.generate("1f1b", 2, 4) as s:
            s.plan_offload(slowdown=-1)


def test_plan_offload_limits_are_positive_or_none():
    with Schedule.generate("1f1b", 2, 4) as s:
        for name in ("device_limit", "host_limit"):
            with pytest.raises(ValueError, match=f"{name} must be a number of microbatches > 0"):
                s.plan_offload(**{name: 0})


def test_refine_finds_a_shorter_v_min_within_its_memory():
    """Schedule.refine on v-min at p = 4, m = 16 (the paper's 1.5B costs): strictly shorter, within
    the schedule's own peak, valid; a limit that is not a positive number is refused."""
    times = (18.522, 18.086, 9.337)
    with Schedule.generate("v-min", 4, 16, times=times, comm=0.601) as s, s.refine() as r:
        r.validate()
        assert r.makespan() < s.makespan()
        assert max(r.rank_memory(q)[0] for q in range(4)) <= max(s.rank_memory(q)[0] for q in range(4))
        assert r.kind == "v-min"
        with pytest.raises(ValueError, match="device_limit must be a number of microbatches > 0"):
            s.refine(0)


def test_selective_offload_is_better_than_linear():
    """PipeOffload's selective offload: under interleaved 1F1B at p = 8, moving only the first chunk's
    activations (half the stages; about half of all activations move) cuts the largest device peak
    by clearly more than half (11.5 -> 5 microbatches), where every stage moving cuts it to 1."""
    times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25}
    with Schedule.generate("interleaved-1f1b", 8, 32, v=2, times=times) as s, \
            s.plan_offload(slowdown=0.02, stages=list(range(8))) as half:
        before = max(s.rank_memory(r)[0] for r in range(8))
        after = max(half.rank_memory(r)[0] for r in range(8))
        moved = sum(op.type == "OFFLOAD" for r in range(8) for op in half.rank_ops(r))
        assert moved <= 8 * 32  # at most the first chunk's 256 of 512 microbatch activations
        assert after < 0.45 * before, f"{before} -> {after}"


def test_plan_offload_with_paired_lanes_keeps_a_pairs_copies_apart():
    """paired_lanes=True: ranks 2k and 2k+1 share one link, so none of their copies overlap in the
    plan (with their own lanes some do), at the same step."""
    times = {"f": 1, "b": 1, "w": 1, "offload": 0.25, "reload": 0.25}

    def overlaps(s):
        found = 0
        for r in range(0, s.ranks - 1, 2):
            lanes = []
            for q in (r, r + 1):
                st, en = s.rank_times(q)
                lanes.append([(a, b) for op, a, b in zip(s.rank_ops(q), st, en) if op.type in ("OFFLOAD", "RELOAD")])
            found += sum(a < d - 1e-9 and c < b - 1e-9 for a, b in lanes[0] for c, d in lanes[1])
        return found

    with Schedule.generate("interleaved-1f1b", 4, 16, v=2, times=times) as base, \
            base.plan_offload() as own, base.plan_offload(paired_lanes=True) as paired:
        assert overlaps(own) > 0 and overlaps(paired) == 0
        assert paired.makespan() == base.makespan()
        assert max(paired.rank_memory(r)[0] for r in range(4)) < max(base.rank_memory(r)[0] for r in range(4))


def test_vocabulary_passes_from_python():
    """Vocabulary Parallelism's passes through from_ops (tests/c/test_vocab_schedule.c times them
    by hand): the same two ranks give the same step, the ops keep their names, and the CSV form,
    which has no cells for them, says so."""
    r0 = [("IF", 0, 0), ("F", 0, 0), ("S", 0, 0), ("T", 0, 0), ("BW", 0, 0), ("IB", 0, 0)]
    r1 = [("IF", 1, 0), ("F", 1, 0), ("S", 1, 0), ("T", 1, 0), ("BW", 1, 0), ("IB", 1, 0)]
    times = {"f": 1, "b": 1, "w": 1, "bw": 2}
    vt = {"s": 0.5, "t": 0.5, "if": 0.25, "ib": 0.25, "comm": 0.1}
    for vocab, end in ((2, 7.7), (1, 7.8)):
        s = Schedule.from_ops([r0, r1], m=1, times=times, vocab=vocab, vocab_times=vt)
        s.validate()
        assert abs(s.makespan() - end) < 1e-12
        assert [op.type for op in s.rank_ops(1)] == ["IF", "F", "S", "T", "BW", "IB"]
        assert "S output layer forward" in s.to_text()
        with pytest.raises(ZbError, match="no CSV cells"):
            s.to_csv()
        s.close()
    with pytest.raises(ValueError, match="vocab must be 0"):
        Schedule.from_ops([r0, r1], m=1, vocab=3)
    with pytest.raises(ValueError, match="vocab_times keys"):
        Schedule.from_ops([r0, r1], m=1, vocab=2, vocab_times={"x": 1})
    plain = Schedule.from_ops([r0, r1], m=1, times=times)
    with pytest.raises(ZbError, match="vocab is 0"):
        plain.validate()
