"""Exercise 12-graph-bucket: a decode batch laid out in the static buffers of its graph's bucket.

Write the body of `write_rows`; `python -m exercises run 12-graph-bucket` plugs it into step 12's engine in
place of `StaticDecodeInputs.write_rows` and runs step 12's tests and dry run on it.
"""

from __future__ import annotations

import torch  # noqa: F401 - for your code

from step12_cuda_graph.decode_graphs import DecodeBatch, StaticDecodeInputs


def write_rows(self: StaticDecodeInputs, batch: DecodeBatch, bucket: int) -> None:
    """Write rows `0 .. bucket-1` of every static input into the host buffer: the batch's n rows, then
    `bucket - n` padded rows that write nowhere a request reads.

    A batch of n rows replays the graph of the smallest captured bucket >= n (`DecodeGraphs.bucket_for`, which
    passes `bucket` here; 0 <= n <= bucket, and n = 0 happens: the capture fills every row as padding).
    `self.host` holds int32 CPU tensors: `"input_ids"`, `"positions"`, `"seq_lens"`, `"slot_mapping"`, each
    1-D and `max_batch` long, and `"block_table"`, `[max_batch, self.width]`. `fill` copies them to the device
    after you return; write only their first `bucket` rows, and nothing else. Row i < n is request i of
    `batch`: its newest token `batch.token_ids[i]`, its length `batch.seq_lens[i]` counting that token, its
    block table `batch.tables[i]` (physical block ids, logical block j first). For each row write:
    - `input_ids`: the token (padded rows: 0);
    - `positions`: the new token's position, the last of its sequence, `seq_lens[i] - 1` (padded: 0);
    - `seq_lens`: the length (padded: 1);
    - `slot_mapping`: the slot the new token's K/V goes to, `table[p // block_size] * block_size +
      p % block_size` for position p (padded: the dummy block's first slot, `self.dummy_block * block_size`);
    - `block_table`: columns `0 .. used-1`, with `used` the longest table of the batch (1 if n = 0): the
      row's table, then `self.dummy_block` up to `used` (padded rows: `self.dummy_block` in every column).
      Columns from `used` on are never read: leave them.
    Example: block_size 4, dummy_block 64, batch token_ids [5, 8], seq_lens [10, 5], tables [[3, 17, 5],
    [6, 22]], bucket 4 -> input_ids [5, 8, 0, 0], positions [9, 4, 0, 0], seq_lens [10, 5, 1, 1],
    slot_mapping [21, 88, 256, 256] (position 9: logical block 2 = block 5, offset 1), block_table
    [[3, 17, 5], [6, 22, 64], [64, 64, 64], [64, 64, 64]] in its first 3 columns.

    Hints (step12_cuda_graph/README.md, "The idea: one launch instead of 1,252" and its "Padded rows, worked
    out"; "The pitfalls", "Padded rows must be invisible"): a padded row runs the whole forward, so its K/V
    must land in the dummy block, one block past those the allocator hands out; assign a whole field at once,
    e.g. `self.host["seq_lens"][:bucket] = torch.tensor([...], dtype=torch.int32)`.
    """
    raise NotImplementedError("write StaticDecodeInputs.write_rows: see the hints in its docstring")
