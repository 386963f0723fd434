"""Talk to a running step08 server with the official openai SDK: one streamed chat, one plain completion.

    .venv/bin/python step08_serve/run.py &                 # in another terminal
    .venv/bin/python step08_serve/client_example.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="unused", help="the server's --api-key, if it set one")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    print(f"[{model}] streaming chat:")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea 🌊"}],
        max_tokens=48,
        temperature=0,  # greedy: a 135M model sampled at temperature 1 reads like a bug, greedy reads well
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    print(f"completion: {completion.choices[0].text!r} (finish: {completion.choices[0].finish_reason})")


if __name__ == "__main__":
    main()
