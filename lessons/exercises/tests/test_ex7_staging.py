"""Exercise 7: StagingRing.acquire must not hand out a host buffer the device has not copied yet
(readings §4: the write-after-read barrier, here a wait on the host; lesson 7). The device's
read is an event the test completes by hand, so the rule is checked without any timing race."""

import threading

import torch

from minisgl.mechanisms import Mechanisms
from minisgl.staging import StagingRing

CPU = torch.device("cpu")


class Gate:
    """A `consumed` event that completes when the test says so (the device's read of a buffer)."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait(10)

    def complete(self) -> None:
        self._done.set()


def ring_with_unread_buffer(*disabled: str) -> tuple[StagingRing, Gate]:
    """Two buffers: the next acquire() returns buffer 0, whose copy to the device is not done."""
    ring = StagingRing(4, 2, CPU, Mechanisms(disabled))
    unread = Gate()
    ring.acquire().consumed = unread  # batch n-1 staged here, the device has not copied it yet
    ring.acquire().consumed = Gate(done=True)  # batch n, already copied
    return ring, unread


def acquire_in_thread(ring: StagingRing) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(ring.acquire()), daemon=True)
    thread.start()
    return thread, got


def test_acquire_waits_until_the_device_has_copied_the_buffer():
    ring, unread = ring_with_unread_buffer()
    thread, got = acquire_in_thread(ring)
    thread.join(2)  # a wrong acquire() returns at once; a right one blocks until the device's read
    returned_early = not thread.is_alive()
    unread.complete()
    thread.join(10)
    assert not returned_early, (
        "write-after-read: acquire() handed out a buffer whose previous contents the device had not copied yet "
        "(its `consumed` event had not passed); the host must wait for THAT buffer's consumed event before it "
        "rewrites the buffer, or the batch in flight runs on the next batch's metadata")
    assert got and got[0] is ring.buffers[0] and ring.waits == 1, (
        f"after the wait acquire() must return the buffer and count the wait in `waits` (waits = {ring.waits})")
    assert ring.unread_overwrites == 0, (
        "count a wait in `waits` only: with staging_war_wait on no unread buffer is ever overwritten, so "
        f"`unread_overwrites` stays 0 (lesson 7 prints both counters; got {ring.unread_overwrites})")


def test_no_wait_when_the_device_has_already_copied_it():
    ring, unread = ring_with_unread_buffer()
    unread.complete()
    thread, got = acquire_in_thread(ring)
    thread.join(5)
    assert got and ring.waits == 0 and ring.unread_overwrites == 0, (
        "wait only while the buffer's consumed event has not passed (query()); with two buffers that is almost "
        f"never, so the wait costs nothing in steady state (waits = {ring.waits})")


def test_switched_off_the_hazard_is_counted_not_waited_for():
    ring, unread = ring_with_unread_buffer("staging_war_wait")
    thread, got = acquire_in_thread(ring)
    thread.join(2)
    waited = thread.is_alive()
    unread.complete()
    thread.join(10)
    assert not waited and ring.unread_overwrites == 1 and ring.waits == 0, (
        "keep the switch: with staging_war_wait off acquire() must not wait; it counts the rewrite of an unread "
        f"buffer in `unread_overwrites` (waited: {waited}, unread_overwrites {ring.unread_overwrites})")
