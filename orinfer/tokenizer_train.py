"""Train a small Qwen-style byte-level BPE tokenizer and save it in Hugging Face format.

The point is to have a real, loadable tokenizer for tests and tiny toy models without downloading a
checkpoint. Everything that affects how text is split (normalizer, pre-tokenizer regex, byte-level
mapping, decoder) and how special tokens are laid out mirrors the published Qwen2.5 / Qwen3
tokenizers, so code that works with this tokenizer works with the real ones; only the learned
vocabulary is (much) smaller.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from orinfer.tokenizer import Tokenizer, TokenizerError

# The pre-tokenization regex of Qwen2/2.5/3 (same as in their tokenizer.json). It differs from GPT-2's
# in splitting digits one by one (\p{N} without "+") and in how it attaches newlines to punctuation.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in Qwen's id order, with their "special" flag as published in the real checkpoints.
# Only the control tokens are special (skipped by decode(skip_special_tokens=True)); the tool/FIM/think
# markers are plain added tokens so they survive decoding and can be parsed from the output text.
_QWEN2_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
_QWEN3_EXTRA_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# All Qwen added tokens (the Qwen3 set; Qwen2.5 uses the first 22 of them), in id order.
QWEN_SPECIAL_TOKENS: list[str] = [tok for tok, _ in _QWEN2_ADDED_TOKENS + _QWEN3_EXTRA_ADDED_TOKENS]

_ARCHES = ("qwen3", "qwen2")
_MODEL_MAX_LENGTH = 131072  # what the published Qwen2.5/Qwen3 tokenizer_config.json files declare


def qwen_added_tokens(arch: str = "qwen3") -> list[tuple[str, bool]]:
    """Return (content, is_special) for every added token of `arch` ("qwen3" or "qwen2"), in id order."""
    if arch not in _ARCHES:
        raise ValueError(f"unknown tokenizer arch {arch!r}; expected one of {_ARCHES}")
    extra = _QWEN3_EXTRA_ADDED_TOKENS if arch == "qwen3" else []
    return list(_QWEN2_ADDED_TOKENS) + extra


def _data_text(name: str) -> str:
    """Read a text file shipped in orinfer/data (works from a source tree and from an installed wheel)."""
    # Chained joinpath: a namespace-package MultiplexedPath accepts only one segment per call.
    return resources.files("orinfer").joinpath("data").joinpath(name).read_text(encoding="utf-8")


def bundled_corpus() -> str:
    """Return the small public-domain English text shipped as orinfer/data/corpus.txt."""
    return _data_text("corpus.txt")


def bundled_chat_template(arch: str = "qwen3") -> str:
    """Return Qwen's published chat template for `arch` ("qwen3" or "qwen2")."""
    if arch not in _ARCHES:
        raise ValueError(f"unknown tokenizer arch {arch!r}; expected one of {_ARCHES}")
    # The published template strings have no trailing newline; keep ours byte-identical.
    return _data_text(f"{arch}_chat_template.jinja").rstrip("\n")


def _new_qwen_backend() -> BackendTokenizer:
    """An untrained tokenizer with Qwen's normalizer, pre-tokenizer, post-processor and decoder."""
    backend = BackendTokenizer(
        BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # The regex above already did the splitting, so ByteLevel must only map bytes to symbols.
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _tokenizer_config(added: list[tuple[str, bool]], first_id: int, chat_template: str) -> dict:
    """The tokenizer_config.json contents, laid out like the published Qwen ones."""
    decoder = {
        str(first_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(added)
    }
    # Qwen lists the special control tokens, except <|endoftext|> (the pad token), as additional ones.
    additional = [content for content, special in added if special and content != "<|endoftext|>"]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": _MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, arch: str = "qwen3") -> Tokenizer:
    """Train a Qwen-style byte-level BPE on `texts` and save it to `out_dir` in Hugging Face format.

    `vocab_size` is the total size including the added (special) tokens, so a model whose embedding
    table has `vocab_size` rows can represent every id; the learned part gets `vocab_size` minus the
    added tokens (fewer if the corpus runs out of pairs to merge). The added tokens follow the learned
    vocabulary in Qwen's order. Writes tokenizer.json, tokenizer_config.json (with the bundled chat
    template for `arch`), vocab.json and merges.txt, and returns `Tokenizer.from_dir(out_dir)`.
    """
    added = qwen_added_tokens(arch)
    n_bytes = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < n_bytes + len(added):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {n_bytes} byte symbols + {len(added)} added tokens"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    backend = _new_qwen_backend()
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(added),
        show_progress=False,
        special_tokens=[],  # added afterwards so that they come after the learned vocabulary, as in Qwen
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte must be encodable
    )
    backend.train_from_iterator(texts, trainer=trainer)

    first_id = backend.get_vocab_size(with_added_tokens=True)
    # normalized=False: added tokens are matched on the raw text, before NFC (same as Qwen's files).
    backend.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in added])
    for i, (content, _) in enumerate(added):
        if backend.token_to_id(content) != first_id + i:  # would mean the corpus produced a clashing token
            raise TokenizerError(f"added token {content!r} did not get id {first_id + i}")

    backend.save(str(out / "tokenizer.json"))
    backend.model.save(str(out))  # vocab.json + merges.txt, the files of the slow/legacy loaders
    config = _tokenizer_config(added, first_id, bundled_chat_template(arch))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Tokenizer.from_dir(out)
