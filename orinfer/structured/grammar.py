"""Compiles structured-output constraints into llguidance matchers, once per constraint.

llguidance was chosen over xgrammar by measurement (benchmarks/NOTES.md runs 274 and 313, Qwen3's 151k-token
vocabulary on a 2-core CPU): a 20-field tool-like JSON schema compiles in ~2-4 ms (xgrammar 0.2.8: ~0.3-1.1 s);
over random walks of 64 rows, a mask takes 0.22 ms mean, p99 2.6 ms (xgrammar: 1.8 ms, p99 30 ms) with the bench's
strings capped at 8 characters, and ~0.02 ms (xgrammar ~0.06 ms) without caps or on a typical tool schema. Its
wheel has no dependencies (xgrammar's requires transformers, torch and triton, and importing it imports
transformers). The tokenizer setup (~2-3 s for 151k tokens) is paid once per engine, at the first constrained
request, not at start-up.

`GrammarCompiler.lease(spec)` returns a fresh matcher for one sequence: a copy of a template compiled once and kept
in an LRU cache keyed by the constraint's canonical text (the compiler belongs to one engine, so one tokenizer).
A constraint the library cannot compile (an unsupported schema keyword, a bad regex or grammar) is a RequestError
with the library's reason.

Two choices make a batch's masks cheaper (benchmarks/NOTES.md run 313, `scripts/bench_grammar_masks.py`):
- Copies of one llguidance matcher share its lexer behind one lock, held for a whole mask computation: 64 copies
  of one template on the executor's threads compute their masks one at a time. So each constraint keeps several
  templates (compiled from the same grammar) and a sequence gets a copy of one that no live sequence uses, while
  there are fewer than `max_templates`.
- The tokenizer's vocabulary slices (tokens the mask takes whole when the lexer accepts every string of a slice)
  include short JSON string bodies of 1 to 8 characters: inside a length-capped string (`maxLength`) the library's
  default slices (10, 30 or any characters) never apply, and it walks the whole token trie for each mask.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance

from orinfer.errors import RequestError
from orinfer.structured.params import StructuredOutputsParams

log = logging.getLogger(__name__)

# JSON layout: the library's default lets whitespace run free between tokens, and small or unsure models then emit
# newlines until max_tokens (a known failure of flexible whitespace). A fixed layout (", " and ": " separators, as
# json.dumps writes) keeps every output parseable and short; a schema may still set its own "x-guidance" options.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept (each a few hundred KB at most for tool-sized schemas)
MAX_TEMPLATES = 64  # independent templates of one constraint: that many sequences compute masks without waiting
TEMPLATE_BUDGET = 1024  # templates kept over all constraints (least recently used constraints are dropped first)

# One unescaped character of a JSON string, as llguidance's default slices write it.
STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
MASK_SLICES = llguidance.LLTokenizer.general_slices() + [STRING_CHAR + "{1,%d}" % n for n in range(1, 9)]


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


@dataclass
class _Templates:
    """The matchers compiled for one constraint, never advanced themselves; `live[i]`: copies of `matchers[i]` held
    by sequences now."""
    grammar: str
    matchers: list[llguidance.LLMatcher] = field(default_factory=list)
    live: list[int] = field(default_factory=list)


class GrammarCompiler:
    """Matchers for one tokenizer. `tokenizer_json`: the HF tokenizer.json text; `vocab_size`: the logits' width
    (ids the tokenizer lacks are never allowed); `eos_ids`: the tokens that end a sequence (allowed only where the
    grammar can end). `max_templates`: independent templates per constraint (see the module docstring)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], cache_size: int = CACHE_SIZE,
                 max_templates: int = MAX_TEMPLATES, template_budget: int = TEMPLATE_BUDGET) -> None:
        if max_templates < 1:
            raise ValueError(f"max_templates must be at least 1, got {max_templates}")
        self._tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, _Templates] = OrderedDict()
        self._cache_size, self.max_templates, self._template_budget = cache_size, max_templates, template_budget
        # The server may validate from another thread than the engine's; reentrant because a release (a sequence's
        # constraint garbage-collected) can run inside a locked section of the same thread.
        self._lock = threading.RLock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            start = time.perf_counter()
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_ids, slices=MASK_SLICES)
            log.info("structured outputs: llguidance tokenizer set up in %.2f s", time.perf_counter() - start)
        return self._tokenizer

    def matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher (start state) for `spec`, a copy of its first template (for checks that hold no
        sequence; the engine uses `lease`); RequestError with the library's reason if it cannot compile."""
        with self._lock:
            return self._templates(spec).matchers[0].deep_copy()

    def lease(self, spec: StructuredOutputsParams) -> tuple[llguidance.LLMatcher, Callable[[], None]]:
        """A fresh matcher for one sequence and the function to call once the sequence is done with it. The copy
        comes from the template the fewest live sequences use; when every template is in use, a new one is compiled
        for it (up to `max_templates`). RequestError with the library's reason if `spec` cannot compile."""
        with self._lock:
            pool = self._templates(spec)
            index = min(range(len(pool.live)), key=pool.live.__getitem__)
            if pool.live[index] and len(pool.matchers) < self.max_templates:
                pool.matchers.append(self._new_matcher(spec.kind, pool.grammar))
                pool.live.append(0)
                index = len(pool.matchers) - 1
                self._evict(keep=pool)
            pool.live[index] += 1
            copy = pool.matchers[index].deep_copy()
        return copy, lambda: self._release(pool, index)

    def _release(self, pool: _Templates, index: int) -> None:
        with self._lock:
            pool.live[index] -= 1

    def _templates(self, spec: StructuredOutputsParams) -> _Templates:
        """The cached templates of `spec` (the first compiled now if absent). Called with the lock held."""
        key = spec.cache_key()
        pool = self._cache.get(key)
        if pool is not None:
            self._cache.move_to_end(key)
            return pool
        grammar = grammar_text(spec)
        start = time.perf_counter()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise RequestError(f"structured_outputs.{spec.kind} is not supported: {messages[0].strip()}")
        pool = _Templates(grammar, [self._new_matcher(spec.kind, grammar)], [0])
        log.debug("structured outputs: compiled a %s constraint in %.1f ms", spec.kind,
                  (time.perf_counter() - start) * 1e3)
        self._cache[key] = pool
        self._evict(keep=pool)
        return pool

    def _new_matcher(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs.{kind} is not supported: {matcher.get_error().strip()}")
        return matcher

    def _evict(self, keep: _Templates) -> None:
        """Drops the least recently used constraints while over the cache's limits (never `keep`). Sequences
        holding copies are unaffected: a copy keeps what it shares with its template alive."""
        while len(self._cache) > 1:
            templates = sum(len(p.matchers) for p in self._cache.values())
            if len(self._cache) <= self._cache_size and templates <= self._template_budget:
                return
            key, oldest = next(iter(self._cache.items()))
            if oldest is keep:
                return
            del self._cache[key]
