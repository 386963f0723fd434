"""Exercise 14-launch-decode: a decode step launched before the host has read the tokens it starts from.

Write the body of `launch_decode`; `python -m exercises run 14-launch-decode` plugs it into step 14's engine in
place of `OverlapSchedulingEngine.launch_decode` and runs step 14's tests (with overlap on) and dry run on it.
"""

from __future__ import annotations

from step11_speculative_decoding.engine import SpeculativeRequest
from step14_overlap_scheduling.engine import LaunchAheadBatch, LaunchedDecode, OverlapSchedulingEngine  # noqa: F401


def launch_decode(self: OverlapSchedulingEngine, requests: list[SpeculativeRequest],
                  previous: LaunchedDecode | None = None) -> LaunchedDecode:
    """Launch one decode step of `requests` (row i is `requests[i]`) without waiting for it, and return it as
    `LaunchedDecode(requests, seq_lens, tokens)`: the requests, each row's length, the step's `PendingTokens`.

    `previous` is the step launched just before, whose tokens the host has not read yet. A request in it
    (its row there is `previous.row_of[request]`) is one token further along than the host knows: that token
    was sampled by its row of `previous`, is still on the device, and is not in `request.output_token_ids`.
    Its row here therefore has:
    - `token_ids`: 0, a placeholder (the graph reads the real token on the device, from `previous_rows`);
    - `previous_rows`: its row in `previous`;
    - `seq_lens`: `request.num_tokens + 1` (the pending token is this step's input, the last of its sequence);
    - `output_positions`: `len(request.output_token_ids) + 1` (the position in its output of the token this
      step draws: a seeded sampler draws by it).
    Every other request (no `previous`, or not in it) has its input on the host, as in step 12's `launch`:
    `request.output_token_ids[-1]`, previous row -1, length `request.num_tokens`, output position
    `len(request.output_token_ids)`. For every row, `self.grow_block_table(request, seq_len)` first (a new block
    if that length crosses into one), then `request.block_table` and `request.params`. Launch with
    `self.graphs.launch(LaunchAheadBatch(token_ids, seq_lens, tables, params, output_positions, previous_rows))`.
    The lengths you return are what `decode` checks next step: it takes this step only if it `covers` that
    step's batch (each request computed at the length it has by then); rows of requests that finished
    meanwhile are never read, since `decode` picks each request's token by `row_of`.
    Example: `previous` had rows [a, b, c]; `requests` = [a, c, d], d not in `previous` (prefilled this step,
    its first token 77 on the host). a: prompt 10, outputs 3; c: prompt 7, outputs 5; d: prompt 6, outputs
    [77] -> token_ids [0, 0, 77], previous_rows [0, 2, -1], seq_lens [14, 13, 7], output_positions [4, 6, 1];
    with blocks of 4 tokens a's and c's tables grow to 4 blocks, d's to 2.

    Hints (step14_overlap_scheduling/README.md, "The idea: do the host's work while the GPU computes", from
    "But step n+1 needs step n's tokens as its input"; "The pitfalls", "The stop check is one step late"):
    `CudaGraphEngine.launch` in step12_cuda_graph/engine.py is this without `previous`.
    """
    raise NotImplementedError("write OverlapSchedulingEngine.launch_decode: see the hints in its docstring")
