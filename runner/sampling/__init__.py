"""Sampling: the logits of a step's sampling rows -> one token per row (and logprobs).

- `stage.py`: `SamplingStage`, the one path the runner calls, sync and async scheduling alike
  (it keeps a step's processors and metadata for the next step with the same rows);
- `processors.py`: min_tokens, penalties, logit_bias, allowed_token_ids, bad words (batched);
  `logits_pass.py`: the penalties, the float32 copy and the top-k candidates in one Triton
  pass over the logits on a GPU (`kernels.py` imports the optional Triton modules);
- `state.py`: per-request state across steps: seeded generators, token counts on the device;
- `sampler.py`: the batched sampler (greedy, temperature, min-p / top-k / top-p, seeds, logprobs);
  `race_kernel.py`: its random draw in one Triton pass over the logits on a GPU;
  `threshold_kernel.py`: its min-p / top-k / top-p thresholds in one Triton launch on a GPU;
- `logprobs.py`: logprobs in vLLM's shape; `bad_words.py`: bad words to token ids.
"""

from runner.sampling.processors import LogitsProcessors
from runner.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, argmax_rows
from runner.sampling.stage import SamplingStage
from runner.sampling.state import SamplingStates, make_generator

__all__ = ["LogitsProcessors", "LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingStage",
           "SamplingStates", "argmax_rows", "make_generator"]
