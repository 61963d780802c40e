"""The threads that run `def` handlers (pgjobd.handler_threads): reused, never more than
the work running at once, a stuck one never in the way, idle ones gone."""

from __future__ import annotations

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pgjobd.handler_threads import HandlerThreads


def wait_until(check, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_one_thread_serves_work_after_work_and_carries_each_ones_name() -> None:
    threads = HandlerThreads()
    seen: list[tuple[int, str]] = []
    for n in range(20):
        done = threading.Event()

        def work(done: threading.Event = done) -> None:
            me = threading.current_thread()
            seen.append((me.ident or 0, me.name))
            done.set()

        threads.run(work, f"pgjobd-job-{n}")
        assert done.wait(5)
        wait_until(lambda: threads.threads_idle() == 1)
    assert {ident for ident, _ in seen} == {seen[0][0]}
    assert [name for _, name in seen] == [f"pgjobd-job-{n}" for n in range(20)]


def test_a_stuck_thread_is_never_given_more_work() -> None:
    threads = HandlerThreads()
    stuck, release = threading.Event(), threading.Event()
    threads.run(lambda: (stuck.set(), release.wait(10)), "stuck")
    assert stuck.wait(5)
    done = threading.Event()
    threads.run(done.set, "next")
    assert done.wait(5)  # a new thread, while the first still holds its work
    release.set()
    wait_until(lambda: threads.threads_idle() == 2)


@settings(max_examples=25, deadline=None)
@given(
    batches=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6),
    idle_ms=st.sampled_from([0, 1, 5, 50]),
)
def test_every_piece_of_work_runs_once_and_threads_never_outnumber_the_work(
    batches: list[int], idle_ms: int
) -> None:
    """Bursts of work from several submitting threads, with idle threads timing out
    around the moment new work is handed over (idle_ms): nothing is lost or run twice,
    and the threads alive never outnumber the largest burst."""
    threads = HandlerThreads(idle_s=idle_ms / 1000)
    ran: list[int] = []
    lock = threading.Lock()
    alive_before = threading.active_count()
    most_alive = 0

    def work(n: int) -> None:
        time.sleep(0.0005)
        with lock:
            ran.append(n)

    expected: list[int] = []
    for batch in batches:
        start = len(expected)
        expected += range(start, start + batch)
        submitters = [
            threading.Thread(target=threads.run, args=(lambda n=n: work(n), f"w{n}"))
            for n in range(start, start + batch)
        ]
        for s in submitters:
            s.start()
        for s in submitters:
            s.join()
        most_alive = max(most_alive, threading.active_count() - alive_before)
        submitted = len(expected)
        wait_until(lambda submitted=submitted: len(ran) == submitted)
        time.sleep(idle_ms / 2000)
    assert sorted(ran) == expected
    assert most_alive <= max(batches)
    if idle_ms < 50:
        wait_until(lambda: threads.threads_idle() == 0)
        wait_until(lambda: threading.active_count() <= alive_before)
