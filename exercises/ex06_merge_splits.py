"""Exercise 06-merge-splits: the merge of split-K decode attention (flash-decoding), in torch.

Write the body of `merge_splits`; `python -m exercises run 06-merge-splits` plugs it into step 06's torch backend
in place of `TorchBackend.merge_splits` and runs step 06's tests of the split decode, and its dry run, on it.
"""

from __future__ import annotations

import torch

from step06_paged_attention.backends import TorchBackend


def merge_splits(self: TorchBackend, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Combine the partial results of a decode split into parts along the keys into the attention output.

    Inputs: each query head's keys (one request, one new token) were cut into `splits` consecutive parts, each
    reduced on its own (as one program of the Triton kernel does) from its scores s (already scaled by
    1/sqrt(head_dim)) and values v:
    - `m[b, h, j]`: the max of part j's scores;
    - `l[b, h, j]`: the sum over part j of exp(s - m[b, h, j]);
    - `acc[b, h, j, :]`: the sum over part j of exp(s - m[b, h, j]) * v, a `head_dim` vector.
    `acc` is `[batch, heads, splits, head_dim]`, `m` and `l` `[batch, heads, splits]`, float32 or float64.
    Returns: `[batch, heads, head_dim]`, softmax(all scores) @ v: the attention over all the keys, as if never split.
    Rule: each part's exponentials are relative to its own max, so its l and acc must be brought to a common
    base (the row's largest m) before the parts are added; only the sums are divided, never a part alone. A part
    may hold none of its request's keys (a short request beside a long one): its m is -inf, its l and acc 0, and
    it adds nothing (and no NaN). Every row has a part with keys, so its largest m is finite.

    Example, one head, `head_dim` 1 (the lesson's): scores [1, 0, 3, 2], values [10, 40, 20, 30], two parts of
    two keys: part 0 has m = 1, l = 1.3679, acc = 24.715; part 1 has m = 3, l = 1.3679, acc = 31.036. Part 0
    rescaled to base 3 by exp(1 - 3) = 0.1353: l 0.1851, acc 3.345. Merged: (3.345 + 31.036) / (0.1851 +
    1.3679) = 22.14, the full softmax's answer; with a third, empty part (m = -inf, l = 0, acc = 0) still 22.14.

    Hints (step06_paged_attention/README.md, "Online softmax and split-K, by hand", its "Split-K" item): work on
    every (request, head) at once with broadcasting, no loop; mind `acc`'s extra `head_dim` axis; exp(-inf) is 0.
    """
    raise NotImplementedError("write TorchBackend.merge_splits: see the hints in its docstring")
