"""Exercise 14-launch-decode: a decode step launched before the host has read the tokens it starts from.

Write the body of `launch_decode`; `python -m exercises run 14-launch-decode` plugs it into step 14's engine in
place of `OverlapSchedulingEngine.launch_decode` and runs step 14's tests (with overlap on) and dry run on it.
"""

from __future__ import annotations

from step11_speculative_decoding.engine import SpeculativeRequest
from step14_overlap_scheduling.engine import LaunchAheadBatch, LaunchedDecode, OverlapSchedulingEngine  # noqa: F401


def launch_decode(self: OverlapSchedulingEngine, requests: list[SpeculativeRequest],
                  previous: LaunchedDecode | None = None) -> LaunchedDecode:
    """Launch one decode step of `requests` (row i is `requests[i]`) without waiting for it, and return it.

    Inputs: `requests`, this step's decoders; `previous`, the step launched just before (or None), whose tokens
    the host has not read yet. A request in it (its row there: `previous.row_of[request]`) is one token further
    along than the host knows: that token, sampled by its row of `previous`, is still on the device and not in
    `request.output_token_ids`.
    Returns: `LaunchedDecode(requests, seq_lens, tokens, logprobs)`: the requests, each row's length, and what
    `self.launch_rows(batch, requests)` returns for `batch = LaunchAheadBatch(token_ids, seq_lens, tables, params,
    output_positions, previous_rows)`: the step's `PendingTokens` (and its log-probabilities to come, or None).
    Rule: never wait for `previous` (reading its tokens would stall the host until the device is done, and
    nothing would overlap). A row whose request is in `previous` takes its input from there, on the device: token
    0 as a placeholder, previous row = its row in `previous`, length `request.num_tokens + 1` (the pending token
    is this step's input), output position `len(request.output_token_ids) + 1` (where in its output the token this
    step draws goes: a seeded sampler draws by it). Any other row has its input on the host, as in step 12's
    `launch`: its last output token, previous row -1, length `request.num_tokens`, output position
    `len(request.output_token_ids)`. Each row's block table must have room for its length first
    (`self.grow_block_table(request, seq_len)`), then goes in with its `request.params`. The lengths returned are
    what `decode` checks next step (it takes this step only if it `covers` that step's batch).

    Example: `previous` had rows [a, b, c]; `requests` = [a, c, d], d not in `previous` (prefilled this step,
    its first token 77 on the host). a: prompt 10, outputs 3; c: prompt 7, outputs 5; d: prompt 6, outputs
    [77] -> token_ids [0, 0, 77], previous_rows [0, 2, -1], seq_lens [14, 13, 7], output_positions [4, 6, 1];
    with blocks of 4 tokens a's and c's tables grow to 4 blocks, d's to 2.

    Hints (step14_overlap_scheduling/README.md, "The idea: do the host's work while the GPU computes", from
    "But step n+1 needs step n's tokens as its input"; "The pitfalls", "The stop check is one step late"):
    `CudaGraphEngine.launch` in step12_cuda_graph/engine.py is this without `previous`.
    """
    raise NotImplementedError("write OverlapSchedulingEngine.launch_decode: see the hints in its docstring")
