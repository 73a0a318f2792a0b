"""Redis Cluster placement of a queue's keys (no server needed: slots are computed)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from broker.base import BrokerError
from broker.redis import has_hash_tag
from broker.redis.keys import QueueKeys, hash_tag
from broker.redis.placement import PlacementError, check_placement, queue_key_samples, slots


def test_hash_tagged_namespace_puts_every_key_in_one_slot():
    keys = QueueKeys("{utopia-queue}", "stats-usage")
    check_placement(keys)
    assert list(slots(keys)) == [key_slot(b"utopia-queue")]


def test_samples_cover_every_kind_of_key():
    keys = QueueKeys("{ns}", "q")
    samples = queue_key_samples(keys)
    for key in (keys.ready, keys.processing, keys.failed, keys.dead, keys.poison,
                keys.reservations, keys.reap_lock, keys.reap_cursor, keys.stat("total"),
                keys.stat("processing"), keys.stat("success"), keys.stat("failed")):
        assert key in samples
    for prefix in (keys.job(""), keys.owner(""), keys.claim(""), keys.pending(""),
                   keys.reservation(""), keys.supervisor("")):
        assert any(sample.startswith(prefix) and sample != prefix for sample in samples)


def test_default_namespace_is_refused_with_what_to_do():
    with pytest.raises(PlacementError) as raised:
        check_placement(QueueKeys("utopia-queue", "stats-usage"))
    message = str(raised.value)
    assert isinstance(raised.value, BrokerError)
    assert "'utopia-queue' has no hash tag" in message
    assert '"{utopia-queue}"' in message  # the hash-tagged form to use
    assert "drain" in message and "migrate" in message  # existing jobs are not moved for you
    assert "Running on a Redis Cluster" in message


@pytest.mark.parametrize(("namespace", "queue"), [
    ("{}x", "q"),  # an empty tag does not count: whole names are hashed
    ("a{b", "c}d"),  # the tag would enclose the kind of key
    ("a.}{b", "q"),
])
def test_misplaced_braces_are_refused(namespace: str, queue: str):
    with pytest.raises(PlacementError, match="would spread over"):
        check_placement(QueueKeys(namespace, queue))


def test_a_tag_in_the_queue_name_is_enough():
    check_placement(QueueKeys("app", "{jobs}"))


def test_pids_with_braces_cannot_move_keys():
    keys = QueueKeys("{ns}", "q")
    assert key_slot(keys.job("{other}").encode()) == key_slot(keys.ready.encode())


# Brace shapes where a looser rule ("has a brace") and Redis's would disagree.
BRACE_SHAPES = ["plain", "", "{}", "{}x", "{a}{b}", "}{", "}{a}", "a}{b}", "{a", "a}", "a{b",
                "x{tag}y", "{{a}}", "a{}b{c}", "{a}", "{ }"]


@pytest.mark.parametrize("name", BRACE_SHAPES)
def test_hash_tag_is_the_rule_redis_hashes_by(name: str):
    tag = hash_tag(name)
    assert key_slot((name if tag is None else tag).encode()) == key_slot(name.encode())
    assert tag is None or tag != ""


@pytest.mark.parametrize("namespace", BRACE_SHAPES)
def test_placement_and_hash_tag_cannot_disagree(namespace: str):
    """Placement refuses a namespace exactly when ``keys.hash_tag`` finds no tag in it, and
    then says so (not "put the tag first" for a namespace that has none)."""
    keys = QueueKeys(namespace, "q")
    assert has_hash_tag(namespace) == (hash_tag(namespace) is not None)
    if hash_tag(namespace) is not None:
        check_placement(keys)
        return
    with pytest.raises(PlacementError) as raised:
        check_placement(keys)
    message = str(raised.value)
    assert f"{namespace!r} has no hash tag" in message
    suggested = message.split('namespace = "', 1)[1].split('"', 1)[0]
    check_placement(QueueKeys(suggested, "q"))  # the namespace it suggests does work
