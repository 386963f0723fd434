"""Exercise 05-own-time: how long each range of a trace ran by itself, and how deep it sits.

Write the body of `nesting`; `python -m exercises run 05-own-time` plugs it into the profiler's trace reader in
place of `common.profiling.trace.nesting` and runs step 05's tests and dry run on it. The per-phase table
(`read_steps`) and the CPU breakdown both read their times through it.
"""

from __future__ import annotations

from common.profiling.trace import Event


def nesting(ranges: list[Event]) -> list[tuple[Event, float, int]]:
    """Each range with its own time and its depth: `[(range, own, depth), ...]`.

    Inputs: `ranges`, named ranges of one thread (`Event`s with `.start`, `.dur` and `.end = start + dur`, in
    microseconds), in any order. Ranges of one thread nest: two either do not overlap, or one lies wholly inside
    the other; a range that ends exactly where the next starts does not hold it.
    Returns: one tuple per range, sorted by start, and among ranges that start at the same instant the longest
    first (it is the outer one).
    Rule: own = the range's duration less the durations of the ranges *directly* inside it (one level deeper:
    the time of ranges deeper still already came off their own parent's); depth = how many other ranges hold it
    (0: inside none). The own times then add up to the outermost ranges' durations: no microsecond counts twice.

    Example (start-end, in microseconds): "sample" 0-100 holds "forward" 10-40, which holds "prepare inputs"
    12-17; "process outputs" 100-120 follows. The result, in this order:

        sample           own 100 - 30 = 70   depth 0
        forward          own  30 -  5 = 25   depth 1
        prepare inputs   own   5         5   depth 2
        process outputs  own  20        20   depth 0   (it starts where sample ends: not inside it)

    Hints (step05_profiling/README.md, "How to read a trace"): in start order, the ranges still open when one
    starts are the ranges that hold it, the last opened its parent. An `Event` is an unhashable dataclass and two
    may be equal: keep per-range totals by `id(range)`.
    """
    raise NotImplementedError("write common.profiling.trace.nesting: see the hints in its docstring")
