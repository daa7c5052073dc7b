"""`SamplingParams.bad_words` to token ids, as vLLM tokenizes them.

Each word is encoded without special tokens as written (leading spaces stripped) and, where the
tokenizer gives it a different first token with a space before it (the word in mid-text, for
BPE tokenizers that fold the space into the token) and the same length, that way too. The engine
calls this once per request (it holds the tokenizer); the sampler bans the results.
"""

from __future__ import annotations


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
