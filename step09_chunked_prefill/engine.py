"""Step 09: a token budget per step; long prompts are prefilled in chunks that ride along with the decoders.

Step 07 prefilled every newly admitted prompt whole, in the same step, before the decoders' forward. One
16,000-token prompt then froze every running stream for the length of its prefill, and sixty-four 2,000-token
prompts arriving together made one forward too large for the memory left beside the KV pool. Here every step
is bounded by `max_num_batched_tokens`:

1. every running decoder takes one token (decoders never wait for prefill);
2. the rest of the budget goes to prefill chunks, most important request first (priority, then arrival): a
   request mid-prefill continues, a waiting one is admitted with its first chunk. A prompt longer than what
   is left is cut, and continues next step from where it stopped, its blocks held meanwhile;
3. decoders and chunks run as ONE forward (a mixed batch): step 06's prefill attention already reads each
   request's cached prefix from its block table, and a decoder is a request with one new token.

A request's state is how many of its tokens have their K/V in the cache (`num_computed`). It samples a token
only in the step that computes its last one: a decoder every step, a prompt after its last chunk. A step that
has only decoders runs step 06's decode forward (and, from step 12 on, a CUDA graph).

Before the KV pool is sized, the engine runs its worst step once (the budget's tokens, or one per running
request if there can be more) and measures its peak memory, so that no admitted load can run out of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.loading import LoadedModel
from common.model import CausalLM, ForwardContext
from common.request import RequestOutput, RequestStatus
from common.sampling import SamplingParams
from step02_paged_kv.kv_cache import PagedKVCache
from step07_preemption.engine import PreemptibleRequest, PreemptionEngine, PreemptionEngineConfig

# The default budget, when --max-num-batched-tokens is not given. A budget is there to bound a step's time,
# and a token's time is mostly its matrix multiplies, 2 FLOPs per weight of the layers it passes through. On a
# GPU the default is therefore a compute figure, turned into tokens for the model loaded (a power of two, in
# [256, 8192]): 8 TFLOP a step is 512 tokens of Qwen2.5-7B and 8192 of Qwen3-0.6B. On the H200, with step
# 12's mixed-step graphs, 512 tokens of the 7B keep 32 decoders' longest wait under 8 steady steps while a
# 16,000-token prompt is prefilled (README: "The budget is a trade-off"). On a CPU it is 512 tokens: a chunk of
# the embedded model that takes about as long as 30 of its decode steps.
GPU_STEP_FLOPS = 8e12
GPU_BUDGET_RANGE = (256, 8192)
CPU_TOKEN_BUDGET = 512


def layer_flops_per_token(model: CausalLM) -> int:
    """Multiply-adds of one token through the decoder layers, times 2 (the embedding is a lookup, and only
    the rows that sample pass through the LM head)."""
    return 2 * sum(p.numel() for p in model.model.layers.parameters())


def default_token_budget(model: CausalLM, device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    low, high = GPU_BUDGET_RANGE
    tokens = int(GPU_STEP_FLOPS // layer_flops_per_token(model))
    return min(max(1 << max(tokens, 1).bit_length() - 1, low), high)  # the power of two at most `tokens`


@dataclass
class ChunkedPrefillEngineConfig(PreemptionEngineConfig):
    max_num_batched_tokens: int | None = None  # tokens per step; None: `default_token_budget`


@dataclass(eq=False)
class ChunkedRequest(PreemptibleRequest):
    num_computed: int = 0  # its first tokens whose K/V is in the cache (or will be, once the forward launched has run)


@dataclass
class Chunk:
    """Part of one request's tokens computed in this step: `num_tokens` of them from `start` on."""

    request: ChunkedRequest
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token, whose logits give its next one."""
        return self.end == self.request.num_tokens


class WorstStepForward(ForwardContext):
    """Attention among one forward's own tokens, storing nothing, to measure a budget-sized step before the KV
    pool exists. PyTorch's SDPA may need more memory here than the paged kernels, which allocate only their
    output (with grouped-query heads on the H200 it takes a path that grows with the square of the tokens):
    the reserve errs on the safe side."""

    def __init__(self, num_tokens: int, max_positions: int, device: torch.device) -> None:
        # A step may hold more tokens than one sequence may have positions (many requests' chunks): wrap around.
        self.positions = torch.arange(num_tokens, device=device) % max_positions

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)


class ChunkedPrefillEngine(PreemptionEngine):
    config_class = ChunkedPrefillEngineConfig
    request_class = ChunkedRequest
    chunk_class = Chunk  # what the scheduler makes: a later step's chunks may do more, as its requests may hold more

    def __init__(self, loaded: LoadedModel, config: ChunkedPrefillEngineConfig) -> None:
        self.step_memory_bytes: int | None = None  # measured by `blocks_in_budget` on a GPU
        super().__init__(loaded, config)
        self.token_budget = self.budget_for(config)
        self.prefill_chunks = 0  # chunks that did not reach the end of their prompt
        self.mixed_steps = 0  # steps that ran decoders and prefill chunks in one forward
        self.preempted_this_step: set[ChunkedRequest] = set()  # sit out the rest of the step (see `schedule`)
        # This step's admission, for `next_chunk`: a swapped request's importance that no admission may pass
        # (`swap_in`), and whether waiting requests may still start (first come, first served).
        self.blocked: tuple[int, float] | None = None
        self.admitting = True
        print(f"[{type(self).__name__}] {self.describe_budget()}", flush=True)  # said at start-up

    def budget_for(self, config: ChunkedPrefillEngineConfig) -> int:
        budget = config.max_num_batched_tokens
        if budget is None:
            return default_token_budget(self.model, self.device)
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {budget}")
        return budget

    def worst_step_tokens(self, config: ChunkedPrefillEngineConfig) -> int:
        """The most tokens one forward can hold: the budget, or one per running request if there are more
        decoders than that (they all run, and take no prefill with them)."""
        return max(self.budget_for(config), config.max_num_seqs)

    # ----- memory: measure the worst step before sizing the pool -------------------------------------------

    def blocks_in_budget(self, config: ChunkedPrefillEngineConfig) -> int:
        """Step 02's budget, less the peak memory of the worst step (measured on a GPU; on a CPU the pool
        has a fixed size and the host's memory holds the activations)."""
        blocks = super().blocks_in_budget(config)
        if self.device.type != "cuda" or config.kv_memory_gb is not None:
            return blocks  # --kv-memory-gb: the user's figure, as given
        self.step_memory_bytes = self.measure_worst_step(self.worst_step_tokens(config), config.max_num_seqs)
        per_block = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        return max(1, blocks - -(-self.step_memory_bytes // per_block))

    @torch.inference_mode()
    def measure_worst_step(self, num_tokens: int, max_rows: int) -> int:
        """Peak bytes allocated by one forward of `num_tokens` tokens, then the logits and sampling of as many
        rows as can sample at once, beyond what was allocated before."""
        device = self.device
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=device),
                            WorstStepForward(num_tokens, self.max_model_len, device))
        rows = min(num_tokens, max_rows)
        logits = self.model.compute_logits(hidden[:rows])
        # Top-k, top-p and temperature: the sampler's every temporary, for every row.
        self.sampler(logits, [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)] * rows, [0] * rows)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del hidden, logits
        torch.cuda.empty_cache()  # give the measured step's memory back before the pool is sized
        return peak

    def describe_budget(self) -> str:
        measured = ("" if self.step_memory_bytes is None else
                    f"; its worst step ({self.worst_step_tokens(self.config)} tokens) measured at "
                    f"{self.step_memory_bytes / 2**20:.0f} MiB, set aside before sizing the KV pool")
        return f"token budget: {self.token_budget} tokens per step{measured}"

    # ----- scheduling ------------------------------------------------------------------------------------

    def is_decoding(self, request: ChunkedRequest) -> bool:
        """A running request whose only token not yet in the cache is the one it generated last."""
        return bool(request.output_token_ids) and request.num_tokens - request.num_computed <= 1

    def prefill_pending(self) -> bool:
        """Whether a step may have prefill work: a request waits, or one is mid-prefill."""
        return bool(self.waiting) or not all(self.is_decoding(r) for r in self.running)

    def step(self) -> list[RequestOutput]:
        decoders, chunks = self.schedule()
        if chunks:
            self.mixed_steps += bool(decoders)
            outputs = self.forward_mixed([self.chunk_class(r, r.num_tokens - 1, 1) for r in decoders] + chunks)
        elif decoders:
            for request in decoders:
                self.mark_computed(request, request.num_tokens)  # its newest token, about to be cached
            outputs = self.decode(decoders)  # step 06's decode forward (step 12: a CUDA graph)
        else:
            outputs = []
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        return outputs

    def schedule(self) -> tuple[list[ChunkedRequest], list[Chunk]]:
        """This step's decoders and prefill chunks, each with the blocks it needs, preempting where needed."""
        self.preempted_this_step = set()
        blocked = self.swap_in([r for r in self.running if self.is_decoding(r)])
        decoders = [r for r in self.running if self.is_decoding(r)]
        for request in sorted(decoders, key=self.importance):
            if request.status is RequestStatus.RUNNING:
                self.reserve_next_block(request)  # may preempt: the least important, most recent request
        decoders = [r for r in decoders if r.status is RequestStatus.RUNNING]
        self.blocked, self.admitting = blocked, True
        chunks = self.fill_budget(decoders)
        # Whoever was preempted along the way has left `running` and sits out this step.
        still_running = [r for r in decoders if r.status is RequestStatus.RUNNING]
        return still_running, [c for c in chunks if c.request.status is RequestStatus.RUNNING]

    # The split of the budget, on its own so that the step's idea reads in a few lines (exercise
    # 09-token-budget); who may start and the blocks of each chunk are `next_chunk`'s.
    def fill_budget(self, decoders: list[ChunkedRequest]) -> list[Chunk]:
        """The prefill chunks of this step: one token of the budget for each decoder, the rest to the requests
        mid-prefill and the waiting ones, most important first, each chunk at most what is left."""
        budget = self.token_budget - len(decoders)
        chunks: list[Chunk] = []
        candidates = [r for r in self.running if not self.is_decoding(r)] + list(self.waiting)
        for request in sorted(candidates, key=self.importance):
            if budget <= 0:
                break
            chunk = self.next_chunk(request, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return chunks

    def next_chunk(self, request: ChunkedRequest, budget: int) -> Chunk | None:
        """The request's next chunk, of at most `budget` tokens, with its blocks (`reserve_chunk`); None if it
        sits out this step: preempted in it, not admitted now, or no block to be had."""
        if request in self.preempted_this_step:
            # Admitted again now, it would take back the blocks it just gave up, and lose them again at the
            # next block that the request which preempted it needs.
            return None
        if request.status is RequestStatus.WAITING:
            # First come, first served: once a waiting request cannot start, none after it may.
            self.admitting = self.admitting and self.may_admit(request, self.blocked)
            if not self.admitting:
                return None  # requests already mid-prefill may still go on
        chunk = self.reserve_chunk(request, budget)
        if chunk is None:
            self.admitting = False
        return chunk

    def may_admit(self, request: ChunkedRequest, blocked: tuple[int, float] | None) -> bool:
        """A free place among the running requests, and no more important swapped request waiting for blocks."""
        return len(self.running) < self.config.max_num_seqs and (blocked is None or self.importance(request) <= blocked)

    def reserve_chunk(self, request: ChunkedRequest, budget: int) -> Chunk | None:
        """The request's next chunk, of at most `budget` tokens from its first one not computed, with the
        blocks it needs, preempting less important requests if the pool is short; a waiting request is
        admitted with it. The chunk is shorter if the pool cannot hold it all; None if it can hold none of it
        (then nothing changed for this request)."""
        admitted = request.status is RequestStatus.RUNNING
        start = request.num_computed
        num_tokens = min(budget, request.num_tokens - start)
        table = request.block_table
        size = self.cache.block_size
        while self.allocator.num_free < self.cache.blocks_for(start + num_tokens) - len(table):
            # A running request may take blocks from anyone less important or admitted later (as step 07's
            # decoders do); a waiting one only from strictly less important requests.
            victim = self.pick_victim(less_important_than=None if admitted else request)
            if victim is None or victim is request:
                break
            self.preempt(victim)
        room = min(num_tokens, (len(table) + self.allocator.num_free) * size - start)
        if room <= 0:
            return None
        request.block_table = table + self.allocator.allocate(self.cache.blocks_for(start + room) - len(table))
        if not admitted:
            self.waiting.remove(request)
            self.mark_running(request)
        return self.chunk_class(request, start, room)

    def mark_computed(self, request: ChunkedRequest, end: int) -> None:
        """The request's first `end` tokens have their K/V in the cache (or will have, once the forward just
        launched has run: a later forward reads them after it)."""
        request.num_computed = end

    def nothing_computed(self, request: ChunkedRequest) -> bool:
        return request.num_computed == 0

    def preempt(self, victim: ChunkedRequest) -> None:
        super().preempt(victim)
        self.preempted_this_step.add(victim)
        if victim.status is RequestStatus.WAITING:
            victim.num_computed = 0  # recomputed from its first token when admitted again

    # ----- running the model -----------------------------------------------------------------------------

    def forward_mixed(self, chunks: list[Chunk]) -> list[RequestOutput]:
        """One forward over every chunk, laid end to end (decoders are chunks of one token); a token for the
        chunks that reach their request's last token, and for no other."""
        sampling = [c for c in chunks if c.samples]
        token_ids = self.compute_chunks(chunks, sampling)
        for chunk in chunks:
            self.mark_computed(chunk.request, chunk.end)
        self.prefill_chunks += len(chunks) - len(sampling)
        return self.process_tokens([c.request for c in sampling], token_ids)

    @torch.inference_mode()
    def compute_chunks(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[int]:
        """The forward itself, eagerly (step 12 replays it as a graph): the K/V of every chunk's tokens into
        the cache, and a token sampled for each chunk of `sampling` (none at all if it is empty: then nothing
        waits for the GPU)."""
        hidden = self.run_chunks(chunks)
        if not sampling:
            return []
        last_rows = list(itertools.accumulate(c.num_tokens for c in chunks))
        logits = self.model.compute_logits(hidden[[last_rows[i] - 1 for i, c in enumerate(chunks) if c.samples]])
        return self.sample(logits, [c.request for c in sampling])

    def run_chunks(self, chunks: list[Chunk]) -> torch.Tensor:
        """One forward over the chunks laid end to end: their K/V into the cache, their hidden states out."""
        requests = [c.request for c in chunks]
        q_lens = [c.num_tokens for c in chunks]
        meta, positions = self.build_metadata(requests, q_lens, [c.end for c in chunks], is_prefill=True)
        token_ids = [t for c in chunks for t in self.chunk_token_ids(c)]
        return self.model(torch.tensor(token_ids, device=self.device), self.context(meta, positions))

    @staticmethod
    def chunk_token_ids(chunk: Chunk) -> list[int]:
        """The chunk's tokens: part of the prompt, then of what the request generated (recomputed after a
        preemption), without copying the whole sequence for a one-token chunk."""
        prompt, generated = chunk.request.prompt_token_ids, chunk.request.output_token_ids
        return prompt[chunk.start : chunk.end] + generated[max(0, chunk.start - len(prompt)) : max(0, chunk.end - len(prompt))]

    # ----- reports ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        # Read by step 08's /metrics while a step may be scheduling: nothing here may assume a finished schedule.
        prefilling = sum(r.num_tokens - r.num_computed > 1 or not r.output_token_ids for r in list(self.running))
        return super().stats() | {"requests_prefilling": prefilling, "prefill_chunks_total": self.prefill_chunks}

    def memory_report(self) -> str:
        return (f"{super().memory_report()}\n{self.describe_budget()}; {self.prefill_chunks} prefill chunks "
                f"stopped mid-prompt, {self.mixed_steps} steps mixed decoders with prefill")
