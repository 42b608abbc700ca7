"""The host's time per step under overlap (runtime/host_clock.py): the wall time between two
launches less the device waits in between, reported for the step applied there, and never
for an interval that held anything else."""

from __future__ import annotations

from specserve.runtime.host_clock import HostClock


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_interval_reports_the_applied_step_less_the_wait():
    now = FakeTime()
    clock = HostClock(now)
    assert clock.launch() is None  # nothing before the first launch
    now.t = 1.0  # step 1 launched at 0; step 0 awaited 3 s of it, then applied
    clock.waited(3.0, tier=2, batch_size=16, tokens=40)
    now.t = 5.0
    assert clock.launch() == (2, 16, 2.0, 40)  # 5 s between launches, 3 of them waiting
    now.t = 9.0
    assert clock.launch() is None  # no step applied in between: nothing to say


def test_an_interrupted_interval_is_not_reported():
    now = FakeTime()
    clock = HostClock(now)
    clock.launch()
    clock.waited(0.5, tier=1, batch_size=4, tokens=8)
    clock.interrupt()  # a prefill ran, or a graph was captured, or the loop idled
    now.t = 10.0
    assert clock.launch() is None
    now.t = 11.0
    clock.waited(0.25, tier=0, batch_size=4, tokens=4)
    now.t = 12.0
    assert clock.launch() == (0, 4, 1.75, 4)  # clean again from the launch after the interrupt


def test_completing_finished_requests_is_set_aside():
    """Reaping finished requests and delivering their final output costs each request once,
    whatever tier decoded it: it is not part of a step's host time."""
    now = FakeTime()
    clock = HostClock(now)
    clock.launch()
    clock.waited(1.0, tier=3, batch_size=10, tokens=25)
    clock.set_aside(0.5)  # two requests finished: their state reaped, their outputs delivered
    clock.set_aside(0.25)
    now.t = 4.0
    assert clock.launch() == (3, 10, 2.25, 25)  # 4 s between launches: 1 waiting, 0.75 aside
    clock.waited(0.5, tier=3, batch_size=10, tokens=25)
    now.t = 6.0
    assert clock.launch() == (3, 10, 1.5, 25)  # (what was set aside counted once only)
