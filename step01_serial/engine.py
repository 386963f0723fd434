"""Step 01: serial decode. Every request runs alone, against its own contiguous KV cache.

Each `step()` admits waiting requests (prefilling each with its own forward), then gives every running
request one decode forward of its own. The requests take turns on the device instead of sharing one
batched forward: with 8 requests, one step is 8 small forwards, each too small to keep the hardware busy.
That is the baseline the later steps improve on, and the reference they must match token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine import Engine
from common.request import Request, RequestOutput, RequestStatus
from step01_serial.kv_cache import ContiguousForward, ContiguousKVCache


@dataclass(eq=False)
class SerialRequest(Request):
    cache: ContiguousKVCache | None = None  # its own KV cache, from its prefill on


class SerialEngine(Engine):
    request_class = SerialRequest

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv_tokens_reserved = 0  # over all finished requests: room set aside...
        self.kv_tokens_used = 0  # ...and room actually filled

    def step(self) -> list[RequestOutput]:
        outputs = []
        admitted = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            admitted.append(request)
            outputs += self.prefill(request)
        for request in list(self.running):
            if request not in admitted:
                outputs += self.decode(request)
        return outputs

    def prefill(self, request: SerialRequest) -> list[RequestOutput]:
        # Reserve the request's whole future up front: prompt plus every token it may generate.
        request.cache = ContiguousKVCache(self.model.config, request.max_total_tokens, self.device, self.model.dtype)
        return self.run_forward(request, request.prompt_token_ids)

    def decode(self, request: SerialRequest) -> list[RequestOutput]:
        return self.run_forward(request, request.output_token_ids[-1:])

    @torch.inference_mode()
    def run_forward(self, request: SerialRequest, token_ids: list[int]) -> list[RequestOutput]:
        cache = request.cache
        ctx = ContiguousForward(cache, cache.length, len(token_ids), self.device)
        input_ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model(input_ids, ctx)
        cache.length = ctx.end
        logits = self.model.compute_logits(hidden[-1:])
        return self.process_tokens([request], self.sample(logits, [request]))

    def free_request(self, request: SerialRequest) -> None:
        if request.cache is not None:
            self.kv_tokens_reserved += request.cache.capacity
            self.kv_tokens_used += request.cache.length
            request.cache = None

    def memory_report(self) -> str:
        if not self.kv_tokens_reserved:
            return ""
        per_token = self.model.config.num_layers * self.model.config.num_kv_heads * self.model.config.head_dim * 2
        mib = per_token * self.model.dtype.itemsize / 2**20
        return (
            f"KV cache: {self.kv_tokens_reserved} token slots reserved ({self.kv_tokens_reserved * mib:.1f} MiB), "
            f"{self.kv_tokens_used} filled: {100 * self.kv_tokens_used / self.kv_tokens_reserved:.0f}% of the "
            "reservation was used"
        )
