"""StructuredOutputsParams -> xgrammar Grammar (validated) -> CompiledGrammar (on a thread pool).

Two stages, because they cost very different amounts: parsing a schema, regex or EBNF into a
Grammar takes well under a millisecond and is where a bad constraint fails, so it runs inside
`add_request` and a bad request is refused there; compiling the Grammar against the tokenizer
(xgrammar precomputes which tokens each grammar state accepts) takes milliseconds to hundreds of
milliseconds with the vocabulary's size, so it runs on a background thread while the request
waits in the scheduler's queue. Compiles are shared through a bounded cache keyed by the
constraint (`StructuredOutputsParams.cache_key`): requests with the same schema compile it once.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from configs.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 256
"""Compiled grammars kept (least recently used dropped first)."""


class InvalidGrammarError(ValueError):
    """A constraint xgrammar cannot parse; the message names the field (`structured_outputs.json`...)."""


def _xgr():
    import xgrammar
    return xgrammar


def choice_as_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b"` with each choice a quoted EBNF literal (JSON's escapes are xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of the request's constraint; InvalidGrammarError names the field."""
    xgr, kind = _xgr(), params.kind
    field = f"structured_outputs.{kind}"
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise InvalidGrammarError(f"{field}: not valid JSON text: {error}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidGrammarError(f"{field}: a JSON schema is an object, got {type(schema).__name__}")
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not params.disable_any_whitespace,
                                                strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                                                strict_mode=True)
        if kind == "regex":
            if "\x00" in params.regex:
                raise InvalidGrammarError(f"{field}: a NUL character is not allowed in the pattern")
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_as_ebnf(params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(params.structural_tag)
    except InvalidGrammarError:
        raise
    except Exception as error:  # xgrammar raises RuntimeError/ValueError with the parser's message
        message = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise InvalidGrammarError(f"{field}: {_what(kind)} is not valid: {message}") from None
    raise InvalidGrammarError(f"structured_outputs: unknown constraint {kind!r}")


def _what(kind: str) -> str:
    return {"json": "the JSON schema", "json_object": "json_object", "regex": "the regular expression",
            "choice": "the choice list", "grammar": "the EBNF grammar",
            "structural_tag": "the structural tag"}[kind]


def grammar_vocab_size(tokenizer, model_vocab_size: int) -> int:
    """The vocabulary xgrammar is given: the tokenizer's (xgrammar's own count: entries or the
    largest id + 1) rounded up to a whole bitmask word, at most the model's.

    Not the model's vocabulary when that is larger (a padded LM head, or a checkpoint paired with
    a smaller tokenizer): xgrammar treats every id past the tokenizer's as a special token and
    pays for each in every bitmask fill and every accept (docs/PERFORMANCE.md, "Structured output
    overhead", has the figures). The ids past it are disallowed by the zero columns of the
    device bitmask instead (StructuredOutputManager)."""
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), max(vocab.values(), default=-1) + 1)
    return min(model_vocab_size, -(-size // 32) * 32)


class GrammarCompilerService:
    """Compiles grammars for one tokenizer and vocabulary, off the engine's thread.

    `vocab_size` is the MODEL's vocabulary (the logits' width), which may exceed the
    tokenizer's; xgrammar sees `grammar_vocab_size` (the tokenizer's), and ids past it are never
    allowed. The tokenizer's xgrammar info (~0.25 s for SmolLM2's 49152 tokens) is built on first
    use, so engines that never see a structured request do not pay for it."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 1) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.grammar_vocab_size = grammar_vocab_size(tokenizer, vocab_size)
        self._compiler = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.grammar_vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Parse now (a bad constraint raises InvalidGrammarError here), compile in the background;
        the future's result is the CompiledGrammar. Constraints already compiled or compiling share it."""
        key = params.cache_key()
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        grammar = parse_grammar(params)
        future = self._pool.submit(self._compile, grammar)
        self._cache[key] = future
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def _compile(self, grammar):
        return self.compiler.compile_grammar(grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
