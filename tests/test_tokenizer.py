"""The real embedded tokenizer: streaming detokenization of multi-byte text, and the chat template."""

from __future__ import annotations

import pytest

from common.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

MULTIBYTE = "你好，世界！🌍🚀 café"
MIXED = "Hello, world! It's a  test: naïve 日本語 😀👍🏽 done."


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Feed ids one at a time through an IncrementalDetokenizer; every delta, the final flush last."""
    detok = IncrementalDetokenizer(tokenizer)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_naive_per_token_decode_breaks_multibyte(tokenizer: Tokenizer) -> None:
    """The bug the detokenizer exists for: decoding each token alone yields U+FFFD on this text."""
    ids = tokenizer.encode(MULTIBYTE)
    naive = "".join(tokenizer.decode([i]) for i in ids)
    assert REPLACEMENT_CHAR in naive
    assert naive != tokenizer.decode(ids)
    assert tokenizer.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("text", [MULTIBYTE, MIXED])
def test_incremental_detokenizer_streams_whole_characters(tokenizer: Tokenizer, text: str) -> None:
    """No delta ever carries U+FFFD, and the deltas joined equal the decode of all ids."""
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids)
    assert not [d for d in deltas if REPLACEMENT_CHAR in d]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert deltas[-1] == ""  # everything was complete before the end: nothing left for flush


def test_incremental_detokenizer_holds_back_partial_characters(tokenizer: Tokenizer) -> None:
    """A token carrying only part of a character yields no text until the character is complete."""
    ids = tokenizer.encode("🌍")
    assert len(ids) > 1  # the emoji is split across byte tokens
    deltas = stream(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert deltas[-2] == "🌍"


def test_flush_releases_an_incomplete_character(tokenizer: Tokenizer) -> None:
    """If generation stops mid-character, flush hands out what the full decode gives (so nothing is lost)."""
    ids = tokenizer.encode("ok🚀")[:-1]  # cut the emoji's last byte token
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(i) for i in ids)
    assert text == "ok"
    rest = detok.flush()
    assert text + rest == tokenizer.decode(ids)
    assert rest.endswith(REPLACEMENT_CHAR)


def test_chat_template_matches_transformers(tokenizer: Tokenizer) -> None:
    """Our chat prompt is the tokenizer's own template: same ids as HF, user text and assistant header in it."""
    message = "What is 2+2? 答えて 🙂"
    ids = tokenizer.apply_chat_template(message)
    hf_ids = tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(hf_ids)
    text = tokenizer.hf.decode(ids, skip_special_tokens=False)
    assert message in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == tokenizer.hf.bos_token_id and ids[1] != ids[0]  # the template's BOS, not doubled
    assert message in tokenizer.decode(ids)


def test_chat_template_accepts_a_message_list(tokenizer: Tokenizer) -> None:
    """A multi-turn list goes through the same template, keeping every turn in order."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.hf.decode(tokenizer.apply_chat_template(messages), skip_special_tokens=False)
    positions = [text.index(m["content"]) for m in messages]
    assert positions == sorted(positions)
    assert "You are a helpful AI assistant" not in text  # our system message replaced the default one
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", [MULTIBYTE, MIXED])
def test_rust_decode_equals_transformers_decode(tokenizer: Tokenizer, text: str) -> None:
    """The shortcut past transformers' wrapper gives its exact text: whole, in every prefix (partial
    characters included) and with special tokens skipped."""
    assert tokenizer._rust_decode is not None, "the embedded tokenizer should take the shortcut"
    ids = tokenizer.apply_chat_template(text) + tokenizer.encode(text)
    for end in range(1, len(ids) + 1):
        assert tokenizer.decode(ids[:end]) == tokenizer.hf.decode(ids[:end], skip_special_tokens=True)


@pytest.mark.parametrize("text", [MULTIBYTE, MIXED])
def test_token_bytes_rebuild_the_text(tokenizer: Tokenizer, text: str) -> None:
    """Each token's own bytes, joined, are the text's UTF-8, also where a token holds part of a character (which
    decodes alone to U+FFFD): what a logprobs entry's `bytes` gives a client."""
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode(), f"{pieces} against {text.encode()}"
    split = [i for i in ids if tokenizer.decode([i]) == REPLACEMENT_CHAR]
    assert split, "the text should hold a character split across tokens"


def test_a_row_past_the_tokenizers_vocabulary_is_no_text(tokenizer: Tokenizer) -> None:
    """A model may have more rows of logits than its tokenizer has tokens (Qwen2.5-7B: 152,064 for 151,665; a
    random model of its shape borrows the embedded tokenizer's 49,152), and a log-probability's alternatives may
    name one: it stands for no bytes and no text (the server's logprobs answered 500 on the GPU before)."""
    past = len(tokenizer.hf) + 7
    assert tokenizer.token_bytes(past) == b""
    assert tokenizer.decode([past]) == ""
