"""Step 05: where a step's time goes, for every step, on one workload.

Each step's engine (one at a time, on one shared model) gets `--batch` requests of `--prompt-len` tokens,
runs until they all decode, then `--profile-steps` steps under the profiler. Each step's trace goes to
runs/profile/traces/, and one evidence file holds every step's table and breakdown, with its plot beside it.

    .venv/bin/python step05_profiling/run.py                                  # every step, embedded model, CPU
    .venv/bin/python step05_profiling/run.py --steps step01_serial,step06_paged_attention
    .venv/bin/python step05_profiling/run.py --device cuda --model random:qwen2.5-7b
    .venv/bin/python step05_profiling/run.py --dry-run          # steps 01, 06, 09 on a tiny model, traces checked

Any step's own run.py profiles its own run: `step06_paged_attention/run.py --profile`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.cli import CommandLineError, Parser, at_least, check_args, fail, parse_names
from common.config import EMBEDDED_MODEL
from common.steps import STEP_NAMES

if TYPE_CHECKING:  # torch and the engines load once the command line is accepted
    from common.engine import Engine, EngineConfig
    from common.loading import LoadedModel
    from common.profiling.profiler import ProfileReport


@dataclass(frozen=True)
class Variant:
    """A row of the table: a step's engine, with some of its switches set."""
    name: str
    step: str
    switches: dict = field(default_factory=dict)


# The seed's bug, kept in step 06 as an ablation: a host read in every layer (see the lesson).
SYNC_PER_LAYER = Variant("step06_paged_attention --sync-per-layer", "step06_paged_attention", {"sync_per_layer": True})
VARIANTS = {**{name: Variant(name, name) for name in STEP_NAMES}, "step06_sync_per_layer": SYNC_PER_LAYER}
DRY_RUN_STEPS = ("step01_serial", "step06_paged_attention", "step09_chunked_prefill")
PHASE_TOLERANCE = 0.10  # the named phases must cover all but this share of a step


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--steps", default=",".join(VARIANTS),
                   help=f"comma-separated, of {','.join(VARIANTS)} (default: all)")
    p.add_argument("--batch", type=at_least(1), default=8, help="requests decoding together (default 8)")
    p.add_argument("--prompt-len", type=at_least(1), default=32)
    p.add_argument("--profile-steps", type=at_least(1), default=8, help="engine steps profiled per row (default 8)")
    p.add_argument("--dry-run", action="store_true", help="steps 01, 06 and 09 on tiny-llama: traces checked")
    p.add_argument("--output", type=Path, help="evidence file (default runs/profile/steps-<device>-<model>.json)")
    p.add_argument("--no-plot", action="store_true", help="no bars drawn beside the evidence file")
    return p


def decoding_engine(variant: Variant, loaded: LoadedModel, config: EngineConfig, batch: int, prompt_len: int,
                    steps: int) -> Engine:
    """`variant`'s engine on the shared model, its `batch` requests past their prefill and decoding."""
    from dataclasses import replace

    from common.bench import fixed_workload
    from common.sampling import SamplingParams
    from common.shared_model import build_engine
    from step02_paged_kv.engine import PagedEngineConfig

    workload = fixed_workload(batch, prompt_len, seed=0)
    max_tokens = 8 * steps + 32  # room for the warm-up, the timed and the profiled steps, even at several tokens a step
    blocks = batch * -(-(prompt_len + max_tokens) // 16) + 8
    base = PagedEngineConfig(model=config.model, device=str(loaded.model.device), dtype=config.dtype)
    engine = build_engine(variant.step, loaded, base, blocks, "auto", batch)
    for name, value in variant.switches.items():
        engine.config = replace(engine.config, **{name: value})
    for prompt in workload.prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.waiting or not all(r.output_token_ids for r in engine.running):
        engine.step()
    for _ in range(2):  # and a first few decode steps: buckets chosen, caches warm
        engine.step()
    return engine


def profile_variant(variant: Variant, loaded: LoadedModel, config: EngineConfig, args: argparse.Namespace,
                    trace: Path) -> tuple[ProfileReport, float]:
    """The variant's decode steps timed, then profiled: the report and the unprofiled ms per step."""
    from common.profiling.profiler import profile_steps

    engine = decoding_engine(variant, loaded, config, args.batch, args.prompt_len, args.profile_steps)
    unprofiled_ms = time_steps(engine, args.profile_steps)
    report = profile_steps(engine, args.profile_steps, trace)
    for request_id in list(engine.requests):
        engine.abort(request_id)  # the rest of the generation would tell nothing more
    return report, unprofiled_ms


def time_steps(engine: Engine, steps: int) -> float:
    """Milliseconds per step over `steps` steps without the profiler, which slows what it watches (every kernel
    launch most of all): the figure to compare steps by; a profile's own figures say where the time goes."""
    import time

    import torch

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return (time.perf_counter() - start) / steps * 1e3


def check_report(name: str, report: ProfileReport) -> bool:
    """The dry run's checks: the trace is JSON with every phase's range, and the phases cover the step."""
    import json

    from common.profiling.phases import STEP_RANGE

    with open(report.trace, encoding="utf-8") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    missing = {STEP_RANGE, "forward", "sample", "process outputs", "detokenize", "prepare inputs"} - names
    s = report.summary()
    uncovered = s["host_ms"]["not in a phase"] / s["step_ms"]
    ok = not missing and uncovered <= PHASE_TOLERANCE
    print(f"[dry run] {name}: trace {report.trace}, ranges missing: {sorted(missing) or 'none'}, "
          f"{uncovered:.1%} of the step in no phase (at most {PHASE_TOLERANCE:.0%}): {'OK' if ok else 'FAILED'}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        names = list(DRY_RUN_STEPS) if args.dry_run else parse_names("--steps", args.steps, VARIANTS)
    except CommandLineError as err:
        return fail(err)
    import torch

    from common.bench import RUNS_DIR, default_output, evidence_header, write_json
    from common.engine import EngineConfig
    from common.loading import ModelLoadError, load_model
    from common.profiling.profiler import format_report, report_dict
    from common.shared_model import release_memory

    model = "tiny-llama" if args.dry_run else args.model
    config = EngineConfig(model=model, device=args.device, dtype="float32" if args.dry_run else args.dtype)
    try:
        loaded = load_model(model, config.resolved_device(), config.resolved_dtype())
    except ModelLoadError as err:
        return fail(err)
    device = loaded.model.device
    header = evidence_header(device, model, loaded.model.dtype, batch=args.batch, prompt_len=args.prompt_len,
                             profile_steps=args.profile_steps, torch_threads=torch.get_num_threads())
    output = args.output or default_output("profile", "steps", device.type, model)
    rows, ok = [], True
    for name in names:
        variant = VARIANTS[name]
        trace = RUNS_DIR / "profile" / "traces" / f"{variant.step}{'-'.join(['', *variant.switches])}-{device.type}.json"
        report, unprofiled_ms = profile_variant(variant, loaded, config, args, trace)
        print(f"\n[{variant.name}] {format_report(report)}\nwithout the profiler: {unprofiled_ms:.3f} ms per step",
              flush=True)
        rows.append({"variant": variant.name, "step": variant.step, "step_ms_unprofiled": unprofiled_ms,
                     **report_dict(report)})
        release_memory(device)
        if args.dry_run:
            ok &= check_report(variant.name, report)
        else:
            write_json(output, header | {"rows": rows})  # after every row: a run cut short keeps its figures
    if args.dry_run:
        print(f"dry run {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    if args.no_plot:
        return 0
    try:
        from common.plots.profile import write_plot

        print(f"wrote {write_plot(output, output.with_suffix('.png'))}")
    except ImportError as err:  # matplotlib is a test extra, not a dependency of the engine
        print(f"no plot written ({err}); pip install matplotlib, then python scripts/plot_profile.py {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
