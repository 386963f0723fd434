"""Step 14: overlap scheduling. The host's work for the next decode step is hidden behind the GPU's current one.

Once step 12's graphs took kernel launches off the host, and step 13 made each step's kernels few and large,
the GPU waits for the host between decode steps: reading the sampled tokens back, appending and detokenizing
them, checking for stops, scheduling the next step, filling its static buffers. On the H200's host that is a
fixed cost per step, whatever the GPU does meanwhile. Here each decode step launches the next one *before*
the host processes its tokens (`launch_ahead`), so that the GPU computes step N+1 while the host works on N:

    host:  launch N | launch N+1 | process N's tokens | (step N+1 begins: its launch is done) ...
    GPU:        [ step N ][ step N+1 ][ step N+2 ] ...

The next step's input tokens are not on the host yet when it is launched: its static buffers name, for each
row, the row of the step before whose sampled token is its input (`LaunchAheadInputs`), and the graph reads
it there, on the device. The batch launched ahead is a guess (every running request that this step does not
finish by length); when the next step's batch turns out different, it is launched afresh (`decode`), and a
mixed step takes the decoders' tokens from it rather than computing them twice (`compute_chunks`).

A batch whose requests need their logits (penalties, a bias, log-probabilities) is launched ahead as well:
step 12's LOGITS graph with the shared sampler queued behind it (`launch_with_sampler`). Its penalties count, on
the device, the token the host has not appended yet (`count_pending`), and its log-probabilities come back with
its tokens (`PendingLogprobs`).

Everything else (graphs, fused kernels, scheduling, prefix caching, preemption) is step 13's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from common.loading import LoadedModel
from common.request import RequestOutput
from common.sampling import LogitControls, LogprobRows, SamplingParams, TokenLogprob, to_device
from step09_chunked_prefill.engine import Chunk
from step11_speculative_decoding.engine import SpeculativeRequest
from step12_cuda_graph.decode_graphs import DecodeBatch, PendingTokens, StaticDecodeInputs
from step13_fused_decode.engine import FusedDecodeEngine, FusedDecodeEngineConfig


@dataclass
class LaunchAheadBatch(DecodeBatch):
    """A decode batch some of whose input tokens are still on the device: row i's input is the token that row
    `previous_rows[i]` of the step before sampled (-1: `token_ids[i]`, known on the host)."""

    previous_rows: list[int] = field(default_factory=list)


class LaunchAheadInputs(StaticDecodeInputs):
    """Step 12's static decode buffers, plus each row's previous row."""

    FIELDS = (*StaticDecodeInputs.FIELDS, "previous_rows")

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        self.wait_for_last_copy()  # before the host buffer is written
        rows = batch.previous_rows if isinstance(batch, LaunchAheadBatch) else [-1] * len(batch)
        self.host["previous_rows"][:bucket] = torch.tensor([*rows, *[-1] * (bucket - len(rows))], dtype=torch.int32)
        super().fill(batch, bucket)  # ... and copied to the device with the rest

    def token_inputs(self, bucket: int, last_tokens: torch.Tensor) -> torch.Tensor:
        """A row launched before the host saw its input token reads it from the last replay's output."""
        previous = self.previous_rows[:bucket]
        return torch.where(previous >= 0, last_tokens[previous.clamp(min=0)], self.input_ids[:bucket])


class PendingLogprobs:
    """A launched step's log-probabilities (`LogprobRows`), copied to pinned host memory behind the step, as
    `PendingTokens` copies its tokens."""

    def __init__(self, rows: LogprobRows, params: Sequence[SamplingParams]) -> None:
        self.params = params

        def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            return host.copy_(tensor, non_blocking=True)

        self.rows = LogprobRows(rows.rows, *map(pinned_copy, (rows.token_ids, rows.chosen, rows.top_values,
                                                              rows.top_ids)))
        self.done: torch.cuda.Event | None = None
        if rows.chosen.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def records(self) -> list[TokenLogprob | None]:
        """Block until the step has run; each row's record (None where its request does not ask)."""
        if self.done is not None:
            self.done.synchronize()
        return self.rows.records(self.params)


def count_pending(controls: LogitControls, logits: torch.Tensor, last_tokens: torch.Tensor,
                  previous_rows: list[int]) -> torch.Tensor:
    """The logits with the controls applied, counting too each row's token still on the device (row i's is the one
    row `previous_rows[i]` of the step before drew; -1: none). Only that token's logit changes: it is penalized
    again from the raw logit with its count one higher, one gather and one scatter. The requests' `LogitState`s
    keep only the tokens the host appended, so a step launched ahead in vain leaves them as they were."""
    rows = to_device(previous_rows, torch.int64, last_tokens.device)
    pending = (rows >= 0)[:, None]
    token = torch.where(pending[:, 0], last_tokens[rows.clamp(min=0)], 0)[:, None]

    def at_token(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else values.gather(1, token)

    seen = at_token(controls.seen)
    one_more = replace(controls, output_counts=at_token(controls.output_counts) + pending, bias=at_token(controls.bias),
                       seen=None if seen is None else seen | pending)
    return controls.apply(logits).scatter(1, token, one_more.apply(logits.gather(1, token)))


@dataclass
class LaunchedDecode:
    """A decode step on the GPU: its requests in row order, the length each was computed at, its tokens to come
    (and their log-probabilities, where a request asks)."""

    requests: list[SpeculativeRequest]
    seq_lens: list[int]
    tokens: PendingTokens
    logprobs: PendingLogprobs | None = None
    row_of: dict[SpeculativeRequest, int] = field(init=False)

    def __post_init__(self) -> None:
        self.row_of = {request: row for row, request in enumerate(self.requests)}

    def seq_len_of(self, request: SpeculativeRequest) -> int | None:
        row = self.row_of.get(request)
        return None if row is None else self.seq_lens[row]

    def covers(self, requests: list[SpeculativeRequest]) -> bool:
        """Whether this step computed the next token of every one of these requests (and more is fine: the
        rows of requests that finished meanwhile are ignored)."""
        return all(self.seq_len_of(r) == r.num_tokens for r in requests)

    def record_logprobs(self, requests: Sequence[SpeculativeRequest]) -> None:
        """Hand each request its token's log-probability record, where it asks, before its token is appended."""
        if self.logprobs is None:
            return
        records = self.logprobs.records()
        for request in requests:
            record = records[self.row_of[request]]
            if record is not None:
                request.output_logprobs.append(record)


@dataclass
class OverlapSchedulingEngineConfig(FusedDecodeEngineConfig):
    # Launch each decode step before the host turns the previous step's tokens into text (`launch_ahead`).
    # None: on wherever decode is captured (eagerly, on a CPU, there is nothing to overlap).
    overlap: bool | None = None


class OverlapSchedulingEngine(FusedDecodeEngine):
    config_class = OverlapSchedulingEngineConfig
    decode_inputs_class = LaunchAheadInputs

    def __init__(self, loaded: LoadedModel, config: OverlapSchedulingEngineConfig) -> None:
        if config.overlap and not config.cuda_graph:
            raise ValueError("--overlap launches decode steps on step 12's static buffers: drop --no-cuda-graph")
        super().__init__(loaded, config)
        self.overlap = self.eager_reason is None if config.overlap is None else config.overlap
        self.ahead: LaunchedDecode | None = None  # launched during this step, for the next one
        self.launched_ahead: LaunchedDecode | None = None  # launched during the last step, for this one
        self.steps_launched_ahead = 0
        self.steps_taken_from_ahead = 0  # the others were launched again (their batch had changed)
        print(f"[{type(self).__name__}] {self.overlap_status()}", flush=True)  # said at start-up

    def overlap_status(self) -> str:
        if not self.overlap:
            return "overlap: off, each step launched once the host has processed the last one"
        return "overlap: each decode step launched before the host processes the previous one"

    def step(self) -> list[RequestOutput]:
        self.launched_ahead, self.ahead = self.ahead, None  # good for this step only; `decode` takes it if it fits
        return super().step()

    @torch.inference_mode()
    def decode(self, requests: list[SpeculativeRequest]) -> list[RequestOutput]:
        ahead, self.launched_ahead = self.launched_ahead, None
        if not self.overlap or self.graphs is None or len(requests) > self.graphs.max_batch:
            return super().decode(requests)
        # The step launched ahead computed these requests' tokens already, unless the batch changed since
        # in a way it could not foresee (someone swapped in, or was preempted and admitted again).
        if ahead is not None and ahead.covers(requests):
            current = ahead
            self.steps_taken_from_ahead += 1
        else:
            current = self.launch_decode(requests)
        self.ahead = self.launch_ahead(current)
        self.steps_launched_ahead += self.ahead is not None
        sampled = current.tokens.wait()  # the GPU goes on with the step launched ahead meanwhile
        current.record_logprobs(requests)
        return self.process_tokens(requests, [sampled[current.row_of[r]] for r in requests])

    def launch_decode(self, requests: list[SpeculativeRequest], previous: LaunchedDecode | None = None
                      ) -> LaunchedDecode:
        """Give each request its next block if it needs one and launch its decode step. A request of
        `previous` has a token there that the host has not appended yet: that token is its input, read on
        the device, and its length counts it."""
        batch = LaunchAheadBatch([], [], [], [], [], [])
        for request in requests:
            row = previous.row_of.get(request, -1) if previous is not None else -1
            pending = int(row >= 0)  # its input token is still on the device
            batch.token_ids.append(0 if pending else request.output_token_ids[-1])
            batch.previous_rows.append(row)
            batch.seq_lens.append(request.num_tokens + pending)
            batch.output_positions.append(len(request.output_token_ids) + pending)
            self.grow_block_table(request, batch.seq_lens[-1])
            batch.tables.append(request.block_table)
            batch.params.append(request.params)
        return LaunchedDecode(requests, batch.seq_lens, *self.launch_rows(batch, requests))

    def launch_rows(self, batch: LaunchAheadBatch, requests: list[SpeculativeRequest]
                    ) -> tuple[PendingTokens, PendingLogprobs | None]:
        """Launch the batch's step: step 12's graph, or the sampler behind it where a request needs its logits."""
        assert self.graphs is not None
        if self.needs_logits(requests):
            return self.launch_with_sampler(batch, requests)
        return self.graphs.launch(batch), None

    def launch_with_sampler(self, batch: LaunchAheadBatch, requests: list[SpeculativeRequest]
                            ) -> tuple[PendingTokens, PendingLogprobs | None]:
        """A batch that needs its logits (penalties, a bias, log-probabilities), launched all the same: step 12's
        LOGITS graph, then the shared sampler queued behind it, nothing read back. Its penalties count, on the
        device, the tokens of the step before that the host has not appended yet (`count_pending`); its tokens go
        where the next step launched ahead reads its inputs."""
        assert self.graphs is not None
        return self.draw_on_device(batch, requests, self.graphs.logits_for(batch))

    def draw_on_device(self, batch: LaunchAheadBatch, requests: list[SpeculativeRequest], logits: torch.Tensor
                       ) -> tuple[PendingTokens, PendingLogprobs | None]:
        """The shared sampler queued behind a launched step's logits, its tokens written where the next step
        launched ahead reads its inputs; nothing is read back."""
        assert self.graphs is not None
        controls = None
        if any(p.adjusts_logits for p in batch.params):
            controls = LogitControls.build(batch.params, [r.prompt_token_ids for r in requests],
                                           [r.output_token_ids for r in requests], logits.shape[-1], logits.device,
                                           [r.logit_state for r in requests])
            if any(row >= 0 for row in batch.previous_rows):
                logits, controls = count_pending(controls, logits, self.graphs.tokens, batch.previous_rows), None
        token_ids, logprobs = self.sampler.draw(logits, batch.params, batch.output_positions, controls)
        self.graphs.tokens[: len(batch)] = token_ids
        pending = PendingLogprobs(logprobs, batch.params) if logprobs is not None else None
        return PendingTokens(self.graphs.tokens[: len(batch)]), pending

    def launch_ahead(self, current: LaunchedDecode) -> LaunchedDecode | None:
        """Launch the next decode step now, before the host has seen this one's tokens, so that the GPU
        computes it while the host detokenizes, checks for stops and schedules. Its batch is a guess: every
        running request (those prefilled this step included) except the ones this step's token finishes by
        length. A request that stops otherwise (end of sequence, a stop string, an abort) costs only a
        wasted row; a batch the guess cannot cover (a swapped request coming back, or no free block for the
        guess) makes the next step launch afresh. Nothing is launched ahead while prefill work waits: the next
        step is then likely a mixed one, which the scheduler lays out."""
        assert self.graphs is not None
        if self.swapped or self.prefill_pending():
            return None  # the next step may bring a request back, or be a mixed step
        batch = [r for r in self.running if not self.finishes_by_length(r, pending=r in current.row_of)]
        if not batch or len(batch) > self.graphs.max_batch:
            return None
        if self.may_speculate(batch):
            return None  # a proposal needs this step's token, on the host, before the next step can be laid out
        new_blocks = sum(self.needs_new_block(r, r.num_tokens + (r in current.row_of)) for r in batch)
        if new_blocks > self.allocator.num_free:
            return None  # the scheduler decides who gets the last blocks (and who is preempted)
        return self.launch_decode(batch, previous=current)

    def may_speculate(self, batch: list[SpeculativeRequest]) -> bool:
        """Whether step 11's rule could check a proposal for any of these decoders in the next step, whatever
        the proposer finds: then that step is laid out once this one's tokens are known, not launched ahead."""
        if self.proposer is None:
            return False
        return any(self.proposal_counts(batch, [self.config.speculative_tokens] * len(batch), len(batch)))

    @staticmethod
    def finishes_by_length(request: SpeculativeRequest, pending: bool) -> bool:
        """Whether the request is done by length once its token still on the device (if any) is appended."""
        outputs = len(request.output_token_ids) + pending
        return outputs >= request.params.max_tokens or request.num_tokens + pending >= request.max_model_len

    @torch.inference_mode()
    def compute_chunks(self, chunks: list[Chunk], sampling: list[Chunk]) -> list[int]:
        """Step 12's mixed step. When new work arrives, the decode step launched ahead during the last step has
        already computed the decoders' next tokens (and written their K/V): those decoders are taken from it,
        and only the other chunks run, rather than computing them twice."""
        ahead, self.launched_ahead = self.launched_ahead, None
        if ahead is None:
            return super().compute_chunks(chunks, sampling)
        taken = {c.request for c in chunks
                 if c.num_tokens == 1 and ahead.seq_len_of(c.request) == c.end == c.request.num_tokens}
        if not taken:
            return super().compute_chunks(chunks, sampling)
        self.steps_taken_from_ahead += 1
        rest = [c for c in chunks if c.request not in taken]
        rest_tokens = iter(super().compute_chunks(rest, [c for c in rest if c.samples]))
        ahead_tokens = ahead.tokens.wait()
        ahead.record_logprobs([c.request for c in chunks if c.request in taken])
        return [ahead_tokens[ahead.row_of[c.request]] if c.request in taken else next(rest_tokens) for c in sampling]

    def memory_report(self) -> str:
        counts = (f", {self.steps_launched_ahead} decode steps launched ahead, {self.steps_taken_from_ahead} of them "
                  "used" if self.overlap else "")
        return f"{super().memory_report()}\n{self.overlap_status()}{counts}"
