"""The worked example of step 16's picture: a schema, a vocabulary of eight tokens, and the mask at each step.

The schema asks for one boolean field, `{"ok": true}` or `{"ok": false}`; the toy vocabulary has no spaces, so the
output is compact. llguidance (step16_structured_output/grammar.py) walks the toy tokenizer against the schema, and
at each step this prints the tokens it allows, the bitmask word (bit j allows token j), and the token taken.

    .venv/bin/python scripts/draw_grammar_masks.py
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch

TOKENS = [b"{", b'"', b"ok", b'":', b"true", b"false", b"}", b"<eos>"]
EOS = 7
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
TAKEN = [0, 1, 2, 3, 4, 6, EOS]  # {  "  ok  ":  true  }  <eos>


class ToyTokenizer:
    """What llguidance asks of a tokenizer: its tokens as bytes, its end-of-sequence token, and an encoder."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = TOKENS

    def __call__(self, text: str | bytes) -> list[int]:
        data, ids, at = text.encode() if isinstance(text, str) else text, [], 0
        while at < len(data):  # the longest token that matches here
            token = max((t for t in range(EOS) if data.startswith(TOKENS[t], at)), key=lambda t: len(TOKENS[t]))
            ids.append(token)
            at += len(TOKENS[token])
        return ids


def main() -> None:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ToyTokenizer()), slices=[])
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    bitmask = llguidance.torch.allocate_token_bitmask(1, len(TOKENS))
    print(f"schema {json.dumps(SCHEMA)}")
    print("vocabulary " + "  ".join(f"{i}:{t.decode()}" for i, t in enumerate(TOKENS)))
    print(f"{'output so far':16} {'allowed next':20} {'bits 7..0':10} taken")
    text = ""
    for token in TAKEN:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        word = int(bitmask[0, 0]) & 0xFF
        allowed = " ".join(TOKENS[i].decode() for i in range(len(TOKENS)) if word >> i & 1)
        print(f"{text or '(nothing)':16} {allowed:20} {word:08b}   {TOKENS[token].decode()}")
        matcher.consume_token(token)
        text += TOKENS[token].decode() if token != EOS else ""


if __name__ == "__main__":
    main()
