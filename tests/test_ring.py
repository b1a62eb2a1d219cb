"""The shared-memory ring of ``http.workers`` (aserve.codecs.ring): pure, one process."""

from __future__ import annotations

import random

import pytest

from aserve.codecs.ring import Ring, ring_bytes


def _pair(capacity: int) -> tuple[Ring, Ring]:
    buf = memoryview(bytearray(ring_bytes(capacity)))
    return Ring(buf), Ring(buf)  # the producer's and the consumer's views of one memory


def test_messages_come_out_in_order_across_many_wraps() -> None:
    producer, consumer = _pair(1024)
    rng = random.Random(7)
    sent: list[bytes] = []
    got: list[bytes] = []
    for i in range(5000):
        msg = bytes([i % 251]) * rng.randrange(0, producer.max_message + 1)
        parts = [msg[:3], msg[3:]]
        while not producer.try_write(parts):  # full: the consumer frees room
            view = consumer.read()
            if view is None:  # all of it read: only a release gives room
                consumer.release()
                continue
            got.append(bytes(view))
            if rng.random() < 0.5:
                consumer.release()
        sent.append(msg)
    while (view := consumer.read()) is not None:
        got.append(bytes(view))
    consumer.release()
    assert got == sent


def test_a_full_ring_refuses_until_released() -> None:
    producer, consumer = _pair(256)
    n = 0
    while producer.try_write([b"x" * 50]):
        n += 1
    assert n >= 2
    assert consumer.read() == b"x" * 50
    assert not producer.try_write([b"y" * 50]), "room given back before release"
    consumer.release()
    assert producer.try_write([b"y" * 50])


def test_a_message_over_the_limit_is_refused() -> None:
    producer, _ = _pair(256)
    with pytest.raises(ValueError, match="over the ring"):
        producer.try_write([b"z" * (producer.max_message + 1)])
    assert producer.try_write([b"z" * producer.max_message])


def test_the_waiting_flag_is_shared() -> None:
    producer, consumer = _pair(64)
    producer.producer_waiting = True
    assert consumer.producer_waiting
    consumer.producer_waiting = False
    assert not producer.producer_waiting
