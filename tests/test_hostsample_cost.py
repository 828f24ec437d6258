"""The host sampler's cost (issue 47): its rate bounded by what its own rounds cost, and a repeated
stack's key found with one look-up, the same key the full walk gives. No timing is asserted: the
costs are given, the periods and keys checked."""

import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiler", "shim")
)
from _traindx_shim import hostsample, selfcost  # noqa: E402


def test_the_sampler_slows_down_where_its_rounds_cost_more_than_its_share(monkeypatch):
    monkeypatch.setattr(hostsample, "RATE_HZ", 50.0)
    monkeypatch.setattr(hostsample, "CPU_SHARE", 0.002)
    monkeypatch.setattr(selfcost, "MIN_SAMPLE_HZ", 5.0)
    assert hostsample.period_s(0, 1.0) == 1 / 50  # nothing measured yet: the stated rate
    assert hostsample.period_s(20_000, 1.0) == 1 / 50  # 20 µs a round: 0.1 % at 50 Hz
    assert abs(hostsample.period_s(100_000, 1.0) - 0.05) < 1e-12  # 100 µs: 20 Hz keeps 0.2 %
    assert hostsample.period_s(10_000_000, 1.0) == 1 / 5  # however dear: never under 5 Hz
    assert hostsample.period_s(20_000, 0.5) == 1 / 25  # the budget's shedding still halves it
    assert hostsample.period_s(0, 0.0) == 1 / 5  # shed to the floor


def _keys_of_a_loop(n):
    """The key ids of n samples at one line of a loop, then one at another line."""
    ids = [hostsample._key_id(sys._getframe()) for _ in range(n)]
    return ids, hostsample._key_id(sys._getframe()), sys._getframe().f_lineno


def test_a_repeated_stack_gets_the_key_the_full_walk_gives(monkeypatch):
    monkeypatch.setattr(hostsample, "_keys", {})
    monkeypatch.setattr(hostsample, "_new_keys", [])
    monkeypatch.setattr(hostsample, "_fast", {})
    ids, other, other_line = _keys_of_a_loop(3)
    assert ids[0] == ids[1] == ids[2] and other != ids[0]
    assert len(hostsample._fast) == 2 and len(hostsample._keys) == 2  # two look-ups kept, two keys
    key = next(k for k, v in hostsample._keys.items() if v == other)
    assert key[0] == "_keys_of_a_loop" and key[1] == __file__ and key[2] == other_line
    # without the look-up table the full walk finds the same keys: no new id
    monkeypatch.setattr(hostsample, "_fast", {})
    again, other_again, _ = _keys_of_a_loop(1)
    assert again == ids[:1] and other_again == other and len(hostsample._keys) == 2
