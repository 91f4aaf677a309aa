"""Structured outputs without a model: the request field, compiling with llguidance over the real Qwen3 vocabulary,
the per-sequence constraint (masks, thinking)."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import llguidance
import pytest
import torch

from orinfer.errors import RequestError
from orinfer.sampling_params import SamplingParams
from orinfer.structured.constraint import SequenceConstraint, bitmask_words, fill_masks
from orinfer.structured.grammar import MASK_SLICES, STRING_CHAR, GrammarCompiler
from orinfer.structured.params import StructuredOutputsParams
from orinfer.thinking import ThinkState
from orinfer.tokenizer import Tokenizer

# The published Qwen3 tokenizer (151,669 ids; the model's logits are 151,936 wide) where this machine has it (the
# shared folder beside the checkout), and always a tokenizer trained with Qwen's added tokens, as CI has.
REAL_QWEN3 = Path(__file__).resolve().parents[2] / "shared" / "real-qwen" / "Qwen3-0.6B"
TOKENIZERS = ["trained"] + (["qwen3"] if (REAL_QWEN3 / "tokenizer.json").is_file() else [])
EXTRA_LOGITS = 267  # logits columns beyond the tokenizer's ids, as Qwen3's 151936 - 151669


@pytest.fixture(scope="module", params=TOKENIZERS)
def qwen3(request, tmp_path_factory):
    if request.param == "qwen3":
        return Tokenizer.from_dir(REAL_QWEN3)
    from orinfer.tokenizer_train import bundled_corpus, train_tokenizer

    return train_tokenizer([bundled_corpus()], 1024, tmp_path_factory.mktemp("tok"))


def vocab_of(tok: Tokenizer) -> int:
    return tok._backend.get_vocab_size() + EXTRA_LOGITS


def eos_of(tok: Tokenizer) -> list[int]:
    return [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]


@pytest.fixture(scope="module")
def compiler(qwen3):
    return GrammarCompiler(qwen3.to_json(), vocab_of(qwen3), eos_of(qwen3))


def allowed_ids(constraint: SequenceConstraint, vocab: int) -> set[int]:
    row = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
    constraint.fill_mask(row)
    bits = ((row[:, None].to(torch.int64) >> torch.arange(32)) & 1).reshape(-1)[:vocab]  # the padding bits: unused
    return set(bits.nonzero().squeeze(1).tolist())


def accepts(compiler: GrammarCompiler, tok: Tokenizer, spec: dict, text: str, end: bool = True) -> bool:
    """Whether the constraint takes `text` (tokenized as the model would write it) and, if `end`, can stop there."""
    c = SequenceConstraint(compiler.matcher(StructuredOutputsParams(**spec)))
    for t in tok.encode(text):
        if t not in allowed_ids(c, compiler.vocab_size) or not c.advance(t):
            return False
    return not end or c.matcher.is_accepting()


# --- the request field -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["x"]}, "exactly one of"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
    ({"json_object": 1}, "structured_outputs.json_object must be true"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
    ({"schema": {}}, "unknown field(s) schema"),
])
def test_bad_specs_name_the_field(value, message):
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(structured_outputs=value)


def test_think_state_is_checked():
    with pytest.raises(RequestError, match="think_state"):
        SamplingParams(think_state="maybe")


def test_cache_key_is_canonical():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "string"}}, "type": "object"}')
    assert a.cache_key() == b.cache_key()
    assert a.cache_key() != StructuredOutputsParams(json_object=True).cache_key()


# --- compiling -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, reason", [
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"json": {"type": "string", "pattern": "("}}, "unclosed group"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: foo\n"}, "foo"),
])
def test_uncompilable_constraints_give_the_library_reason(compiler, spec, reason):
    with pytest.raises(RequestError, match=reason) as info:
        compiler.matcher(StructuredOutputsParams(**spec))
    assert f"structured_outputs.{next(iter(spec))}" in str(info.value)


def test_compiled_grammars_are_cached(compiler):
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    first = compiler.matcher(spec)
    before = len(compiler._cache)
    second = compiler.matcher(StructuredOutputsParams(regex="[0-9]{3}"))
    assert len(compiler._cache) == before and first is not second   # one template, a fresh copy each time
    assert first.consume_token(compiler.tokenizer.tokenize_str("1")[0])
    fresh = SequenceConstraint(compiler.matcher(spec))
    assert allowed_ids(SequenceConstraint(second), compiler.vocab_size) == allowed_ids(fresh, compiler.vocab_size)


def test_json_schema_accepts_valid_and_refuses_invalid(compiler, qwen3):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    spec = {"json": schema}
    assert accepts(compiler, qwen3, spec, json.dumps({"city": "Paris", "days": 3}))
    assert not accepts(compiler, qwen3, spec, json.dumps({"city": "Paris", "days": "3"}))
    assert not accepts(compiler, qwen3, spec, json.dumps({"city": "Paris"}))
    assert not accepts(compiler, qwen3, spec, json.dumps({"city": "Paris", "days": 3}, indent=2))  # fixed layout


def test_eos_only_where_the_grammar_can_end_and_no_ids_beyond_the_tokenizer(compiler, qwen3):
    c = SequenceConstraint(compiler.matcher(StructuredOutputsParams(regex="[0-9]{2,3}")))
    eos = eos_of(qwen3)
    assert not set(eos) & allowed_ids(c, compiler.vocab_size)
    for t in qwen3.encode("12"):
        c.advance(t)
    ids = allowed_ids(c, compiler.vocab_size)
    assert set(eos) <= ids and max(ids) < qwen3._backend.get_vocab_size()
    assert not c.is_complete
    for t in qwen3.encode("3"):
        c.advance(t)
    assert c.is_complete  # three digits: nothing more can follow
    choice = SequenceConstraint(compiler.matcher(StructuredOutputsParams(choice=["yes", "no"])))
    assert all(qwen3.decode([t]) in ("yes", "no", "y", "n", "ye") for t in allowed_ids(choice, compiler.vocab_size))


def test_thinking_is_free_and_the_answer_constrained(compiler, qwen3):
    start, end = qwen3.token_to_id("<think>"), qwen3.token_to_id("</think>")
    spec = StructuredOutputsParams(choice=["yes", "no"])
    grammar_first = allowed_ids(SequenceConstraint(compiler.matcher(spec)), compiler.vocab_size)
    # START: the grammar's tokens plus <think>.
    c = SequenceConstraint(compiler.matcher(spec), ThinkState.START, start, end)
    assert allowed_ids(c, compiler.vocab_size) == grammar_first | {start}
    c.advance(start)
    assert c.think_state is ThinkState.THINKING and len(allowed_ids(c, compiler.vocab_size)) == compiler.vocab_size
    for t in qwen3.encode("Let me think: maybe."):
        assert c.advance(t)
    assert c.advance(end) and c.think_state is ThinkState.CONTENT
    assert allowed_ids(c, compiler.vocab_size) == grammar_first
    # START without <think>: the first token is already the answer's.
    d = SequenceConstraint(compiler.matcher(spec), ThinkState.START, start, end)
    first, *rest = qwen3.encode("no")
    assert d.advance(first) and d.think_state is ThinkState.CONTENT
    assert all(d.advance(t) for t in rest) and d.is_complete


def test_masks_filled_together_equal_masks_filled_one_by_one(compiler, qwen3):
    """`fill_masks` (llguidance's thread pool) gives each row what `fill_mask` gives it alone: grammar rows at
    different points of their grammars, a row that may still open <think> and a row inside the reasoning."""
    think_start, think_end = qwen3.token_to_id("<think>"), qwen3.token_to_id("</think>")

    def make(spec: dict, prefix: str, state: ThinkState = ThinkState.CONTENT) -> SequenceConstraint:
        c = SequenceConstraint(compiler.matcher(StructuredOutputsParams(**spec)), state, think_start, think_end)
        for t in qwen3.encode(prefix):
            assert c.advance(t)
        return c

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    constraints = [make({"json": schema}, ""), make({"json": schema}, '{"a": 12'), make({"regex": "[0-9]+x"}, "12"),
                   make({"choice": ["yes", "no"]}, "", ThinkState.START),
                   make({"choice": ["yes", "no"]}, "", ThinkState.THINKING)]
    words = bitmask_words(compiler.vocab_size)
    together = torch.zeros(len(constraints), words, dtype=torch.int32)
    fill_masks(constraints, together)
    for row, c in zip(together, constraints):
        alone = torch.zeros(words, dtype=torch.int32)
        c.fill_mask(alone)
        assert torch.equal(row, alone)
    assert not torch.equal(together[0], together[1]) and bool((together[4] == -1).all())


def test_mask_slices_extend_the_library_defaults():
    """The engine's slices are llguidance's own plus shorter string bodies (1-8 characters): only an optimisation
    of the mask computation, on the same JSON string character class as the library's."""
    library = llguidance.LLTokenizer.general_slices()
    assert MASK_SLICES[:len(library)] == library and STRING_CHAR + "{1,10}" in library
    assert MASK_SLICES[len(library):] == [STRING_CHAR + "{1,%d}" % n for n in range(1, 9)]


@pytest.mark.slow  # ~5 s: a second tokenizer set up over the real vocabulary
def test_length_capped_string_masks_equal_the_library_default_slices(compiler, qwen3):
    """The finer slices give the same masks as llguidance's default ones, step by step through strings capped at
    8 characters (where they apply) and the rest of a JSON value: a random walk over the allowed tokens."""
    plain = GrammarCompiler(qwen3.to_json(), compiler.vocab_size, compiler.eos_ids)
    plain._tokenizer = llguidance.LLTokenizer(qwen3.to_json(), n_vocab=compiler.vocab_size, eos_token=compiler.eos_ids)
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
              "properties": {"a": {"type": "string", "maxLength": 8}, "b": {"type": "string", "maxLength": 3},
                             "c": {"type": "array", "items": {"type": "string", "maxLength": 5}}}}
    spec = StructuredOutputsParams(json=schema)
    fine, default = SequenceConstraint(compiler.matcher(spec)), SequenceConstraint(plain.matcher(spec))
    rng = random.Random(0)
    for _ in range(40):
        allowed = allowed_ids(fine, compiler.vocab_size)
        assert allowed == allowed_ids(default, compiler.vocab_size)
        allowed -= set(compiler.eos_ids)
        if not allowed:
            break
        token = rng.choice(sorted(allowed))
        assert fine.advance(token) and default.advance(token)


def test_concurrent_sequences_get_copies_of_different_templates(compiler):
    """Copies of one llguidance template share its lexer lock, so `lease` gives each live sequence its own template
    while it may compile one more; a released template is handed out again before a new one is compiled."""
    small = GrammarCompiler(compiler._tokenizer_json, compiler.vocab_size, compiler.eos_ids, max_templates=3)
    small._tokenizer = compiler.tokenizer  # the slow part, shared
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    leases = [small.lease(spec) for _ in range(3)]
    pool = small._cache[spec.cache_key()]
    assert len(pool.matchers) == 3 and pool.live == [1, 1, 1]
    assert len({id(m) for m, _ in leases}) == 3
    fourth = small.lease(spec)  # at the cap: the least used template, shared
    assert len(pool.matchers) == 3 and sorted(pool.live) == [1, 1, 2]
    for _, release in leases:
        release()
    fourth[1]()
    assert pool.live == [0, 0, 0]
    matcher, release = small.lease(spec)
    constraint = SequenceConstraint(matcher, release=release)
    assert sum(pool.live) == 1
    del constraint  # the engine drops a finished sequence's constraint: its template is free again
    gc.collect()
    assert sum(pool.live) == 0
    # Copies of the three templates, all live at once, constrain alike.
    constraints = []
    for _ in range(3):
        matcher, release = small.lease(spec)
        constraints.append(SequenceConstraint(matcher, release=release))
    assert pool.live == [1, 1, 1]
    digit = small.tokenizer.tokenize_str("7")[0]
    masks = [allowed_ids(c, small.vocab_size) for c in constraints]
    assert digit in masks[0] and masks[0] == masks[1] == masks[2]


def test_template_budget_drops_least_recently_used_constraints(compiler):
    small = GrammarCompiler(compiler._tokenizer_json, compiler.vocab_size, compiler.eos_ids, max_templates=4,
                            template_budget=5)
    small._tokenizer = compiler.tokenizer
    first, second = StructuredOutputsParams(regex="[0-9]{3}"), StructuredOutputsParams(regex="[a-z]{2}")
    held = [small.lease(first) for _ in range(4)]
    small.matcher(second)
    assert set(small._cache) == {first.cache_key(), second.cache_key()}  # 5 templates: within the budget
    held.append(small.lease(second))
    held.append(small.lease(second))  # 6 templates: `first` (least recently used) is dropped
    assert set(small._cache) == {second.cache_key()}
    matcher = held[0][0]
    assert matcher.consume_token(small.tokenizer.tokenize_str("1")[0])  # a dropped template's copies still work
    for _, release in held:
        release()  # harmless for a dropped constraint


def test_draft_masks_are_the_masks_after_each_draft_prefix(compiler, qwen3):
    """A verify step's rows: `valid_drafts` cuts a draft where the grammar refuses a token; `fill_draft_masks` gives
    each row the mask after the drafts before it (as consuming them one by one would), for two constraints side by
    side, and leaves every matcher where it was."""
    from orinfer.structured.constraint import fill_draft_masks

    vocab = vocab_of(qwen3)
    spec = StructuredOutputsParams(regex=r"[a-z]{1,6}-[0-9]{2,3}")
    a = SequenceConstraint(compiler.lease(spec)[0])
    b = SequenceConstraint(compiler.lease(StructuredOutputsParams(choice=["Alice", "a golden key"]))[0])
    word = qwen3.encode("ab-12")
    assert a.valid_drafts(word) == word
    assert a.valid_drafts(word + qwen3.encode("x")) == word     # a letter after the digits: refused, cut there
    assert a.valid_drafts(qwen3.encode("-1")) == []             # a dash first: refused at once
    golden = qwen3.encode("a golden")
    rows = [(a, word[:j]) for j in range(len(word) + 1)] + [(b, golden[:j]) for j in range(len(golden) + 1)]
    mask = torch.zeros(len(rows), bitmask_words(vocab), dtype=torch.int32)
    fill_draft_masks(rows, mask)
    for row, (constraint, prefix) in zip(mask, rows):
        fresh = SequenceConstraint(compiler.lease(spec if constraint is a else
                                                  StructuredOutputsParams(choice=["Alice", "a golden key"]))[0])
        for token in prefix:
            assert fresh.accept(token)
        want = torch.zeros(bitmask_words(vocab), dtype=torch.int32)
        fresh.fill_mask(want)
        assert torch.equal(row, want)
    assert a.num_consumed == 0 and b.num_consumed == 0 and allowed_ids(a, vocab) == allowed_ids(
        SequenceConstraint(compiler.lease(spec)[0]), vocab)        # rolled back: the matchers start over
    with pytest.raises(ValueError, match="growing prefixes"):
        fill_draft_masks([(a, word[:2]), (a, word[:1])], mask[:2])
