"""Exercise 07-choose-victim: which running request gives its blocks back when the KV pool runs out.

Write the body of `pick_victim`; `python -m exercises run 07-choose-victim` plugs it into step 07's engine in
place of `PreemptionEngine.pick_victim` and runs step 07's tests and dry run on it.
"""

from __future__ import annotations

from step07_preemption.engine import PreemptibleRequest, PreemptionEngine


def pick_victim(self: PreemptionEngine,
                less_important_than: PreemptibleRequest | None = None) -> PreemptibleRequest | None:
    """The running request to preempt: the least important one, and among equals the most recently admitted.

    Inputs: the candidates are `self.running` (`PreemptibleRequest`s). Each has `priority`, an int where a
    SMALLER value is MORE important (0 is the default), and `admitted_at`, an int that grows with every admission
    (the largest is the newest; a request preempted and admitted again gets a new, larger one). With
    `less_important_than` (a waiting request that wants blocks), only running requests whose `priority` value is
    strictly larger than its priority are candidates; without it (a decoding request needs a block), all are.
    Returns: the candidate with the largest `priority` value, among those the one with the largest `admitted_at`;
    None if there is no candidate. It changes nothing (neither `self.running` nor its order, which means nothing).
    Why the newest: it has the least work to lose.

    Example: a, b, c running with priorities 0, 2, 2, admitted in that order (admitted_at 0, 1, 2): the victim is
    c. For a waiting request of priority 2: None (b and c are not strictly less important); of priority 1: c. If
    b is then preempted and admitted again (admitted_at 3), b is the victim.

    Hints (step07_preemption/README.md, "Who is preempted." and the first question).
    """
    raise NotImplementedError("write PreemptionEngine.pick_victim: see the hints in its docstring")
