"""The session state machine and restart policy: pure, exhaustive."""

from __future__ import annotations

import itertools

import pytest

from supervisor.core.states import (
    LIVE,
    InvalidTransition,
    RestartPolicy,
    State,
    Trigger,
    transition,
)

pytestmark = pytest.mark.pure

S, T = State, Trigger


# The whole transition table, written out by hand from the design (the
# diagram in supervisor/core/states.py and docs/internals.md), not
# derived from TRANSITIONS: adding, removing or redirecting any move in the
# code must fail the test below until this table is changed to match.
EXPECTED: dict[tuple[State, Trigger], State] = {
    (S.STARTING, T.READY): S.IDLE,
    (S.STARTING, T.EXIT): S.CRASHED,
    (S.STARTING, T.GIVE_UP): S.FAILED,  # boot failure at create
    (S.STARTING, T.STOP): S.STOPPING,
    (S.STARTING, T.DELETE): S.DELETED,
    (S.IDLE, T.INPUT): S.RUNNING,
    (S.IDLE, T.EXIT): S.CRASHED,
    (S.IDLE, T.HIBERNATE): S.HIBERNATED,
    (S.IDLE, T.STOP): S.STOPPING,
    (S.IDLE, T.DELETE): S.DELETED,
    (S.RUNNING, T.TURN_END): S.IDLE,
    (S.RUNNING, T.INTERRUPT): S.INTERRUPTING,
    (S.RUNNING, T.EXIT): S.CRASHED,
    (S.RUNNING, T.STOP): S.STOPPING,
    (S.RUNNING, T.DELETE): S.DELETED,
    (S.INTERRUPTING, T.TURN_END): S.IDLE,
    (S.INTERRUPTING, T.EXIT): S.CRASHED,
    (S.INTERRUPTING, T.STOP): S.STOPPING,
    (S.INTERRUPTING, T.DELETE): S.DELETED,
    (S.STOPPING, T.STOPPED): S.STOPPED,
    (S.STOPPING, T.DELETE): S.DELETED,
    (S.STOPPED, T.RESTART): S.STARTING,
    (S.STOPPED, T.DELETE): S.DELETED,
    (S.CRASHED, T.BACKOFF): S.RESTARTING,
    (S.HIBERNATED, T.BACKOFF): S.RESTARTING,  # loaded with the turn the daemon died in
    (S.CRASHED, T.GIVE_UP): S.FAILED,
    (S.CRASHED, T.RESTART): S.STARTING,
    (S.CRASHED, T.STOP): S.STOPPING,
    (S.CRASHED, T.DELETE): S.DELETED,
    (S.RESTARTING, T.SPAWN): S.STARTING,
    (S.RESTARTING, T.HIBERNATE): S.HIBERNATED,  # no room to restart: wait for input
    (S.RESTARTING, T.RESTART): S.STARTING,
    (S.RESTARTING, T.STOP): S.STOPPING,
    (S.RESTARTING, T.DELETE): S.DELETED,
    (S.FAILED, T.RESTART): S.STARTING,
    (S.FAILED, T.STOP): S.STOPPING,
    (S.FAILED, T.DELETE): S.DELETED,
    (S.HIBERNATED, T.SPAWN): S.STARTING,
    (S.HIBERNATED, T.RESTART): S.STARTING,
    (S.HIBERNATED, T.STOP): S.STOPPING,
    (S.HIBERNATED, T.DELETE): S.DELETED,
    # Stored state that did not load: only a repair or a delete leaves it.
    (S.DAMAGED, T.REPAIR): S.HIBERNATED,
    (S.DAMAGED, T.DELETE): S.DELETED,
    # DELETED: nothing leaves it.
    # Another daemon took it over (supervisor.core.fencing): no worker here.
    (S.STOPPING, T.RELEASE): S.HIBERNATED,
    (S.STOPPED, T.RELEASE): S.HIBERNATED,
    (S.FAILED, T.RELEASE): S.HIBERNATED,
    (S.CRASHED, T.RELEASE): S.HIBERNATED,
    (S.RESTARTING, T.RELEASE): S.HIBERNATED,
    # A read while the daemon runs found its stored log damaged (supervisor.core.damage).
    **{(s, T.DAMAGE): S.DAMAGED for s in State if s not in (S.DELETED, S.DAMAGED)},
}

def _actual_table() -> dict[tuple[State, Trigger], State | None]:
    """What transition() does for every (state, trigger) pair; None = refused."""
    table: dict[tuple[State, Trigger], State | None] = {}
    for state, trigger in itertools.product(State, Trigger):
        try:
            table[(state, trigger)] = transition(state, trigger)
        except InvalidTransition:
            table[(state, trigger)] = None
    return table


def test_every_pair_moves_exactly_as_the_expected_table_says() -> None:
    actual = _actual_table()
    assert len(actual) == len(State) * len(Trigger) > 0  # not vacuous
    assert set(EXPECTED) <= set(actual)
    expected = {pair: EXPECTED.get(pair) for pair in actual}
    wrong = {pair: (expected[pair], got) for pair, got in actual.items() if got is not expected[pair]}
    assert not wrong, "(state, trigger): (expected, got):\n" + "\n".join(
        f"  {s.value} --{t.value}--> expected {e}, got {g}" for (s, t), (e, g) in wrong.items()
    )


@pytest.mark.parametrize(
    "path",
    [
        # a turn
        [(S.STARTING, T.READY, S.IDLE), (S.IDLE, T.INPUT, S.RUNNING), (S.RUNNING, T.TURN_END, S.IDLE)],
        # interrupt
        [(S.RUNNING, T.INTERRUPT, S.INTERRUPTING), (S.INTERRUPTING, T.TURN_END, S.IDLE)],
        # crash and restart
        [(S.RUNNING, T.EXIT, S.CRASHED), (S.CRASHED, T.BACKOFF, S.RESTARTING),
         (S.RESTARTING, T.SPAWN, S.STARTING)],
        # give up, then operator restart
        [(S.CRASHED, T.GIVE_UP, S.FAILED), (S.FAILED, T.RESTART, S.STARTING)],
        # hibernation and revival
        [(S.IDLE, T.HIBERNATE, S.HIBERNATED), (S.HIBERNATED, T.SPAWN, S.STARTING)],
        # stop
        [(S.IDLE, T.STOP, S.STOPPING), (S.STOPPING, T.STOPPED, S.STOPPED), (S.STOPPED, T.RESTART, S.STARTING)],
    ],
)
def test_documented_paths(path: list[tuple[State, Trigger, State]]) -> None:
    for old, trigger, new in path:
        assert transition(old, trigger) is new


def test_only_live_states_can_crash() -> None:
    for state in State:
        if state in LIVE:
            assert transition(state, T.EXIT) is S.CRASHED
        else:
            with pytest.raises(InvalidTransition):
                transition(state, T.EXIT)


def test_everything_but_deleted_can_be_deleted_and_nothing_leaves_deleted() -> None:
    for state in State:
        if state is S.DELETED:
            for trigger in Trigger:
                with pytest.raises(InvalidTransition):
                    transition(state, trigger)
        else:
            assert transition(state, T.DELETE) is S.DELETED


def test_cannot_take_input_unless_idle() -> None:
    for state in State:
        if state is not S.IDLE:
            with pytest.raises(InvalidTransition):
                transition(state, T.INPUT)


def test_restart_policy_backoff_doubles_and_caps() -> None:
    p = RestartPolicy(max_attempts=5, window_secs=60, initial_ms=100, max_ms=350)
    delays = [p.on_failure(float(i)).delay_secs for i in range(5)]
    assert delays == [0.1, 0.2, 0.35, 0.35, 0.35]


def test_restart_policy_gives_up_past_intensity_within_window() -> None:
    p = RestartPolicy(max_attempts=2, window_secs=10, initial_ms=1, max_ms=1000)
    assert p.on_failure(0.0).restart
    assert p.on_failure(1.0).restart
    third = p.on_failure(2.0)
    assert not third.restart and third.attempts_in_window == 3


def test_restart_policy_forgets_failures_outside_the_window() -> None:
    p = RestartPolicy(max_attempts=2, window_secs=10, initial_ms=1, max_ms=1000)
    p.on_failure(0.0)
    p.on_failure(1.0)
    d = p.on_failure(20.0)  # the first two fell out of the window
    assert d.restart and d.attempts_in_window == 1
    p.reset()
    assert p.on_failure(21.0).attempts_in_window == 1


def test_a_restart_the_store_caused_is_not_counted_in_the_window() -> None:
    """A worker restarted because the store could not save its turn (a full
    disk, supervisor.core.resync) is not failing: any number of those leave
    the intensity as it was (issue 32: 5 full-disk turns failed the session)."""
    p = RestartPolicy(max_attempts=2, window_secs=60, initial_ms=100, max_ms=1000)
    p.on_failure(0.0)
    for _ in range(10):
        d = p.not_charged()
        assert d.restart and d.delay_secs == 0.1 and d.attempts_in_window == 1
    assert p.on_failure(1.0).restart and not p.on_failure(2.0).restart


def test_zero_attempts_means_never_restart() -> None:
    assert not RestartPolicy(0, 60, 100, 1000).on_failure(0.0).restart


def test_damaged_leaves_only_by_repair_or_delete() -> None:
    for trigger in Trigger:
        expected = {Trigger.REPAIR: State.HIBERNATED, Trigger.DELETE: State.DELETED}.get(trigger)
        if expected is None:
            with pytest.raises(InvalidTransition):
                transition(State.DAMAGED, trigger)
        else:
            assert transition(State.DAMAGED, trigger) is expected
    # Nothing else becomes damaged by a transition: only a failed load or a
    # read that finds damage (supervisor.core.damage) makes it.
    assert {trigger for (_, trigger), new in _actual_table().items() if new is State.DAMAGED} == {Trigger.DAMAGE}
