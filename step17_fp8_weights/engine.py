"""Step 17: FP8 weights. Each decoder layer's projections kept in e4m3 with a scale per row: half the bytes of
bf16, and a decode step's time follows the bytes it reads.

Against step 16, `Fp8WeightsEngine` changes one thing when asked (`quantization="fp8"`, `--quantization fp8`): it
runs a twin of the loaded model whose projections are `Fp8Linear` (`fp8.fp8_twin`), quantized as it starts from
whatever checkpoint was loaded. The embedding, the norms and the output head keep their dtype. Every path, eager or
captured, reads the projections through `Fp8Linear`; on a GPU step 13's fused decode packs them as it packs bf16
ones (`fused_path.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.loading import LoadedModel
from step16_structured_output.engine import StructuredOutputEngine, StructuredOutputEngineConfig
from step17_fp8_weights.fp8 import fp8_twin, projection_bytes, weight_bytes
from step17_fp8_weights.run import QUANTIZATIONS  # one list, where the command line reads it without torch


@dataclass
class Fp8WeightsEngineConfig(StructuredOutputEngineConfig):
    # "fp8": the projections in e4m3 with a scale per row, quantized as the engine starts. None: as loaded.
    quantization: str | None = None


class Fp8WeightsEngine(StructuredOutputEngine):
    config_class = Fp8WeightsEngineConfig

    def __init__(self, loaded: LoadedModel, config: Fp8WeightsEngineConfig) -> None:
        if config.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"--quantization {config.quantization}: the choices are {', '.join(QUANTIZATIONS)}")
        self.loaded_weight_bytes = weight_bytes(loaded.model)
        self.loaded_projection_bytes = projection_bytes(loaded.model)
        if config.quantization == "fp8":
            if config.batch_invariant:
                raise ValueError("--batch-invariant multiplies through its own kernels, which read higher-precision "
                                 "weights, not FP8 ones: drop --quantization or --batch-invariant")
            # No checkpoint folder: the weights are no longer the folder's, and a reference (HF's model) is then
            # built from this model's state, the dequantized weights (`Fp8Linear`'s state_dict).
            loaded = replace(loaded, model=fp8_twin(loaded.model), source_dir=None)
        super().__init__(loaded, config)

    @property
    def fused_graphs_class(self) -> type:  # noqa: D102 (step 13's attribute, chosen by the quantization)
        if self.config.quantization != "fp8":
            return super().fused_graphs_class
        from step17_fp8_weights.fused_path import Fp8DecodeGraphs  # Triton is optional

        return Fp8DecodeGraphs

    def memory_report(self) -> str:
        """Step 16's, and the weights held against the loaded model's: all of them, and the projections alone (what
        FP8 quantizes; the embedding, norms and head keep their dtype)."""
        held, projections = weight_bytes(self.model), projection_bytes(self.model)
        return (f"{super().memory_report()}\nweights: {held / 2**20:,.0f} MiB ({held / self.loaded_weight_bytes:.2f}x "
                f"of the loaded model's {self.loaded_weight_bytes / 2**20:,.0f} MiB); their projections "
                f"{projections / 2**20:,.0f} MiB ({projections / self.loaded_projection_bytes:.2f}x of "
                f"{self.loaded_projection_bytes / 2**20:,.0f} MiB)")
