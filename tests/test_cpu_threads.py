"""The thread governor: all threads while they are faster, one while a competing load makes
one faster, a fixed count never changed, long steps left alone."""

from __future__ import annotations

from parity.backends.cpu.threads import RECHECK, ThreadGovernor


def drive(gov: ThreadGovernor, cost, runs: int, key: int = 1) -> list[int]:
    used = []
    for _ in range(runs):
        n = gov.threads(key)
        used.append(n)
        gov.record(key, n, cost(n))
    return used


def test_all_threads_while_they_are_faster():
    used = drive(ThreadGovernor(4, fixed=False), lambda n: 0.010 / n, 200)
    assert used[:3] == [4, 4, 1]  # warm-up, measure all, measure one
    assert used[3:].count(1) <= 200 // RECHECK + 1  # rechecks only


def test_one_thread_under_a_competing_load_and_back():
    loaded = {"on": True}

    def cost(n):  # busy cores: every parallel region waits for a descheduled thread
        return 0.040 if loaded["on"] and n > 1 else 0.010 / (1 if loaded["on"] else n)

    gov = ThreadGovernor(2, fixed=False)
    used = drive(gov, cost, 100)
    assert used[3:].count(2) <= 100 // RECHECK + 1
    loaded["on"] = False  # the competitor is gone: the next recheck finds all threads faster
    used = drive(gov, cost, 2 * RECHECK)
    assert used[-RECHECK // 2 :].count(2) >= RECHECK // 2 - 1


def test_a_sudden_slowdown_is_checked_at_once():
    loaded = {"on": False}
    gov = ThreadGovernor(2, fixed=False)
    drive(gov, lambda n: 0.010 / n, 10)
    loaded["on"] = True
    used = drive(gov, lambda n: 0.040 if n > 1 else 0.010, 4)
    assert used[1] == 1 and used[2:] == [1, 1]  # one slow run, one check, then one thread


def test_a_fixed_count_and_long_steps_are_left_alone():
    assert set(drive(ThreadGovernor(4, fixed=True), lambda n: 0.01, 50)) == {4}
    assert set(drive(ThreadGovernor(4, fixed=False), lambda n: 0.2, 50)) == {4}
    assert set(drive(ThreadGovernor(1, fixed=False), lambda n: 0.01, 50)) == {1}
