"""Step 04: one model over several processes. With tensor parallelism each rank holds 1/N of every layer's
weights and KV heads, and the ranks add up their partial results with two all-reduces a layer; every rank runs
the same engine (by default the final one) on the requests rank 0 hands it.

Examples:
    .venv/bin/python step04_multi_gpu/run.py --dry-run                 # tiny models over 2 or 3 CPU processes, checked
    .venv/bin/python step04_multi_gpu/run.py                           # the embedded model (3 KV heads) over 3 processes
    .venv/bin/python step04_multi_gpu/run.py --tensor-parallel-size 2  # refused: 2 does not divide 3 KV heads
    .venv/bin/python step04_multi_gpu/run.py --batch-invariant --output-json out.json  # any flag of the --step run
    torchrun --nproc-per-node 2 step04_multi_gpu/run.py --device cuda --model random:qwen2.5-7b --no-check
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from common.cli import (
    CommandLineError,
    Parser,
    at_least,
    build_parser,
    check_args,
    fail,
    read_prompts,
    refuse_flag,
    write_completions,
)
from common.config import TINY_ARCHES
from common.prompts import DEMO_PROMPTS
from common.steps import STEP_NAMES, find_step


def chosen_step(argv: Sequence[str] | None) -> str:
    """--step alone, read first: the flags the rest of the command line may hold are that step's."""
    first = Parser(add_help=False)
    first.add_argument("--step", choices=STEP_NAMES, default=STEP_NAMES[-1])
    return first.parse_known_args(argv)[0].step


def build_step_parser(step: str) -> argparse.ArgumentParser:
    """The shared command line, the flags of `step` (the engine every rank runs) and the ranks' own."""
    parser = build_parser(__doc__)
    find_step(step).add_arguments(parser)
    ranks = parser.add_argument_group("multi-GPU")
    ranks.add_argument("--tensor-parallel-size", type=at_least(1), default=None,
                       help="processes the model is split over (default: the smallest size above 1 that divides its "
                            "heads; under torchrun, its number of processes)")
    ranks.add_argument("--step", default=STEP_NAMES[-1], choices=STEP_NAMES,
                       help="the engine every rank runs, steps 06 and later (default: the final one); its own flags "
                            "are offered with it (--step step12_cuda_graph --help lists them)")
    ranks.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                       help="the model's collectives: nccl between GPUs (default there), gloo on CPUs; gloo on a GPU "
                            "lets ranks share one GPU, to check correctness, with the eager steps 06 to 11")
    refuse_flag(parser, "--profile", why="the ranks run in processes of their own; profile one engine with its "
                "step's run.py --profile (step 05)")
    return parser


def tensor_parallel_size(args: argparse.Namespace, model_config: object) -> int:
    """The size asked for, or under torchrun its world, or the smallest above 1 that splits the model."""
    from step04_multi_gpu.sharding import sizes_that_divide

    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if args.tensor_parallel_size is not None:
        return args.tensor_parallel_size
    above_one = [n for n in sizes_that_divide(model_config) if n > 1]
    return above_one[0] if above_one else 1


def generate_and_check(args: argparse.Namespace, config: object, texts: list[str], max_tokens: int,
                       arrive_every: int, label: str, show: bool = False, output_json: Path | None = None) -> bool:
    """Run the chat prompts over the ranks, request i joining after i x `arrive_every` steps (their rows written
    to `output_json`, if given); check the tokens against one process and HF, and that every rank emitted the
    same and holds nothing at the end."""
    from common.checks import check_model_against_reference, staggered_generate
    from common.loading import load_model
    from common.sampling import SamplingParams
    from step04_multi_gpu.tensor_parallel import TensorParallelEngine

    whole = load_model(config.model, config.resolved_device(), config.resolved_dtype(), config.seed)
    prompts = [whole.tokenizer.apply_chat_template(t) for t in texts]
    size = tensor_parallel_size(args, whole.model.config)
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
    started = time.perf_counter()
    with TensorParallelEngine(args.step, config, size, args.distributed_backend) as engine:
        print(f"[{type(engine.engine).__name__}] {config.model} over {size} ranks on {engine.device} "
              f"(started in {time.perf_counter() - started:.1f} s)")
        started = time.perf_counter()
        completions = staggered_generate(engine, prompts, params, arrive_every)
        elapsed = time.perf_counter() - started
        reports = engine.rank_reports()
        eos = engine.eos_token_ids
    for text, completion in zip(texts, completions, strict=True) if show else ():
        print(f"\n>>> {text}\n{completion.text}\n[{len(completion.token_ids)} tokens]")
    if output_json is not None:
        write_completions(output_json, texts, completions)
    total = sum(len(c.token_ids) for c in completions)
    print(f"{label}: {len(prompts)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)")
    in_step = len({r["emitted"] for r in reports}) == 1
    empty = all(r["requests"] == 0 and r["blocks_used"] == 0 for r in reports)
    print(f"  every rank emitted the same tokens: {'yes' if in_step else 'NO'}; "
          f"every rank holds nothing at the end: {'yes' if empty else 'NO'}")
    if args.temperature > 0 or args.no_check:
        print("  parity check not run (sampling, or --no-check)")
        return in_step and empty
    one = find_step(args.step).engine_class()(whole, replace(config, device=str(whole.model.device)))
    alone = one.generate(prompts, params)
    same = sum(a.token_ids == b.token_ids for a, b in zip(completions, alone, strict=True))
    print(f"  the same as one process: {same}/{len(prompts)}")
    # HF on the weights one process runs: the loaded ones, or what its engine made of them (step 17's FP8).
    parity = check_model_against_reference(one.loaded, eos, prompts, completions, max_tokens)
    for i, report in enumerate(parity):
        print(f"  prompt {i:2d}: {len(completions[i].token_ids):3d} tokens, {report.describe()}")
    ok = all(r.ok for r in parity)
    print(f"  parity with HF generate(): {sum(r.equal for r in parity)}/{len(parity)} identical, "
          f"{'OK' if ok else 'FAILED'}")
    return in_step and empty and same == len(prompts) and ok


def main(argv: Sequence[str] | None = None) -> int:
    args = build_step_parser(chosen_step(argv)).parse_args(argv)
    try:
        check_args(args)
        if args.bench:
            raise CommandLineError("--bench: step 04's measurements run on GPUs, in scripts/gpu_suite.sh (not yet "
                                   "here); run without --bench")
    except CommandLineError as err:
        return fail(err)
    from common.loading import ModelLoadError
    from step04_multi_gpu.sharding import TensorParallelConfigError
    from step04_multi_gpu.tensor_parallel import Launch, RankDiedError, check_splits, follow_rank_zero

    step = find_step(args.step)
    config = step.engine_class().config_class.from_args(args)
    device_type = config.resolved_device().type
    backend = args.distributed_backend or ("nccl" if device_type == "cuda" else "gloo")
    rank = int(os.environ.get("RANK", 0))
    if rank:  # started by torchrun: this process follows rank 0's commands
        follow_rank_zero(Launch(rank, int(os.environ["WORLD_SIZE"]), device_type, None, backend), args.step, config)
        return 0
    try:
        check_splits(step, config, backend)  # once, in one line, before any model loads (the dry run's too)
        if args.dry_run:
            ok, checked, skipped = True, [], []
            for arch in TINY_ARCHES:
                tiny = replace(config, model=f"tiny-{arch}", dtype="float32",
                               device="cpu" if args.device == "auto" else args.device)
                try:
                    ok &= generate_and_check(args, tiny, list(DEMO_PROMPTS), args.max_tokens or 12, 2,
                                             f"[dry run] tiny-{arch}")
                    checked.append(tiny.model)
                except TensorParallelConfigError as err:  # its heads need more GPUs than there are
                    print(f"[dry run] tiny-{arch}: not run: {err}")
                    skipped.append(tiny.model)
            print(f"dry run {'OK' if ok and checked else 'FAILED'}: checked {', '.join(checked) or 'nothing'}"
                  + (f"; not run: {', '.join(skipped)}" if skipped else ""))
            return 0 if ok and checked else 1
        ok = generate_and_check(args, config, read_prompts(args.prompts_file), args.max_tokens or 48, 0,
                                f"{config.model}", show=True, output_json=args.output_json)
        return 0 if ok else 1
    except (ModelLoadError, TensorParallelConfigError, ValueError) as err:
        return fail(err)
    except RankDiedError as err:  # not a bad command line: the run failed
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # every rank is stopped on the way out (TensorParallelEngine.close)
        print("interrupted: every rank stopped")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
