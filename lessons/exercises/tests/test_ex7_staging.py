"""Exercise 7: StagingRing.acquire must not hand out a host buffer the device has not copied yet
(readings §4: the write-after-read barrier, here a wait on the host; lesson 7). The device's
read is an event the test completes by hand, so the rule is checked without any timing race."""

import threading

import torch

from minisgl.mechanisms import Mechanisms
from minisgl.staging import StagingRing
from minisgl.streams import CpuEvent

CPU = torch.device("cpu")


def gate(done: bool = False) -> CpuEvent:
    """A `consumed` event the test completes by hand (the device's read of a buffer): the engine's
    own kind of event, so that nothing tells a test's event from a real one."""
    event = CpuEvent()
    if done:
        event._set()
    else:  # a wait that never ends (for the wrong event, say) is over after 10 s: the test fails, not hangs
        timer = threading.Timer(10, event._set)
        timer.daemon = True
        timer.start()
    return event


def ring_with_unread_buffer(*disabled: str) -> tuple[StagingRing, CpuEvent]:
    """Two buffers: the next acquire() returns buffer 0, whose copy to the device is not done."""
    ring = StagingRing(4, 2, CPU, Mechanisms(disabled))
    unread = gate()
    ring.acquire().consumed = unread  # batch n-1 staged here, the device has not copied it yet
    ring.acquire().consumed = gate(done=True)  # batch n, already copied
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
    unread._set()
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
    unread._set()
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
    unread._set()
    thread.join(10)
    assert not waited and ring.unread_overwrites == 1 and ring.waits == 0, (
        "keep the switch: with staging_war_wait off acquire() must not wait; it counts the rewrite of an unread "
        f"buffer in `unread_overwrites` (waited: {waited}, unread_overwrites {ring.unread_overwrites})")
