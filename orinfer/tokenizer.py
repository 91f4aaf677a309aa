"""Runtime tokenizer: encode/decode with the `tokenizers` library, Qwen chat templates, streaming detokenization.

This deliberately does not depend on `transformers`; it reads the same files a Hugging Face checkpoint
ships (tokenizer.json, tokenizer_config.json, chat_template.jinja/.json) and renders chat templates in
the same jinja2 environment as transformers, so prompts are byte-identical to what the model was
trained with.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from orinfer.errors import OrinferError

# The named special-token slots of a tokenizer_config.json, passed to chat templates like transformers does.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")



# Texts this long or longer are encoded through the backend's batch call, which releases the interpreter lock while
# the Rust tokenizer runs (its one-text call holds it throughout). The server tokenizes prompts in worker threads:
# 32 prompts of ~2,000 words arriving together waited on one another's lock, a median 35 ms (62 ms at worst) to
# tokenize on an H100 host and more for the thread hops queued behind them (NOTES run 356). Short texts keep the
# one-text call, which skips the batch call's thread-pool dispatch.
RELEASE_LOCK_CHARS = 4096

class TokenizerError(OrinferError):
    """A tokenizer could not be loaded or used (missing file, bad config, chat template failure, ...)."""


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: either a plain string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders the body unchanged.

    transformers uses these markers (in some fine-tuned templates) to build assistant-token masks for
    training; for inference they are no-ops, but without this extension such templates fail to parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    """Template helper: `{{ raise_exception('...') }}` aborts rendering with that message."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's built-in tojson HTML-escapes characters like '<' and '&'; templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses (cached: compiling is slow)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _sync_added_tokens(backend: BackendTokenizer, config: dict) -> None:
    """Make sure every token of tokenizer_config's added_tokens_decoder exists in the backend with its id.

    Real checkpoints already have them in tokenizer.json; this covers files that only list them in the
    config. A token can only be appended at the next free id, so anything else is reported as an error
    instead of silently giving the model different ids than it was trained with.
    """
    decoder = config.get("added_tokens_decoder") or {}
    for raw_id, entry in sorted(decoder.items(), key=lambda item: int(item[0])):
        token_id, content = int(raw_id), _token_content(entry)
        if content is None:
            continue
        existing = backend.token_to_id(content)
        if existing == token_id:
            continue
        if existing is None and token_id == backend.get_vocab_size(with_added_tokens=True):
            token = AddedToken(content, normalized=bool(entry.get("normalized", False)),
                               lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                               single_word=bool(entry.get("single_word", False)))
            if entry.get("special", False):
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])
            continue
        raise TokenizerError(
            f"added token {content!r} has id {token_id} in tokenizer_config.json but {existing} in tokenizer.json"
        )


def _load_chat_templates(model_dir: Path, config: dict) -> dict[str, str]:
    """Find the chat template(s): chat_template.jinja, then chat_template.json, then tokenizer_config.json.

    The separate files win over the config entry, as in transformers. A config may hold several named
    templates (a list of {"name", "template"}); they are returned by name, a single one as "default".
    """
    jinja_file, json_file = model_dir / "chat_template.jinja", model_dir / "chat_template.json"
    if jinja_file.is_file():
        raw: Any = jinja_file.read_text(encoding="utf-8")
    elif json_file.is_file():
        raw = _read_json(json_file).get("chat_template")
    else:
        raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {item["name"]: item["template"] for item in raw}
    if isinstance(raw, dict):
        return dict(raw)
    return {}


def builtin_chat_template(name: str) -> str:
    """One of the chat templates shipped in orinfer/data ("qwen3", "qwen2", "qwen3_vl"), without the file's
    trailing newline (the published template strings have none)."""
    from importlib import resources

    try:
        source = resources.files("orinfer").joinpath("data").joinpath(f"{name}_chat_template.jinja")
        return source.read_text(encoding="utf-8").rstrip("\n")
    except (FileNotFoundError, OSError) as exc:
        raise TokenizerError(f"no built-in chat template named {name!r}") from exc


class Tokenizer:
    """A Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) without transformers."""

    def __init__(self, backend: BackendTokenizer, config: dict | None = None,
                 chat_templates: dict[str, str] | None = None) -> None:
        """Wrap a loaded `tokenizers.Tokenizer`; `config` is the parsed tokenizer_config.json."""
        self._backend = backend
        self.config: dict = dict(config or {})
        _sync_added_tokens(backend, self.config)
        # Named special tokens (e.g. {"eos_token": "<|im_end|>", ...}); also exposed to chat templates.
        self.special_tokens: dict[str, str] = {
            key: content for key in _SPECIAL_TOKEN_KEYS if (content := _token_content(self.config.get(key)))
        }
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = self._special_id("eos_token")
        self.pad_token_id: int | None = self._special_id("pad_token")
        self.bos_token_id: int | None = self._special_id("bos_token")
        self._templates = dict(chat_templates or {})
        self.chat_template: str | None = self._templates.get("default")

    @classmethod
    def from_dir(cls, model_dir: str | Path, tokenizer_file: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        Reads tokenizer.json (or `tokenizer_file`), tokenizer_config.json if present (special tokens, added
        tokens, chat template) and chat_template.jinja / chat_template.json, which take precedence over the
        config's template. A missing tokenizer.json raises TokenizerError naming the path.
        """
        model_dir = Path(model_dir)
        path = Path(tokenizer_file) if tokenizer_file is not None else model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception for malformed files
            raise TokenizerError(f"cannot load tokenizer file {path}: {exc}") from exc
        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        return cls(backend, config, _load_chat_templates(model_dir, config))

    def set_default_chat_template(self, source: str) -> bool:
        """Uses `source` as the chat template if the model directory brought none; returns whether it did."""
        if self.chat_template is not None:
            return False
        self._templates["default"] = source
        self.chat_template = source
        return True

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return self._backend.token_to_id(token) if token is not None else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are recognised (one id each).

        `add_special_tokens` runs tokenizer.json's post-processor (BOS/EOS insertion); Qwen's adds nothing.
        """
        if len(text) >= RELEASE_LOCK_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; with `skip_special_tokens` the special added tokens (e.g. <|im_end|>) are dropped."""
        # int(): callers may hand over numpy/torch integers, which the Rust binding rejects.
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary or added token given as its string form, or None if unknown."""
        return self._backend.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as HF tokenizer.json text (what the structured-output library builds its vocabulary from)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        """String form of a token id (byte-level symbols for BPE pieces), or None if out of range."""
        return self._backend.id_to_token(token_id)

    def chat_template_for(self, tools: bool) -> str | None:
        """The template source a chat uses: like transformers, one named "tool_use" is preferred when tools are
        given."""
        source = self._templates.get("tool_use") if tools else None
        return source or self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, enable_thinking: bool | None = None,
                            **template_kwargs: Any) -> str:
        """Render a conversation into the prompt text, exactly like transformers' apply_chat_template.

        `enable_thinking=None` leaves the variable undefined in the template (the model's default);
        extra keyword arguments become template variables. Raises TokenizerError if there is no chat
        template or rendering fails (including the template's own raise_exception messages).
        """
        source = self.chat_template_for(tools is not None)
        if source is None:
            raise TokenizerError("this tokenizer has no chat template (no chat_template.jinja, chat_template.json "
                                 "or 'chat_template' in tokenizer_config.json)")
        if not messages:
            raise TokenizerError("cannot apply the chat template to an empty conversation")
        if tools is not None and not all(isinstance(tool, dict) for tool in tools):
            raise TokenizerError("tools must be JSON-schema dicts")
        variables: dict[str, Any] = {**self.special_tokens, "documents": None, **template_kwargs}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            template = _compile_template(source)
            return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   **variables)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template error: {exc.message or exc}") from exc
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
            # Python errors from inside the template (e.g. str + None on a malformed message).
            raise TokenizerError(f"chat template error: {type(exc).__name__}: {exc}") from exc

    def new_detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                        ) -> IncrementalDetokenizer:
        """A streaming detokenizer for a generation that continues after `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Byte-level BPE can split one UTF-8 character over several tokens; decoding such a prefix gives a
    trailing U+FFFD, so that text is held back until the character completes. Only a small window of
    ids is re-decoded per step: `prefix` (already emitted, kept as context because some decoders
    render a token differently at the start of a string) and the not-yet-emitted tail. Emitted ids
    leave the window, so the cost per token does not grow with the length of the generation.
    """

    # How many prompt tokens to keep as decoding context for the first generated tokens.
    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                 ) -> None:
        """Start after `prompt_ids` (only their last few are used, as context)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[max(0, len(prompt_ids) - self._PROMPT_CONTEXT):])
        if self._decode(context).endswith("\ufffd"):
            # The prompt ends inside a character; using it as context would glue generated bytes to it.
            context = []
        self._window: list[int] = context  # window[:read] is emitted context, window[read:] is pending
        self._read = len(context)
        self.text: str = ""
        self.token_ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _advance(self, force: bool) -> str:
        """Emit the pending tail if it decodes to complete characters (or unconditionally when `force`)."""
        prefix_text = self._decode(self._window[: self._read])
        full_text = self._decode(self._window)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not force):
            return ""
        delta = full_text[len(prefix_text):]
        # What was pending becomes the context for the next tokens; older ids are no longer needed.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (possibly "")."""
        self.token_ids.append(int(token_id))
        self._window.append(int(token_id))
        return self._advance(force=False)

    def flush(self) -> str:
        """At the end of generation: return whatever text is still held back."""
        return self._advance(force=True)
