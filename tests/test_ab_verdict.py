"""The A/B judge (traindx.analyzers.core.ab_verdict): the outcome of a comparison and every --fix arm
decision from given numbers, no run recorded."""

import pytest

from traindx.analyzers.core import ab_verdict
from traindx.analyzers.core.ab_verdict import (
    ABVerdict,
    Arm,
    ArmEvidence,
    Judgement,
    Measure,
    Outcome,
    judge_arm,
    keep,
    settles_search,
    worth_repeating,
)
from traindx.analyzers.core.ab_verdict import (
    ab_verdict as judge_ab,
)
from traindx.analyzers.core.findings import Finding


def test_a_faster_arm_whose_interval_is_above_one_is_a_win_with_parity():
    verdict = judge_ab(1.40, 1.12, True)
    assert verdict.outcome is Outcome.FASTER and verdict.is_win
    assert verdict.text() == "faster and numerically equivalent"
    # no losses logged: still a win, said so
    unchecked = judge_ab(1.40, 1.12, None)
    assert unchecked.outcome is Outcome.FASTER_UNCHECKED and unchecked.is_win
    assert unchecked.text() == "faster, numerics not checked (no losses in the log)"


def test_an_interval_reaching_one_or_a_small_gain_is_no_gain():
    assert judge_ab(1.40, 0.99, True).outcome is Outcome.NO_GAIN  # the interval holds 1
    assert judge_ab(1.04, 1.01, True).outcome is Outcome.NO_GAIN  # under MIN_SPEEDUP
    assert judge_ab(None, None, True).outcome is Outcome.NO_GAIN
    assert not judge_ab(0.5, 0.4, True).is_win and judge_ab(0.5, 0.4, True).text() == "no gain"


def test_a_parity_failure_is_never_a_win():
    verdict = judge_ab(2.0, 1.8, False)
    assert verdict.outcome is Outcome.FASTER_NUMERICS_DIFFER and not verdict.is_win
    assert verdict.text() == "faster but numerics differ"
    start = judge_ab(1.0, 0.9, False, first_step_speedup=5.0, first_step_saved_s=4.0)
    assert start.outcome is Outcome.FASTER_START_NUMERICS_DIFFER and not start.is_win
    assert start.text() == "faster start (step 0 5.0× faster), no steady-state gain, numerics differ"


def test_a_quicker_first_step_alone_is_a_faster_start():
    start = judge_ab(1.0, 0.9, True, first_step_speedup=3.0, first_step_saved_s=2.0)
    assert start.outcome is Outcome.FASTER_START and start.is_win
    assert start.text() == "faster start (step 0 3.0× faster), no steady-state gain"
    # a second saved is the least: a twice-as-fast 0.4 s step 0 is no faster start
    assert judge_ab(1.0, 0.9, True, first_step_speedup=2.0, first_step_saved_s=0.4).outcome is Outcome.NO_GAIN


def test_a_crashed_candidate_is_no_win_and_never_kept():
    verdict = ab_verdict.crashed(2)
    assert verdict.outcome is Outcome.CRASHED and not verdict.is_win
    assert verdict.text() == "candidate failed (exit 2): the change does not work as applied"
    # even with a comparison that looked faster, an arm that crashed is not significant
    judged = judge_arm(_evidence(exit_code=2, verdict=verdict, speedup=3.0))
    assert not judged.significant
    arm = _arm(exit_code=2, judgement=judged)
    assert not worth_repeating(arm) and keep([arm]) is None


def test_the_comparisons_verdict_decides_significance():
    win = judge_arm(_evidence(verdict=judge_ab(1.4, 1.1, True), speedup=1.4))
    assert win.significant and win.judged_by is Measure.MEDIAN and win.judged_speedup == 1.4
    lost = judge_arm(_evidence(verdict=judge_ab(1.4, 0.9, True), speedup=1.4))
    assert not lost.significant
    differ = judge_arm(_evidence(verdict=judge_ab(1.4, 1.1, False), speedup=1.4, parity=False))
    assert not differ.significant


def test_a_periodic_cost_is_judged_by_the_mean():
    # a checkpoint every 5th step costs 1 s; the candidate writes it in the background
    base = ([0.1] * 4 + [1.1]) * 4
    cand = [0.1] * 20
    evidence = _evidence(verdict=judge_ab(1.0, 1.0, True), speedup=1.0, values=(base, cand), periodic=True)
    judged = judge_arm(evidence)
    assert judged.judged_by is Measure.PERIODIC_MEAN and judged.significant
    assert judged.judged_speedup == pytest.approx(3.0)
    assert judged.to_dict()["mean_speedup_ci95"][0] > 1.0
    # the same means, but the numerics differ: not significant
    assert not judge_arm(
        _evidence(verdict=judge_ab(1.0, 1.0, False), values=(base, cand), periodic=True, parity=False)
    ).significant


def test_a_warm_up_is_judged_by_its_first_step():
    evidence = _evidence(verdict=judge_ab(1.0, 0.95, True), speedup=1.0, firsts=(30.0, 3.0), precompile=True)
    judged = judge_arm(evidence)
    assert judged.judged_by is Measure.FIRST_STEP and judged.judged_speedup == pytest.approx(10.0)
    assert judged.significant


def test_an_unsettled_arm_is_repeated_and_a_settled_or_broken_one_is_not():
    # not proven faster, but its interval reaches a 20 % gain: measured again
    unsettled = _arm(judgement=Judgement(Measure.MEDIAN, 1.08, False), speedup_ci95=[0.97, 1.25])
    assert worth_repeating(unsettled)
    # an interval that rules a real gain out, and no prediction: believed
    assert not worth_repeating(
        _arm(judgement=Judgement(Measure.MEDIAN, 1.01, False), speedup_ci95=[0.97, 1.05])
    )
    # a ledger that predicted a 30 % saving contradicts a result of no gain: measured again
    promised = _arm(
        judgement=Judgement(Measure.MEDIAN, 1.0, False),
        speedup_ci95=[0.97, 1.05],
        baseline_median_step_s=1.0,
        predicted_saving_s_per_step=0.3,
    )
    assert worth_repeating(promised)
    # a win, a crash, a parity failure, a cold start: never repeated
    assert not worth_repeating(_arm(judgement=Judgement(Measure.MEDIAN, 1.5, True), speedup_ci95=[1.3, 1.7]))
    assert not worth_repeating(
        _arm(exit_code=1, judgement=Judgement(Measure.MEDIAN, 1.08, False), speedup_ci95=[0.97, 1.25])
    )
    assert not worth_repeating(
        _arm(loss_parity=False, judgement=Judgement(Measure.MEDIAN, 1.08, False), speedup_ci95=[0.97, 1.25])
    )
    assert not worth_repeating(_arm(judgement=Judgement(Measure.FIRST_STEP, 1.02, False)))


def test_a_win_far_under_its_prediction_does_not_settle_the_search():
    as_predicted = _arm(
        judgement=Judgement(Measure.MEDIAN, 2.0, True),
        baseline_median_step_s=1.0,
        measured_step_time_s=0.5,
        predicted_saving_s_per_step=0.6,
    )
    assert settles_search(as_predicted)
    partial = _arm(
        judgement=Judgement(Measure.MEDIAN, 1.2, True),
        baseline_median_step_s=1.0,
        measured_step_time_s=0.83,
        predicted_saving_s_per_step=0.9,
    )
    assert not settles_search(partial)
    assert ab_verdict.why_not_settled(partial) == "under half its predicted saving"
    assert not settles_search(_arm(judgement=Judgement(Measure.MEDIAN, 1.0, False)))


def test_keep_prefers_a_significant_win_then_the_least_invasive_of_equal_gains():
    loser = _arm(name="slow", dir="slow", judgement=Judgement(Measure.MEDIAN, 0.8, False))
    even = _arm(name="even", dir="even", judgement=Judgement(Measure.MEDIAN, 1.02, False))
    win = _arm(name="win", dir="win", mechanism="source", judgement=Judgement(Measure.MEDIAN, 1.5, True))
    flag = _arm(name="flag", dir="flag", mechanism="config", judgement=Judgement(Measure.MEDIAN, 1.45, True))
    assert keep([loser]) is None
    assert keep([loser, even]) is even
    assert keep([even, win]) is win
    assert keep([win, flag]) is flag  # within 10 %: the job's own flag
    diverged = _arm(dir="d", loss_parity=False, judgement=Judgement(Measure.MEDIAN, 3.0, True))
    assert keep([diverged, even]) is even


def test_an_arm_row_round_trips_through_fix_json():
    arm = _arm(
        judgement=Judgement(Measure.PERIODIC_MEAN, 1.3, True, [1.1, 1.5]),
        repeat={"first": {}},
        after="x",
    )
    row = arm.to_row()
    assert list(row)[:3] == ["judged_by", "judged_speedup", "mean_speedup_ci95"]
    assert list(row)[-2:] == ["repeat", "after"] and row["significant"] is True
    assert Arm.from_row(row) == arm
    assert "mean_speedup_ci95" not in _arm(judgement=Judgement(Measure.MEDIAN, 1.0, False)).to_row()


def _evidence(
    exit_code=0,
    verdict=None,
    speedup=None,
    parity=True,
    values=((), ()),
    firsts=(None, None),
    periodic=False,
    precompile=False,
):
    return ArmEvidence(
        exit_code=exit_code,
        verdict=verdict or ABVerdict(Outcome.NO_GAIN),
        statistic=Measure.MEDIAN,
        speedup=speedup,
        parity_passed=parity,
        window_values=values,
        first_steps=firsts,
        periodic=periodic,
        precompile=precompile,
    )


def _arm(**fields):
    defaults = {
        "name": "candidate",
        "dir": "runs/x/candidate",
        "finding": "gc.collect",
        "mechanism": "config",
        "summary": "a change",
        "exit_code": 0,
        "judgement": Judgement(Measure.MEDIAN, 1.0, False),
        "loss_parity": True,
        "verdict": "no gain",
    }
    return Arm(**{**defaults, **fields})


def test_periodic_cost_needs_a_period_or_few_affected_steps():
    window = {"window_values_s": {"baseline": [0.1] * 20}}
    few = Finding(id="gc.x", title="gc", severity="high", analyzer="gc", steps_affected=(3, 9))
    every = Finding(id="gc.y", title="gc", severity="high", analyzer="gc", steps_affected=tuple(range(20)))
    assert ab_verdict.periodic_cost(few, window) and not ab_verdict.periodic_cost(every, window)
    assert not ab_verdict.periodic_cost(None, window)
