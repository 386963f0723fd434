"""Exercise 12-graph-bucket: a decode batch laid out in the static buffers of its graph's bucket.

Write the body of `write_rows`; `python -m exercises run 12-graph-bucket` plugs it into step 12's engine in
place of `StaticDecodeInputs.write_rows` and runs step 12's tests and dry run on it.
"""

from __future__ import annotations

import torch  # noqa: F401 - for your code

from step12_cuda_graph.decode_graphs import DecodeBatch, StaticDecodeInputs


def write_rows(self: StaticDecodeInputs, batch: DecodeBatch, bucket: int) -> None:
    """Lay a decode batch out in rows `0 .. bucket-1` of the static host buffers: its n rows, then padding.

    Inputs: `batch` (n rows: `batch.token_ids[i]`, the newest token; `batch.seq_lens[i]`, the length counting
    it; `batch.tables[i]`, the block table, physical blocks in logical order) and `bucket`, the captured bucket
    it replays (0 <= n <= bucket; n = 0 happens: the capture fills every row as padding). `self.host` holds int32
    CPU tensors `"input_ids"`, `"positions"`, `"seq_lens"`, `"slot_mapping"` (1-D, `max_batch` long) and
    `"block_table"` (`[max_batch, self.width]`); `self.block_size`, `self.dummy_block`.
    Returns: nothing; writes the first `bucket` rows of each field (and nothing else: `fill` copies them to the
    device after you return).
    Rule: row i < n is request i: its token, its position (the last of its sequence: seq_len - 1), its length,
    the slot its new K/V goes to (from its table), and its table in columns `0 .. used-1` (`used`: the longest
    table of the batch, 1 if n = 0), padded with the dummy block. A padded row runs the whole forward too, so it
    must write nowhere a request reads: token 0, position 0, length 1, its slot the dummy block's first, and the
    dummy block in every used column of its table. Columns from `used` on are never read: leave them.

    Example: block_size 4, dummy_block 64, batch token_ids [5, 8], seq_lens [10, 5], tables [[3, 17, 5],
    [6, 22]], bucket 4 -> input_ids [5, 8, 0, 0], positions [9, 4, 0, 0], seq_lens [10, 5, 1, 1],
    slot_mapping [21, 88, 256, 256] (position 9: logical block 2 = block 5, offset 1), block_table
    [[3, 17, 5], [6, 22, 64], [64, 64, 64], [64, 64, 64]] in its first 3 columns.

    Hints (step12_cuda_graph/README.md, "The idea: one launch instead of 1,252" and its "Padded rows, worked
    out"; "The pitfalls", "Padded rows must be invisible"): the dummy block is one block past those the
    allocator hands out; a field can be written whole from a list.
    """
    raise NotImplementedError("write StaticDecodeInputs.write_rows: see the hints in its docstring")
