"""Step 07: preemption and priorities. When the pool runs out, or a more important request waits, the
scheduler takes blocks away from the least important running request instead of refusing work.

Step 02 admitted a request only if its worst case (prompt + max_tokens) fit beside everyone else's, so it
never ran out of blocks, but it left most of the pool idle. Here admission is optimistic: a request needs
only the blocks for the tokens it has now. When a running request then needs a block and none is free, a
victim is preempted:

- `swap`: all its blocks, of all layers, are copied to host memory (`swap.py`) and freed; it comes back,
  before any less important new work, as soon as its blocks fit again, and carries on decoding;
- `recompute`: its blocks are freed and it goes back to the queue keeping every token it generated; when
  readmitted, prompt + generated tokens are prefilled again in one forward;
- a request admitted in this very step but not yet prefilled has no KV worth keeping: it is simply put back.

Priority is a per-request integer: a SMALLER value is MORE important (0 is the default; ties go to the
earlier arrival). The victim is always the least important running request, and among equals the most
recently admitted. A waiting request may also preempt running requests that are strictly less important.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from common.loading import LoadedModel
from common.request import RequestOutput, RequestStatus
from step02_paged_kv.engine import PagedRequest
from step06_paged_attention.engine import PagedAttentionEngine, PagedAttentionEngineConfig
from step07_preemption.swap import HostKV, Swapper

PREEMPT_MODES = ("recompute", "swap")


@dataclass
class PreemptionEngineConfig(PagedAttentionEngineConfig):
    preempt: str = "recompute"  # recompute | swap
    swap_per_block: bool = False  # ablation: swap with one small copy per block and layer


@dataclass(eq=False)
class PreemptibleRequest(PagedRequest):
    host_kv: HostKV | None = None  # its K/V while swapped out
    admitted_at: int = -1  # when it was (last) admitted, counted in admissions: the newest is the first victim


class PreemptionEngine(PagedAttentionEngine):
    config_class = PreemptionEngineConfig
    request_class = PreemptibleRequest

    def __init__(self, loaded: LoadedModel, config: PreemptionEngineConfig) -> None:
        if config.preempt not in PREEMPT_MODES:
            raise ValueError(f"--preempt must be one of {', '.join(PREEMPT_MODES)}, got {config.preempt!r}")
        super().__init__(loaded, config)
        self.swapper = Swapper(self.cache, per_block=config.swap_per_block)
        self.swapped: list[PreemptibleRequest] = []
        self._admissions = itertools.count()
        self._not_prefilled: set[PreemptibleRequest] = set()  # admitted during the scheduling now in progress
        self.preemptions = 0
        self.unadmissions = 0

    @staticmethod
    def importance(request: PreemptibleRequest) -> tuple[int, float]:
        """Sort key, most important first: smaller priority value, then earlier arrival."""
        return request.priority, request.arrival_time

    # ----- scheduling ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        to_prefill, to_decode = self.schedule()
        outputs = self.prefill_admitted(to_prefill)
        if to_decode:
            outputs += self.decode(to_decode)
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        return outputs

    def schedule(self) -> tuple[list[PreemptibleRequest], list[PreemptibleRequest]]:
        """Decide this step's work and give it its blocks, preempting where needed. Returns the requests
        to prefill and those to decode; every block either needs is allocated when this returns."""
        decoding = list(self.running)
        blocked = self.swap_in(decoding)
        self._not_prefilled = set()
        admitted = self.admit_waiting(blocked)
        for request in sorted(decoding, key=self.importance):
            if request.status is RequestStatus.RUNNING:
                self.reserve_next_block(request)
        self._not_prefilled = set()
        # Whoever was preempted along the way has left `running` and sits out this step.
        still_running = [r for r in admitted if r.status is RequestStatus.RUNNING]
        return still_running, [r for r in decoding if r.status is RequestStatus.RUNNING]

    def swap_in(self, decoding: list[PreemptibleRequest]) -> tuple[int, float] | None:
        """Bring swapped requests back, most important first, while their blocks fit. Returns the
        importance of the first one that did not fit: no less important request may be admitted before it."""
        for request in sorted(self.swapped, key=self.importance):
            host = request.host_kv
            # Room for its blocks, and for the new block any decoding request (itself included) starts this
            # step: otherwise it would be the newest admission, the first victim, and go straight back out.
            starts_block = self.cache.blocks_for(request.num_tokens) > host.num_blocks
            need = host.num_blocks + starts_block + self.new_blocks_this_step(decoding)
            if self.allocator.num_free < need or len(self.running) >= self.config.max_num_seqs:
                return self.importance(request)
            request.block_table = self.allocator.allocate(host.num_blocks)
            self.swapper.swap_in(host, request.block_table)
            request.host_kv = None
            self.swapped.remove(request)
            self.mark_running(request)
            decoding.append(request)
        return None

    def admit_waiting(self, blocked: tuple[int, float] | None) -> list[PreemptibleRequest]:
        admitted = []
        for request in sorted(self.waiting, key=self.importance):
            if blocked is not None and self.importance(request) > blocked:
                break  # a more important swapped request is waiting for these blocks
            if len(self.running) >= self.config.max_num_seqs:
                break
            need = self.cache.blocks_for(request.num_tokens)
            while self.allocator.num_free < need:
                victim = self.pick_victim(less_important_than=request)
                if victim is None:
                    break
                self.preempt(victim)
            if self.allocator.num_free < need:
                break  # first come, first served within a priority: nobody overtakes this request
            request.block_table = self.allocator.allocate(need)
            self.waiting.remove(request)
            self.mark_running(request)
            self._not_prefilled.add(request)
            admitted.append(request)
        return admitted

    def new_blocks_this_step(self, requests: list[PreemptibleRequest]) -> int:
        """How many of these decoding requests cross into a new block with this step's token."""
        return sum(self.needs_new_block(r, r.num_tokens) for r in requests)

    def reserve_next_block(self, request: PreemptibleRequest) -> None:
        """A decoding request whose next token starts a new block gets one, preempting if the pool is empty
        (possibly the request itself, if it is the least important)."""
        if not self.needs_new_block(request, request.num_tokens):
            return
        while self.allocator.num_free == 0:
            victim = self.pick_victim()
            assert victim is not None, "a running request always exists here"
            self.preempt(victim)
            if victim is request:
                return
        self.grow_block_table(request, request.num_tokens)

    def mark_running(self, request: PreemptibleRequest) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.admitted_at = next(self._admissions)

    def pick_victim(self, less_important_than: PreemptibleRequest | None = None) -> PreemptibleRequest | None:
        candidates = self.running
        if less_important_than is not None:
            candidates = [r for r in candidates if r.priority > less_important_than.priority]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.admitted_at))

    def nothing_computed(self, request: PreemptibleRequest) -> bool:
        """Whether a running request's blocks hold no computed K/V yet (admitted in this scheduling, not prefilled)."""
        return request in self._not_prefilled

    def preempt(self, victim: PreemptibleRequest) -> None:
        self.running.remove(victim)
        table, victim.block_table = victim.block_table, []
        if self.nothing_computed(victim):
            # Admitted a moment ago and never prefilled: nothing was computed, so just put it back.
            self._not_prefilled.discard(victim)
            self.unadmissions += 1
            victim.status = RequestStatus.WAITING
            self.waiting.append(victim)
        elif self.config.preempt == "swap":
            self.preemptions += 1
            victim.host_kv = self.swapper.swap_out(table)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.preemptions += 1
            victim.status = RequestStatus.WAITING  # its generated tokens stay: they are recomputed as a prompt
            self.waiting.append(victim)
        self.allocator.free(table)

    # ----- cleanup ---------------------------------------------------------------------------

    def free_request(self, request: PreemptibleRequest) -> None:
        super().free_request(request)
        request.host_kv = None  # a swapped request's host copy
        if request in self.swapped:
            self.swapped.remove(request)

    def stats(self) -> dict[str, float]:
        return super().stats() | {"preemptions_total": self.preemptions, "requests_swapped": len(self.swapped),
                                  "swapped_out_blocks_total": self.swapper.stats.swapped_out_blocks}

    def memory_report(self) -> str:
        stats = self.swapper.stats
        swap = (f"; swapped {stats.swapped_out_blocks} blocks out and {stats.swapped_in_blocks} in at "
                f"{stats.gb_per_s:.2f} GB/s" if stats.bytes_moved else "")
        return (super().memory_report() + f"\npreemptions: {self.preemptions} ({self.config.preempt}), "
                f"un-admitted before prefill: {self.unadmissions}{swap}")
