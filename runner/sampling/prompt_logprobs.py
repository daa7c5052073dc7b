"""`prompt_logprobs=k`: each prompt token's logprob (and rank) under the logits of the position
before it, with the top-k, in vLLM's shape: None for the first token (nothing predicts it), then
{prompt token: Logprob, top-k tokens: Logprob}. Logprobs of the float32 logits as the model
produced them (no processors, no temperature), like HF's log_softmax of the prompt logits.

Chunked prefill: each chunk yields the entries of the prompt tokens its positions predict, in
order, and the engine appends them. A request that asks for them takes no prefix-cache hits (the
KV-cache manager skips them, as vLLM does: cached positions would have no logits). After a
preemption the prompt is recomputed; `PromptLogprobs.emitted` remembers how many entries went
out, so none is sent twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runner.outputs import Logprob
from runner.scheduler import ScheduledRequest


class PromptLogprobs:
    def __init__(self) -> None:
        self.emitted: dict[str, int] = {}
        """Request id -> prompt entries sent so far (the first, None, included)."""

    def release(self, request_ids) -> None:
        for request_id in request_ids:
            self.emitted.pop(request_id, None)

    def launch(self, reqs: list[ScheduledRequest], query_start_loc: list[int],
               logits_of_rows: Callable[[list[int]], torch.Tensor],
               to_device: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], dict] | None:
        """Enqueue the step's prompt logprobs: `reqs` is the whole step (row i of the flattened
        batch starts at query_start_loc[i]); `logits_of_rows(rows)` gives float32 logits of those
        token rows. Returns a function that builds {request id: [entries]} once the step's
        copies have reached the host, or None when no request of the step needs any. `to_device`
        moves a small host tensor to the device without a host sync."""
        rows: list[int] = []
        targets: list[int] = []
        plan: list[tuple[str, int, bool, int]] = []   # (request id, k, leading None, number of rows)
        for i, req in enumerate(reqs):
            k = req.sampling_params.prompt_logprobs
            if k is None:
                continue
            prompt = req.prompt_token_ids
            emitted = self.emitted.get(req.request_id, 0)
            start = req.num_computed_tokens
            lead = start == 0 and emitted == 0
            first_target = max(start + 1, emitted, 1)
            last_target = min(start + len(req.token_ids), len(prompt) - 1)   # position p predicts token p + 1
            count = max(0, last_target - first_target + 1)
            if not lead and not count:
                continue
            rows += [query_start_loc[i] + (t - 1 - start) for t in range(first_target, first_target + count)]
            targets += prompt[first_target:first_target + count]
            plan.append((req.request_id, k, lead, count))
            self.emitted[req.request_id] = max(emitted, first_target + count, 1 if lead else 0)
        if not plan:
            return None
        host = None
        if rows:
            logprobs = torch.log_softmax(logits_of_rows(rows), dim=-1)
            target = to_device(torch.tensor(targets, dtype=torch.int64))
            target_lp = logprobs.gather(1, target.unsqueeze(1))
            ranks = (logprobs > target_lp).sum(dim=-1) + 1
            k_max = max(k for _, k, _, _ in plan)
            top_lp, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], logprobs[:, :0].long())
            host = [t.to("cpu", non_blocking=True) for t in (target_lp.squeeze(1), ranks, top_ids, top_lp)]

        def finish() -> dict[str, list[dict[int, Logprob] | None]]:
            lps, rks, ids, tops = (t.tolist() for t in host) if host is not None else ([], [], [], [])
            out, row = {}, 0
            for request_id, k, lead, count in plan:
                entries: list[dict[int, Logprob] | None] = [None] if lead else []
                for j in range(row, row + count):
                    entry = {targets[j]: Logprob(lps[j], rks[j])}
                    for rank, (token, value) in enumerate(zip(ids[j][:k], tops[j][:k]), start=1):
                        entry.setdefault(token, Logprob(value, rank))
                    entries.append(entry)
                row += count
                out[request_id] = entries
            return out

        return finish
