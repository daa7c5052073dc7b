"""Incremental detokenization and stop-string matching for one request.

Streaming contract (the engine's DELTA and CUMULATIVE outputs rely on it): `text[:num_stable_chars]`
only ever grows, and is a prefix of every later `text` and of the final one. Two things are held
back until they are decided: a character a byte-level token left unfinished (never shown as
U+FFFD), and a tail of the text that could be the start of a stop string.
"""

from __future__ import annotations

try:
    from tokenizers import Tokenizer
    from tokenizers.decoders import ByteLevel, DecodeStream
except ImportError:  # tokenizers < 0.21: every update decodes the whole output
    Tokenizer = DecodeStream = ByteLevel = None


def _stream_backend(tokenizer):
    """The Rust tokenizer behind a fast HF tokenizer whose decode adds nothing in Python (no
    clean-up of spaces), so a DecodeStream over it yields the same text; else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    """Keeps a request's text equal to `decode(output).rstrip("\\ufffd")` after every token.

    Stripping U+FFFD holds back a character that a byte-level BPE token leaves unfinished
    (it completes with the next one). Decoding the whole output every step costs O(length)
    per request per step. So with a fast tokenizer the text grows by the new tokens only
    (tokenizers' DecodeStream, a constant cost per token), which gives the same text whenever the stream holds nothing back. When it does
    (an unfinished character, a skipped special token: a third of the steps in emoji or CJK
    text), the held tokens are decoded on their own after the streamed text: exact for a
    byte-level decoder, because the stream last let go at a character boundary. Other
    decoders, and other tokenizers, decode the whole output then."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        """Stop strings are looked for once more than this many tokens are out (vLLM's rule: a
        match must end in text that a token past `min_tokens` added)."""
        self.text = ""
        """decode(output).rstrip("\\ufffd"), cut at the stop string once one matched."""
        self.num_stable_chars = 0
        """Length of the prefix of `text` that no later token can change: the text minus a tail that
        could start a stop string (and, for a tokenizer that cleans up spaces, minus what that
        clean-up may still change). All of `text` once the request is finished."""
        self._max_stop_len = max(map(len, stop), default=0)
        self._backend = _stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._byte_level = self._backend is not None and isinstance(self._backend.decoder, ByteLevel)
        self._cleans_up = self._backend is None and bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._stream_text = ""
        """decode(output[:_num_emitted]): what the stream has let go of."""
        self._num_emitted = self._num_streamed = 0

    def update(self, output_token_ids: list[int]) -> str | None:
        """Refresh the text; returns the stop string that matched, if any (text cut before it, or
        after it with `include_stop_str_in_output`). Call once per new token, with the whole output."""
        if self.tokenizer is None:
            return None
        stable_limit = None
        if self._stream is None:
            text, stable_limit = self._decode_whole(output_token_ids)
        elif not self._stream_holds_back(output_token_ids):
            text = self._stream_text
        elif self._byte_level:
            text = self._stream_text + self._decode(output_token_ids[self._num_emitted:])
        else:
            text = self._decode(output_token_ids)
        previous = len(self.text)
        self.text = text
        if self.stop and len(output_token_ids) > self.min_tokens:
            stop = self._find_stop(text, previous)
            if stop is not None:
                self.num_stable_chars = len(self.text)
                return stop
        stable = len(text) - self._stop_prefix_tail(text) if self.stop else len(text)
        if stable_limit is not None:
            stable = min(stable, stable_limit)
        self.num_stable_chars = max(self.num_stable_chars, stable)
        return None

    def finish(self) -> None:
        """The request ended (any reason): everything in `text` is final."""
        self.num_stable_chars = len(self.text)

    def _find_stop(self, text: str, previous: int) -> str | None:
        """The stop string whose match starts first among those ending in the text new since
        `previous` characters (ties: the first in `stop`); cuts `text` there."""
        best, best_index = None, len(text)
        for stop in self.stop:
            index = text.find(stop, max(0, previous - len(stop) + 1))
            if index != -1 and index < best_index:
                best, best_index = stop, index
        if best is not None:
            self.text = text[:best_index + len(best)] if self.include_stop_str_in_output else text[:best_index]
        return best

    def _stop_prefix_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string: it may
        become a match with the next tokens, so it is not shown yet."""
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0

    def _decode_whole(self, token_ids: list[int]) -> tuple[str, int | None]:
        """The whole output decoded (tokenizers without the stream), and how much of it is stable.
        A tokenizer that cleans up spaces (" ." -> ".", " 's" -> "'s", " ' " -> "'") may still change
        the text from a space on; the stable part ends at the last space whose clean-up is decided
        (not one that ends " '", which " ' " may still take), cleaned as the whole text will be."""
        if not self._cleans_up:
            return self._decode(token_ids), None
        raw = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                    clean_up_tokenization_spaces=False).rstrip("\ufffd")
        cut = raw.rfind(" ")
        while cut > 0 and raw[max(0, cut - 2):cut] == " '":
            cut = raw.rfind(" ", 0, cut - 2)
        text = self._decode(token_ids)
        clean = self.tokenizer.clean_up_tokenization
        if text == raw and clean(raw) != raw:
            return text, None  # the tokenizer does not clean up after all (transformers 5 skips it for BPE)
        return text, (len(clean(raw[:cut])) if cut >= 0 else 0)

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            # The stream's tokenizer, whose decode is its Rust one (`_stream_backend`): called
            # directly, without transformers' per-call conversion of the ids (`to_py_obj`), which
            # cost more than the decode itself where the stream held tokens back (py-spy of the
            # engine process under `graphrunner bench serve`).
            text = self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        else:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return text.rstrip("\ufffd")

    def _stream_holds_back(self, output_token_ids: list[int]) -> bool:
        """Feed the tokens not streamed yet; True when the stream keeps the last ones back."""
        chunk = None
        for token in output_token_ids[self._num_streamed:]:
            self._num_streamed += 1
            chunk = self._stream.step(self._backend, token)
            if chunk is not None:
                self._stream_text += chunk
                self._num_emitted = self._num_streamed
        return chunk is None
