"""Exercise 06-merge-splits: the merge of split-K decode attention (flash-decoding), in torch.

Write the body of `merge_splits`; `python -m exercises run 06-merge-splits` plugs it into step 06's torch backend
in place of `TorchBackend.merge_splits` and runs step 06's tests of the split decode, and its dry run, on it.
"""

from __future__ import annotations

import torch

from step06_paged_attention.backends import TorchBackend


def merge_splits(self: TorchBackend, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Combine the partial results of a decode split into parts along the keys into the attention output.

    Each query head's keys (one request, one new token) were cut into `splits` consecutive parts, and each part
    was reduced on its own, as one program of the Triton kernel does, from its scores s (already scaled by
    1/sqrt(head_dim)) and values v:
    - `m[b, h, j]`: the max of part j's scores;
    - `l[b, h, j]`: the sum over part j of exp(s - m[b, h, j]);
    - `acc[b, h, j, :]`: the sum over part j of exp(s - m[b, h, j]) * v, a `head_dim` vector.
    Shapes: `acc` `[batch, heads, splits, head_dim]`, `m` and `l` `[batch, heads, splits]`, all float32 (or
    float64). Return `[batch, heads, head_dim]`: softmax(all scores) @ v, that is the attention output over all
    the keys, as if they had never been split.
    A part may hold none of its request's keys (a short request in a batch with a long one): then its m is
    -inf, its l is 0 and its acc is 0, and it must add nothing (and no NaN). At least one part of every row
    has keys, so the largest m of a row is finite.

    Example, one head, `head_dim` 1 (the lesson's): scores [1, 0, 3, 2] and values [10, 40, 20, 30], two
    parts of two keys: part 0 has m = 1, l = 1.3679, acc = 24.715; part 1 has m = 3, l = 1.3679,
    acc = 31.036. The merge returns 22.14, the full softmax's answer; with a third, empty part
    (m = -inf, l = 0, acc = 0) still 22.14.

    Hints (step06_paged_attention/README.md, "Online softmax and split-K, by hand", its "Split-K" item):
    - the parts' exponentials have different bases (their own m): rescale each part's l and acc to the
      largest m of its row by exp(m_j - m_max) before adding them up, then divide;
    - `amax(dim, keepdim=True)` and broadcasting do it for every (request, head) at once, no loop; mind the
      extra `head_dim` axis of `acc`;
    - exp(-inf - m_max) is 0 in torch; acc / l of an empty part is 0 / 0 = NaN, so never divide a part alone.
    """
    raise NotImplementedError("write TorchBackend.merge_splits: see the hints in its docstring")
