"""Step 12: decode steps replayed as CUDA graphs (`decode_graphs.py`); everything else is step 07's.

Against step 07, `CudaGraphEngine` changes one method, `decode`: the batch is padded to a bucket, its
inputs are written into static buffers, and the bucket's captured graph is replayed. Prefill stays eager
(its shapes change with every prompt). Scheduling, preemption and priorities are step 07's, so requests
join, leave and get preempted between replays exactly as before. One block of the pool is reserved as the
dummy block that padded rows write to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.loading import LoadedModel
from common.request import Request, RequestOutput
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import require_triton_device
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig
from step12_cuda_graph.decode_graphs import GRAPH_BYTES_PER_LOGIT, DecodeGraphs


@dataclass
class CudaGraphEngineConfig(PreemptionEngineConfig):
    cuda_graph: bool = True  # False: step 07's eager decode, for comparison
    max_graph_batch: int = 256  # larger decode batches run eagerly
    # Decode with packed projections and one Triton kernel per element-wise chain (`fused_forward.py`).
    # None: on wherever decode is captured, the case it was measured for; True on CPU needs TRITON_INTERPRET=1.
    fused_ops: bool | None = None


class CudaGraphEngine(PreemptionEngine):
    config_class = CudaGraphEngineConfig
    reserved_blocks = 1  # the dummy block: padded rows write their K/V there, and nobody reads it

    def __init__(self, loaded: LoadedModel, config: CudaGraphEngineConfig) -> None:
        if config.fused_ops and not config.cuda_graph:
            raise ValueError("--fused-ops changes the graph decode path: drop --no-cuda-graph to use it")
        super().__init__(loaded, config)
        self.dummy_block = self.allocator.num_blocks  # the one block past those the allocator hands out
        self.graphs: DecodeGraphs | None = None
        self.eager_reason = self.why_not_capture(config)
        fused_ops = self.eager_reason is None if config.fused_ops is None else config.fused_ops
        if fused_ops:
            require_triton_device(self.device)
        if config.cuda_graph:
            self.graphs = DecodeGraphs(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                                       self.max_graph_batch(config), capture=self.eager_reason is None,
                                       fused_ops=fused_ops)
        print(f"[{type(self).__name__}] decode: {self.graph_status()}", flush=True)  # said at start-up

    @staticmethod
    def max_graph_batch(config: CudaGraphEngineConfig) -> int:
        return max(1, min(config.max_graph_batch, config.max_num_seqs))

    def blocks_in_budget(self, config: CudaGraphEngineConfig) -> int:
        """Step 02's budget, less what the graphs will hold (an estimate: they are captured after the pool
        exists, since they record its address; the real figure is printed at start-up)."""
        blocks = super().blocks_in_budget(config)
        if not config.cuda_graph or self.device.type != "cuda":
            return blocks
        graph_bytes = GRAPH_BYTES_PER_LOGIT * self.max_graph_batch(config) * self.model.config.vocab_size
        per_block = PagedKVCache.bytes_per_block(self.model.config, config.block_size, self.model.dtype)
        return max(1, blocks - graph_bytes // per_block)

    def why_not_capture(self, config: CudaGraphEngineConfig) -> str | None:
        """None if decode can be captured; otherwise the reason it runs eagerly, to be said out loud."""
        if not config.cuda_graph:
            return "--no-cuda-graph: step 07's eager decode"
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device: the padded static-buffer decode runs eagerly"
        if self.backend.name == "torch":
            return ("the torch backend sizes its gather from a host number (the longest length), which a graph "
                    "would freeze: use --attn triton or flash_attn; decoding eagerly")
        if config.sync_per_layer:
            return "--sync-per-layer reads a device value on the host, which a graph cannot hold; decoding eagerly"
        return None

    def graph_status(self) -> str:
        described = self.graphs.describe() if self.graphs else "no graphs"
        return described if self.eager_reason is None else f"{described}: {self.eager_reason}"

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> list[RequestOutput]:
        if self.graphs is None or len(requests) > self.graphs.max_batch:
            return super().decode(requests)
        seq_lens = self.grow_block_tables(requests)
        tables = [self.block_tables[r.request_id] for r in requests]
        return self.process_tokens(requests, self.graphs.run(requests, seq_lens, tables))

    def memory_report(self) -> str:
        return f"{super().memory_report()}\ndecode: {self.graph_status()}"
