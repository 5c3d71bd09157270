"""The turn helpers without a loop: a spin gate counts chances, so its retries always come."""

import asyncio

from omni_async.transport.turns import Handoffs, SpinGate, TurnBudget


def test_spin_gate_retries_every_retry_th_chance_after_misses_and_reopens_on_a_hit():
    gate = SpinGate()
    for _ in range(SpinGate.MISSES):
        assert gate.may()
        assert gate.spin(lambda: False, 0.0) is False
    tries = [gate.may() for _ in range(3 * SpinGate.RETRY)]
    # Whatever rhythm the caller's turns have, every RETRY-th chance tries (a retry keyed to a
    # turn counter could be missed for ever by a steady two-turn rhythm).
    assert [i for i, taken in enumerate(tries) if taken] == [
        SpinGate.RETRY - 1, 2 * SpinGate.RETRY - 1, 3 * SpinGate.RETRY - 1
    ]
    assert gate.spin(lambda: True, 0.001) is True
    assert all(gate.may() for _ in range(SpinGate.RETRY))


def test_spin_gate_counts_outcomes_recorded_for_spins_made_elsewhere():
    """A spin spread over several loop turns (a hot lane) reports its outcome once."""
    gate = SpinGate()
    for _ in range(SpinGate.MISSES):
        assert gate.may()
        gate.record(False)
    assert not gate.may()
    gate.record(True)
    assert all(gate.may() for _ in range(SpinGate.RETRY))


async def test_a_turn_budget_lets_limit_awaits_skip_the_loop_then_asks_for_a_turn():
    """``limit`` skips in a row, then none until the loop had a turn (which clears the count)."""
    budget = TurnBudget(asyncio.get_running_loop(), limit=3)
    assert [budget.may_skip() for _ in range(5)] == [True, True, True, False, False]
    await asyncio.sleep(0)
    assert [budget.may_skip() for _ in range(4)] == [True, True, True, False]


def test_handoffs_refuse_the_next_quiet_spins_after_each_hand_off_and_none_before():
    handoffs = Handoffs()
    assert handoffs.may_spin()  # nothing handed on yet
    handoffs.handed()
    assert [handoffs.may_spin() for _ in range(Handoffs.QUIET + 2)] == [False] * Handoffs.QUIET + [True, True]
    handoffs.handed()
    assert not handoffs.may_spin()
    handoffs.handed()  # a new hand-off starts the count again
    assert [handoffs.may_spin() for _ in range(Handoffs.QUIET)] == [False] * Handoffs.QUIET
    assert handoffs.may_spin()
