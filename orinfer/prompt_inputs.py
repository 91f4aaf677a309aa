"""What a user may hand to `LLM.generate` / `LLM.chat`, checked and taken apart for the engine.

Prompts (vLLM's forms): a string, a list of token ids, or a dict
    {"prompt": str | "prompt_token_ids": [int, ...],
     "multi_modal_data": {"image": image or [images]},      # optional
     "mm_processor_kwargs": {"max_pixels": int}}             # optional
where an image is a path, a data: URL, encoded bytes or a PIL image, one per <|image_pad|> in the prompt.

Chat messages (OpenAI's forms): "content" is a string or a list of parts
    {"type": "text", "text": str}
    {"type": "image_url", "image_url": {"url": path or data: URL}}   (or "image_url": "url")
    {"type": "image", "image": PIL image or path}
The chat template turns each image part into one placeholder; the images are collected in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from orinfer.errors import RequestError

Message = dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}


@dataclass
class EngineInput:
    """One request as the engine takes it: text or token ids, plus images and their resize cap."""

    prompt: str | list[int]
    images: list[Any] = field(default_factory=list)
    max_pixels: int | None = None


def parse_prompt(prompt: Any, default_max_pixels: int | None = None) -> EngineInput:
    """Checks one prompt in any accepted form; RequestError naming the problem."""
    if isinstance(prompt, str):
        return EngineInput(prompt, max_pixels=default_max_pixels)
    if not isinstance(prompt, dict):
        if isinstance(prompt, (Sequence, Iterable)):  # token ids: the engine checks each one
            return EngineInput(list(prompt), max_pixels=default_max_pixels)
        raise RequestError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - _PROMPT_KEYS
    if unknown:
        raise RequestError(f"unknown prompt key(s) {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise RequestError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if "prompt" in prompt and not isinstance(text, str):
        raise RequestError("'prompt' must be a string")
    if "prompt_token_ids" in prompt:
        if not isinstance(text, Sequence) or isinstance(text, str):
            raise RequestError("'prompt_token_ids' must be a list of integers")
        text = list(text)
    return EngineInput(text, _images(prompt.get("multi_modal_data")),
                       _max_pixels(prompt.get("mm_processor_kwargs"), default_max_pixels))


def _images(data: Any) -> list[Any]:
    if data is None:
        return []
    if not isinstance(data, dict):
        raise RequestError("'multi_modal_data' must be a dict such as {'image': [...]}")
    other = set(data) - {"image"}
    if other:
        raise RequestError(f"multi_modal_data: {sorted(other)} not supported; orinfer takes 'image' only")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _max_pixels(kwargs: Any, default: int | None) -> int | None:
    if kwargs is None:
        return default
    if not isinstance(kwargs, dict) or set(kwargs) - {"max_pixels"}:
        raise RequestError("'mm_processor_kwargs' takes only {'max_pixels': int}")
    value = kwargs.get("max_pixels", default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise RequestError(f"max_pixels must be a positive integer, got {value!r}")
    return value


# Roles whose image parts the Qwen-VL chat templates render (and count: "Picture N").
IMAGE_ROLES = ("user", "tool")


def split_chat(messages: list[Message], multimodal: bool) -> tuple[list[Message], list[Any]]:
    """(messages for the chat template, the images of their content parts in order).

    For a text-only model, content-part lists are joined into plain strings (its template expects strings) and an
    image part is an error; for a vision-language model, so is an image outside user and tool messages.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out: list[Message] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts: list[str] = []
        for j, part in enumerate(content):
            kind, value = _part(part, f"messages[{i}].content[{j}]")
            if kind == "text":
                texts.append(value)
            elif multimodal and message.get("role") not in IMAGE_ROLES:
                # Qwen-VL chat templates render only the text of system and assistant messages: an image there would
                # have no placeholder in the prompt.
                raise RequestError(f"messages[{i}].content[{j}]: images go in user or tool messages; the chat "
                                   f"template does not show the model an image in a {message.get('role')!r} message")
            else:
                images.append(value)
        if not multimodal:
            if images:
                raise RequestError("this model takes no images (image content part in the messages)")
            message = {**message, "content": "".join(texts)}
        out.append(message)
    return out, images


def _part(part: Any, where: str) -> tuple[str, Any]:
    """("text", str) or ("image", source) for one content part."""
    if not isinstance(part, dict):
        raise RequestError(f"{where}: a content part must be a dict with a 'type'")
    kind = part.get("type")
    if kind == "text" or (kind is None and "text" in part):
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}: a text part needs a string 'text'")
        return "text", part["text"]
    if kind == "image_url" or (kind is None and "image_url" in part):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}: an image_url part needs {{'image_url': {{'url': path or data: URL}}}}")
        return "image", url
    if kind == "image" or (kind is None and "image" in part):
        if part.get("image") is None:
            raise RequestError(f"{where}: an image part needs an 'image' (PIL image, path, data: URL or bytes)")
        return "image", part["image"]
    if kind in ("video", "video_url", "input_audio", "audio_url"):
        raise RequestError(f"{where}: {kind} parts are not supported; orinfer takes text and images")
    raise RequestError(f"{where}: unknown content part type {kind!r}; use 'text', 'image_url' or 'image'")
