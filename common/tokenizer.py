"""Text in, token ids out, and back again, including while tokens are still arriving.

Byte-level BPE tokenizers split a multi-byte character (most CJK characters, every emoji) across tokens.
Decoding each new token on its own therefore yields U+FFFD replacement characters. `IncrementalDetokenizer`
decodes a short window of recent tokens instead and holds text back until the bytes are complete.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for one raw byte


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's table, inverted: the printable character each of the 256 bytes is written as in a token's
    piece (printable Latin-1 bytes as themselves, the others from U+0100 up, in byte order), to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


BYTE_OF_CHAR = byte_level_alphabet()


class Tokenizer:
    """A thin wrapper over a Hugging Face tokenizer with the few calls the engine needs."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        # Detokenizing decodes twice per token per request, so on a large batch it is a real share of each
        # step's host time. The Rust tokenizer's own decode skips transformers' Python wrapper around it;
        # used only where the wrapper would not change the text (no clean-up of spaces).
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        fast = backend is not None and not hf_tokenizer.clean_up_tokenization_spaces
        self._rust_decode = backend.decode if fast else None

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        return cls(AutoTokenizer.from_pretrained(str(path)), eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Raw text to ids, as a completion prompt (no chat template)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def apply_chat_template(self, messages: str | list[dict[str, str]]) -> list[int]:
        """A user message (or a list of chat messages) to ids, through the tokenizer's own template."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template: pass a raw prompt instead of chat messages")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template already wrote any BOS it wants; adding special tokens again would double it.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for. A token holding part of a multi-byte character decodes alone to
        U+FFFD; its bytes are still exact (what an OpenAI logprobs entry's `bytes` reports)."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:  # a row of the model's vocabulary past the tokenizer's (Qwen2.5-7B pads 151,665 to 152,064)
            return b""
        if byte := BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(byte.group(1), 16)])
        if all(ch in BYTE_OF_CHAR for ch in piece):  # a byte-level BPE piece
            return bytes(BYTE_OF_CHAR[ch] for ch in piece)
        return self.decode([token_id]).encode()  # a SentencePiece word piece ("▁the"), or a special token

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(list(token_ids), skip_special_tokens=True)
        return self.hf.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a character.

    Each call decodes the window `ids[prefix_offset:]` and compares it with the decode of the already
    emitted part `ids[prefix_offset:read_offset]`; the difference is the new text. Decoding a window
    (rather than one token) keeps merges and leading spaces right; the window slides forward after each
    emitted delta so the cost per token stays small. If the new text ends in U+FFFD, the last token holds
    an incomplete character, so nothing is emitted until a later token completes it. The deltas joined
    together equal `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are already emitted as text

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now complete (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character (or a token with no text yet): wait for more
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of generation, release whatever is held back, even an incomplete character."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]
