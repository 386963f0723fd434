"""Request.append_token with the real tokenizer: finish reasons, stop strings, and streamed text."""

from __future__ import annotations

from common.request import FinishReason, Request, RequestOutput, RequestStatus
from common.sampling import SamplingParams
from common.tokenizer import REPLACEMENT_CHAR, Tokenizer

EOS = 2  # <|im_end|>, the embedded tokenizer's end of turn
PROMPT = [1, 4093, 198]  # "<|im_start|>user\n"


def make_request(tokenizer: Tokenizer, max_model_len: int = 1000, **params) -> Request:
    return Request.create(
        "r", list(PROMPT), SamplingParams(**params), tokenizer, frozenset({EOS}), max_model_len
    )


def feed(request: Request, token_ids: list[int]) -> list[RequestOutput]:
    """Append tokens until the request finishes (or the ids run out); every output in order."""
    outputs = []
    for token_id in token_ids:
        outputs.append(request.append_token(token_id))
        if request.finished:
            break
    return outputs


def streamed(outputs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outputs)


def test_eos_finishes_with_stop_and_adds_no_text(tokenizer: Tokenizer) -> None:
    """EOS ends the request with reason stop; the EOS token is recorded but gives no text."""
    ids = tokenizer.encode("Hello world")
    request = make_request(tokenizer, max_tokens=50)
    outputs = feed(request, ids + [EOS] + tokenizer.encode(" more"))
    assert len(outputs) == len(ids) + 1
    assert [o.finished for o in outputs] == [False] * len(ids) + [True]
    last = outputs[-1]
    assert last.finish_reason is FinishReason.STOP and last.new_token_ids == [EOS] and last.new_text == ""
    assert request.status is RequestStatus.FINISHED and request.finish_reason is FinishReason.STOP
    assert request.text == streamed(outputs) == "Hello world"
    assert request.output_token_ids == ids + [EOS]


def test_ignore_eos_keeps_generating_until_length(tokenizer: Tokenizer) -> None:
    """With ignore_eos, EOS is just another token; the request runs to max_tokens and ends with length."""
    ids = tokenizer.encode("Hi") + [EOS] + tokenizer.encode(" again")
    request = make_request(tokenizer, max_tokens=len(ids), ignore_eos=True)
    outputs = feed(request, ids)
    assert len(outputs) == len(ids)
    assert not any(o.finished for o in outputs[:-1])
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
    assert request.text == streamed(outputs) == "Hi again"


def test_max_tokens_finishes_with_length(tokenizer: Tokenizer) -> None:
    """The max_tokens-th token finishes the request with reason length, not one earlier or later."""
    ids = tokenizer.encode("one two three four five")
    request = make_request(tokenizer, max_tokens=3)
    outputs = feed(request, ids)
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert request.text == streamed(outputs) == tokenizer.decode(ids[:3])


def test_full_context_finishes_with_length(tokenizer: Tokenizer) -> None:
    """When prompt plus output reach max_model_len, the request ends with length even under max_tokens."""
    request = make_request(tokenizer, max_model_len=len(PROMPT) + 2, max_tokens=100)
    assert request.max_total_tokens == len(PROMPT) + 2
    outputs = feed(request, tokenizer.encode("a b c d"))
    assert len(outputs) == 2 and outputs[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_finish_with_stop(tokenizer: Tokenizer) -> None:
    """A token in stop_token_ids ends the request with stop and, like EOS, contributes no text."""
    ids = tokenizer.encode("Hello world, and more")
    stop_id = ids[2]  # ","
    request = make_request(tokenizer, stop_token_ids=[stop_id])
    outputs = feed(request, ids)
    assert len(outputs) == 3
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert request.text == streamed(outputs) == "Hello world"


def test_stop_string_cuts_text_and_excludes_it(tokenizer: Tokenizer) -> None:
    """A stop string spanning tokens ends the request; the text ends right before it."""
    ids = tokenizer.encode("The answer is 42. END of story")
    request = make_request(tokenizer, stop=["42. END"], max_tokens=50)
    outputs = feed(request, ids)
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.STOP
    assert len(outputs) < len(ids)  # it stopped as soon as the stop string was complete
    assert request.text == streamed(outputs) == "The answer is "


def test_text_that_may_start_a_stop_string_is_held_then_released(tokenizer: Tokenizer) -> None:
    """' world' could begin ' world peace': it is held back, released once ',' rules the stop out."""
    ids = tokenizer.encode("Hello world, and hello world peace. More")
    assert tokenizer.hf.convert_ids_to_tokens(ids[:3]) == ["Hello", "Ġworld", ","]
    request = make_request(tokenizer, stop=[" world peace"], max_tokens=50)
    outputs = feed(request, ids)
    texts = [o.new_text for o in outputs]
    assert texts[:3] == ["Hello", "", " world,"]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert len(outputs) == 7  # finished on " peace"
    assert request.text == streamed(outputs) == "Hello world, and hello"


def test_held_text_is_released_when_the_request_ends_by_length(tokenizer: Tokenizer) -> None:
    """A held-back possible stop prefix is handed out when the request finishes for another reason."""
    ids = tokenizer.encode("Hello world")
    request = make_request(tokenizer, stop=[" world peace"], max_tokens=len(ids))
    outputs = feed(request, ids)
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert streamed(outputs) == request.text == "Hello world"


def test_multibyte_stop_string(tokenizer: Tokenizer) -> None:
    """A stop string of CJK characters (split across byte tokens) is matched and cut cleanly."""
    ids = tokenizer.encode("你好，世界！再见")
    request = make_request(tokenizer, stop=["世界"], max_tokens=50)
    outputs = feed(request, ids)
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert request.text == streamed(outputs) == "你好，"


def test_multibyte_output_streams_without_replacement_chars(tokenizer: Tokenizer) -> None:
    """CJK and emoji output streams whole characters; the deltas add up to the final text."""
    text = "你好，世界！🌍🚀 café 😀👍🏽"
    ids = tokenizer.encode(text)
    request = make_request(tokenizer, max_tokens=len(ids) + 1)
    outputs = feed(request, ids + [EOS])
    assert request.finish_reason is FinishReason.STOP
    assert not [o.new_text for o in outputs if REPLACEMENT_CHAR in o.new_text]
    assert any(o.new_text == "" for o in outputs[:-1])  # partial characters were held back
    assert streamed(outputs) == request.text == text


def test_abort_finishes_with_abort(tokenizer: Tokenizer) -> None:
    """abort() ends a running request with reason abort and no new tokens."""
    request = make_request(tokenizer)
    request.append_token(tokenizer.encode("Hi")[0])
    out = request.abort()
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert request.finished and request.finish_reason is FinishReason.ABORT
