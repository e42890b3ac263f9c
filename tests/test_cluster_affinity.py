"""Which replica serves a request, without Ray: the conversation key and the chooser."""
from __future__ import annotations

import pytest

from colibri_aio.cluster.affinity import (CHAT_PATH, MESSAGES_PATH, NoReplica, NoRoom, ReplicaChooser,
                                          conversation_key)

SYSTEM = {"role": "system", "content": "You explain Python."}
ASK = {"role": "user", "content": "What is a list?"}


def test_every_turn_of_a_chat_has_the_key_of_its_opening() -> None:
    turn1 = {"messages": [SYSTEM, ASK]}
    turn2 = {"messages": [SYSTEM, ASK, {"role": "assistant", "content": "A sequence."},
                          {"role": "user", "content": "And a tuple?"}]}
    key = conversation_key(CHAT_PATH, turn1)
    assert key is not None and key == conversation_key(CHAT_PATH, turn2)
    assert conversation_key(CHAT_PATH, {"messages": [SYSTEM, {"role": "user", "content": "What is a dict?"}]}) != key
    assert conversation_key(CHAT_PATH, {"messages": [ASK]}) != key  # the system message is part of the opening


def test_the_session_header_wins_and_other_requests_have_no_key() -> None:
    assert conversation_key(CHAT_PATH, {"messages": [ASK]}, "abc") == "session:abc"
    assert conversation_key("/v1/completions", {"prompt": "x"}, "abc") == "session:abc"
    assert conversation_key("/v1/completions", {"prompt": "x"}) is None
    for broken in (None, [], {"messages": "hi"}, {"prompt": "x"}):
        assert conversation_key(CHAT_PATH, broken) is None


def test_a_next_turn_goes_to_the_replica_that_served_the_conversation_last() -> None:
    c = ReplicaChooser(per_replica=2)
    c.set_replicas(["a", "b"])
    first = c.assign("x")
    c.finished(first.replica)
    other = c.assign("y")
    assert other.replica != first.replica  # a new conversation takes the replica that holds nothing recent
    c.finished(other.replica)
    again = c.assign("x")
    assert (again.replica, again.reason) == (first.replica, "holder")


def test_the_holder_is_passed_over_when_it_is_busier_than_another() -> None:
    c = ReplicaChooser(per_replica=3)
    c.set_replicas(["a", "b"])
    assert c.assign("x").replica == "a"
    moved = c.assign("x")  # "a" holds x but is generating; "b" is idle
    assert (moved.replica, moved.reason) == ("b", "least_busy")
    c.finished("b")
    assert c.assign("x").replica == "b"  # b's cache now ends with x


def test_once_another_conversation_ran_there_the_replica_no_longer_holds_the_key() -> None:
    c = ReplicaChooser(per_replica=4)
    c.set_replicas(["a"])
    c.assign("x")
    c.finished("a")
    c.assign("y")
    c.finished("a")
    assert c.assign("x").reason == "least_busy"


def test_full_lines_refuse_with_retry_after_and_no_replica_is_its_own_error() -> None:
    c = ReplicaChooser(per_replica=2)
    with pytest.raises(NoReplica):
        c.assign(None)
    c.set_replicas(["a", "b"])
    placed = [c.assign(None).replica for _ in range(4)]
    assert sorted(placed) == ["a", "a", "b", "b"] and c.in_flight == c.capacity == 4
    with pytest.raises(NoRoom) as full:
        c.assign("x")
    assert full.value.retry_after >= 1 and full.value.in_flight == 4
    c.finished("b", seconds=7.0)
    assert c.assign("x").replica == "b"
    with pytest.raises(NoRoom) as again:
        c.assign(None)
    assert again.value.retry_after >= 2  # it learnt that a request takes seconds


def test_replicas_that_go_and_come_are_forgotten_and_start_empty() -> None:
    c = ReplicaChooser(per_replica=1)
    c.set_replicas(["a", "b"])
    c.assign("x")
    c.set_replicas(["b", "c"])  # "a" died while generating; "c" replaced it
    assert c.replicas == ["b", "c"] and c.in_flight == 0
    c.finished("a")  # its request ends later: nothing to count
    assert {c.assign(None).replica, c.assign(None).replica} == {"b", "c"}
    c.forget("b")
    c.finished("b")
    assert c.assign("x").reason == "least_busy"


def test_an_anthropic_conversation_keeps_its_key_and_its_system_prompt_counts() -> None:
    turn1 = {"system": "You explain Python.", "messages": [{"role": "user", "content": "What is a list?"}]}
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "A sequence."},
                                   {"role": "user", "content": "And a tuple?"}]}
    key = conversation_key(MESSAGES_PATH, turn1)
    assert key is not None and key == conversation_key(MESSAGES_PATH, turn2)
    assert conversation_key(MESSAGES_PATH, {**turn1, "system": "Be brief."}) != key
