"""The synthetic model's tokenizer: UTF-8 bytes in, short words out.

Text is tokenized as UTF-8 bytes (ids 0..255 shifted by `TOKEN_OFFSET` so they
never collide with generated ids); generated ids render as short words, so the
HTTP front sees a real text stream. The front tokenizes with it (engines get
token ids); the synthetic engine only renders what it generates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

TOKEN_OFFSET = 1000


def encode_text(text: str) -> list[int]:
    return [TOKEN_OFFSET + b for b in text.encode("utf-8")]


def render_token(token_id: int) -> str:
    return f" w{token_id % 997}"


def decode_tokens(token_ids: Sequence[int]) -> str:
    """Prompt bytes back to text; any other id renders as its word."""
    out: list[str] = []
    raw = bytearray()
    for t in token_ids:
        if TOKEN_OFFSET <= t < TOKEN_OFFSET + 256:
            raw.append(t - TOKEN_OFFSET)
            continue
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
        out.append(render_token(t))
    if raw:
        out.append(raw.decode("utf-8", errors="replace"))
    return "".join(out)


def chat_to_text(messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """The synthetic chat template over (role, content) pairs."""
    text = "".join(f"<|{role}|>{content}\n" for role, content in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")
