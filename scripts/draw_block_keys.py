"""The worked example of step 10's picture: the block keys of two prompts that share a prefix, as the engine
computes them (step10_prefix_caching/block_pool.py), and the blocks the second prompt claims.

Both prompts are tokenized with the embedded model's tokenizer and cut into blocks of 4 tokens. Request A's full
blocks are allocated, keyed and freed (they stay cached, as after A finished); then B's keys are looked up the
way `claim_cached_prefix` does: every full block but the one holding the last token, stopping at the first miss.

    .venv/bin/python scripts/draw_block_keys.py
"""

from __future__ import annotations

from common.loading import embedded_tokenizer
from step10_prefix_caching.block_pool import PrefixCachingAllocator, chain_keys

BLOCK = 4
PROMPTS = {"A": "You are a helpful assistant. What is the capital of France?",
           "B": "You are a helpful assistant. What is the capital of Italy?"}


def main() -> None:
    tokenizer = embedded_tokenizer()
    pool = PrefixCachingAllocator(num_blocks=16)
    ids = {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    for name, tokens in ids.items():
        full = len(tokens) // BLOCK
        keys = list(chain_keys(tokens, BLOCK, full))
        print(f"prompt {name}: {len(tokens)} tokens, {full} full blocks")
        for i in range(-(-len(tokens) // BLOCK)):
            words = [tokenizer.decode([t]) for t in tokens[i * BLOCK:(i + 1) * BLOCK]]
            key = keys[i].hex()[:8] if i < full else "(not full: no key)"
            print(f"  block {i}: {words!r:60} key {key}")
        if name == "A":
            table = pool.allocate(-(-len(tokens) // BLOCK))
            for block, key in zip(table, keys):
                pool.register(block, key)
            print(f"  A's block table {table}; A finishes, its keyed blocks stay cached")
            pool.free(table)
        else:
            claimable = (len(tokens) - 1) // BLOCK  # never the block holding the last token
            claimed = pool.claim(chain_keys(tokens, BLOCK, claimable))
            print(f"  B claims {claimed}: prefill starts at token {len(claimed) * BLOCK}")


if __name__ == "__main__":
    main()
