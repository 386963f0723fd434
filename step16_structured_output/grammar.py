"""Grammars over tokens, from llguidance: compiled once per request format, matched once per request.

A grammar (a JSON schema, a regular expression, a list of choices) says which texts are allowed. A matcher that has
read a request's output so far says which vocabulary tokens keep the output inside the grammar, as a bitmask: bit j
of 32-bit word w allows token 32 w + j. One token can span several grammar symbols (`{"` is a brace and a quote),
and one symbol several tokens, so the matcher walks the tokenizer's vocabulary as a trie of byte strings against
the grammar's state, which is why it needs the tokenizer (built once here, `GrammarCompiler`).

Why llguidance: one wheel for every Python 3.9+ on Linux, macOS and Windows with no dependencies (no torch, no
Triton, no compiler), JSON schemas, regular expressions and Lark grammars, a rollback for speculative decoding, and
a mask in tens of microseconds for most steps (measured in this step's lesson).
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from common.sampling import StructuredOutput
from common.tokenizer import Tokenizer


# JSON laid out as Python's json.dumps lays it out, one space after each comma and colon and nowhere else. JSON's own
# grammar allows any whitespace between tokens, and a model that starts a run of spaces or newlines could fill its
# whole budget with them, the object never closed; a schema may still ask otherwise ("x-guidance").
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A request's format cannot be compiled, or its output left the grammar."""


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a request's format. Refuses, naming what is wrong, a format the library cannot
    honour in full: an unknown schema keyword would otherwise be dropped, and the output not validate."""
    if structured.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
    elif structured.kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(structured.spec, defaults=JSON_LAYOUT)
    elif structured.kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(structured.spec)
    else:  # "choice": one of the given strings exactly, as a Lark rule of literals
        choices = json.loads(structured.spec)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice needs a list of non-empty strings")
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:  # a warning too: what it warns of would not be enforced
        raise GrammarError(f"the {structured.kind.replace('_', ' ')} cannot be enforced: {'; '.join(messages)}")
    return grammar


class GrammarCompiler:
    """The tokenizer as llguidance walks it (built once: about a second), and each format's grammar, compiled once
    and cached by the format's text as a matcher that has read nothing. A request's matcher is a copy of it: 7 to
    10 us on our CPU, against 0.3 to 0.7 ms to build one from the grammar's text, which every constrained request
    of a batch being admitted would pay in turn (`results/cpu/grammar.json`)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # The model's vocabulary may be wider than the tokenizer's (Qwen2.5-7B: 152,064 rows, 151,665 tokens): the
        # bitmask spans the model's, and a row no token names is never allowed. The grammar ends at the
        # end-of-sequence tokens the tokenizer names: a checkpoint's config adds its own to the tokenizer's, and a
        # random model's config may name ids its borrowed tokenizer lacks (llguidance refuses those).
        named = sorted(t for t in tokenizer.eos_token_ids if t < len(tokenizer.hf))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=named or None)
        self.vocab_size = vocab_size
        self.unread = lru_cache(maxsize=256)(self.compile)  # never handed out: only its copies read tokens
        self.threads = llguidance.LLExecutor()  # most of the host's cores (llguidance's default)

    def compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """The format's grammar as a matcher at its start (raises GrammarError as `grammar_text` does)."""
        return llguidance.LLMatcher(self.tokenizer, grammar_text(structured))

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self.unread(structured).deep_copy())

    def bitmask(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """Each matcher's allowed next tokens, one row each: [len(matchers), words] int32, on the host (in pinned
        memory where there is a GPU). The rows are filled by llguidance's threads, outside Python's lock: a mask
        where most of the vocabulary is allowed (free text in a JSON string) walks the whole tokenizer trie."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.vocab_size)
        rows = [(matcher.matcher, row) for row, matcher in enumerate(matchers)]
        llguidance.torch.fill_next_token_bitmask_par(self.threads, rows, bitmask)
        return bitmask

    def bitmasks_along(self, matcher: GrammarMatcher, tokens: list[int]) -> torch.Tensor:
        """The masks before each of `tokens` and after the last ([len(tokens) + 1, words]): what a verification
        checks its proposals against. The matcher is left where it was."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        for row in range(len(tokens) + 1):
            llguidance.torch.fill_next_token_bitmask(matcher.matcher, bitmask, row)
            if row < len(tokens):
                matcher.advance(tokens[row])
        matcher.rollback(len(tokens))
        return bitmask


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        """Read one more token of the output; a token the mask did not allow is a bug, not a choice."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} leaves the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar allows nothing more (a closed JSON object, a whole choice): the output is done."""
        return self.matcher.is_stopped()

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order from the current place, the grammar allows (nothing is read)."""
        return self.matcher.validate_tokens(tokens)

    def rollback(self, tokens: int) -> None:
        """Forget the last `tokens` tokens read (proposals a verification rejected)."""
        self.matcher.rollback(tokens)
