"""Prompt text -> plaintext token ids, with control tokens only where the chat template writes them.

A caller's text is text: a message (or a tool result, a tool definition, a completion prompt) that holds
``<|im_end|>`` or ``<|im_start|>system`` must not become the template's control tokens, or pasted text forges
turns (role injection). OpenAI's API treats such strings as text, and so does this module by default:

* control tokens are the tokenizer's special added tokens and the added tokens the chat template writes itself
  (Qwen's ``<tool_call>`` is an added token that is not marked special);
* a request without any of them in its strings is tokenized exactly as before (the common case costs one regex
  scan);
* otherwise each control token in the caller's strings is wrapped in private-use markers, the template is rendered,
  and the rendered text is encoded piece by piece: the template's own text as usual, each marked token as plain
  text (by a copy of the tokenizer that does not match special tokens, so the shared one is never reconfigured
  while other threads use it).

``special_tokens=True`` is the opt-in for callers who really send control tokens: the old behaviour.
No torch here (the client SDK imports this module).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

# private-use code points (plane 15) around a caller's control token; removed from callers' strings first, so a
# caller cannot place them
_START, _END = "\U000f0000", "\U000f0001"


class PromptEncoder:
    """The client's prompt tokenization (see the module's docstring). ``tokenizer``: a Hugging Face tokenizer, or any
    object with ``apply_chat_template`` and ``encode`` (without added tokens it has no control tokens to guard)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.control_tokens = control_tokens(tokenizer)
        longest_first = sorted(self.control_tokens, key=len, reverse=True)
        self._control_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self._marked_re = re.compile(f"{_START}(.*?){_END}|[{_START}{_END}]", re.S)
        self._control_ids = {_token_id(tokenizer, t) for t in self.control_tokens}
        self._plain = _plain_text_tokenizer(tokenizer) if self.control_tokens else None
        self.max_chars_per_token = max_chars_per_token(tokenizer)

    # -- what callers use
    def chat_ids(self, messages: Sequence[dict[str, Any]], tools: list[dict] | None = None,
                 special_tokens: bool = False) -> list[int]:
        """The chat template rendered (with ``tools``, if given) and tokenized; the strings in ``messages`` and
        ``tools`` are text unless ``special_tokens``."""
        extra = {"tools": tools} if tools else {}
        if special_tokens or not self._holds_control_token((messages, tools)):
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                                     **extra)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        marked = self._mark(list(messages))
        if tools:
            extra["tools"] = self._mark(tools)
        rendered = self.tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False, **extra)
        return self._encode_marked(rendered)

    def text_ids(self, text: str, special_tokens: bool = False) -> list[int]:
        """A completion prompt tokenized (with what the tokenizer adds in front, e.g. BOS); text unless
        ``special_tokens``."""
        if special_tokens or not self._holds_control_token(text):
            return [int(i) for i in self.tokenizer.encode(text)]
        prefix = [int(i) for i in self.tokenizer.encode("")]  # BOS, when the tokenizer adds one
        return prefix + self._encode_marked(self._mark(text))

    # -- how
    def _holds_control_token(self, obj: Any) -> bool:
        if self._control_re is None:
            return False
        return any(self._control_re.search(s) for s in strings_in(obj))

    def _mark(self, obj: Any) -> Any:
        """``obj`` with every control token in its strings (dict keys included) wrapped in the markers."""
        if isinstance(obj, str):
            obj = obj.replace(_START, "").replace(_END, "")
            return self._control_re.sub(lambda m: _START + m.group(0) + _END, obj)
        if isinstance(obj, dict):
            return {self._mark(k): self._mark(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self._mark(v) for v in obj]
        return obj

    def _encode_marked(self, rendered: str) -> list[int]:
        """Rendered text -> ids: the text between markers as usual (its control tokens are the template's), each
        marked control token as plain text. A marker the template split from its token is dropped, but still
        separates the text on its two sides, so they cannot join into a control token."""
        pieces = self._marked_re.split(rendered)  # [text, marked or None, text, marked or None, ..., text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            ids += self._as_text(piece) if i % 2 else self._encode_piece(piece)
        return ids

    def _encode_piece(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def _as_text(self, token: str) -> list[int]:
        """One control token's string as plain text. Added tokens that are not special still match in the plain
        tokenizer (Qwen's ``<tool_call>``): then its first character is encoded apart from the rest."""
        ids = self._plain(token)
        if self._control_ids.intersection(ids):
            ids = self._plain(token[:1]) + self._plain(token[1:])
        if self._control_ids.intersection(ids):
            raise ValueError(f"the text {token!r} cannot be tokenized as plain text by this tokenizer")
        return ids


def strings_in(obj: Any):
    """Every string in a JSON-like value (dict keys included)."""
    todo = [obj]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special added tokens, and the added tokens its chat template writes (not whitespace ones)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict):
        return ()
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    out = []
    for token in added.values():
        content = getattr(token, "content", None)
        if not isinstance(content, str) or not content or content.isspace():
            continue
        if getattr(token, "special", False) or content in template:
            out.append(content)
    return tuple(dict.fromkeys(out))


def _token_id(tokenizer: Any, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


def _plain_text_tokenizer(tokenizer: Any):
    """``text -> ids`` that never matches a special token: a private copy of the fast tokenizer's backend with
    ``encode_special_tokens`` set (the shared tokenizer's flag is never touched, since other threads encode with
    it). Sentencepiece tokenizers add a prefix space at the start of a string: encode after a newline and drop it,
    as transformers does for its own sanitized chats. A tokenizer without a backend (a slow one) encodes the first
    character apart from the rest, so no control token can match whole."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        def split(text: str) -> list[int]:
            return [int(i) for part in (text[:1], text[1:]) if part
                    for i in tokenizer.encode(part, add_special_tokens=False)]

        return split

    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(backend.to_str())
    backend.encode_special_tokens = True

    def encode(text: str) -> list[int]:
        return backend.encode_batch([text], add_special_tokens=False)[0].ids  # encode_batch releases the GIL

    newline = encode("\n")

    def plain(text: str) -> list[int]:
        ids = encode("\n" + text)
        return ids[len(newline):] if ids[:len(newline)] == newline else encode(text)

    return plain


def max_chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters of text one token stands for, or None if the tokenizer does not tell.

    The vocabulary's longest entry: byte-level BPE writes one character per byte, sentencepiece one per character
    (byte tokens as ``<0x..>``, longer than the byte), so no token covers more input characters than its entry
    is long. A normalizer can compose several characters into one (NFC: up to about 4), hence the factor."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        longest = max((len(t) for t in get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a duck-typed tokenizer without a usable vocabulary
        return None
    if longest < 1:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (4 if getattr(backend, "normalizer", None) is not None else 1)
