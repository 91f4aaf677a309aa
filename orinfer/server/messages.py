"""Chat messages as the chat template takes them, and the images their content parts carry.

The body's messages (validated `ChatMessage`s) become plain dicts: role `developer` is `system`, the optional fields
(name, reasoning_content, tool_calls, tool_call_id) pass through, tool-call arguments sent as a JSON string as
objects (orinfer/tool_calls/history.py). Content parts are checked here, with errors that
name the part (`messages.2.content.1`); then
- a vision-language model keeps its parts (its template writes <|vision_start|><|image_pad|><|vision_end|> per image
  part) and the image URLs are collected, in prompt order, by `orinfer.prompt_inputs.split_chat`: the same code as
  `LLM.chat`, so the server and the Python API build the same prompt;
- a text-only model gets its text parts joined with newlines (as vLLM does), and an image part is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orinfer.errors import RequestError
from orinfer.prompt_inputs import split_chat
from orinfer.server.errors import APIError
from orinfer.server.protocol import ChatMessage, ContentPart
from orinfer.tool_calls.history import with_parsed_arguments

_IMAGE_PART_TYPES = {"image_url", "input_image", "image"}
_OTHER_MEDIA = {"input_audio": "audio", "audio_url": "audio", "video_url": "video", "video": "video", "file": "file"}


@dataclass
class ImagePart:
    """One image of a chat request: its URL as sent, and where it sits in the body (for error messages)."""

    url: str
    param: str


@dataclass
class ChatInput:
    messages: list[dict[str, Any]]                        # for tokenizer.apply_chat_template
    images: list[ImagePart] = field(default_factory=list)  # one per <|image_pad|> the template writes, in order


def chat_input(messages: list[ChatMessage], limit: int, multimodal: bool) -> ChatInput:
    """The template messages and images of a chat; APIError (400) for a message or part that cannot be used."""
    if len(messages) > limit:
        raise APIError(400, f"too many messages ({len(messages)}); the limit is {limit}", param="messages")
    out: list[dict[str, Any]] = []
    image_params: list[str] = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if isinstance(content, list):
            parts = [_part(part, f"messages.{i}.content.{j}", multimodal, image_params)
                     for j, part in enumerate(content)]
            # Text parts are concatenated as they are, as `LLM.chat` does and Qwen-VL's template renders them
            # (vLLM puts "\n" between them for text-only models; then the same request would differ per model).
            content = parts if multimodal else "".join(p["text"] for p in parts)
        if content is None:
            if m.role != "assistant" or not m.tool_calls:
                raise APIError(400, f"messages.{i}.content is required (role {m.role!r})",
                               param=f"messages.{i}.content")
            content = ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        for key in ("name", "reasoning_content", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls is not None:
            msg["tool_calls"] = [with_parsed_arguments(call) for call in m.tool_calls]
        out.append(msg)
    if not multimodal:
        return ChatInput(out)
    try:
        rendered, urls = split_chat(out, multimodal=True)
    except RequestError as exc:  # the parts were checked above: this is a disagreement between the two checks
        raise APIError(400, str(exc), param="messages") from None
    if len(urls) != len(image_params):
        raise RuntimeError(f"split_chat found {len(urls)} images, the server {len(image_params)}")
    return ChatInput(rendered, [ImagePart(url, param) for url, param in zip(urls, image_params)])


def _part(part: ContentPart, param: str, multimodal: bool, image_params: list[str]) -> dict[str, Any]:
    """One content part in the form split_chat and the templates take: {"type": "text", "text": ...} or
    {"type": "image_url", "image_url": {"url": ...}} (the image's position is recorded in `image_params`)."""
    if part.type == "text":
        if part.text is None:
            raise APIError(400, f"{param}: a text part needs 'text'", param=param)
        return {"type": "text", "text": part.text}
    if part.type in _IMAGE_PART_TYPES:
        url = part.image_url if part.image_url is None or isinstance(part.image_url, str) else part.image_url.url
        if not url:
            raise APIError(400, f"{param}: an image part needs image_url.url (a data:image/...;base64, URL)",
                           param=param)
        if not multimodal:
            raise APIError(400, "this model takes no images (it is not a vision-language model)", param=param,
                           code="image_input_not_supported")
        image_params.append(param)
        return {"type": "image_url", "image_url": {"url": url}}
    if part.type in _OTHER_MEDIA:
        raise APIError(400, f"this model does not accept {_OTHER_MEDIA[part.type]} input", param=param)
    raise APIError(400, f"{param}: unknown content part type {part.type!r}", param=param)
