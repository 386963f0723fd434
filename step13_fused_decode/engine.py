"""Step 13: fewer, larger kernels per decode step; everything else is step 12's.

Against step 12, `FusedDecodeEngine` changes what its decode graphs capture (`build_graphs`): not the plain
model but its fused twin (`fused_forward.fuse`), whose layers run packed projections, one Triton kernel per
element-wise chain and, at up to 16 rows, our own skinny matrix multiply with the greedy tokens found inside
the output head's; with `pdl`, every kernel, step 06's attention kernels included (`PDLTritonBackend`), is
launched with programmatic dependent launch. The mixed steps' graphs and the verification rows' run the same twin
(`build_mixed_graphs`, `build_verify_graphs`). Scheduling, and the graphs' buckets and buffers, are step 12's. Each
switch off gives step 12's path back, as an ablation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.loading import LoadedModel
from common.model import CausalLM
from step02_paged_kv.kv_cache import PagedKVCache
from step06_paged_attention.backends import AttentionBackend, AttentionMetadata, require_triton_device
from step12_cuda_graph.decode_graphs import DecodeGraphs, StaticDecodeInputs
from step12_cuda_graph.engine import CudaGraphEngine, CudaGraphEngineConfig
from step12_cuda_graph.mixed_graphs import MixedStepGraphs
from step12_cuda_graph.verify_graphs import VerifyStepGraphs


@dataclass
class FusedDecodeEngineConfig(CudaGraphEngineConfig):
    # Decode with packed projections and one Triton kernel per element-wise chain (`fused_forward.py`).
    # None: on wherever decode is captured, the case it was measured for; True on CPU needs TRITON_INTERPRET=1.
    fused_ops: bool | None = None
    # With fused ops, projections of at most 16 rows through our own skinny matrix multiply, not cuBLAS.
    # None: whenever fused ops are on.
    skinny_matmul: bool | None = None
    # With fused ops, launch their kernels and step 06's attention kernels with programmatic dependent launch
    # (`dependent_launch.py`). None: wherever decode is captured on a GPU that has it (compute capability 9.0+).
    pdl: bool | None = None


class FusedDecodeGraphs(DecodeGraphs):
    """Step 12's decode graphs over the fused twin of the model (`fuse`), with its context."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, backend: AttentionBackend, max_model_len: int,
                 dummy_block: int, max_batch: int, capture: bool,
                 inputs_class: type[StaticDecodeInputs] = StaticDecodeInputs, skinny_matmul: bool = False,
                 pdl: bool = False) -> None:
        from step13_fused_decode.fused_forward import fuse  # imported only when asked for: Triton is optional

        self.skinny_matmul, self.pdl = skinny_matmul, pdl
        super().__init__(fuse(model, skinny=skinny_matmul, pdl=pdl, projections=self.projections_class()),
                         cache, backend, max_model_len, dummy_block, max_batch, capture, inputs_class)

    @staticmethod
    def projections_class() -> type:
        """How the projections are packed and multiplied (a method: imported only once Triton is needed)."""
        from step13_fused_decode.packed_projections import PackedProjections

        return PackedProjections

    def context(self, meta: AttentionMetadata, positions: torch.Tensor):  # noqa: ANN201
        from step13_fused_decode.fused_forward import FusedDecodeForward

        return FusedDecodeForward(self.cache, self.backend, meta, positions, self.pdl)

    def greedy_tokens(self, hidden) -> torch.Tensor:  # noqa: ANN001
        return self.model.greedy_tokens(hidden)  # up to 16 rows: from the head's multiply, no logits

    def describe(self) -> str:
        skinny = ", skinny matrix multiplies" if self.skinny_matmul else ""
        pdl = ", launched with programmatic dependent launch" if self.pdl else ""
        return f"{super().describe()}; fused ops: packed projections{skinny}, fused element-wise kernels{pdl}"


class FusedMixedGraphs(MixedStepGraphs):
    """Step 12's mixed-step graphs over the decode graphs' fused twin of the model: a prompt's chunk runs the packed
    projections and the fused element-wise kernels as decode does. On the plain model, a 32-token prompt alone
    spent about 1.5 ms of its 8.2 ms step on separate norm, activation and add kernels (an H100, the 7B)."""

    def context(self, meta: AttentionMetadata, positions: torch.Tensor, tile_request: torch.Tensor,
                tile_index: torch.Tensor):  # noqa: ANN201
        from step13_fused_decode.fused_forward import FusedMixedForward

        return FusedMixedForward(self.cache, self.backend, meta, positions, tile_request, tile_index,
                                 self.model.pdl)

    def last_tokens(self, hidden, rows: int):  # noqa: ANN001, ANN201 - the fused model's PreparedNorm
        """Each row's last token of the residual stream, for the output head's own norm to read."""
        from step13_fused_decode.packed_projections import PreparedNorm

        return PreparedNorm(hidden.stream[self.inputs.sample_index[:rows]], norm=None)

    def greedy_tokens(self, hidden) -> torch.Tensor:  # noqa: ANN001
        return self.model.greedy_tokens(hidden)  # as the fused decode graphs: the head's argmax, up to 16 rows


class FusedVerifyGraphs(VerifyStepGraphs, FusedMixedGraphs):
    """Step 12's verification graphs over the decode graphs' fused twin of the model, as the mixed steps: a
    verification row of k + 1 tokens is small enough for the skinny multiply too."""


class FusedDecodeEngine(CudaGraphEngine):
    config_class = FusedDecodeEngineConfig
    # The graphs of the fused path (attributes: a later step names subclasses of its own).
    fused_graphs_class: type[FusedDecodeGraphs] = FusedDecodeGraphs
    fused_mixed_graphs_class: type[FusedMixedGraphs] = FusedMixedGraphs
    fused_verify_graphs_class: type[FusedVerifyGraphs] = FusedVerifyGraphs

    @classmethod
    def skips_all_reduces(cls, config: FusedDecodeEngineConfig) -> bool:
        return config.fused_ops is not False  # packed projections are not split over ranks yet

    def __init__(self, loaded: LoadedModel, config: FusedDecodeEngineConfig) -> None:
        if config.fused_ops and not config.cuda_graph:
            raise ValueError("--fused-ops changes the graph decode path: drop --no-cuda-graph to use it")
        super().__init__(loaded, config)

    @staticmethod
    def supports_pdl(device: torch.device) -> bool:
        """Whether kernels on `device` can use programmatic dependent launch (compute capability 9.0 or later)."""
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9

    def backend_classes(self, config: FusedDecodeEngineConfig) -> dict[str, type[AttentionBackend]]:
        """Step 12's, the Triton backend's KV-write and decode kernels launched with PDL where the fused decode
        may use it (so that the o projection after attention is placed early); --no-pdl keeps step 12's."""
        classes = super().backend_classes(config)
        if config.cuda_graph and config.pdl is not False and config.fused_ops is not False and self.supports_pdl(
                self.device):
            from step13_fused_decode.attention_pdl import PDLTritonBackend  # Triton is optional

            classes["triton"] = PDLTritonBackend
        return classes

    def build_graphs(self, config: FusedDecodeEngineConfig) -> DecodeGraphs:
        fused_ops = self.eager_reason is None if config.fused_ops is None else config.fused_ops
        if fused_ops:
            require_triton_device(self.device)
        skinny_matmul = fused_ops if config.skinny_matmul is None else config.skinny_matmul
        if skinny_matmul and not fused_ops:
            raise ValueError("--skinny-matmul runs the packed projections of the fused decode path: add --fused-ops")
        can_pdl = fused_ops and self.supports_pdl(self.device)
        pdl = can_pdl and self.eager_reason is None if config.pdl is None else config.pdl
        if pdl and not can_pdl:
            raise ValueError("--pdl launches the fused decode path's kernels with programmatic dependent launch, "
                             "which needs --fused-ops and a GPU of compute capability 9.0 or later: drop --pdl")
        if not fused_ops:
            return super().build_graphs(config)  # step 12's graphs, over the plain model
        return self.fused_graphs_class(self.model, self.cache, self.backend, self.max_model_len, self.dummy_block,
                                       self.max_graph_batch(config), capture=self.eager_reason is None,
                                       inputs_class=self.decode_inputs_class, skinny_matmul=skinny_matmul, pdl=pdl)

    def build_mixed_graphs(self, config: FusedDecodeEngineConfig) -> MixedStepGraphs:
        if not isinstance(self.graphs, FusedDecodeGraphs):
            return super().build_mixed_graphs(config)  # --no-fused-ops: step 12's, over the plain model
        return self.fused_mixed_graphs_class(self.graphs.model, self.cache, self.backend, self.max_model_len,
                                             self.dummy_block, self.worst_step_tokens(config), config.max_num_seqs,
                                             capture=self.eager_reason is None)

    def build_verify_graphs(self, config: FusedDecodeEngineConfig) -> VerifyStepGraphs:
        if not isinstance(self.graphs, FusedDecodeGraphs):
            return super().build_verify_graphs(config)  # --no-fused-ops: step 12's, over the plain model
        return self.fused_verify_graphs_class(self.graphs.model, self.cache, self.backend, self.max_model_len,
                                              self.dummy_block, self.verify_max_tokens(config), config.max_num_seqs,
                                              capture=self.eager_reason is None)
