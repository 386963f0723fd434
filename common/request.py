"""A request's life: its tokens, its text, and when it is done.

Every step of the tutorial schedules requests differently, but they all turn a sampled token into output
the same way, here: append it, detokenize it incrementally, check stop conditions, and hand out only text
that can no longer change (text that might still turn out to be the start of a stop string is held back).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from common.sampling import LogitState, SamplingParams, TokenLogprob
from common.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestStatus(Enum):
    WAITING = "waiting"  # queued, holds no KV cache
    RUNNING = "running"  # admitted: its KV cache lives on the device
    SWAPPED = "swapped"  # preempted (step07): its KV cache is parked in host memory
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # its own processing failed (`Request.fail`); the other requests go on


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    # Whatever the caller of `add_request` gave to find the request's outputs by (step 08's server: the request's
    # stream), handed back with each one, so that no caller keeps a map of request ids.
    listener: Any = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the new tokens, where the request asks
    # On a request's first output, where it asks (`SamplingParams.prompt_logprobs`): one per prompt token, the first
    # None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # what went wrong, where finish_reason is ERROR


@dataclass
class Completion:
    """The whole result of one request, as `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


@dataclass(eq=False)  # a request is itself: compared and hashed by identity, so it can key a set
class Request:
    """Everything the engine keeps about one request. A step that keeps more (its KV blocks, how much of it is
    computed) declares a subclass with those fields in its own folder, and names it as its `request_class`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    max_model_len: int
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    text: str = ""  # the output text so far, already cut at a stop string
    listener: Any = None  # given to `add_request`, handed back on its outputs (see `RequestOutput.listener`)
    # One per output token where `params.logprobs` is set. The sampler's record of a token lands here as the token is
    # drawn (`Engine.sample`), just before `append_token` appends the token itself.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Its penalties' and bias's device rows, kept between steps where it uses any (see `LogitState`).
    logit_state: LogitState = field(default_factory=LogitState)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # scored before its first token is appended
    _emitted_chars: int = 0  # how much of `text` has been handed out

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        priority: int = 0,
    ) -> Request:
        return cls(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            detokenizer=IncrementalDetokenizer(tokenizer),
            eos_token_ids=eos_token_ids,
            max_model_len=max_model_len,
            priority=priority,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt plus its budget, capped by the context."""
        return min(len(self.prompt_token_ids) + self.params.max_tokens, self.max_model_len)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def to_completion(self) -> Completion:
        assert self.finish_reason is not None, "only a finished request has a completion"
        return Completion(self.request_id, self.prompt_token_ids, self.output_token_ids, self.text, self.finish_reason)

    def append_token(self, token_id: int) -> RequestOutput:
        """Record one sampled token and return what becomes visible to the caller."""
        self.output_token_ids.append(token_id)
        params = self.params
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            self.finish_reason = FinishReason.STOP  # the stop token itself adds no text
        else:
            self.text += self.detokenizer.add(token_id)
            self._cut_at_stop_string()
        if self.finish_reason is None and (
            len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= self.max_model_len
        ):
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            self.text += self.detokenizer.flush()  # release a held-back partial character
            self._cut_at_stop_string()
            self.status = RequestStatus.FINISHED
        # This token's record, if the sampler left one (the slice is empty where the request asks for none).
        logprobs = self.output_logprobs[len(self.output_token_ids) - 1 : len(self.output_token_ids)]
        first = len(self.output_token_ids) == 1
        return RequestOutput(self.request_id, [token_id], self._take_new_text(), self.finished, self.finish_reason,
                             self.listener, logprobs, self.prompt_logprobs if first else None)

    def abort(self) -> RequestOutput:
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason.ABORT
        return RequestOutput(self.request_id, [], "", True, FinishReason.ABORT, self.listener)

    def fail(self, error: Exception) -> RequestOutput:
        """End the request because handling its token raised `error`: it alone, with the error as its last output."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason.ERROR
        return RequestOutput(self.request_id, [], "", True, FinishReason.ERROR, self.listener,
                             error=f"{type(error).__name__}: {error}")

    def _cut_at_stop_string(self) -> None:
        for stop in self.params.stop:
            # Only the tail can contain a new match; search a window that covers the latest text.
            at = self.text.find(stop, max(0, self._emitted_chars - len(stop)))
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = FinishReason.STOP

    def _take_new_text(self) -> str:
        """Text not yet handed out, minus a tail that could still grow into a stop string."""
        end = len(self.text)
        if not self.finished:
            end -= self._stop_string_prefix_len()
        new_text = self.text[self._emitted_chars : end]
        self._emitted_chars = max(self._emitted_chars, end)
        return new_text

    def _stop_string_prefix_len(self) -> int:
        held = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return held
