"""The engine interface every step implements, and what all steps share.

    engine = SerialEngine.from_config(EngineConfig(model="smollm2-135m-instruct"))
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():          # one scheduler iteration
            print(out.new_text, end="")

A step decides which requests run and how their KV cache is stored; that is `step()` and the `free_request`
hook. Admission checks, prompt handling, abort, and `generate` are the same everywhere and live here.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from common.loading import EMBEDDED_MODEL, LoadedModel, load_model
from common.prompt_logprobs import prompt_logprobs
from common.request import Completion, Request, RequestOutput
from common.sampling import Sampler, SamplingParams

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PromptTooLongError(ValueError):
    """The prompt leaves no room for even one generated token."""


@dataclass
class EngineConfig:
    model: str = EMBEDDED_MODEL
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: float32 on CPU (exact comparisons), bfloat16 on CUDA
    max_num_seqs: int = 256  # most requests running at once
    max_model_len: int | None = None  # context limit; default: the model's own
    seed: int = 0  # for random weights (tiny-*, random:*)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of: auto, {', '.join(_DTYPES)}")
        return _DTYPES[self.dtype]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """Take every field this config has from the parsed command line (subclasses get theirs too)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


class Engine(ABC):
    config_class: type[EngineConfig] = EngineConfig
    request_class: type[Request] = Request  # a step that keeps more about a request names its subclass here
    serves_structured_output = False  # whether it holds output to a grammar (`SamplingParams.structured`): step 16
    # What step 04 needs to know before it splits an engine over processes; the step that changes one says so.
    splits_over_ranks = False  # its KV pool is sized once, the same on every rank: each rank holds its own heads
    captures_cuda_graphs = False  # gloo's collectives (host-side) cannot be captured into a graph

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = self.model.device
        model_limit = self.model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids | set(self.model.config.eos_token_ids))
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()

    @classmethod
    def skips_all_reduces(cls, config: EngineConfig) -> bool:
        """Whether the engine, so configured on a GPU, runs kernels that read a layer's projections whole, past
        the all-reduces tensor parallelism adds (step 04 refuses to split it then)."""
        return False

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        loaded = load_model(config.model, config.resolved_device(), config.resolved_dtype(), config.seed)
        return cls.on_own_model(loaded, config)

    @classmethod
    def on_own_model(cls, loaded: LoadedModel, config: EngineConfig) -> Engine:
        """The engine on a model loaded for it alone (`from_config`'s, or one rank's shard in step 04), which it
        may change in place as it starts; an engine given a model others share must leave that model as it is."""
        return cls(loaded, config)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Engine:
        return cls.from_config(cls.config_class.from_args(args))

    # ----- the interface -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        listener: Any = None,
    ) -> str:
        """Queue a request. `prompt` is raw text (no chat template: see `Tokenizer.apply_chat_template`)
        or token ids; `listener`, if given, comes back on each of its outputs. Returns the request id. Raises
        ValueError for a prompt that cannot run."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check_prompt(prompt_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.request_class.create(
            request_id, prompt_ids, params, self.tokenizer, self.eos_token_ids, self.max_model_len, priority
        )
        request.listener = listener
        self.check_request(request)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_model_len}, "
                "with room needed for at least one new token: shorten the prompt"
            )

    def check_request(self, request: Request) -> None:
        """Refuse, with a ValueError that says what to change, a request this engine could never run."""
        if request.params.structured is not None and not self.serves_structured_output:
            raise ValueError(f"{type(self).__name__} does not constrain output to a grammar: serve step 16's engine "
                             "(--step step16_structured_output) for response_format and structured outputs")
        vocab = self.model.config.vocab_size
        outside = [t for t in request.params.logit_bias if t >= vocab]
        if outside:
            raise ValueError(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})")

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit, run one forward (or several), sample, and report."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request and free everything it holds. Unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request)
        return request.abort()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run prompts to completion; results come back in prompt order."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        requests = [self.requests[i] for i in ids]
        while self.has_unfinished():
            self.step()
        return [r.to_completion() for r in requests]

    # ----- shared by the steps -----------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per request from logits [len(requests), vocab]; the one host sync of a step. A request that
        asks for log-probabilities gets its token's `TokenLogprob` on its record, for `append_token` to hand out."""
        token_ids, logprobs = self.sampler.sample(
            logits, [r.params for r in requests], [len(r.output_token_ids) for r in requests],
            [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
            [r.logit_state for r in requests])
        for request, logprob in zip(requests, logprobs, strict=True):
            if logprob is not None:
                request.output_logprobs.append(logprob)
        return token_ids.tolist()

    def process_tokens(self, requests: Sequence[Request], token_ids: Sequence[int]) -> list[RequestOutput]:
        """Append each sampled token; retire the requests that finished. A request that asks for its prompt's
        log-probabilities has its prompt scored first, with its first token (see `common.prompt_logprobs`). A
        request whose handling raises ends with the error (`Request.fail`); the others are not touched."""
        outputs = []
        for request, token_id in zip(requests, token_ids, strict=True):
            try:
                if request.params.prompt_logprobs is not None and request.prompt_logprobs is None:
                    request.prompt_logprobs = prompt_logprobs(self.model, request.prompt_token_ids,
                                                              request.params.prompt_logprobs)
                out = request.append_token(token_id)
            except Exception as err:  # noqa: BLE001 - its text or stop check failed: it ends alone, the batch goes on
                log.exception("request %s failed", request.request_id)
                out = request.fail(err)
            if out.finished:
                self.finish(request)
            outputs.append(out)
        return outputs

    def finish(self, request: Request) -> None:
        """Remove a request from the scheduler and free its KV cache."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.free_request(request)
        self.requests.pop(request.request_id, None)

    def memory_report(self) -> str:
        """A line on how the step used its KV memory so far (each step knows its own cache)."""
        return ""

    def stats(self) -> dict[str, float]:
        """The scheduler's state now, one number per name, for a monitor (step 08's /metrics exports each one).
        A step that has more to say adds it: step 02 its KV blocks, step 07 its preemptions."""
        return {"requests_running": len(self.running), "requests_waiting": len(self.waiting)}

    @abstractmethod
    def free_request(self, request: Request) -> None:
        """Release whatever KV cache the request holds (it may hold none yet); called once per request."""
