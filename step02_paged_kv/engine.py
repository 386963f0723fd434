"""Step 02: a paged KV cache shared by all requests, one batched decode forward, continuous batching.

Each `step()`:
1. admits waiting requests, first come first served, while the block budget allows;
2. prefills each newly admitted request (one forward over its prompt, K/V written into fresh blocks);
3. runs ONE decode forward for every other running request together, giving each a new block whenever
   its sequence crosses a block boundary.
Requests join and leave the batch at any step: that is continuous batching.

Admission is deliberately cautious: a request is admitted only if the blocks it could ever need (prompt +
max_tokens) fit beside the worst case of every running request. Blocks are still allocated only as
sequences grow, so memory in use follows real lengths, but with this rule no running request can ever find
the pool empty, and nothing has to be preempted. Step 07 admits optimistically and preempts instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.engine import Engine, EngineConfig
from common.loading import LoadedModel
from common.model import ForwardContext
from common.request import Request, RequestOutput, RequestStatus
from step02_paged_kv.block_allocator import BlockAllocator
from step02_paged_kv.kv_cache import PagedDecodeForward, PagedKVCache, PagedPrefillForward


@dataclass
class PagedEngineConfig(EngineConfig):
    block_size: int = 16  # token slots per KV block
    num_blocks: int | None = None  # the KV budget in blocks; default: from kv_memory_gb
    kv_memory_gb: float | None = None  # default: 90% of free GPU memory after the weights; 1 GB on CPU


@dataclass(eq=False)
class PagedRequest(Request):
    block_table: list[int] = field(default_factory=list)  # its logical blocks -> physical blocks of the pool


class PagedEngine(Engine):
    config_class = PagedEngineConfig
    request_class = PagedRequest
    # The contexts a forward runs with: step03 swaps in vectorized ones, and nothing else.
    prefill_context = PagedPrefillForward
    decode_context = PagedDecodeForward

    def __init__(self, loaded: LoadedModel, config: PagedEngineConfig) -> None:
        super().__init__(loaded, config)
        if config.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {config.block_size}")
        num_blocks = config.num_blocks or self.blocks_in_budget(config)
        self.cache = self.create_cache(num_blocks)
        self.allocator = BlockAllocator(num_blocks)  # hands out blocks 0 .. num_blocks - 1
        self.peak_blocks_used = 0
        self.scattered_example: tuple[str, list[int], int] | None = None  # a table worth printing, see below

    def create_cache(self, num_blocks: int) -> PagedKVCache:
        """The pool of `num_blocks` blocks (a method: a later step may shape its pool differently)."""
        return PagedKVCache(self.model.config, num_blocks, self.config.block_size, self.device, self.model.dtype)

    def blocks_in_budget(self, config: PagedEngineConfig) -> int:
        per_block = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        if config.kv_memory_gb is not None:
            budget = config.kv_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = 0.9 * free  # leave room for activations and the allocator's slack
        else:
            budget = 2**30
        return max(1, int(budget // per_block))

    # ----- scheduling ------------------------------------------------------------------------------------

    def worst_case_blocks(self, request: Request) -> int:
        return self.cache.blocks_for(request.max_total_tokens)

    def check_request(self, request: Request) -> None:
        super().check_request(request)
        need = self.worst_case_blocks(request)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"this request may need {need} KV blocks ({len(request.prompt_token_ids)} prompt tokens + "
                f"max_tokens {request.params.max_tokens}, {self.cache.block_size} tokens a block) but the cache "
                f"has {self.allocator.num_blocks}: raise --num-blocks or lower max_tokens"
            )

    def admit(self) -> list[Request]:
        """Move waiting requests to running while their worst case fits beside the running ones'."""
        promised = sum(self.worst_case_blocks(r) for r in self.running)
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = self.worst_case_blocks(self.waiting[0])
            if promised + need > self.allocator.num_blocks:
                break  # first come, first served: later requests wait behind this one
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            promised += need
        return admitted

    def step(self) -> list[RequestOutput]:
        decoding = list(self.running)  # already prefilled: each gets one more token this step
        outputs = self.prefill_admitted(self.admit())
        if decoding:
            outputs += self.decode(decoding)
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.num_used)
        return outputs

    def prefill_admitted(self, requests: list[Request]) -> list[RequestOutput]:
        """Each newly admitted request is prefilled by a forward of its own."""
        outputs = []
        for request in requests:
            outputs += self.prefill(request)
        return outputs

    # ----- running the model ---------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, request: PagedRequest) -> list[RequestOutput]:
        token_ids = request.all_token_ids  # nothing of this request is cached yet
        request.block_table = self.allocator.allocate(self.cache.blocks_for(len(token_ids)))
        ctx = self.prefill_context(self.cache, request.block_table, len(token_ids), self.device)
        hidden = self.model(torch.tensor(token_ids, device=self.device), ctx)
        logits = self.model.compute_logits(hidden[-1:])
        return self.process_tokens([request], self.sample(logits, [request]))

    @torch.inference_mode()
    def decode(self, requests: list[PagedRequest]) -> list[RequestOutput]:
        seq_lens = self.grow_block_tables(requests)
        ctx = self.make_decode_context(requests, seq_lens)
        input_ids = torch.tensor([r.output_token_ids[-1] for r in requests], device=self.device)
        hidden = self.model(input_ids, ctx)
        logits = self.model.compute_logits(hidden)
        return self.process_tokens(requests, self.sample(logits, requests))

    def grow_block_tables(self, requests: list[PagedRequest]) -> list[int]:
        """Give each request a new block if its next token starts one; return the lengths after this step."""
        seq_lens = []
        for request in requests:
            length = request.num_tokens  # the newest token is not cached yet: it is this forward's input
            self.grow_block_table(request, length)
            seq_lens.append(length)
        return seq_lens

    def needs_new_block(self, request: PagedRequest, length: int) -> bool:
        """Whether holding `length` tokens takes the request into a block its table does not have yet."""
        return self.cache.blocks_for(length) > len(request.block_table)

    def grow_block_table(self, request: PagedRequest, length: int) -> None:
        if self.needs_new_block(request, length):
            request.block_table += self.allocator.allocate(1)  # crossing into a new block

    def make_decode_context(self, requests: list[PagedRequest], seq_lens: list[int]) -> ForwardContext:
        tables = [r.block_table for r in requests]
        return self.decode_context(self.cache, tables, seq_lens, self.device)

    def free_request(self, request: PagedRequest) -> None:
        table, request.block_table = request.block_table, []
        if table:
            if self.scattered_example is None and any(b != a + 1 for a, b in zip(table, table[1:])):
                self.scattered_example = (request.request_id, table, request.num_tokens - 1)
            self.allocator.free(table)

    def describe_block_table(self, request_id: str, table: list[int], num_tokens: int) -> str:
        """Where each logical block of a request lives in the pool, and which slots its positions map to."""
        size = self.cache.block_size
        lines = [f"request {request_id} ({num_tokens} cached tokens), logical -> physical:"]
        for logical, block in enumerate(table):
            first, last = logical * size, min((logical + 1) * size, num_tokens) - 1
            lines.append(
                f"  block {logical:2d} -> {block:4d}   positions {first:4d}-{last:<4d} -> slots "
                f"{self.cache.slot(table, first)}-{self.cache.slot(table, last)}"
            )
        return "\n".join(lines)

    def stats(self) -> dict[str, float]:
        return super().stats() | {"kv_blocks_used": self.allocator.num_used, "kv_blocks_total": self.allocator.num_blocks}

    def memory_report(self) -> str:
        per_block = PagedKVCache.bytes_per_block(self.model.config, self.cache.block_size, self.model.dtype)
        return (
            f"KV cache: {self.allocator.num_blocks} blocks of {self.cache.block_size} tokens "
            f"({self.allocator.num_blocks * per_block / 2**20:.1f} MiB); at most {self.peak_blocks_used} in use at once "
            f"({self.peak_blocks_used * per_block / 2**20:.1f} MiB); {self.allocator.num_used} in use now"
        ) + ("\n" + self.describe_block_table(*self.scattered_example) if self.scattered_example else "")
