"""Exercise 11-accept-greedy: which proposals a greedy verification keeps, and the token after them.

Write the body of `accept_greedy`; `python -m exercises run 11-accept-greedy` plugs it into step 11 in place of
`verify.accept_greedy` and runs step 11's tests and dry run on it.
"""

from __future__ import annotations


def accept_greedy(proposals: list[int], target_tokens: list[int]) -> list[int]:
    """The tokens a verification row emits, greedily.

    Inputs: the row held the request's last token and its k proposals d_1..d_k (`proposals`); `target_tokens`
    are the target model's argmax at each of those k + 1 positions: `target_tokens[i]` is the token the target
    itself would write after the row's first i + 1 tokens.
    Returns: the emitted tokens, at least one and at most k + 1; each is one that plain greedy decoding would
    have written.
    Rule: proposals are kept for as long as each equals the target's token at its place; the first that differs
    is replaced by the target's token there, and the row ends (what follows was computed after a wrong token and
    means nothing). If all k are kept, the target's token after the last one comes free.

    Example: proposals [5, 6, 7], target tokens [5, 9, 7, 8]: d_1 = 5 is kept, d_2 = 6 differs from 9, so the row
    emits [5, 9]. With target [5, 6, 7, 8] it emits all four. With no proposal (target [4]) it emits [4]: plain
    decoding.

    Hints (step11_speculative_decoding/README.md, "The idea").
    """
    raise NotImplementedError("write verify.accept_greedy: see the hints in its docstring")
