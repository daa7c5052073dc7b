"""Streamed text never shrinks and never shows what the final text will not contain.

Random token streams through the request's detokenizer and the engine's output logic (no model):
with the real SmolLM2 byte-level BPE tokenizer (emoji and CJK tokens that carry a part of a
character, special tokens) and the one-byte test tokenizer, for every stop-string,
`include_stop_str_in_output`, `skip_special_tokens` and `min_tokens` setting:
- the DELTA texts concatenate to the final text, and each CUMULATIVE text is a prefix of the next
  and of the final one (so an unfinished character never shows as U+FFFD and a possible stop
  string's start is never shown before it is decided);
- the final text is `decode(output).rstrip("\\ufffd")` cut at the first stop string that ends
  after `min_tokens` tokens (the reference below decodes the whole output at every token).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from checkpoints import _byte_tokenizer
from configs import RequestOutputKind, SamplingParams
from runner.detokenizer import IncrementalDetokenizer
from runner.outputs import RequestMetrics
from runner.request import Request, RequestStatus
from runner.request_state import RequestState, completion_output

MULTIBYTE_TEXT = "你好世界 🎉🚀 日本語 café naïve 😀👍🏽 Hello world. The end, STOP here.\n"


def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from models.embedded import EmbeddedModelError, ensure_smollm2
    try:
        return AutoTokenizer.from_pretrained(ensure_smollm2())
    except EmbeddedModelError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module", params=["smollm2", "byte"])
def tokenizer_and_pool(request):
    tokenizer = _smollm2_tokenizer() if request.param == "smollm2" else _byte_tokenizer(4096)
    pool = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    if request.param == "smollm2":
        pool += [0, 1, 2]  # special tokens: <|endoftext|>, <|im_start|>, <|im_end|>
    else:
        pool += [0, 1, 2, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x98, 0x80]  # bytes of 你 and 😀, split
    return tokenizer, sorted(set(pool)), len(tokenizer)


def reference(tokenizer, ids, skip, stop, include, min_tokens, max_tokens):
    """(number of tokens consumed, final text, stop string or None), decoding everything each time."""
    previous = ""
    for k in range(1, min(len(ids), max_tokens) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip).rstrip("\ufffd")
        if k > min_tokens:
            matches = [(text.find(s, max(0, len(previous) - len(s) + 1)), i) for i, s in enumerate(stop)]
            matches = [(index, i) for index, i in matches if index != -1]
            if matches:
                index, i = min(matches)
                return k, text[:index + len(stop[i])] if include else text[:index], stop[i]
        previous = text
    return k, previous, None


def stream(tokenizer, ids, params: SamplingParams):
    """Feed the tokens one by one as the engine does; the outputs of every kind at every step."""
    outputs = {kind: [] for kind in RequestOutputKind}
    trackers = {}
    for kind in RequestOutputKind:
        request = Request(request_id=kind.name, prompt_token_ids=[1],
                          sampling_params=params.model_copy(update={"output_kind": kind}))
        detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop,
                                       params.include_stop_str_in_output, params.min_tokens)
        trackers[kind] = RequestState(request, detok, None, RequestMetrics(0.0))
    for k in range(1, len(ids) + 1):
        for kind, tracked in trackers.items():
            request = tracked.request
            request.output_token_ids.append(ids[k - 1])
            stop = tracked.detokenizer.update(request.output_token_ids)
            finished = stop is not None or k == min(len(ids), params.max_tokens)
            if finished:
                request.status, request.finish_reason = RequestStatus.FINISHED, "stop" if stop else "length"
                tracked.detokenizer.finish()
            completion = completion_output(tracked, finished)
            if completion is not None:
                outputs[kind].append(completion)
        if finished:
            return k, outputs
    raise AssertionError("unreachable: the last token finishes")


@st.composite
def cases(draw, pool, vocab):
    ids = draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, vocab - 1)), min_size=1, max_size=40))
    return ids, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 6))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_is_a_prefix_of_the_final_text(tokenizer_and_pool, data):
    tokenizer, pool, vocab = tokenizer_and_pool
    ids, skip, include, min_tokens = data.draw(cases(pool, vocab))
    full = tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
    # Stop strings cut from the text itself (so they match, anywhere: inside a token, across tokens,
    # starting or ending inside a multi-byte token's characters), and sometimes one that never does.
    stop = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            stop.append(full[start:start + data.draw(st.integers(1, 4))])
        else:
            stop.append(data.draw(st.sampled_from(["STOP", "好世", "🚀 日", "\n", "é n", "zz"])))
    max_tokens = data.draw(st.integers(max(1, min_tokens), 40))
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip,
                            min_tokens=min_tokens, max_tokens=max_tokens)
    consumed, expected_text, expected_stop = reference(tokenizer, ids, skip, stop, include, min_tokens, max_tokens)
    k, outputs = stream(tokenizer, ids, params)
    assert k == consumed
    cumulative, delta, final = (outputs[kind] for kind in RequestOutputKind)
    assert len(final) == 1 and final[0].text == expected_text
    assert final[0].finish_reason == ("stop" if expected_stop else "length")
    assert "".join(d.text for d in delta) == expected_text
    assert sum((d.token_ids for d in delta), []) == ids[:k]
    texts = [c.text for c in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == expected_text
    if expected_stop is not None:
        assert k > min_tokens  # no stop string ends a request within min_tokens (one may show in that window)
        if include:
            assert expected_text.endswith(expected_stop)


def test_multibyte_characters_are_held_back_not_replaced():
    tokenizer = _smollm2_tokenizer()
    ids = tokenizer.encode("🎉你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, True, [])
    shown = []
    for k in range(1, len(ids) + 1):
        detok.update(ids[:k])
        shown.append(detok.text[:detok.num_stable_chars])
    assert all("\ufffd" not in text for text in shown) and shown[-1] == "🎉你好"
    assert "" in shown  # the emoji's first tokens showed nothing


def test_stop_string_prefix_is_held_back_until_decided():
    tokenizer = _byte_tokenizer(4096)
    detok = IncrementalDetokenizer(tokenizer, True, ["STOP"])
    ids = tokenizer.encode("a STOre", add_special_tokens=False)
    shown = []
    for k in range(1, len(ids) + 1):
        assert detok.update(ids[:k]) is None
        shown.append(detok.text[:detok.num_stable_chars])
    assert shown == ["a", "a ", "a ", "a ", "a ", "a STOr", "a STOre"]


def test_clean_up_spaces_tokenizer_never_shrinks():
    """A tokenizer that cleans up spaces (" ." -> ".") decodes whole outputs; what it shows stays a
    prefix of the final text."""
    tokenizer = _byte_tokenizer(4096)
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True  # transformers 5
    cleaned = 0
    for text in ["do n't x ' . it 's a b .", "x ' . y", "a ' b ' c", "end ."]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, True, [])
        assert detok._stream is None
        shown = []
        for k in range(1, len(ids) + 1):
            detok.update(ids[:k])
            shown.append(detok.text[:detok.num_stable_chars])
        detok.finish()
        final = tokenizer.decode(ids)
        cleaned += final != tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert detok.text == final
        assert all(final.startswith(s) for s in shown) and all(b.startswith(a) for a, b in zip(shown, shown[1:]))
        assert len(shown[-2]) > 0  # not everything held back
    assert cleaned == 4  # the clean-up did change these texts
