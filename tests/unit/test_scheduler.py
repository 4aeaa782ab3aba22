"""The scheduler: requests start in arrival order in the lowest free rows, and a finished
sequence's row serves the next one at once."""

from __future__ import annotations

import torch

from specd.sampling import SamplingParams
from specd.scheduler import RowAllocator, RunningSequence, Scheduler


def test_rows_go_lowest_first_and_come_back():
    rows = RowAllocator(3)
    assert [rows.take(), rows.take()] == [0, 1]
    rows.free(0)
    assert [rows.take(), rows.take()] == [0, 2]
    assert rows.num_free == 0


def test_admission_in_arrival_order_into_free_rows_and_rows_freed_on_finish():
    scheduler: Scheduler[str] = Scheduler(2)
    for name in "abcd":
        scheduler.add(name)

    def start(request: str, row: int) -> RunningSequence | None:
        if request == "b":  # it does not run after all (cancelled while it waited): its row stays free
            return None
        return RunningSequence(seq_id=ord(request), row=row, params=SamplingParams(), generator=torch.Generator(),
                               context=[1, 2], num_prompt=2)

    scheduler.admit(start)
    assert [(chr(s.seq_id), s.row) for s in scheduler.running] == [("a", 0), ("c", 1)]
    assert list(scheduler.waiting) == ["d"]
    scheduler.admit(start)  # no free row: nothing moves
    assert list(scheduler.waiting) == ["d"]
    scheduler.running[0].done = True
    assert [chr(s.seq_id) for s in scheduler.finish_done()] == ["a"]
    scheduler.admit(start)
    assert [(chr(s.seq_id), s.row) for s in scheduler.running] == [("c", 1), ("d", 0)]  # a's row, at once
    assert not scheduler.waiting and scheduler.has_work
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    assert not scheduler.has_work and scheduler.rows.num_free == 2
