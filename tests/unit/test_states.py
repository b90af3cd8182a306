"""Supervision layer, the state vocabulary (orchestrator/states.py): one table of allowed
transitions per state kind, checked by `check_transition`."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import pytest

from orchestrator.states import (
    CLUSTER_TRANSITIONS,
    TASK_TRANSITIONS,
    ClusterState,
    IllegalTransition,
    TaskState,
    check_transition,
)

C, T = ClusterState, TaskState


def reachable(table: Any, start: Any) -> set[Any]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in table[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_cluster_state_has_an_entry() -> None:
    assert set(CLUSTER_TRANSITIONS) == set(ClusterState)


def test_every_task_state_has_an_entry() -> None:
    assert set(TASK_TRANSITIONS) == set(TaskState)


def test_tables_only_name_states_of_their_own_kind() -> None:
    assert all(s in set(ClusterState) for exits in CLUSTER_TRANSITIONS.values() for s in exits)
    assert all(s in set(TaskState) for exits in TASK_TRANSITIONS.values() for s in exits)
    assert all(type(s) is ClusterState for exits in CLUSTER_TRANSITIONS.values() for s in exits)
    assert all(type(s) is TaskState for exits in TASK_TRANSITIONS.values() for s in exits)


def test_terminal_sets() -> None:
    assert {s for s in ClusterState if s.is_terminal} == {C.SUCCEEDED, C.FAILED, C.INTERRUPTED}
    assert {s for s in TaskState if s.is_terminal} == {T.SUCCEEDED, T.FAILED, T.LOST, T.STOPPED}


@pytest.mark.parametrize("state", [s for s in ClusterState if s.is_terminal])
def test_terminal_cluster_states_have_no_exits(state: ClusterState) -> None:
    assert CLUSTER_TRANSITIONS[state] == frozenset()


@pytest.mark.parametrize("state", [s for s in ClusterState if not s.is_terminal])
def test_non_terminal_cluster_states_have_exits_and_no_self_loop(state: ClusterState) -> None:
    assert CLUSTER_TRANSITIONS[state]
    assert state not in CLUSTER_TRANSITIONS[state]


@pytest.mark.parametrize("state", [s for s in ClusterState if not s.is_terminal])
def test_every_non_terminal_cluster_state_can_reach_a_terminal_one(state: ClusterState) -> None:
    assert any(s.is_terminal for s in reachable(CLUSTER_TRANSITIONS, state))


@pytest.mark.parametrize("terminal", [s for s in ClusterState if s.is_terminal])
def test_every_terminal_cluster_state_is_reachable_from_pending(terminal: ClusterState) -> None:
    assert terminal in reachable(CLUSTER_TRANSITIONS, C.PENDING)


def test_every_cluster_state_is_reachable_from_pending() -> None:
    assert reachable(CLUSTER_TRANSITIONS, C.PENDING) == set(ClusterState)


def test_every_task_state_is_reachable_from_pending() -> None:
    assert reachable(TASK_TRANSITIONS, T.PENDING) == set(TaskState)


@pytest.mark.parametrize("state", [s for s in TaskState if not s.is_terminal])
def test_every_non_terminal_task_state_can_end(state: TaskState) -> None:
    assert any(s.is_terminal for s in TASK_TRANSITIONS[state])


@pytest.mark.parametrize("state", [s for s in TaskState if s.is_terminal])
def test_a_new_attempt_starts_every_ended_task_again(state: TaskState) -> None:
    assert T.STARTING in TASK_TRANSITIONS[state]


def test_a_stopping_run_ends_or_restarts_only_through_stopping() -> None:
    into_restarting = {s for s, exits in CLUSTER_TRANSITIONS.items() if C.RESTARTING in exits}
    assert into_restarting == {C.STOPPING}
    into_terminal = {s for s, exits in CLUSTER_TRANSITIONS.items() if any(x.is_terminal for x in exits)}
    assert into_terminal == {C.STOPPING}


@pytest.mark.parametrize(
    ("table", "old", "new"),
    [
        (CLUSTER_TRANSITIONS, C.PENDING, C.LAUNCHING),
        (CLUSTER_TRANSITIONS, C.RUNNING, C.STOPPING),
        (CLUSTER_TRANSITIONS, C.STOPPING, C.RESTARTING),
        (CLUSTER_TRANSITIONS, C.RESTARTING, C.LAUNCHING),
        (TASK_TRANSITIONS, T.STARTING, T.RUNNING),
        (TASK_TRANSITIONS, T.LOST, T.STOPPED),
    ],
)
def test_allowed_transitions_pass_and_are_logged(
    table: Any, old: Any, new: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="orchestrator.supervise"):
        check_transition(table, old, new, "run demo")
    assert f"run demo: {old.value} → {new.value}" in caplog.text


@pytest.mark.parametrize(
    ("table", "old", "new"),
    [
        (CLUSTER_TRANSITIONS, C.RUNNING, C.RESTARTING),  # a restart always stops every task first
        (CLUSTER_TRANSITIONS, C.RUNNING, C.SUCCEEDED),
        (CLUSTER_TRANSITIONS, C.SUCCEEDED, C.RUNNING),
        (CLUSTER_TRANSITIONS, C.FAILED, C.STOPPING),
        (CLUSTER_TRANSITIONS, C.PENDING, C.RUNNING),
        (CLUSTER_TRANSITIONS, C.LAUNCHING, C.LAUNCHING),
        (TASK_TRANSITIONS, T.PENDING, T.RUNNING),
        (TASK_TRANSITIONS, T.RUNNING, T.STARTING),
        (TASK_TRANSITIONS, T.SUCCEEDED, T.FAILED),
        (TASK_TRANSITIONS, T.STOPPED, T.LOST),
    ],
)
def test_forbidden_transitions_raise_and_name_the_move(table: Any, old: Any, new: Any) -> None:
    with pytest.raises(IllegalTransition) as exc:
        check_transition(table, old, new, "worker-1")
    assert str(exc.value) == f"worker-1: {old.value} → {new.value} is not an allowed transition"


def test_every_forbidden_cluster_move_raises() -> None:
    for old in ClusterState:
        for new in ClusterState:
            if new in CLUSTER_TRANSITIONS[old]:
                check_transition(CLUSTER_TRANSITIONS, old, new, "run")
            else:
                with pytest.raises(IllegalTransition):
                    check_transition(CLUSTER_TRANSITIONS, old, new, "run")


def test_states_are_their_status_json_strings() -> None:
    assert [s.value for s in ClusterState] == [
        "PENDING",
        "LAUNCHING",
        "RUNNING",
        "RESTARTING",
        "STOPPING",
        "SUCCEEDED",
        "FAILED",
        "INTERRUPTED",
    ]
    assert [s.value for s in TaskState] == [
        "PENDING",
        "STARTING",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "LOST",
        "STOPPED",
    ]
    assert ClusterState("RUNNING") is C.RUNNING
