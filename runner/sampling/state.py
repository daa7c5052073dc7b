"""Per-request sampling state that outlives a step: seeded generators and token statistics.

Why on the device: with async scheduling the token a step samples is known only on the device
when the next step is planned (the scheduler feeds a placeholder), so a penalty that counts the
output tokens cannot read them from the host lists. Each request that needs them gets a slot
(a row) in pooled device tensors, written when its first token is sampled and updated from the
sampled-token tensor itself after every step (`record`, no host sync):

- `output_counts[slot, token]` (int32): how often `token` is in the output (presence and
  frequency penalties);
- `seen[slot, token]` (uint8 flags): PROMPT where `token` is in the prompt, OUTPUT where it is in
  the output (the repetition penalty's set is where it is nonzero). A pass over the logits reads
  these bytes and the counts only where OUTPUT is set: a quarter of the bytes of reading the
  counts (runner/sampling/logits_pass.py);
- `recent[slot, -W:]` (int64): the last W output tokens, -1 before the first (multi-token
  bad words compare their prefix with it).

State is kept until the request finishes, through preemptions: a preempted request recomputes
its KV cache but samples none of its earlier tokens again, so its counts and its generator stay
right. A generator advances once per sampled token of its request (the sampler draws one
vector of Exp(1) per seeded row per step), so a seeded request's tokens do not depend on the
batch, the KV-cache size, chunking, prefix caching or async scheduling.
"""

from __future__ import annotations

import torch

from runner.scheduler import ScheduledRequest

PROMPT, OUTPUT = 1, 2
"""The flags of `SamplingStates.seen`."""


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request (SamplingParams checks the seed fits: [0, 2**64 - 1])."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def needs_token_state(req: ScheduledRequest) -> bool:
    params = req.sampling_params
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0
            or bool(req.bad_words_token_ids and any(len(word) > 1 for word in req.bad_words_token_ids)))


class SamplingStates:
    """Generators (by request id) and the pooled token statistics (by slot)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.generators: dict[str, torch.Generator] = {}
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.uint8, device=device)
        # No window until a request has a multi-token bad word: `record` then skips it.
        self.recent = torch.full((0, 0), -1, dtype=torch.int64, device=device)

    # ---- lifetime ------------------------------------------------------------------------
    def release(self, request_ids) -> None:
        """Finished (or aborted) requests: drop their generator and free their slot."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
            slot = self.slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def generator(self, req: ScheduledRequest) -> torch.Generator:
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = self.generators[req.request_id] = make_generator(req.sampling_params.seed, self.device)
        return gen

    def slot(self, req: ScheduledRequest) -> int:
        """The request's slot, made (and its prompt mask written) when it first samples."""
        slot = self.slots.get(req.request_id)
        if slot is not None:
            return slot
        if req.output_token_count:
            raise RuntimeError(f"request {req.request_id!r} has {req.output_token_count} output tokens but no "
                               "sampling state: its penalties would not count them")
        if not self._free:
            self._grow()
        slot = self.slots[req.request_id] = self._free.pop()
        self.output_counts[slot].zero_()
        self.seen[slot].zero_()
        self.recent[slot].fill_(-1)
        if req.sampling_params.repetition_penalty != 1.0:
            if req.prompt_token_ids is None:
                raise RuntimeError(f"request {req.request_id!r}: repetition_penalty needs the prompt's token ids")
            prompt = torch.tensor(req.prompt_token_ids, dtype=torch.int64).clamp_(0, self.vocab_size - 1)
            if self.device.type == "cuda":  # pinned: a pageable upload would wait for the step in flight
                prompt = prompt.pin_memory()
            self.seen[slot, prompt.to(self.device, non_blocking=True)] = PROMPT
        words = req.bad_words_token_ids or []
        window = max((len(word) - 1 for word in words), default=0)
        if window > self.recent.shape[1]:
            pad = torch.full((self.recent.shape[0], window - self.recent.shape[1]), -1, dtype=torch.int64,
                             device=self.device)
            self.recent = torch.cat([pad, self.recent], dim=1)
        return slot

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        counts[:old] = self.output_counts
        seen = torch.zeros(new, self.vocab_size, dtype=torch.uint8, device=self.device)
        seen[:old] = self.seen
        recent = torch.full((new, self.recent.shape[1]), -1, dtype=torch.int64, device=self.device)
        recent[:old] = self.recent
        self.output_counts, self.seen, self.recent = counts, seen, recent
        self._free.extend(range(new - 1, old - 1, -1))

    # ---- per step --------------------------------------------------------------------------
    def record(self, slots: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor | None = None,
               ones: torch.Tensor | None = None) -> None:
        """The step's sampled `tokens` of the rows whose requests hold `slots` (device tensors; a
        slot at most once). The counts take one `index_add_` on the flattened tensor at
        `slot * vocab_size + token` (not `index_put_(accumulate=True)`, which sorts its indices on
        a GPU: many launches), and their OUTPUT flags are set. `offsets` (slots * vocab_size, int64)
        and `ones` (int32, one per slot) are what a plan keeps for its steps; computed here when
        not given."""
        if offsets is None:
            offsets = slots * self.vocab_size
        if ones is None:
            ones = torch.ones_like(tokens, dtype=torch.int32)
        at = offsets + tokens
        self.output_counts.view(-1).index_add_(0, at, ones)
        flags = self.seen.view(-1)
        flags[at] = flags[at] | OUTPUT
        if self.recent.shape[1]:
            self.recent[slots] = torch.cat([self.recent[slots, 1:], tokens.unsqueeze(1)], dim=1)
