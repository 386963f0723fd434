"""Exercise 07-choose-victim: which running request gives its blocks back when the KV pool runs out.

Write the body of `pick_victim`; `python -m exercises run 07-choose-victim` plugs it into step 07's engine in
place of `PreemptionEngine.pick_victim` and runs step 07's tests and dry run on it.
"""

from __future__ import annotations

from step07_preemption.engine import PreemptibleRequest, PreemptionEngine


def pick_victim(self: PreemptionEngine,
                less_important_than: PreemptibleRequest | None = None) -> PreemptibleRequest | None:
    """The running request to preempt: the least important one, and among equals the most recently admitted.

    The candidates are `self.running` (a list of `PreemptibleRequest`). Each request has `priority`, an int
    where a SMALLER value is MORE important (0 is the default), and `admitted_at`, an int that grows with
    every admission (`mark_running` sets it): the largest is the newest admission. A request preempted and
    admitted again gets a new, larger `admitted_at`, so it can be the newest admission though it arrived first.
    - Without `less_important_than` (a decoding request needs a block and none is free): return the running
      request with the largest `priority` value; among those, the one with the largest `admitted_at`.
    - With `less_important_than` (a waiting request that wants blocks): the same choice, but only among
      running requests whose `priority` value is strictly larger than `less_important_than.priority`.
    Return None if there is no candidate. Do not change `self.running`, nor rely on its order.

    Example: a, b, c running with priorities 0, 2, 2, admitted in that order (admitted_at 0, 1, 2): the victim
    is c. For a waiting request of priority 2: None (b and c are not strictly less important); of priority 1:
    c. If b is then preempted and admitted again (admitted_at 3), b is the victim.

    Hints (step07_preemption/README.md, "Who is preempted." and the first question): filter the candidates,
    then `max` with a key that is a tuple compares the priority first and the admission second.
    """
    raise NotImplementedError("write PreemptionEngine.pick_victim: see the hints in its docstring")
