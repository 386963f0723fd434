"""Exercise 07-preempt: what a preempted request gives back, and what it keeps (swap, recompute, or neither).

Write the body of `preempt`; `python -m exercises run 07-preempt` plugs it into step 07's engine in place of
`PreemptionEngine.preempt` and runs step 07's tests and dry run on it.
"""

from __future__ import annotations

from common.request import RequestStatus  # noqa: F401  (for your code: WAITING, SWAPPED)
from step07_preemption.engine import PreemptibleRequest, PreemptionEngine


def preempt(self: PreemptionEngine, victim: PreemptibleRequest) -> None:
    """Take `victim`, a running request, out of the running batch and give all its blocks back to the pool.

    Inputs: `victim` is in `self.running` and holds blocks (`victim.block_table`).
    Returns: nothing; afterwards `victim` is out of `self.running`, its `block_table` is empty, and every block
    it held is free again (`self.allocator.free`). What it keeps depends on how far it got:
    1. Nothing computed yet (`self.nothing_computed(victim)`: admitted in this very scheduling, never prefilled,
       no K/V in its blocks, no output): it is simply put back in the queue, not preempted. It leaves the set
       `self._not_prefilled`, `self.unadmissions` grows by 1, and it waits again (`RequestStatus.WAITING`, at the
       end of `self.waiting`).
    2. Otherwise, with `self.config.preempt == "swap"`: a preemption (`self.preemptions` grows by 1). Its K/V,
       every layer of every block of its table, is copied to host memory (`self.swapper.swap_out(table)`
       returns a `HostKV`) and kept in `victim.host_kv`; it goes to `self.swapped` (`RequestStatus.SWAPPED`),
       from which `swap_in` later brings it back into fresh blocks to carry on decoding.
    3. Otherwise (recompute): a preemption too; it waits again at the end of `self.waiting`, keeping its
       generated tokens: admitted again, prompt + generated tokens are prefilled in one forward, none sampled again.

    Example (blocks of 4): B decodes with 8 tokens in blocks [3, 9]. preempt(B) with swap: B leaves `running`,
    its table becomes [], blocks 3 and 9 are free, `B.host_kv.k` holds `self.cache.k[:, [3, 9]]`
    (`[num_layers, 2, 4, kv_heads, head_dim]`, V alike) and B is in `self.swapped`; with recompute, B is at the
    end of `self.waiting` with its 8 tokens. C, admitted a moment ago with [5, 6] and never prefilled, is put
    back: `self.unadmissions` goes up, `self.preemptions` does not.

    Hints (step07_preemption/README.md, "The idea: admit on what a request needs now, take blocks back when it
    runs out", its state diagram, and "The never-prefilled request" under "Pitfalls"): a freed block belongs to
    the pool again, and the next request given it overwrites it.
    """
    raise NotImplementedError("write PreemptionEngine.preempt: see the hints in its docstring")
