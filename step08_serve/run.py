"""Step 08: an OpenAI-compatible streaming server over one shared engine step loop.

Any step's engine serves (`--step`; default step16_structured_output, the final engine),
with that step's own flags (`--step step09_chunked_prefill --help` lists them: --attn, --preempt,
--max-num-batched-tokens, ...).

Examples:
    .venv/bin/python step08_serve/run.py                               # the embedded model on http://127.0.0.1:8000
    .venv/bin/python step08_serve/run.py --dry-run                     # in-process server + the official openai SDK, tiny model
    .venv/bin/python step08_serve/run.py --model Qwen/Qwen2.5-7B-Instruct --device cuda --port 8000 --api-key secret
    .venv/bin/python step08_serve/run.py --step step14_overlap_scheduling --device cuda --no-overlap
    .venv/bin/python step08_serve/client_example.py                    # talk to a running server
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from common.cli import CommandLineError, Parser, at_least, check_args, fail
from common.config import EMBEDDED_MODEL, model_names_help
from common.steps import STEP_NAMES, engine_class, find_step
from step08_serve.launcher import DEFAULT_STEP, running_server, serve

if TYPE_CHECKING:  # for the annotations only: the command line is checked before the engine and server load
    from fastapi import FastAPI

    from common.engine import Engine


def add_engine_arguments(parser: argparse.ArgumentParser, step: str) -> None:
    """--step, the flags every engine has (those of common/cli.py's command line that build an engine), the
    chosen step's own, and step 04's (split or replicate it). `EngineConfig.from_args` reads each into the
    config field of the same name."""
    parser.add_argument("--step", choices=STEP_NAMES, default=step,
                        help=f"which step's engine serves (default {DEFAULT_STEP}, the final engine); its own flags "
                             "follow below")
    parser.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of: {model_names_help()}")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:1, mps, or auto (default: cuda if there is one)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16, or auto (fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--max-num-seqs", type=at_least(1), default=256, help="most requests running at once")
    parser.add_argument("--max-model-len", type=at_least(1), default=None, help="context limit (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="seed for random weights (tiny-*, random:*)")
    find_step(step).add_arguments(parser)
    parallel = parser.add_argument_group("several devices (step 04)")
    parallel.add_argument("--tensor-parallel-size", type=at_least(1), default=1,
                          help="split the model over this many processes, one per GPU (steps 06 and later)")
    parallel.add_argument("--data-parallel-size", type=at_least(1), default=1,
                          help="this many whole engines, one per GPU, behind a router")


def chosen_step(argv: Sequence[str] | None) -> str:
    """--step alone (or the default), read first: which step's flags the whole command line may hold depends on
    it."""
    first = Parser(add_help=False)
    first.add_argument("--step", choices=STEP_NAMES, default=DEFAULT_STEP)
    return first.parse_known_args(argv)[0].step


def build_parser(step: str) -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server = p.add_argument_group("server")
    server.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: --model)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000, help="1 to 65535 (default 8000)")
    server.add_argument("--api-key", default=os.environ.get("LLM_STEPS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $LLM_STEPS_API_KEY)")
    server.add_argument("--shutdown-grace", type=at_least(0, float), default=30.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C, how long requests in flight may still run (default 30)")
    server.add_argument("--max-queued-outputs", type=at_least(1), default=4096,
                        help="outputs a stream may leave unread before its request is aborted (default 4096)")
    server.add_argument("--dry-run", action="store_true",
                        help="serve a tiny model in-process and call it with the openai SDK")
    add_engine_arguments(p, step)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser(chosen_step(argv)).parse_args(argv)


def build_engine(args: argparse.Namespace) -> Engine:
    """The chosen step's engine, its config taken from the command line like every step's run.py does; split
    over processes (--tensor-parallel-size) or replicated (--data-parallel-size) by step 04."""
    if args.tensor_parallel_size > 1 and args.data_parallel_size > 1:
        raise CommandLineError("--tensor-parallel-size and --data-parallel-size together are not built: choose one")
    config = engine_class(args.step).config_class.from_args(args)
    if args.tensor_parallel_size > 1:
        from step04_multi_gpu.tensor_parallel import TensorParallelEngine

        return TensorParallelEngine(args.step, config, args.tensor_parallel_size)
    if args.data_parallel_size > 1:
        from step04_multi_gpu.replicas import ReplicatedEngine

        return ReplicatedEngine(args.step, config, args.data_parallel_size)
    return engine_class(args.step).from_config(config)


def build_app(args: argparse.Namespace) -> FastAPI:
    from step08_serve.api_server import create_app  # these load torch and the web framework: not for --help
    from step08_serve.async_engine import AsyncEngine

    async_engine = AsyncEngine(build_engine(args), args.max_queued_outputs)
    return create_app(async_engine, args.served_model_name or args.model, args.model, args.api_key)


def dry_run(args: argparse.Namespace) -> int:
    """One streaming and one non-streaming chat request through the official SDK, compared."""
    from openai import OpenAI

    args.model, args.device, args.dtype = "tiny-qwen2", "cpu", "float32"
    served = args.served_model_name or args.model
    with running_server(build_app(args)) as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key or "unused")
        messages = [{"role": "user", "content": "Say hello in Chinese: 你好 🌍"}]
        full = client.chat.completions.create(model=served, messages=messages, max_tokens=16, temperature=0)
        stream = client.chat.completions.create(model=served, messages=messages, max_tokens=16,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = full.choices[0].message.content
    print(f"{args.model} has random weights, so its text is meaningless: the check is that streaming gives the "
          "same text")
    print(f"non-streaming: {text!r} ({full.usage.completion_tokens} tokens, finish {full.choices[0].finish_reason})")
    print(f"streaming:     {streamed!r}")
    ok = streamed == text and full.usage.completion_tokens > 0
    print(f"dry run {'OK: streamed text equals the non-streamed text' if ok else 'FAILED: the two texts differ'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)  # the same checks as every step's run.py, before the model loads
    except CommandLineError as err:
        return fail(err)
    # Only now, with the command line accepted, do torch, transformers, the engine and the server load.
    from common.loading import ModelLoadError

    try:
        if args.dry_run:
            return dry_run(args)
        app = build_app(args)
    except (ModelLoadError, ValueError) as err:
        return fail(err)
    print(f"serving {args.model} with {args.step} on http://{args.host}:{args.port}/v1")
    serve(app, app.state.async_engine, args.host, args.port, args.shutdown_grace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
