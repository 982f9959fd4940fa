"""The session state machine and restart policy: pure, exhaustive."""

from __future__ import annotations

import itertools

import pytest

from supervisor.states import (
    LIVE,
    TRANSITIONS,
    InvalidTransition,
    RestartPolicy,
    State,
    Trigger,
    transition,
)

pytestmark = pytest.mark.pure

S, T = State, Trigger


def test_every_pair_is_either_in_the_table_or_refused() -> None:
    for state, trigger in itertools.product(State, Trigger):
        if (state, trigger) in TRANSITIONS:
            assert transition(state, trigger) is TRANSITIONS[(state, trigger)]
        else:
            with pytest.raises(InvalidTransition):
                transition(state, trigger)


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


def test_zero_attempts_means_never_restart() -> None:
    assert not RestartPolicy(0, 60, 100, 1000).on_failure(0.0).restart
