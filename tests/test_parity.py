"""Loss parity that knows noise: the correlation decides only where the curve has a trend well
above its noise and enough points; on few or flat points the pointwise tolerance and the final
loss decide; a different data order on a flat noisy curve is no change of numerics. Each
comparison names the rule that decided."""

from __future__ import annotations

import numpy as np

from traindx.analyzers.core import parity


def test_flat_noisy_five_points_anticorrelated_but_inside_tolerance_pass():
    # an HF Trainer job on a random dataset: 6 logged losses (5 after the skip), flat around 1.93;
    # the workers arm draws other batches: the points correlate at -0.34, none leaves tolerance
    golden = [1.9394, 1.9317, 1.9524, 1.941, 1.9306, 1.9216]
    candidate = [1.9218, 1.9333, 1.9107, 1.9311, 1.9169, 1.9213]
    r = parity.loss_parity(golden, candidate)
    assert r.points == 5 and r.pointwise_failures == 0
    assert -0.4 < r.correlation < -0.3
    assert r.passed and r.decided_by == parity.POINTWISE and "correlation not used" in r.rule
    assert r.final_loss_difference < 0.001 and not r.reasons


def test_few_points_with_a_real_difference_fail_by_the_pointwise_rule():
    golden = [2.3, 2.2, 2.1, 2.0, 1.9]
    r = parity.loss_parity(golden, [2.3, 2.2, 2.6, 2.7, 2.8])
    assert not r.passed and r.decided_by == parity.POINTWISE
    assert any("pointwise" in x for x in r.reasons) and any("final loss" in x for x in r.reasons)


def test_another_data_order_on_a_flat_noisy_curve_is_not_a_numerics_change():
    # a random-label classifier: the loss sits at ln(10) with 10 % batch-to-batch noise; workers
    # seeded differently draw other batches, so single points leave the 10 % tolerance
    rng = np.random.default_rng(0)
    golden = 2.30 * (1 + 0.10 * rng.standard_normal(20))
    candidate = 2.30 * (1 + 0.10 * rng.standard_normal(20))
    r = parity.loss_parity(golden, candidate)
    assert r.pointwise_failures > 0.1 * r.points or not r.final_loss_passed  # the old rules failed it
    assert r.passed and r.decided_by == parity.LEVEL and r.level_difference < 0.1
    # the same noise around a level 25 % higher is a change of numerics
    shifted = parity.loss_parity(golden, candidate * 1.25)
    assert not shifted.passed and shifted.decided_by == parity.LEVEL
    assert "mean loss differs" in shifted.reasons[0]


def test_a_curve_with_a_trend_is_judged_by_its_correlation_too():
    golden = np.linspace(5.0, 3.0, 20) + 0.02 * np.sin(np.arange(20) * 1.7)
    r = parity.loss_parity(golden, golden * 1.01)
    assert r.passed and r.decided_by == parity.TREND and r.trend > 10 * r.noise
    mirrored = golden.mean() - (golden - golden.mean())
    bad = parity.loss_parity(golden, mirrored)
    assert not bad.passed and bad.decided_by == parity.TREND and "correlation" in bad.reasons[0]


def test_unchecked_curves_say_so():
    r = parity.loss_parity([5.0, 4.0], [5.0, float("nan")])
    assert not r.passed and r.decided_by == parity.UNCHECKED and "NaN" in r.reasons[0]


def test_a_trainer_job_on_a_random_dataset_keeps_its_workers_arm():
    # recorded: an HF Trainer (tiny Llama, logging_steps=3) on a dataset that draws random tokens
    # per item, baseline vs its --workers 2 arm (each worker draws its own): r = -0.84 over the
    # 5 compared points, which the correlation rule rejected; the 2.04x arm is kept now
    golden = [4.864, 4.859, 4.86, 4.859, 4.859, 4.856]
    candidate = [4.856, 4.857, 4.86, 4.857, 4.858, 4.867]
    r = parity.loss_parity(golden, candidate)
    assert r.correlation < -0.8 and r.pointwise_failures == 0
    assert r.passed and r.decided_by == parity.POINTWISE


def test_arms_that_update_at_another_rate_are_judged_by_the_updates_rule():
    # accumulation put right: one update per 4 micro-batches; the per-step losses differ by
    # design (points outside tolerance), which is no numerics failure
    base = [2.3, 2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.25, 1.2, 1.15]
    cand = [2.3, 2.2, 2.1, 2.0, 1.9, 1.85, 1.8, 1.75, 1.7, 1.65]
    assert not parity.loss_parity(base, cand).passed  # as a numerics check it would fail
    p = parity.loss_parity(base, cand, update_ratio=4.0)
    assert p.passed and p.decided_by == "updates" and "different rates" in p.rule
    diverged = parity.loss_parity(base, [*cand[:-1], 9.0], update_ratio=4.0)
    assert not diverged.passed and "diverged" in diverged.reasons[0]
