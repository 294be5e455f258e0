"""Server ids in, plaintext out, sans-IO: the inverse permutation, EOS, incremental detokenization, stop strings
(checked on the decoded text here: they are never sent to the server, where they would be plaintext) and
logprobs mapped back; and the plaintext shapes the clients hand out (:class:`Delta`, :class:`Completion`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ...keyfile import KeyFile
from .errors import UpstreamProtocolError
from .wire import ServerLogprob


@dataclass
class TokenLogprob:
    """One reply token's log-probability, in plaintext. ``token`` is the text this token adds to the reply (the
    tokens' texts concatenate to the reply text; a token inside a multi-byte character adds "" and the one that
    completes it the whole character); ``top``: the most likely tokens at that step as (plaintext id, its own
    text, logprob), most likely first."""

    token_id: int
    token: str | None
    logprob: float
    top: list[tuple[int, str | None, float]] = field(default_factory=list)


@dataclass
class Delta:
    """One step of a streamed reply, in plaintext."""

    text: str | None  # None without a tokenizer
    token_ids: list[int]
    finish_reason: str | None = None
    index: int = 0  # which choice (n > 1)
    logprobs: list[TokenLogprob] | None = None  # of the tokens whose text this delta hands out, when asked for


@dataclass
class Completion:
    text: str | None
    token_ids: list[int]  # plaintext reply ids (without the EOS)
    finish_reason: str
    prompt_token_ids: list[int]  # plaintext prompt ids
    server_prompt_ids: list[int]  # what the server was sent (ids; in text mode, before rendering)
    server_reply_ids: list[int]  # what the server produced (permuted ids, EOS included if it sent one)
    usage: dict[str, int]
    seconds: float = 0.0
    index: int = 0  # which choice (n > 1)
    logprobs: list[TokenLogprob] | None = None  # one per token of ``text``, when asked for

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class IncrementalDetokenizer:
    """Token ids in, text out, piece by piece, equal to decoding all ids at once.

    Each step decodes a short window that starts a few tokens back, so a token's text (leading spaces,
    characters whose bytes span several tokens) comes out as in the full decode; a window that ends inside a
    multi-byte character (U+FFFD) is held until the next token completes it.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix_off = self._read_off = 0

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids)
        if len(self.ids) <= self._read_off:
            return ""
        prefix = self._decode(self.ids[self._prefix_off:self._read_off])
        full = self._decode(self.ids[self._prefix_off:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._prefix_off, self._read_off = self._read_off, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        return self.push([], final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


class ReplyDecoder:
    """Server ids in, plaintext deltas out: inverse permutation, EOS, incremental detokenization, stop strings."""

    def __init__(self, key: KeyFile, tokenizer: Any, stop: Sequence[str] = (), max_tokens: int | None = None,
                 index: int = 0):
        self.key, self.tokenizer, self.index = key, tokenizer, index
        self.eos = set(key.obfuscated_eos_ids())
        self.stop = [s for s in stop if s]
        self.cut_by_stop_string = False  # the client ended the reply: the server would have gone on
        self.max_tokens = max_tokens
        self.server_ids: list[int] = []
        self.plain_ids: list[int] = []
        self.finish_reason: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._text = ""  # decoded so far
        self._released = 0  # characters of _text handed out
        self._final_text: str | None = None
        # logprobs, when the server sends them: one entry per reply token, handed out with the text it covers
        self.logprobs: list[TokenLogprob] | None = None  # handed out
        self._lp_all: list[TokenLogprob] | None = None
        self._lp_text = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._lp_ends: list[int] = []  # where each entry's text ends in _text
        self._lp_released = 0  # entries handed out
        self._top_text: dict[int, str] = {}

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, server_ids: Sequence[int], logprobs: Sequence[ServerLogprob] | None = None) -> Delta:
        """New server ids (and, when asked for, their logprobs) -> the plaintext delta they complete (may be empty
        while text is held back)."""
        new_plain: list[int] = []
        if logprobs is not None and self._lp_all is None:
            self.logprobs, self._lp_all = [], []
        for j, sid in enumerate(server_ids):
            if self.done:
                break
            self.server_ids.append(int(sid))
            if sid in self.eos:
                self.finish_reason = "stop"
                break
            if not 0 <= sid < self.key.vocab_size:
                raise UpstreamProtocolError(f"the server produced token id {sid}, outside the vocabulary")
            pid = int(self.key.inverse_permutation[sid])
            self.plain_ids.append(pid)
            new_plain.append(pid)
            if logprobs is not None:
                self._add_logprob(pid, logprobs[j])
            if self.max_tokens is not None and len(self.plain_ids) >= self.max_tokens:
                self.finish_reason = "length"
        text = self._detokenize(new_plain, final=self.done)
        return Delta(text, new_plain, self.finish_reason, self.index, self._take_logprobs())

    def finish(self, reason: str | None) -> Delta:
        """The server ended the reply (reason as it said, normalized)."""
        if not self.done:
            self.finish_reason = reason or "stop"
        return Delta(self._detokenize([], final=True), [], self.finish_reason, self.index, self._take_logprobs())

    # -- logprobs: the server's ids mapped back; each token's text is its share of the reply text
    def _plain_id(self, sid: int) -> int:
        if not 0 <= sid < self.key.vocab_size:
            raise UpstreamProtocolError(f"the server sent a logprob for token id {sid}, outside the vocabulary")
        return int(self.key.inverse_permutation[sid])

    def _token_text(self, pid: int) -> str | None:
        if self.tokenizer is None:
            return None
        if pid not in self._top_text:
            self._top_text[pid] = self.tokenizer.decode([pid], skip_special_tokens=False)
        return self._top_text[pid]

    def _add_logprob(self, pid: int, server_lp: ServerLogprob) -> None:
        value, top = server_lp
        plain_top = sorted(((self._plain_id(t), lp) for t, lp in top), key=lambda x: -x[1])
        piece = self._lp_text.push([pid]) if self._lp_text is not None else None
        self._lp_all.append(TokenLogprob(pid, piece, value, [(t, self._token_text(t), lp) for t, lp in plain_top]))
        self._lp_ends.append((self._lp_ends[-1] if self._lp_ends else 0) + len(piece or ""))

    def _take_logprobs(self) -> list[TokenLogprob] | None:
        """The entries whose text has been handed out (all of them once the reply is over; the token a stop
        string cut keeps the text before the cut, those past it are dropped)."""
        if self._lp_all is None:
            return None
        final = self._final_text is not None or self._detok is None
        if self._final_text is not None and self._lp_all and self._lp_text is not None:
            rest = self._lp_text.flush()  # what the per-token detokenizer still held goes to the last token
            if rest:
                self._lp_all[-1].token = (self._lp_all[-1].token or "") + rest
                self._lp_ends[-1] += len(rest)
        limit = (len(self._final_text) if self._final_text is not None else self._released) \
            if self._detok is not None else None
        out = []
        while self._lp_released < len(self._lp_all):
            i = self._lp_released
            entry, start, end = self._lp_all[i], (self._lp_ends[i - 1] if i else 0), self._lp_ends[i]
            if limit is None or (final and not self.cut_by_stop_string):
                out.append(entry)
            elif final:  # cut by a stop string: the tokens before the cut, the one it cut shortened
                if start < limit:
                    entry.token = (entry.token or "")[: limit - start]
                    out.append(entry)
            elif end < limit or (end == limit and entry.token):
                out.append(entry)  # (a token that adds no text yet waits: it may begin a stop string)
            else:
                break
            self._lp_released += 1
        self.logprobs.extend(out)
        return out

    @property
    def text(self) -> str | None:
        if self._detok is None:
            return None
        return self._final_text if self._final_text is not None else self._text[: self._released]

    def _detokenize(self, new_plain: list[int], final: bool) -> str | None:
        if self._detok is None:
            return None
        if self._final_text is not None:
            return ""
        self._text += self._detok.push(new_plain, final=final)
        return self._release(final)

    def _release(self, final: bool) -> str:
        text, start = self._text, self._released
        if self.stop:
            longest = max(len(s) for s in self.stop)
            search_from = max(0, start - longest + 1)
            hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                cut = min(hits)
                self._final_text = text[:cut]
                self.finish_reason, self.cut_by_stop_string = "stop", True
                out = text[start:cut] if cut > start else ""
                self._released = max(start, cut)
                return out
            if not final:
                hold = 0  # keep back a tail that could still become a stop string
                for s in self.stop:
                    for k in range(min(len(s) - 1, len(text) - start), 0, -1):
                        if text.endswith(s[:k]):
                            hold = max(hold, k)
                            break
                end = len(text) - hold
                self._released = max(start, end)
                return text[start:end] if end > start else ""
        self._released = len(text)
        if final:
            self._final_text = text
        return text[start:]
