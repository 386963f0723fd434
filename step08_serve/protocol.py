"""The OpenAI request bodies we accept, checked before anything reaches the engine.

Unknown fields are accepted and ignored: the official SDK's `extra_body` and benchmark clients send
fields a server may not know, and rejecting them breaks those clients. Known fields are checked for type
and range; a field we understand but do not implement is refused with a 400 that names it, rather than
silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.sampling import SamplingParams, StructuredOutput


class RequestError(ValueError):
    """A client error: becomes a 400 (or the given status) in the OpenAI error envelope."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationFields(BaseModel):
    """Fields shared by chat completions and completions."""

    model_config = ConfigDict(extra="allow")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    # "strict"}}: the last two constrain the output (an engine that cannot refuses them: never free text under a 200).
    response_format: dict[str, Any] | None = None
    user: str | None = None
    # Extras sent as top-level keys through the SDK's extra_body.
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    priority: int = 0
    # vLLM's extension, one key of: {"json": schema}, {"regex": "..."}, {"choice": ["a", "b"]}.
    structured_outputs: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return value

    def check_supported(self, vocab_size: int) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        self.token_biases(vocab_size)
        if self.min_tokens != 0:
            raise RequestError("min_tokens is not supported by this server; leave it at its default", "min_tokens")
        self.structured_output()

    def structured_output(self) -> StructuredOutput | None:
        """The format the output is held to, from `response_format` or `structured_outputs`; None: free text."""
        if self.structured_outputs is not None:
            if self.response_format is not None and self.response_format.get("type", "text") != "text":
                raise RequestError("send response_format or structured_outputs, not both", "structured_outputs")
            return structured_outputs_format(self.structured_outputs)
        return response_format(self.response_format or {})

    def token_biases(self, vocab_size: int) -> dict[int, float]:
        """`logit_bias` with its keys as token ids, each checked against the vocabulary, each bias in [-100, 100]."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            token_id = int(key) if key.strip().lstrip("-").isdigit() else -1
            if not 0 <= token_id < vocab_size:
                raise RequestError(f"logit_bias: key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias: the bias of token {key} must be in [-100, 100], got {bias}",
                                   "logit_bias")
            biases[token_id] = bias
        return biases

    def sampling_params(self, max_tokens: int, choice: int, vocab_size: int) -> SamplingParams:
        """The engine's parameters for choice number `choice` of `n` (each choice gets its own seed)."""
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),  # -1 and 0 both mean "no top-k" (vLLM uses -1)
            seed=seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=self.token_biases(vocab_size),
            logprobs=self.logprobs_count(),
            prompt_logprobs=self.prompt_logprobs_count(),
            structured=self.structured_output(),
        )

    def logprobs_count(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """The same for each prompt token (completions' `echo`); None: the prompt is not scored."""
        return None

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


def response_format(value: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's `response_format`: text (None), any JSON object, or JSON valid against `json_schema.schema`."""
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("response_format of type json_schema needs json_schema.schema, a JSON schema object",
                               "response_format")
        return StructuredOutput("json_schema", json.dumps(spec["schema"]))
    raise RequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       "response_format")


def structured_outputs_format(value: dict[str, Any]) -> StructuredOutput:
    """vLLM's `structured_outputs` extension: exactly one of json (a schema), regex, choice."""
    if len(value) != 1 or next(iter(value)) not in ("json", "regex", "choice"):
        raise RequestError("structured_outputs takes exactly one of: json (a schema), regex, choice (a list of "
                           f"strings); got {sorted(value)}", "structured_outputs")
    (key, spec), = value.items()
    if key == "json":
        schema = json.loads(spec) if isinstance(spec, str) else spec
        if not isinstance(schema, dict):
            raise RequestError("structured_outputs.json must be a JSON schema object", "structured_outputs")
        return StructuredOutput("json_schema", json.dumps(schema))
    if key == "regex":
        if not isinstance(spec, str) or not spec:
            raise RequestError("structured_outputs.regex must be a non-empty string", "structured_outputs")
        return StructuredOutput("regex", spec)
    if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
        raise RequestError("structured_outputs.choice must be a list of non-empty strings", "structured_outputs")
    return StructuredOutput("choice", json.dumps(spec))


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check_supported(self, vocab_size: int) -> None:
        super().check_supported(vocab_size)
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs is only allowed when logprobs is true", "top_logprobs")

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def token_budget(self) -> int | None:
        """Chat has no default budget: None means "up to the context limit"."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 only with `echo`: the prompt alone comes back, scored if `logprobs` is set (evaluation harnesses ask so).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def check_supported(self, vocab_size: int) -> None:
        super().check_supported(vocab_size)
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be at least 1 (0 is allowed only with echo: the prompt alone comes "
                               "back)", "max_tokens")
        if self.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, several strings, one id list, or several id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[list-item]
        return [list(x) for x in p]  # type: ignore[union-attr]

    def token_budget(self) -> int | None:
        # The engine draws at least one token: with max_tokens 0 the server drops it (`CompletionShape`).
        return 1 if self.max_tokens == 0 else self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        return self.logprobs if self.echo else None
