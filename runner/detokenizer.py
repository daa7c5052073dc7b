"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Keeps a request's text in step with its tokens.

    Decodes the whole output each step (cheap at these lengths, and exact where a byte-level
    BPE token completes a multi-byte character only with the next one: an unfinished
    character shows as U+FFFD and is held back until it resolves)."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.text = ""

    def update(self, output_token_ids: list[int]) -> str | None:
        """Refresh the text; returns the stop string that matched, if any (text cut before it)."""
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        previous = len(self.text)
        self.text = text
        for stop in self.stop:
            index = text.find(stop, max(0, previous - len(stop) + 1))
            if index != -1:
                self.text = text[:index]
                return stop
        return None
