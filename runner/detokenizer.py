"""Incremental detokenization and stop-string matching for one request."""

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

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.text = ""
        self._backend = _stream_backend(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._byte_level = self._backend is not None and isinstance(self._backend.decoder, ByteLevel)
        self._stream_text = ""
        """decode(output[:_num_emitted]): what the stream has let go of."""
        self._num_emitted = self._num_streamed = 0

    def update(self, output_token_ids: list[int]) -> str | None:
        """Refresh the text; returns the stop string that matched, if any (text cut before it)."""
        if self.tokenizer is None:
            return None
        if self._stream is None:
            text = self._decode(output_token_ids)
        elif not self._stream_holds_back(output_token_ids):
            text = self._stream_text
        elif self._byte_level:
            text = self._stream_text + self._decode(output_token_ids[self._num_emitted:])
        else:
            text = self._decode(output_token_ids)
        previous = len(self.text)
        self.text = text
        for stop in self.stop:
            index = text.find(stop, max(0, previous - len(stop) + 1))
            if index != -1:
                self.text = text[:index]
                return stop
        return None

    def _decode(self, token_ids: list[int]) -> str:
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
