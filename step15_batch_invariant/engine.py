"""Step 15: batch invariance. A request's tokens and logits, bit for bit, whatever else shares its steps.

A request's numbers depend on its neighbours wherever a kernel picks how to sum by the shape of the batch:
the library's matrix multiply (a matrix-vector kernel for one row, blocked kernels and splits of K for more),
the decode kernel's number of splits, the prefill kernel's tiles against the decode kernel's (`probe.py`
measures which ops vary on a machine). Each pick is correct, and each rounds differently, so a
greedy request can take another token when it is batched with others. Then greedy output is not
reproducible, speculative decoding (step 11) is not exactly output-preserving, and a user cannot test an
application against the server.

`--batch-invariant` (off by default: it costs speed) makes every row's arithmetic a function of that row
alone. Against step 14, `BatchInvariantEngine` changes three things before anything is built or captured:
- the model's linear layers, norms, RoPE and SiLU (`invariant_ops.batch_invariant_twin`): one order of every
  sum for every row count, and on a GPU the same kernels as the fused decode;
- the attention backend (`attention.py`): every row summed over fixed pieces of its keys, in order, whether it
  decodes, ends a prefill chunk, or verifies a proposal.
- on a GPU, step 13's fused decode, whose every op is made the same arithmetic as the model's (`fused_path.py`).
Scheduling, graphs, prefix caching, speculation and overlap are step 14's. Over step 04's ranks the twin's
sharded layers multiply the same way, and add the ranks' partial sums in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.loading import LoadedModel
from step06_paged_attention.backends import AttentionBackend
from step14_overlap_scheduling.engine import OverlapSchedulingEngine, OverlapSchedulingEngineConfig
from step15_batch_invariant.attention import InvariantTorchBackend, InvariantTritonBackend
from step15_batch_invariant.invariant_ops import batch_invariant_twin


@dataclass
class BatchInvariantEngineConfig(OverlapSchedulingEngineConfig):
    # Every kernel computes a row the same way whatever else is in the step. Off: step 14 as it is.
    batch_invariant: bool = False


class BatchInvariantEngine(OverlapSchedulingEngine):
    config_class = BatchInvariantEngineConfig

    def __init__(self, loaded: LoadedModel, config: BatchInvariantEngineConfig) -> None:
        if config.batch_invariant:
            config = self.invariant_config(config, on_gpu=loaded.model.device.type == "cuda")
            loaded = replace(loaded, model=batch_invariant_twin(loaded.model))
        super().__init__(loaded, config)

    @staticmethod
    def invariant_config(config: BatchInvariantEngineConfig, on_gpu: bool) -> BatchInvariantEngineConfig:
        """`config` with what the mode cannot run turned off, or a one-line refusal where it was asked for."""
        if config.skinny_matmul or config.pdl:
            raise ValueError("--batch-invariant multiplies every row count with one kernel and launches plainly: "
                             "drop --skinny-matmul and --pdl")
        if config.fused_ops and not on_gpu:
            raise ValueError("--batch-invariant on a CPU runs the model as it is: drop --fused-ops")
        attn = config.attn if config.attn != "auto" else "triton" if on_gpu else "torch"
        if attn not in ({"triton"} if on_gpu else {"torch", "triton"}):
            raise ValueError(f"--batch-invariant attends with our own kernels, not --attn {config.attn}: use "
                             f"--attn {'triton' if on_gpu else 'torch'}")
        return replace(config, attn=attn, skinny_matmul=False, pdl=False)

    def backend_classes(self, config: BatchInvariantEngineConfig) -> dict[str, type[AttentionBackend]]:
        if not config.batch_invariant:
            return super().backend_classes(config)
        return {"torch": InvariantTorchBackend, "triton": InvariantTritonBackend}

    @property
    def fused_graphs_class(self) -> type:  # noqa: D102 (step 13's attribute, chosen by the mode)
        if not self.config.batch_invariant:
            return super().fused_graphs_class
        from step15_batch_invariant.fused_path import InvariantDecodeGraphs  # Triton is optional

        return InvariantDecodeGraphs

    @property
    def fused_mixed_graphs_class(self) -> type:  # noqa: D102
        if not self.config.batch_invariant:
            return super().fused_mixed_graphs_class
        from step15_batch_invariant.fused_path import InvariantMixedGraphs

        return InvariantMixedGraphs

    @property
    def fused_verify_graphs_class(self) -> type:  # noqa: D102
        if not self.config.batch_invariant:
            return super().fused_verify_graphs_class
        from step15_batch_invariant.fused_path import InvariantVerifyGraphs

        return InvariantVerifyGraphs
