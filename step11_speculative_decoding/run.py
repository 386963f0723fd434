"""Step 11: speculative decoding. A decoder's next tokens are guessed (n-gram lookup in its own text, or a
small draft model) and checked in one forward of k + 1 tokens; the output is plain decoding's.

Examples:
    .venv/bin/python step11_speculative_decoding/run.py --dry-run                          # tiny models, parity with HF
    .venv/bin/python step11_speculative_decoding/run.py                                    # the embedded model, k = 4
    .venv/bin/python step11_speculative_decoding/run.py --speculative-method draft --draft-model tiny-llama
    .venv/bin/python step11_speculative_decoding/run.py --speculative-tokens 0             # step 10's decoding
    .venv/bin/python step11_speculative_decoding/bench/bench_speculative.py                # acceptance and speed-up
"""

import argparse

from common.cli import main
from step10_prefix_caching.run import add_arguments as add_step10_arguments


def add_arguments(parser: argparse.ArgumentParser, speculative_tokens: int = 4) -> None:
    """Step 11's flags; later steps take them with speculation off by default (`speculative_tokens=0`)."""
    add_step10_arguments(parser)
    speculation = parser.add_argument_group("speculative decoding")
    speculation.add_argument("--speculative-tokens", type=int, default=speculative_tokens,
                             help=f"k, the most tokens proposed for a decoder per step (default {speculative_tokens}; "
                                  "0: no speculation)")
    speculation.add_argument("--speculative-method", choices=["ngram", "draft"], default="ngram",
                             help="ngram: the request's last tokens found earlier in its prompt or output (default); "
                                  "draft: a smaller model with the same tokenizer (--draft-model)")
    speculation.add_argument("--draft-model", default=None,
                             help="the draft model for --speculative-method draft (any --model name)")
    # The defaults are engine.py's DEFAULT_TOKEN_COST, DEFAULT_DECODE_TOKEN_COST and DEFAULT_STEP_COST, written
    # out: --help must not wait for torch to load (tests/test_cli_flags.py keeps them equal).
    speculation.add_argument("--speculative-token-cost", type=float, default=None,
                             help="what a token of a step that verifies costs, in decode steps, for the rule that "
                                  "decides how many proposals to check (default 0.1 on a CPU, 0.012 on a GPU)")
    speculation.add_argument("--speculative-decode-token-cost", type=float, default=None,
                             help="what a token of a plain decode step costs, in decode steps (default: the token "
                                  "cost on a CPU, 0.004 on a GPU)")
    speculation.add_argument("--speculative-step-cost", type=float, default=None,
                             help="what a step that verifies costs more than a decode step, in decode steps "
                                  "(default 0 on a CPU, 0.2 on a GPU; both costs 0: check every proposal)")

if __name__ == "__main__":
    raise SystemExit(main("step11_speculative_decoding", __doc__, add_arguments=add_arguments))
