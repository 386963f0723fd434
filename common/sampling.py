"""Choosing the next token for a whole batch at once, on the device.

Penalties and a logit bias (`LogitControls`) first change the logits of the rows that ask for them. Then greedy
rows take the argmax. Sampled rows scale by temperature, cut to min-p, top-k and top-p, and then use the
Gumbel-max trick: argmax(logits + Gumbel noise) is a draw from softmax(logits). The noise is not taken from a
global random generator: it is a hash of (request seed, output position, vocabulary index), computed for
all rows in one pass. So every request has its own seed, the batch stays one set of device ops, and a
request's n-th token is the same whichever other requests share its batch, and when it is recomputed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_seed_source = random.SystemRandom()
MAX_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit for chat)


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Output held to a grammar, token by token: any JSON object, JSON that validates against a schema, text a
    regular expression matches whole, or one of a list of choices. Served by step 16's engine
    (`step16_structured_output`); an engine before it refuses a request that sets it."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str = ""  # the schema as JSON text, the regular expression, or the choices as a JSON list

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")


@dataclass
class SamplingParams:
    """How to generate for one request. The default is greedy decoding of up to 16 tokens."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # None: a fresh random seed per request
    stop: list[str] = field(default_factory=list)  # the stop text itself is not part of the output
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past end-of-sequence (benchmarks want fixed lengths)
    # OpenAI's penalties, over the tokens generated so far: logit - count x frequency - presence (if count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF's, over the prompt and the output: a positive logit of a token seen is divided by it, a negative multiplied.
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the top one (after temperature)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # None: no log-probabilities; 0: the chosen token's; n: also the n most likely tokens' (see `TokenLogprob`).
    logprobs: int | None = None
    # None: none; n: each prompt token's log-probability given those before it, with the n most likely tokens
    # there (see `common.prompt_logprobs`).
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None  # None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured, dict):  # as JSON gives it: {"kind": ..., "spec": ...}
            self.structured = StructuredOutput(**self.structured)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.seed is None:
            self.seed = _seed_source.randrange(2**31)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a bias change this request's logits: they need its tokens so far, which the host
        holds, so a path that picks tokens without the logits (a captured graph's argmax) cannot serve it."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias)

    @property
    def needs_logits(self) -> bool:
        """Whether picking this request's token needs its whole row of logits in the shared sampler: for its
        penalties or bias, its log-probabilities, or its grammar's mask. A path that picks tokens otherwise (a captured graph's
        argmax, a check of proposals) leaves such a request to the sampler."""
        return self.adjusts_logits or self.logprobs is not None or self.structured is not None


@dataclass
class TokenLogprob:
    """The log-probability of one chosen token, and of the most likely tokens at its position (those the request
    asked for, most likely first), under the distribution it was drawn from: log_softmax of the logits after
    penalties and bias and divided by the temperature (1 for greedy rows), before the min-p, top-k and top-p cuts."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for it: on a GPU, copied from pinned memory, which runs
    behind the work already queued (a copy from ordinary memory first waits until the GPU is idle, so the host
    could not prepare the sampler's work while the forward runs)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, without overflowing int64: multiply in two 16-bit halves."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (the "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, num_columns: int) -> torch.Tensor:
    """Uniform noise [rows, num_columns] strictly inside (0, 1), a pure function of each row's seed, output
    position and column: the same request draws the same numbers however it is batched."""
    columns = torch.arange(num_columns, device=seeds.device, dtype=torch.int64)
    row_key = _mix32((_mix32(seeds & _MASK32) ^ (positions & _MASK32)) & _MASK32)
    bits = _mix32(row_key[:, None] ^ columns[None, :])
    # 23 random bits: (k + 0.5) / 2**23 is exact in float32, so the value is strictly inside (0, 1) and the
    # Gumbel noise below is finite (with 24 bits the largest value rounds up to 1.0 and the noise becomes +inf).
    return ((bits >> 9).float() + 0.5) / float(1 << 23)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab], a pure function of each row's seed and output position."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab_size)))


@dataclass
class SamplingTensors:
    """Every row's sampling parameters as device tensors: the form a captured CUDA graph can read."""

    temperature: torch.Tensor  # [rows] float32; 1.0 for greedy rows (their scaled logits are unused)
    top_k: torch.Tensor  # [rows] int64; the vocabulary size where there is no cut
    top_p: torch.Tensor  # [rows] float32; 1.0 where there is no cut
    seeds: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64: the output position of the token being drawn
    is_greedy: torch.Tensor  # [rows] bool
    min_p: torch.Tensor  # [rows] float32; 0.0 where there is no cut

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_positions: Sequence[int], vocab_size: int,
              device: torch.device) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature or 1.0 for p in params], device=device),
            top_k=torch.tensor([p.top_k or vocab_size for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            seeds=torch.tensor([p.seed for p in params], device=device, dtype=torch.int64),
            positions=torch.tensor(list(output_positions), device=device, dtype=torch.int64),
            is_greedy=torch.tensor([p.greedy for p in params], device=device),
            min_p=torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32),
        )


def sample_rows(logits: torch.Tensor, rows: SamplingTensors, cut: bool = True) -> torch.Tensor:
    """One token per row, from tensors only (no host decision depends on the values). `cut=False` skips
    the min-p, top-k and top-p cuts, which change nothing when no row asks for one."""
    greedy_ids = logits.argmax(dim=-1)
    scaled = logits / rows.temperature[:, None]
    if cut:
        scaled = top_k_top_p(min_p_cut(scaled, rows.min_p), rows.top_k, rows.top_p)
    sampled_ids = (scaled + gumbel_noise(rows.seeds, rows.positions, logits.shape[-1])).argmax(dim=-1)
    return torch.where(rows.is_greedy, greedy_ids, sampled_ids)


def min_p_cut(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set every logit whose probability is below min_p times its row's top probability to -inf (the top token
    always stays, so a greedy row is unchanged)."""
    probs = scaled.softmax(dim=-1)
    return scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))


def top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set every logit outside each row's top-k and top-p nucleus to -inf."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    probs = sorted_logits.softmax(dim=-1)
    # A token stays if the probability mass strictly before it is below top_p: the first always stays.
    # top_p = 1 cuts nothing, even where the rounded running sum reaches 1.0 before the last token.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (rank[None, :] >= top_k[:, None]) | ((mass_before >= top_p[:, None]) & (top_p[:, None] < 1))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def largest(values: torch.Tensor, k: int, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`values.topk(k, dim=-1)` for a few alternatives out of a long row, in about two reads of it instead of a
    radix select's several. Each row is cut into chunks and each chunk's maximum taken: the k largest values lie in
    the k chunks with the largest maxima (a chunk holding none of them has its maximum below all of them), so
    only those k chunks are searched. Rows that do not cut evenly are searched whole."""
    rows, width = values.shape
    if k == 0 or width % chunk or width // chunk <= k:
        return values.topk(k, dim=-1)
    chunks = values.view(rows, width // chunk, chunk)
    best_chunks = chunks.amax(dim=-1).topk(k, dim=-1).indices  # [rows, k]
    candidates = chunks.gather(1, best_chunks[:, :, None].expand(rows, k, chunk)).view(rows, k * chunk)
    top_values, where = candidates.topk(k, dim=-1)
    return top_values, best_chunks.gather(1, where // chunk) * chunk + where % chunk


class LogitState:
    """One request's penalty and bias inputs as device rows, kept from step to step: its prompt is marked once, and
    each step adds only the tokens drawn since the last (`counted`), so a step's cost does not grow with the text.
    Empty (no tensors) until the request's first step that uses a control."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [vocab] float32: how often each token was generated
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (for a repetition penalty)
        self.bias: torch.Tensor | None = None  # [vocab] float32, where the request sets a logit_bias
        self.counted = 0  # output tokens already in `counts`


@dataclass
class LogitControls:
    """The penalties and biases of a batch, as device tensors; neutral values on rows that use none. A kind of
    control that no row uses is None, and costs nothing."""

    presence: torch.Tensor | None  # [rows, 1]
    frequency: torch.Tensor | None  # [rows, 1]
    repetition: torch.Tensor | None  # [rows, 1]
    output_counts: torch.Tensor  # [rows, vocab] float32
    seen: torch.Tensor | None  # [rows, vocab] bool, where a row has a repetition penalty
    bias: torch.Tensor | None  # [rows, vocab] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
              outputs: Sequence[Sequence[int]], vocab_size: int, device: torch.device,
              states: Sequence[LogitState] | None = None) -> LogitControls:
        """The batch's controls from each row's `LogitState` (fresh ones where none are given), brought up to date
        with the tokens drawn since its last step: one transfer of those token ids (and of the prompts of rows new
        to a repetition penalty), counted by one scatter on the device. Each state then keeps its row of the result.
        `seen` is kept only where a row has a repetition penalty: the others never read it."""
        rows = len(params)
        states = list(states) if states is not None else [LogitState() for _ in range(rows)]
        used = [i for i, p in enumerate(params) if p.adjusts_logits]
        uses = set(used)
        repeating = {i for i in used if params[i].repetition_penalty != 1}
        zero_counts = torch.zeros(vocab_size, device=device)
        counts = torch.stack([states[i].counts if i in uses and states[i].counts is not None else zero_counts
                              for i in range(rows)])
        new_prompts = [i for i in used if states[i].counts is None]
        # (row, token) of every output token not yet counted, and of the prompts of rows new to a repetition penalty.
        drawn = [(i, t) for i in used for t in outputs[i][states[i].counted:]]
        prompt_pairs = [(i, t) for i in new_prompts if i in repeating for t in prompts[i]]
        pairs = to_device(drawn + prompt_pairs, torch.int64, device).reshape(-1, 2)
        # An atomic add at each (row, token) of the flattened counts: a token drawn twice counts twice, with none
        # of the sorting that index_put_(accumulate=True) does on a GPU (which costs as much as the step's top-k).
        flat = pairs[: len(drawn), 0] * vocab_size + pairs[: len(drawn), 1]
        counts.view(-1).index_add_(0, flat, torch.ones((), device=device).expand(len(drawn)))
        seen = None
        if repeating:
            unseen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen = torch.stack([states[i].seen if i in repeating and states[i].seen is not None else unseen
                                for i in range(rows)])
            seen.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones((), dtype=torch.bool, device=device))
        for i in new_prompts:
            if params[i].logit_bias:  # built once per request: its bias never changes
                bias_row = torch.zeros(vocab_size, device=device)
                bias_row[to_device(list(params[i].logit_bias), torch.int64, device)] = to_device(
                    list(params[i].logit_bias.values()), torch.float32, device)
                states[i].bias = bias_row
        for i in used:
            states[i].counts, states[i].counted = counts[i], len(outputs[i])
            if seen is not None and i in repeating:
                states[i].seen = seen[i]
        biased = {i for i in used if states[i].bias is not None}
        bias = (torch.stack([states[i].bias if i in biased else zero_counts for i in range(rows)])
                if biased else None)

        def column(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return to_device(values, torch.float32, device)[:, None]

        return cls(presence=column([p.presence_penalty for p in params], 0.0),
                   frequency=column([p.frequency_penalty for p in params], 0.0),
                   repetition=column([p.repetition_penalty for p in params], 1.0),
                   output_counts=counts, seen=seen, bias=bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The bias, then the repetition penalty, then frequency and presence (vLLM's order)."""
        if self.bias is not None:
            logits = logits + self.bias
        if self.repetition is not None:
            assert self.seen is not None, "a repetition penalty needs the tokens seen"
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen, penalized, logits)
        if self.frequency is not None:
            logits = logits.addcmul(self.output_counts, self.frequency, value=-1)  # one kernel: minus count x frequency
        if self.presence is not None:  # a count clamped to 1 is 1 where the token was drawn at all
            logits = logits.addcmul(self.output_counts.clamp(max=1), self.presence, value=-1)
        return logits


class Sampler:
    """Samples one token per row of a logits batch for the given per-row parameters."""

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_positions: Sequence[int],
        prompts: Sequence[Sequence[int]] = (), outputs: Sequence[Sequence[int]] = (),
    ) -> torch.Tensor:
        """logits: [rows, vocab] float32; `prompts` and `outputs`: each row's token ids, needed only where a row
        uses a penalty or a bias. Returns token ids [rows] (int64, on the logits' device)."""
        return self.sample(logits, params, output_positions, prompts, outputs)[0]

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_positions: Sequence[int],
        prompts: Sequence[Sequence[int]] = (), outputs: Sequence[Sequence[int]] = (),
        states: Sequence[LogitState] | None = None,
    ) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
        """`__call__`'s token ids, and for each row that asks (`SamplingParams.logprobs`) its `TokenLogprob`:
        None for the others. `states`: each row's `LogitState`, kept by the caller between steps (without them,
        the controls are counted afresh from `prompts` and `outputs`)."""
        controls = None
        if any(p.adjusts_logits for p in params):  # a host-side check: a batch with no control pays nothing
            controls = LogitControls.build(params, prompts, outputs, logits.shape[-1], logits.device, states)
        token_ids, logprobs = self.draw(logits, params, output_positions, controls)
        return token_ids, logprobs.records(params) if logprobs is not None else [None] * len(params)

    def draw(self, logits: torch.Tensor, params: Sequence[SamplingParams], output_positions: Sequence[int],
             controls: LogitControls | None = None) -> tuple[torch.Tensor, LogprobRows | None]:
        """`sample`'s work queued on the device, with nothing read back: the token ids, and the log-probabilities
        of the rows that ask (None if none does) for `LogprobRows.records` to read once they are needed."""
        if controls is not None:
            logits = controls.apply(logits)
        if all(p.greedy for p in params):
            token_ids = logits.argmax(dim=-1)
        else:
            rows = SamplingTensors.build(params, output_positions, logits.shape[-1], logits.device)
            token_ids = sample_rows(logits, rows, cut=any(p.top_k or p.top_p < 1 or p.min_p for p in params))
        if all(p.logprobs is None for p in params):  # a host-side check too: no row asks, nothing is computed
            return token_ids, None
        return token_ids, LogprobRows.compute(logits, params, token_ids)


@dataclass
class LogprobRows:
    """The log-probabilities of the rows that ask, as tensors: each one's chosen token and its best alternatives
    (as many as the most any row asks for), under the distribution it was drawn from."""

    rows: list[int]  # which rows of the batch ask
    token_ids: torch.Tensor  # [asking]
    chosen: torch.Tensor  # [asking] float32
    top_values: torch.Tensor  # [asking, most asked]
    top_ids: torch.Tensor  # [asking, most asked]

    @classmethod
    def compute(cls, logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor) -> LogprobRows:
        """From the logits after penalties and bias: one log_softmax over the asking rows and one top-k."""
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        if len(asking) < len(params):  # only the rows that ask
            where = to_device(asking, torch.int64, logits.device)
            logits, token_ids = logits[where], token_ids[where]
        temperatures = [params[i].temperature or 1.0 for i in asking]
        if any(t != 1 for t in temperatures):
            logits = logits / to_device(temperatures, torch.float32, logits.device)[:, None]
        logprobs = logits.log_softmax(dim=-1)
        chosen_ids = token_ids
        top_values, top_ids = largest(logprobs, max(params[i].logprobs or 0 for i in asking))
        return cls(asking, chosen_ids, logprobs.gather(-1, chosen_ids[:, None])[:, 0], top_values, top_ids)

    def records(self, params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
        """Each row's `TokenLogprob` (None where it does not ask), read back to the host: this waits for the GPU."""
        results: list[TokenLogprob | None] = [None] * len(params)
        for row, token_id, logprob, values, ids in zip(self.rows, self.token_ids.tolist(), self.chosen.tolist(),
                                                       self.top_values.tolist(), self.top_ids.tolist(), strict=True):
            n = params[row].logprobs or 0
            results[row] = TokenLogprob(token_id, logprob, list(zip(ids[:n], values[:n], strict=True)))
        return results
