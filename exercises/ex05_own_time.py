"""Exercise 05-own-time: how long each range of a trace ran by itself, and how deep it sits.

Write the body of `nesting`; `python -m exercises run 05-own-time` plugs it into the profiler's trace reader in
place of `common.profiling.trace.nesting` and runs step 05's tests and dry run on it. The per-phase table
(`read_steps`) and the CPU breakdown both read their times through it.
"""

from __future__ import annotations

from common.profiling.trace import Event


def nesting(ranges: list[Event]) -> list[tuple[Event, float, int]]:
    """Each range with its own time and its depth: `[(range, own, depth), ...]`.

    `ranges` are named ranges of one thread (`Event`s with `.start`, `.dur` and `.end = start + dur`, in
    microseconds), in any order. Ranges of one thread nest: two of them either do not overlap, or one lies
    wholly inside the other. A range that ends exactly where the next starts does not hold it.

    Return one tuple per range, sorted by start, and, for ranges that start at the same instant, the longest
    first (it is the outer one). For each:
    - own: its duration less the durations of the ranges *directly* inside it (those one level deeper, not
      the ranges inside those: their time already came off their parent's);
    - depth: how many of the other ranges hold it; 0 for a range inside no other.

    Example (start-end, in microseconds): "sample" 0-100 holds "forward" 10-40, which holds "prepare inputs"
    12-17; "process outputs" 100-120 follows. The result, in this order:

        sample           own 100 - 30 = 70   depth 0
        forward          own  30 -  5 = 25   depth 1
        prepare inputs   own   5         5   depth 2
        process outputs  own  20        20   depth 0   (it starts where sample ends: not inside it)

    The own times add up to the outermost ranges' durations (70 + 25 + 5 + 20 = 120): no microsecond counts twice.

    Hints (step05_profiling/README.md, "How to read a trace"): after sorting, walk the ranges keeping a stack
    of the ranges still open at the current one's start (pop those that ended at or before it); the stack's
    top is its parent, whose own time loses this range's duration, and the stack's height is its depth.
    Key your running totals by `id(range)`: an `Event` is an unhashable dataclass, and two may be equal.
    """
    raise NotImplementedError("write common.profiling.trace.nesting: see the hints in its docstring")
