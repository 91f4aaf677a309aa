"""Compiles structured-output constraints into llguidance matchers, once per constraint.

llguidance was chosen over xgrammar by measurement (benchmarks/NOTES.md run 274, Qwen3's
151k-token vocabulary on a 2-core CPU): a 20-field tool-like JSON schema compiles in ~2 ms (xgrammar: ~1.1 s),
a mask takes ~0.12 ms per token (xgrammar: ~0.21 ms), and its wheel has no dependencies (xgrammar's requires
transformers, torch and triton). The tokenizer setup (~2 s for 151k tokens) is paid once per engine, at the first
constrained request, not at start-up.

`GrammarCompiler.matcher(spec)` returns a fresh matcher for one sequence: a copy of a template compiled once and kept
in an LRU cache keyed by the constraint's canonical text (the compiler belongs to one engine, so one tokenizer).
A constraint the library cannot compile (an unsupported schema keyword, a bad regex or grammar) is a RequestError
with the library's reason.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import llguidance

from orinfer.errors import RequestError
from orinfer.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

# JSON layout: the library's default lets whitespace run free between tokens, and small or unsure models then emit
# newlines until max_tokens (a known failure of flexible whitespace). A fixed layout (", " and ": " separators, as
# json.dumps writes) keeps every output parseable and short; a schema may still set its own "x-guidance" options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept (each a few hundred KB at most for tool-sized schemas)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked against the library's rules)."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes, so json.dumps quotes each choice exactly.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise RequestError(f"structured_outputs.{kind} cannot be compiled: {exc}") from None


class GrammarCompiler:
    """Matchers for one tokenizer. `tokenizer_json`: the HF tokenizer.json text; `vocab_size`: the logits' width
    (ids the tokenizer lacks are never allowed); `eos_ids`: the tokens that end a sequence (allowed only where the
    grammar can end)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the server may validate from another thread than the engine's

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids)
            log.info("structured outputs: llguidance tokenizer set up in %.2f s", time.perf_counter() - start)
        return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher (start state) for `spec`; RequestError with the library's reason if it cannot compile."""
        key = spec.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
            else:
                template = self._compile(spec)
                self._cache[key] = template
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            return template.deep_copy()

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_text(spec)
        start = time.perf_counter()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise RequestError(f"structured_outputs.{spec.kind} is not supported: {messages[0].strip()}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs.{spec.kind} is not supported: {matcher.get_error().strip()}")
        log.debug("structured outputs: compiled a %s constraint in %.1f ms", spec.kind,
                  (time.perf_counter() - start) * 1e3)
        return matcher
