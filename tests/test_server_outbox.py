"""The engine's thread hands outputs to the event loop in bursts: everything posted arrives,
in order, and a burst posted while a wake-up is pending does not wake the loop again."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specserve.server.outbox import LoopOutbox


def test_outputs_from_other_threads_all_arrive_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        box = LoopOutbox(loop)
        queues = [asyncio.Queue() for _ in range(4)]
        bursts, per_burst = 50, 64
        posted = threading.Event()

        def engine_thread():
            for b in range(bursts):
                for i in range(per_burst):  # one step's reports, request by request
                    box.post(queues[i % 4], (b, i))
                posted.wait(0.001)

        t = threading.Thread(target=engine_thread)
        t.start()
        got = [[] for _ in queues]
        for q, out in zip(queues, got):
            for _ in range(bursts * per_burst // 4):
                out.append(await asyncio.wait_for(q.get(), timeout=30))
        t.join()
        for k, out in enumerate(got):
            expected = [(b, i) for b in range(bursts) for i in range(per_burst) if i % 4 == k]
            assert out == expected
        # (how many wake-ups the bursts took depends on where the threads were preempted:
        # the next test counts them where the event loop cannot run meanwhile)
        assert 1 <= box.wakeups <= bursts * per_burst

    asyncio.run(main())


def test_a_burst_posted_while_a_wake_up_is_pending_takes_no_other():
    async def main():
        loop = asyncio.get_running_loop()
        box = LoopOutbox(loop)
        queue: asyncio.Queue = asyncio.Queue()
        bursts, per_burst = 5, 64
        for b in range(bursts):

            def post_burst(b=b):
                for i in range(per_burst):
                    box.post(queue, (b, i))

            poster = threading.Thread(target=post_burst)
            poster.start()
            poster.join()  # (the event loop waits here: nothing is delivered meanwhile)
            got = [await asyncio.wait_for(queue.get(), timeout=30) for _ in range(per_burst)]
            assert got == [(b, i) for i in range(per_burst)]
        assert box.wakeups == bursts  # one per burst, not one per report

    asyncio.run(main())


def test_posting_to_a_closed_loop_raises_and_leaves_the_outbox_usable():
    dead = asyncio.new_event_loop()
    dead.close()
    box = LoopOutbox(dead)
    q: asyncio.Queue = asyncio.Queue()
    with pytest.raises(RuntimeError):
        box.post(q, 1)
    with pytest.raises(RuntimeError):  # not silently swallowed as "a wake-up is pending"
        box.post(q, 2)
