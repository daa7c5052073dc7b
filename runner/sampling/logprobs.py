"""Logprobs as the user sees them: {token id: Logprob} per sampled token (vLLM's shape)."""

from __future__ import annotations

from runner.outputs import Logprob


def logprobs_entries(request_ids: list[str], num_logprobs: list[int | None], sampled_ids: list[int],
                     sampled_lps: list[float], sampled_ranks: list[int], top_ids: list[list[int]],
                     top_lps: list[list[float]]) -> dict[str, dict[int, Logprob]]:
    """{request id: {token id: Logprob}} for the rows that asked (num_logprobs[row] = k, not None):
    the sampled token first (with its rank), then the top-k (ranks 1..k), as vLLM returns them."""
    out = {}
    for row, (request_id, k) in enumerate(zip(request_ids, num_logprobs)):
        if k is None:
            continue
        entry = {sampled_ids[row]: Logprob(sampled_lps[row], sampled_ranks[row])}
        for rank, (token, value) in enumerate(zip(top_ids[row][:k], top_lps[row][:k]), start=1):
            entry.setdefault(token, Logprob(value, rank))
        out[request_id] = entry
    return out
