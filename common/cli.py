"""The command line every step's `run.py` shares, so any two steps can be compared on the same input.

    .venv/bin/python stepNN_name/run.py                      # the embedded model on a few prompts, checked against HF
    .venv/bin/python stepNN_name/run.py --dry-run            # tiny random models of each architecture, checked, seconds
    .venv/bin/python stepNN_name/run.py --bench              # throughput against HF generate(), JSON evidence in runs/
    .venv/bin/python stepNN_name/run.py --prompts-file p.txt --output-json out.json --max-tokens 64

A step with its own switches passes `add_arguments`; its engine's `config_class` has fields of the same names.

Every value is checked before anything loads (`check_args`): a bad one ends the program with one line on
stderr that says what to give instead, `error: --max-tokens must be at least 1 (got 0)`, and exit code 2. A
number's smallest value is declared with its flag, `type=at_least(1)`, wherever the flag is added.
compare.py, step 08's server and the benchmark scripts use the same checks and the same `Parser`.

Parsing and checking import no torch, transformers or engine: those take seconds to load, so this module imports
them inside the functions that run once the command line is accepted, and `--help` or a refused value answers
at once. The engine is looked up by the step's name in common/steps.py.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from common.config import EMBEDDED_MODEL, TINY_ARCHES, model_names_help
from common.prompts import DEMO_PROMPTS
from common.steps import find_step

if TYPE_CHECKING:  # for the annotations only (they load torch)
    from common.engine import Engine
    from common.request import Completion


# ----- checking the command line ---------------------------------------------------------------------------


class CommandLineError(ValueError):
    """A command-line value that cannot work; the message names the flag, the value, and what to give instead."""


class Parser(argparse.ArgumentParser):
    """argparse's parser with its own errors (an unknown flag, `--max-tokens x`) as one line and exit code 2:
    the default prints the whole usage block first, which buries the one line that matters. A flag added
    again replaces the earlier one (`refuse_flag` relies on it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, conflict_handler="resolve", **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


class RefusedFlag(argparse.Action):
    """A flag of an earlier step that changes nothing in this one: given, it ends the program with one line."""

    def __init__(self, option_strings: list[str], dest: str, why: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} does nothing in this step: {self.why}")


def refuse_flag(parser: argparse.ArgumentParser, *flags: str, why: str) -> None:
    """Turn an earlier step's `flags` (added already) into ones this step refuses, saying `why`."""
    parser.add_argument(*flags, action=RefusedFlag, why=why)


def fail(err: Exception) -> int:
    """Print `err` as the one line a user reads, and return the exit code of a bad command line."""
    print(f"error: {err}", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class BelowMinimum:
    """A number given under its flag's minimum, kept as given for `check_args` to refuse with the other values:
    argparse's own refusal would print the usage block, and a caller (a test, the exercise runner) could not
    catch it as a CommandLineError."""

    value: float
    minimum: int


def at_least(minimum: int, number: Callable[[str], float] = int) -> Callable[[str], float | BelowMinimum]:
    """argparse's `type=` for a number of at least `minimum`, declared with its flag: `type=at_least(1)`."""

    def parse(text: str) -> float | BelowMinimum:
        value = number(text)
        # `not value >= minimum` rather than `value < minimum`: it also refuses nan, which compares false to anything.
        return BelowMinimum(value, minimum) if not value >= minimum else value

    parse.__name__ = number.__name__  # argparse's "invalid int value: 'x'" names it
    return parse


DTYPES = ("auto", "float32", "bfloat16", "float16")  # the names EngineConfig.resolved_dtype accepts


def check_at_least(flag: str, value: float | None, minimum: int) -> None:
    """A number given on the command line is at least `minimum` (None: not given, nothing to check)."""
    # `not value >= minimum` rather than `value < minimum`: it also refuses nan, which compares false to anything.
    if value is not None and not value >= minimum:
        raise CommandLineError(f"{flag} must be at least {minimum} (got {value})")


def parse_sizes(flag: str, text: str) -> list[int]:
    """`"1,4,8"` -> [1, 4, 8]: comma-separated whole numbers of at least 1 (batch sizes, lengths)."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdecimal() and int(part) >= 1 for part in parts):
        raise CommandLineError(f"{flag} takes comma-separated whole numbers of at least 1, like 1,4,8 (got {text!r})")
    return [int(part) for part in parts]


def parse_names(flag: str, text: str, allowed: Collection[str]) -> list[str]:
    """`"a,b"` -> ["a", "b"], each one of `allowed` (compare.py's --steps)."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise CommandLineError(f"{flag} has unknown names {', '.join(unknown)}: choose from {','.join(allowed)}")
    return names


def available_devices() -> list[str]:
    """The devices this machine has, as --device names them."""
    import torch  # here, not at the top: only a --device other than auto needs it

    devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def check_device(device: str) -> None:
    """auto, cpu, cuda, cuda:N or mps, and one this machine has: a missing GPU is one line here rather than a
    long traceback from deep inside torch once the model starts loading."""
    if device == "auto":
        return
    have = available_devices()
    if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", device):
        raise CommandLineError(f"--device {device} is not a device: give auto, cpu, cuda, cuda:N or mps "
                               f"(this machine has: {', '.join(have)})")
    # Plain cuda is cuda:0, and cuda:01 is cuda:1.
    name = f"cuda:{int(device.partition(':')[2] or 0)}" if device.startswith("cuda") else device
    if name not in have:
        raise CommandLineError(f"--device {device} is not available: this machine has: {', '.join(have)} "
                               "(give one of those, or auto)")


def check_args(args: argparse.Namespace) -> None:
    """Check the flags the command lines share (a number under its flag's `at_least`, --device, --dtype,
    --batch-sizes, ...) on whichever parser made `args`, before anything loads; raises CommandLineError for the
    first bad value. A program checks its own other flags (compare.py's --steps) with the helpers above."""
    given = vars(args)
    for name, value in given.items():
        if isinstance(value, BelowMinimum):
            check_at_least("--" + name.replace("_", "-"), value.value, value.minimum)
    if "device" in given:
        check_device(args.device)
    if "dtype" in given and args.dtype not in DTYPES:
        raise CommandLineError(f"--dtype {args.dtype} is not a dtype: give {', '.join(DTYPES)}")
    if "batch_sizes" in given:
        parse_sizes("--batch-sizes", args.batch_sizes)
    if given.get("kv_memory_gb") is not None and not args.kv_memory_gb > 0:
        raise CommandLineError(f"--kv-memory-gb must be more than 0 (got {args.kv_memory_gb})")
    if "port" in given and not 1 <= args.port <= 65535:
        raise CommandLineError(f"--port must be between 1 and 65535 (got {args.port})")
    if given.get("prompts_file") is not None and not args.prompts_file.is_file():
        problem = "is not a file" if args.prompts_file.exists() else "does not exist"
        raise CommandLineError(f"--prompts-file {args.prompts_file} {problem}: "
                               "give a text file with one prompt per line")


# ----- the shared run.py ------------------------------------------------------------------------------------


def build_parser(description: str) -> argparse.ArgumentParser:
    p = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of: {model_names_help()}")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto (default: cuda if there is one)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-tokens", type=at_least(1), default=None,
                   help="new tokens per request (default: run 48, bench 128, dry run 12)")
    p.add_argument("--temperature", type=at_least(0, float), default=0.0,
                   help="0 (default) is greedy, and is checked against HF")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and for sampling")
    p.add_argument("--max-num-seqs", type=at_least(1), default=256, help="most requests running at once")
    p.add_argument("--max-model-len", type=at_least(1), default=None, help="context limit (default: the model's)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line (write \\n for a newline), chat-templated")
    p.add_argument("--output-json", type=Path, help="write [{prompt, token_ids, text, finish_reason}] here")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with HF generate()")
    p.add_argument("--profile", type=at_least(1), nargs="?", const=8, default=None, metavar="STEPS",
                   help="profile STEPS engine steps (default 8) after 2 to warm up: a trace under runs/profile/ "
                        "for https://ui.perfetto.dev, and where each step's time went, phase by phase (step 05)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="tiny random models of each architecture, checked")
    mode.add_argument("--bench", action="store_true", help="throughput against HF generate(); writes JSON evidence")
    bench = p.add_argument_group("benchmark")
    bench.add_argument("--batch-sizes", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    bench.add_argument("--prompt-len", type=at_least(1), default=32, help="prompt tokens per request (default 32)")
    bench.add_argument("--workload", choices=["fixed", "nanovllm"], default="fixed",
                       help="fixed: batch x prompt-len x max-tokens; nanovllm: 256 seqs, lengths in [100, 1024]")
    bench.add_argument("--repeats", type=at_least(1), default=1, help="runs per point; the median is kept")
    bench.add_argument("--no-hf", action="store_true", help="skip the HF generate() baseline")
    bench.add_argument("--bench-output", type=Path,
                       help="evidence file (default runs/<step>/bench-<device>-<model>.json, numbered if taken)")
    return p


def main(
    step_name: str,
    description: str | None,
    argv: Sequence[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """The run.py of step `step_name`: its command line checked, then its engine (named in common/steps.py) run."""
    parser = build_parser(description or step_name)
    if add_arguments:
        add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_args(args)  # before any model loads
    except CommandLineError as err:
        return fail(err)
    # Only now, with the command line accepted, do torch, transformers and the engine load.
    from common.loading import ModelLoadError

    try:
        engine_class = find_step(step_name).engine_class()
        if args.dry_run:
            return dry_run(engine_class, args)
        if args.bench:
            return bench(engine_class, step_name, args)
        return run_prompts(engine_class, args, step_name)
    except (ModelLoadError, ValueError) as err:  # CommandLineError is a ValueError
        return fail(err)


def read_prompts(path: Path | None) -> list[str]:
    """The prompts of --prompts-file (check_args has made sure it is a file), or the demo prompts without one."""
    if path is None:
        return list(DEMO_PROMPTS)
    prompts = [line.replace("\\n", "\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts: write one prompt per line")
    return prompts


def write_completions(path: Path, prompts: list[str], completions: list[Completion]) -> None:
    """--output-json: one row per prompt, in prompt order, the same rows from every step's run."""
    from common.bench import write_json  # loads torch: only once a run has finished

    rows = [{"prompt": p, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason.value}
            for p, c in zip(prompts, completions, strict=True)]
    write_json(path, rows)


def report_parity(engine: Engine, prompt_ids: list[list[int]], completions: list[Completion], max_tokens: int) -> bool:
    from common.checks import check_against_reference  # loads transformers: only once a run has started

    reports = check_against_reference(engine, prompt_ids, completions, max_tokens)
    for i, report in enumerate(reports):
        print(f"  prompt {i:2d}: {len(completions[i].token_ids):3d} tokens, {report.describe()}")
    ok = all(r.ok for r in reports)
    same = sum(r.equal for r in reports)
    print(f"parity with HF generate(): {same}/{len(reports)} identical, "
          f"{sum(r.ok and not r.equal for r in reports)} near-ties, {'OK' if ok else 'FAILED'}")
    return ok


def run_prompts(engine_class: type[Engine], args: argparse.Namespace, step_name: str) -> int:
    """The default run: generate for each prompt, print it, and check it against HF generate()."""
    from common.bench import default_output  # loads torch: only once the command line is accepted
    from common.sampling import SamplingParams

    prompts = read_prompts(args.prompts_file)
    max_tokens = 48 if args.max_tokens is None else args.max_tokens
    engine = engine_class.from_args(args)
    print(f"[{engine_class.__name__}] model {args.model} on {engine.device} ({engine.model.dtype})")
    prompt_ids = [engine.tokenizer.apply_chat_template(p) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    if args.profile:  # the same generation, some of its steps under the profiler (step 05)
        from common.profiling.profiler import format_report, profile_generate

        trace = default_output("profile", step_name, engine.device.type, args.model)
        completions, report = profile_generate(engine, prompt_ids, params, args.profile, trace)
    else:
        completions = engine.generate(prompt_ids, params)
    elapsed = time.perf_counter() - start
    for prompt, c in zip(prompts, completions):
        print(f"\n>>> {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish: {c.finish_reason.value}]")
    total = sum(len(c.token_ids) for c in completions)
    print(f"\n{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tok/s ({len(prompts)} prompts together)")
    if engine.memory_report():
        print(engine.memory_report())
    if args.profile:
        print(f"\n[profile] {format_report(report)}\n(the tok/s above include the profiler's own cost)")
    if args.output_json:
        write_completions(args.output_json, prompts, completions)
    if args.temperature > 0 or args.no_check:
        print("parity check not run (sampling, or --no-check)")
        return 0
    return 0 if report_parity(engine, prompt_ids, completions, max_tokens) else 1


def dry_run(engine_class: type[Engine], args: argparse.Namespace) -> int:
    """Tiny random models of every architecture, requests arriving while others decode, checked against HF."""
    from common.checks import staggered_generate  # loads torch: only once the command line is accepted
    from common.sampling import SamplingParams
    from common.shared_model import release_memory

    config_class = engine_class.config_class
    ok = True
    for arch in TINY_ARCHES:
        # float32 for exact comparisons; the CPU unless a device was asked for (`--device cuda` checks a GPU).
        device = "cpu" if args.device == "auto" else args.device
        config = replace(config_class.from_args(args), model=f"tiny-{arch}", device=device, dtype="float32")
        engine = engine_class.from_config(config)
        prompt_ids = [engine.tokenizer.apply_chat_template(p) for p in DEMO_PROMPTS]
        max_tokens = 12 if args.max_tokens is None else args.max_tokens
        completions = staggered_generate(engine, prompt_ids, SamplingParams(max_tokens=max_tokens), arrive_every=2)
        print(f"[dry run] tiny-{arch}: {len(prompt_ids)} requests arriving every 2 steps")
        ok &= report_parity(engine, prompt_ids, completions, max_tokens)
        # On a GPU each engine sizes its KV pool from the memory left free: the next one needs this one's back.
        engine_device = engine.device
        del engine
        release_memory(engine_device)
    print(f"dry run {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def bench(engine_class: type[Engine], step_name: str, args: argparse.Namespace) -> int:
    """This step against HF generate() on the same weights and workload; writes JSON evidence."""
    import torch  # these load torch and transformers: only once the command line is accepted

    from common.bench import (
        Workload,
        default_output,
        evidence_header,
        fixed_workload,
        format_table,
        median_of,
        nanovllm_workload,
        run_engine,
        run_hf_generate,
        write_evidence,
    )
    from common.reference import hf_model_for

    engine = engine_class.from_args(args)
    max_tokens = 128 if args.max_tokens is None else args.max_tokens
    if args.workload == "nanovllm":
        workloads = [nanovllm_workload(seed=args.seed)]
    else:
        sizes = parse_sizes("--batch-sizes", args.batch_sizes)
        workloads = [fixed_workload(b, args.prompt_len, max_tokens, seed=args.seed) for b in sizes]
    hf = None if args.no_hf else hf_model_for(engine.loaded)
    pad = min(engine.eos_token_ids) if engine.eos_token_ids else 0
    # Taken before the runs: the commit and dirty flag describe the code that is about to run.
    header = evidence_header(
        engine.device, args.model, engine.model.dtype, step=step_name, engine=engine_class.__name__,
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        torch_threads=torch.get_num_threads(),
    )
    runs = []
    for workload in workloads:
        print(f"[bench] {workload.name} ...", flush=True)
        # Warm up on the same batch and prompt shapes (kernel selection, allocator), with few new tokens.
        warmup = Workload("warmup", workload.prompts, [min(n, 8) for n in workload.output_lens])
        run_engine(engine, warmup, step_name)
        runs.append(median_of(lambda: run_engine(engine, workload, step_name), args.repeats))
        if hf is not None and len(set(workload.output_lens)) == 1:
            run_hf_generate(hf, warmup, pad)
            runs.append(median_of(lambda: run_hf_generate(hf, workload, pad), args.repeats))
    print(format_table(runs))
    output = args.bench_output or default_output(step_name, "bench", engine.device.type, args.model)
    write_evidence(output, header, runs, workloads)
    return 0
