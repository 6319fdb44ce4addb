"""Tests for engine/frontend/detokenizer.py with the default model's real tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.engine.frontend.detokenizer import IncrementalDetokenizer
from pagoda.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a test.",
    "héllo naïve café — déjà vu, Ångström",
    "🎉🎉 party 👩‍👩‍👧‍👦 family 🇫🇷 flag",
    "世界你好，日本語のテキスト、한국어 텍스트",
    "mixed: a🎉b世c é\u0301 (combining) \t tabs\nnew lines\n\n  spaces  ",
    "code: def f(x):\n    return x ** 2  # ∑ ∫ √",
    "<|im_start|>assistant\nspecial tokens inside<|im_end|> text",
]


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.engine.model_loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model())


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(tokenizer, ids, params=None, prompt=(), step=1):
    """Feeds ``ids`` ``step`` at a time; returns (detokenizer, deltas, stopped_at_call)."""
    det = IncrementalDetokenizer(tokenizer, list(prompt), params or SamplingParams())
    deltas, stopped, texts = [], None, []
    for call, i in enumerate(range(0, len(ids), step)):
        if det.update(ids[i : i + step]):
            stopped = call
        deltas.append(det.get_delta())
        texts.append("".join(deltas))
        if det.finished:
            break
    deltas.append(det.finish())
    # Half a character was never streamed: no text so far that a later token changed (a U+FFFD
    # along the way only for bytes that can no longer form one).
    assert all(det.output_text.startswith(text) for text in texts)
    return det, deltas, stopped


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text, skip_special_tokens):
    ids = encode(tokenizer, text)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    for prompt in ([], encode(tokenizer, "<|im_start|>user\nSay hi 世界<|im_end|>\n<|im_start|>assistant\n")):
        for step in (1, 3):
            det, deltas, _ = run(tokenizer, ids, params, prompt, step)
            assert det.output_text == expected
            assert "".join(deltas) == expected
            assert det.stop_reason is None


def test_multibyte_characters_are_held_until_complete(tokenizer):
    ids = encode(tokenizer, " 🎉")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for tok in ids[:-1]:
        det.update([tok])
        assert det.output_text == "" and det.get_delta() == ""
    det.update(ids[-1:])
    assert det.output_text == " 🎉" and det.get_delta() == " 🎉"


def test_finish_flushes_incomplete_characters(tokenizer):
    ids = encode(tokenizer, " 🎉")[:-1]
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    det.update(ids)
    assert det.get_delta() == ""
    assert det.finish() == tokenizer.decode(ids)
    assert det.output_text.endswith("\ufffd") and det.finished
    assert det.finish() == "" and det.update([100]) is False


def _byte_tokens(tokenizer, data: bytes) -> list[int]:
    """The byte-level BPE's single-byte tokens spelling ``data`` (valid UTF-8 or not): GPT-2's
    byte alphabet, printable bytes as themselves and the others as code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    return tokenizer.convert_tokens_to_ids([chars[b] for b in data])


def test_bytes_that_never_form_a_character_stream_with_a_short_lag(tokenizer):
    # A model emitting lone continuation bytes (invalid UTF-8, which the default model did in
    # a served request), then an emoji spelled byte by byte, then text: the invalid bytes go
    # out as U+FFFD a few tokens behind instead of all at the end; the emoji never as U+FFFD.
    ids = _byte_tokens(tokenizer, bytes([0x80 + i for i in range(12)]) + "🎉".encode() + b" ok")
    final = tokenizer.decode(ids)
    assert final.count("\ufffd") == 12 and "🎉 ok" in final
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    streamed = ""
    for i, token in enumerate(ids):
        det.update([token])
        streamed += det.get_delta()
        assert final.startswith(streamed)  # nothing emitted that a later byte changes
        if i >= 4 and i < 12:
            assert streamed.count("\ufffd") >= i + 1 - 4  # at most 4 tokens held back
    streamed += det.finish()
    assert streamed == final == det.output_text


class _CountingTokenizer:
    """Wraps a tokenizer and records the longest id list passed to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decodes_only_a_small_window(tokenizer):
    ids = encode(tokenizer, " ".join(TEXTS * 5))
    counting = _CountingTokenizer(tokenizer)
    det, _, _ = run(counting, ids, prompt=list(range(100, 200)))
    assert det.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 300 and counting.longest <= 12


def test_stop_terminated_token_is_left_out_unless_asked(tokenizer):
    ids = encode(tokenizer, "The end.")
    eos = tokenizer.eos_token_id
    for include, expected in ((False, "The end."), (True, "The end." + tokenizer.eos_token)):
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        det = IncrementalDetokenizer(tokenizer, [], params)
        for tok in ids:
            det.update([tok])
        det.update([eos], stop_terminated=True)
        assert det.finish() and det.output_text == expected


def _boundaries(tokenizer, ids):
    """Character offsets at which token boundaries fall."""
    return {len(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)}


def test_stop_string_spanning_token_boundaries(tokenizer):
    text = "Hello world, this is a test of stop strings."
    ids = encode(tokenizer, text)
    stop = "o wor"
    start = text.index(stop)
    cuts = _boundaries(tokenizer, ids)
    assert any(start < c < start + len(stop) for c in cuts), "the stop string should span tokens"
    for include in (False, True):
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        det, deltas, stopped = run(tokenizer, ids, params)
        want = text[: start + len(stop)] if include else text[:start]
        assert stopped is not None and det.stop_reason == stop
        # The stream is exactly the text before the stop: no part of it leaked.
        assert det.output_text == want and "".join(deltas) == want


def test_stop_string_in_first_token(tokenizer):
    ids = encode(tokenizer, "Hello there")
    params = SamplingParams(stop=["Hel"])
    det = IncrementalDetokenizer(tokenizer, [], params)
    assert det.update(ids[:1]) is True
    assert det.output_text == "" and det.stop_reason == "Hel" and det.finished
    assert det.get_delta() == "" and det.finish() == ""
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["Hel"], include_stop_str_in_output=True))
    assert det.update(ids[:1]) is True and det.get_delta() == "Hel"


def test_multiple_stop_strings_earliest_match_wins(tokenizer):
    text = "one two three four"
    ids = encode(tokenizer, text)
    # All text arrives in one update: "two" starts first although listed last.
    det, deltas, _ = run(tokenizer, ids, SamplingParams(stop=["four", "three", "two"]), step=len(ids))
    assert det.stop_reason == "two" and det.output_text == "one " and "".join(deltas) == "one "
    # One token at a time: the first stop string to complete wins.
    det, _, _ = run(tokenizer, ids, SamplingParams(stop=["four", "ee"]))
    assert det.stop_reason == "ee" and det.output_text == "one two thr"


def test_deltas_hold_back_possible_stop_prefixes(tokenizer):
    ids = encode(tokenizer, "abc abd abe")
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz", "abf"]))
    sent = ""
    for tok in ids:
        assert not det.update([tok])
        sent += det.get_delta()
        assert det.output_text.startswith(sent) and len(det.output_text) - len(sent) <= 2
    assert sent + det.finish() == "abc abd abe"


_stop_alphabet = st.sampled_from(["a", "b", "é", "🎉", "世", " ", "\n", "ab", "end"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60), prompt=st.text(max_size=20), step=st.integers(1, 4))
def test_property_round_trip(tokenizer, text, prompt, step):
    ids = encode(tokenizer, text)
    det, deltas, _ = run(tokenizer, ids, prompt=encode(tokenizer, prompt), step=step)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert det.output_text == expected and "".join(deltas) == expected


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(_stop_alphabet, max_size=25),
    stops=st.lists(st.lists(_stop_alphabet, min_size=1, max_size=3).map("".join), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_property_stop_strings_never_leak(tokenizer, parts, stops, include):
    ids = encode(tokenizer, "".join(parts))
    full = tokenizer.decode(ids)
    det, deltas, _ = run(tokenizer, ids, SamplingParams(stop=stops, include_stop_str_in_output=include))
    streamed = "".join(deltas)
    assert streamed == det.output_text
    # Reference: the first token prefix holding a stop string; in it, the earliest match.
    for i in range(len(ids) + 1):
        prefix = tokenizer.decode(ids[:i])
        if not prefix.endswith("\ufffd") and any(s in prefix for s in stops):
            _, _, stop = min((prefix.find(s), k, s) for k, s in enumerate(stops) if s in prefix)
            start = prefix.find(stop)
            assert det.stop_reason == stop
            assert streamed == (prefix[: start + len(stop)] if include else prefix[:start])
            break
    else:
        assert streamed == full and det.stop_reason is None


@pytest.mark.parametrize("stop", [[], ["zzz"]])
def test_streams_without_stop_strings_are_detokenized_when_read(tokenizer, stop):
    # Between steps (process) only a request with stop strings is detokenized; the others
    # make their text when the stream is read, and the deltas still add up to the full
    # text with EOS left out.
    from pagoda.engine.frontend.output_processor import OutputKind, OutputProcessor, RequestStream
    from pagoda.engine.core.request import Request, RequestStatus
    from pagoda.engine.core.scheduler import RequestUpdate

    ids = encode(tokenizer, TEXTS[1])
    eos = tokenizer.eos_token_id
    request = Request("r", [1, 2, 3], SamplingParams(stop=stop), max_tokens=100, eos_token_ids=frozenset([eos]))
    processor = OutputProcessor(tokenizer)
    stream = RequestStream("r", None, [1, 2, 3], OutputKind.DELTA)
    sample = processor.new_sample(stream, request, 0)
    processor.add(stream)
    texts, decoded_in_process = [], 0
    for i, token in enumerate([*ids, eos]):
        finished = i == len(ids)
        if finished:
            request.status = RequestStatus.FINISHED_STOPPED
        before = sample.detokenizer.output_text
        processor.process([RequestUpdate(request, [token], finished=finished)])
        decoded_in_process += not finished and sample.detokenizer.output_text != before
        texts.append(stream.take().outputs[0].text)
    assert (decoded_in_process > 0) == bool(stop)
    assert "".join(texts) == tokenizer.decode(ids, clean_up_tokenization_spaces=False)
