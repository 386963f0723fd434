"""Step 08: an OpenAI-compatible streaming server over one shared engine step loop.

Examples:
    .venv/bin/python step08_serve/run.py                               # the embedded model on http://127.0.0.1:8000
    .venv/bin/python step08_serve/run.py --dry-run                     # in-process server + the official openai SDK, tiny model
    .venv/bin/python step08_serve/run.py --model Qwen/Qwen2.5-7B-Instruct --device cuda --port 8000 --api-key secret
    .venv/bin/python step08_serve/client_example.py                    # talk to a running server
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from common.cli import Parser, check_args, fail
from common.loading import EMBEDDED_MODEL, ModelLoadError, model_names_help
from step02_paged_kv.engine import PagedEngineConfig
from step08_serve.api_server import create_app
from step08_serve.async_engine import AsyncEngine
from common.steps import STEP_NAMES, engine_class
from step08_serve.launcher import DEFAULT_STEP, running_server


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL, help=f"one of: {model_names_help()}")
    p.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: --model)")
    p.add_argument("--step", choices=STEP_NAMES, default=DEFAULT_STEP, help="which step's engine serves")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto (default: cuda if there is one)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16, or auto (fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="1 to 65535 (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("LLM_STEPS_API_KEY"), help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-memory-gb", type=float, default=None)
    p.add_argument("--dry-run", action="store_true", help="serve a tiny model in-process and call it with the openai SDK")
    return p


def build_app(args: argparse.Namespace) -> tuple[AsyncEngine, object]:
    step_engine = engine_class(args.step)
    fields = {k: getattr(args, k) for k in ("model", "device", "dtype", "max_num_seqs", "max_model_len",
                                            "block_size", "num_blocks", "kv_memory_gb")}
    if not issubclass(step_engine.config_class, PagedEngineConfig):
        for k in ("block_size", "num_blocks", "kv_memory_gb"):
            fields.pop(k)
    engine = step_engine.from_config(step_engine.config_class(**fields))
    async_engine = AsyncEngine(engine)
    served = args.served_model_name or args.model
    return async_engine, create_app(async_engine, served, args.model, args.api_key)


def dry_run(args: argparse.Namespace) -> int:
    """One streaming and one non-streaming chat request through the official SDK, compared."""
    from openai import OpenAI

    args.model, args.device, args.dtype = "tiny-qwen2", "cpu", "float32"
    _, app = build_app(args)
    with running_server(app) as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key=args.api_key or "unused")
        messages = [{"role": "user", "content": "Say hello in Chinese: 你好 🌍"}]
        full = client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=16, temperature=0)
        stream = client.chat.completions.create(model="tiny-qwen2", messages=messages, max_tokens=16,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = full.choices[0].message.content
    print(f"non-streaming: {text!r} ({full.usage.completion_tokens} tokens, finish {full.choices[0].finish_reason})")
    print(f"streaming:     {streamed!r}")
    ok = streamed == text and full.usage.completion_tokens > 0
    print(f"dry run {'OK: streamed text equals the non-streamed text' if ok else 'FAILED: the two texts differ'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)  # the same checks as every step's run.py, before the model loads
        if args.dry_run:
            return dry_run(args)
        _, app = build_app(args)
    except (ModelLoadError, ValueError) as err:  # CommandLineError is a ValueError
        return fail(err)
    print(f"serving {args.model} with {args.step} on http://{args.host}:{args.port}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
