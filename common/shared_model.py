"""Every step's engine on one loaded model, one after another: the cross-step comparison and step 05's table.

Sharing the model makes the figures differ only by what the steps do. Engines are built one at a time and freed
before the next: engines on one GPU would each hold a KV pool, and a later engine may re-lay the shared weights
out (step 13 packs its projections), which a graph captured earlier by another engine would still point at.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, fields
from typing import TYPE_CHECKING

from common.steps import engine_class

if TYPE_CHECKING:  # for the annotations only: torch and the engines load when an engine is built
    import torch

    from common.engine import Engine, EngineConfig
    from common.loading import LoadedModel


def build_engine(name: str, loaded: LoadedModel, base: EngineConfig, blocks: int, attn: str, largest_batch: int
                 ) -> Engine:
    """Step `name`'s engine on the shared model, with `base`'s settings and those every step gets where its config
    has them: a KV pool of `blocks` blocks, the attention backend `attn`, and graphs captured only up to the
    largest batch measured."""
    step_engine = engine_class(name)
    settings = asdict(base) | {"num_blocks": blocks, "attn": attn, "max_graph_batch": largest_batch}
    accepted = {f.name for f in fields(step_engine.config_class) if f.init}
    return step_engine(loaded, step_engine.config_class(**{k: v for k, v in settings.items() if k in accepted}))


def release_memory(device: torch.device) -> None:
    """Give back what a dropped engine held (engines keep reference cycles: collect them first)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
