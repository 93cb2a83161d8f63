"""Pipeline schedules as pure functions: which micro-batch each stage runs forward or backward, in order.

`gpipe(stages, microbatches)` and `one_f_one_b(stages, microbatches)` return one list per stage
of actions `("F", i)` / `("B", i)` (forward / backward of micro-batch i); the parameter update
follows the last action. `check_schedule` raises `PipelineScheduleError` unless a schedule is
complete (each micro-batch's F and B once per stage, F before B) and can run: every action's
inputs come from actions that can run before it (F(i) on stage s after F(i) on s-1, B(i) on s
after B(i) on s+1), found by simulating the stages as sequential processes.

* GPipe: every stage runs all forwards, then all backwards (in micro-batch order); up to m
  micro-batches are in flight (their activations kept) on each stage.
* 1F1B (PipeDream-flush): stage s runs `stages - s - 1` warm-up forwards (at most m), then
  alternates one forward and one backward, then drains the backwards; at most `stages - s`
  micro-batches are in flight on stage s, whatever m.
"""

from __future__ import annotations

Action = tuple[str, int]  # ("F" | "B", micro-batch)
Schedule = list[list[Action]]  # one list per stage


class PipelineScheduleError(ValueError):
    """A schedule is incomplete or cannot run; the message says which stage and action."""


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise PipelineScheduleError(f"a pipeline needs stages >= 1 and micro-batches >= 1 (got {stages}, {microbatches})")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """Return the GPipe schedule: all forwards, then all backwards, on every stage."""
    _check_sizes(stages, microbatches)
    one = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    return [list(one) for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Return the 1F1B schedule (warm-up forwards, one forward one backward, drain)."""
    _check_sizes(stages, microbatches)
    out = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        acts: list[Action] = [("F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < microbatches:
            acts.append(("F", f))
            f += 1
            acts.append(("B", b))
            b += 1
        acts.extend(("B", i) for i in range(b, microbatches))
        out.append(acts)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def in_flight(actions: list[Action]) -> int:
    """Return the most micro-batches whose forward ran and backward did not, over `actions`."""
    live = most = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


def check_schedule(schedule: Schedule, microbatches: int) -> list[tuple[int, Action]]:
    """Raise PipelineScheduleError unless `schedule` is complete and runs; return one global order.

    The order returned interleaves the stages' actions so that each action comes after the
    ones it needs (it is what a run of the stages as independent processes could do).
    """
    stages = len(schedule)
    for s, acts in enumerate(schedule):
        want = sorted([("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)])
        if sorted(acts) != want:
            raise PipelineScheduleError(f"stage {s}: needs each of {microbatches} micro-batches' F and B once, has {acts}")
        for i in range(microbatches):
            if acts.index(("B", i)) < acts.index(("F", i)):
                raise PipelineScheduleError(f"stage {s}: micro-batch {i}'s backward comes before its forward")
    done: set[tuple[int, Action]] = set()
    pos = [0] * stages
    order: list[tuple[int, Action]] = []
    while len(order) < sum(len(a) for a in schedule):
        progressed = False
        for s in range(stages):
            if pos[s] == len(schedule[s]):
                continue
            kind, i = schedule[s][pos[s]]
            need = [(s - 1, ("F", i))] if kind == "F" and s > 0 else []
            if kind == "B":
                need = [(s, ("F", i))] + ([(s + 1, ("B", i))] if s + 1 < stages else [])
            if all(n in done for n in need):
                done.add((s, (kind, i)))
                order.append((s, (kind, i)))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][pos[s]] for s in range(stages) if pos[s] < len(schedule[s])}
            raise PipelineScheduleError(f"the schedule cannot go on: each stage waits for another ({stuck})")
    return order
