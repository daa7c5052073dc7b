"""Structured output: outputs constrained to a JSON schema, regex, choice list or grammar.

With xgrammar (the library vLLM and SGLang use). `grammar.py` turns a request's
`StructuredOutputsParams` into an xgrammar Grammar (refusing a bad one with an error that names
the field) and compiles it against the engine's tokenizer on a background thread, sharing
compiles between requests with the same constraint. `manager.py` keeps one GrammarMatcher per
request: it fills the rows of the step's token bitmask (the runner calls it after launching the
forward, so the host fills them while the device runs the step) and advances each matcher by
the sampled token. `bitmask.py` applies the bitmask to the logits on the device, for those rows
only. How the engine drives it (and how, under async scheduling, the fill of step n+1 first
advances the matchers by the tokens of step n, still in flight when n+1 was launched):
docs/STRUCTURED_OUTPUT.md.
"""

from runner.structured_output.bitmask import TokenBitmask
from runner.structured_output.grammar import GrammarCompilerService, InvalidGrammarError
from runner.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarCompilerService", "InvalidGrammarError", "StructuredOutputManager", "TokenBitmask"]
