"""Step 17: FP8 weights. Each decoder layer's projections kept in e4m3 with a scale per row: half the bytes of
bf16, and a decode step's time follows the bytes it reads.

Against step 16, `Fp8WeightsEngine` changes one thing when asked (`quantization="fp8"`, `--quantization fp8`): the
model's projections become `Fp8Linear`, quantized as the engine starts from whatever checkpoint was loaded. The
embedding, the norms and the output head keep their dtype. Every path, eager or captured, reads the projections
through `Fp8Linear`; on a GPU step 13's fused decode packs them as it packs bf16 ones (`fused_path.py`).

Where the quantizing happens decides what the KV pool gets. A model loaded for this engine alone (`on_own_model`:
the command line, the server, each of step 04's ranks) is quantized in place before the engine is built, so its
higher-precision projections are freed before the pool is sized from the memory left. A model other engines share
(a test's, the notebook's) is left as it is, and the engine runs an FP8 twin of it (`fp8.fp8_twin`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.engine import Engine
from common.loading import LoadedModel
from common.shared_model import release_memory
from step16_structured_output.engine import StructuredOutputEngine, StructuredOutputEngineConfig
from step17_fp8_weights.fp8 import fp8_twin, holds_fp8, projection_bytes, quantize_projections, weight_bytes
from step17_fp8_weights.run import QUANTIZATIONS  # one list, where the command line reads it without torch


@dataclass
class Fp8WeightsEngineConfig(StructuredOutputEngineConfig):
    # "fp8": the projections in e4m3 with a scale per row, quantized as the engine starts. None: as loaded.
    quantization: str | None = None


class Fp8WeightsEngine(StructuredOutputEngine):
    config_class = Fp8WeightsEngineConfig

    def __init__(self, loaded: LoadedModel, config: Fp8WeightsEngineConfig) -> None:
        self.check_quantization(config)
        if config.quantization == "fp8":
            model = loaded.model if holds_fp8(loaded.model) else fp8_twin(loaded.model)
            # No checkpoint folder: the weights are no longer the folder's, and a reference (HF's model) is then
            # built from this model's state, the dequantized weights (`Fp8Linear`'s state_dict).
            loaded = replace(loaded, model=model, source_dir=None)
        elif holds_fp8(loaded.model):
            raise ValueError("the model's projections are FP8 already: pass --quantization fp8")
        super().__init__(loaded, config)

    @staticmethod
    def check_quantization(config: Fp8WeightsEngineConfig) -> None:
        if config.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"--quantization {config.quantization}: the choices are {', '.join(QUANTIZATIONS)}")
        if config.quantization == "fp8" and config.batch_invariant:
            raise ValueError("--batch-invariant multiplies through its own kernels, which read higher-precision "
                             "weights, not FP8 ones: drop --quantization or --batch-invariant")

    @classmethod
    def on_own_model(cls, loaded: LoadedModel, config: Fp8WeightsEngineConfig) -> Engine:
        """For FP8, quantize the projections in place before the engine is built: nothing else holds this model, so
        the projections it loaded with are freed first, and the KV pool, sized from the memory left, gets the bytes
        FP8 saves. (A twin would leave them held while the pool is sized.)"""
        cls.check_quantization(config)
        if config.quantization == "fp8":
            quantize_projections(loaded.model)
            release_memory(loaded.model.device)
        return cls(loaded, config)

    @property
    def fused_graphs_class(self) -> type:  # noqa: D102 (step 13's attribute, chosen by the quantization)
        if self.config.quantization != "fp8":
            return super().fused_graphs_class
        from step17_fp8_weights.fused_path import Fp8DecodeGraphs  # Triton is optional

        return Fp8DecodeGraphs

    def memory_report(self) -> str:
        """Step 16's, and the weights held against what they held as loaded: all of them, and the projections alone
        (what FP8 quantizes; the embedding, norms and head keep their dtype)."""
        held, projections = weight_bytes(self.model), projection_bytes(self.model)
        loaded_projections = projection_bytes(self.model, as_loaded=True)
        loaded = held - projections + loaded_projections
        return (f"{super().memory_report()}\nweights: {held / 2**20:,.0f} MiB ({held / loaded:.2f}x of the loaded "
                f"model's {loaded / 2**20:,.0f} MiB); their projections {projections / 2**20:,.0f} MiB "
                f"({projections / loaded_projections:.2f}x of {loaded_projections / 2**20:,.0f} MiB)")
