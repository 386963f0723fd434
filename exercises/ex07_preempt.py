"""Exercise 07-preempt: what a preempted request gives back, and what it keeps (swap, recompute, or neither).

Write the body of `preempt`; `python -m exercises run 07-preempt` plugs it into step 07's engine in place of
`PreemptionEngine.preempt` and runs step 07's tests and dry run on it.
"""

from __future__ import annotations

from common.request import RequestStatus  # noqa: F401  (for your code: WAITING, SWAPPED)
from step07_preemption.engine import PreemptibleRequest, PreemptionEngine


def preempt(self: PreemptionEngine, victim: PreemptibleRequest) -> None:
    """Take `victim`, a running request, out of the running batch and give all its blocks back to the pool.

    Every case: remove `victim` from `self.running`; take its block table and leave `victim.block_table` an
    empty list; at the end give the table's blocks back with `self.allocator.free(table)`. What it keeps
    depends on how far it got:
    1. `self.nothing_computed(victim)` is True (admitted in this very scheduling, never prefilled: its blocks
       hold no K/V yet, and it has no output): put it back in the queue. Remove it from the set
       `self._not_prefilled`, count `self.unadmissions += 1`, set `victim.status = RequestStatus.WAITING` and
       append it to `self.waiting`. Nothing is copied, and it is not a preemption.
    2. Otherwise, with `self.config.preempt == "swap"`: count `self.preemptions += 1`; copy its K/V, every
       layer of every block in its table, to host memory with `self.swapper.swap_out(table)` (before the
       blocks are freed), which returns a `HostKV`; keep it in `victim.host_kv`; set
       `victim.status = RequestStatus.SWAPPED` and append it to `self.swapped` (`swap_in` brings it back into
       fresh blocks and it carries on decoding).
    3. Otherwise (recompute): count `self.preemptions += 1`, set `victim.status = RequestStatus.WAITING` and
       append it to `self.waiting`. It keeps its generated tokens (`output_token_ids`, untouched): admitted
       again, prompt + generated tokens are prefilled in one forward, and none is sampled again.

    Example (blocks of 4): B decodes with 8 tokens in blocks [3, 9]. preempt(B) with swap: B leaves
    `running`, its table becomes [], blocks 3 and 9 are free again, `B.host_kv.k` holds
    `self.cache.k[:, [3, 9]]` (`[num_layers, 2, 4, kv_heads, head_dim]`, V alike) and B is in `self.swapped`;
    with recompute, B is at the end of `self.waiting` with its tokens. C, admitted a moment ago with [5, 6],
    is simply put back: `self.unadmissions` goes up, `self.preemptions` does not.

    Hints (step07_preemption/README.md, "The idea: admit on what a request needs now, take blocks back when it
    runs out", its state diagram, and "The never-prefilled request" under "Pitfalls"): swap out before freeing,
    since a freed block belongs to the pool again, and the next request given it overwrites it.
    """
    raise NotImplementedError("write PreemptionEngine.preempt: see the hints in its docstring")
