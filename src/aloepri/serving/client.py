"""Client SDK: talk to an obfuscated model on any OpenAI-compatible engine, with the secret key kept here.

The server only ever sees permuted token ids. The client

1. renders the chat template and tokenizes with the *plaintext* tokenizer,
2. maps the ids through the key's permutation and sends them (``prompt`` as a list of ints),
3. maps the ids that come back through the inverse permutation and detokenizes them,
4. stops on the permuted EOS and on stop strings, which it checks on the decoded plaintext itself: stop strings
   are never sent to the server (they would be plaintext).

How the ids travel is one :class:`Backend` (a sans-IO adapter: request body out, parsed pieces in):

``openai-completions``
    ``POST /v1/completions`` with ``prompt: [ids]`` and ``return_token_ids: true``; the ids come back in
    ``choices[0].token_ids`` (vLLM's field; ``aloepri serve-local`` speaks it too).
``llamacpp-native``
    llama.cpp's own ``POST /completion`` with ``prompt: [ids]`` and ``return_tokens: true``; the ids come back in
    ``tokens`` (the C++ ``llama-server``).
``openai-text``
    the paper's text path: ``POST /v1/completions`` with the permuted ids rendered as *text* by the server's
    neutral tokenizer (a :class:`TextCodec`); the server re-tokenizes, and its text reply is tokenized back
    into ids here. Needed for servers whose OpenAI endpoint takes no int prompts (llama-cpp-python's server).

Sampling parameters that do not depend on which token is which (temperature, top-k, top-p, min-p, seed,
penalties) pass through unchanged; ``logit_bias`` keys are plaintext ids and are mapped.
"""
from __future__ import annotations

import json
import time
import weakref
from contextlib import aclosing, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Protocol, Sequence

from ..keyfile import KeyFile, KeyMismatchError, check_fingerprint, load_key
from ..runtime.tokenizer import load_hf_tokenizer, load_tokenizer

DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_TOKENS = 512


# ----------------------------------------------------------------------------------------------------- errors


class UpstreamError(RuntimeError):
    """The inference server could not be used. ``status`` is the HTTP status a proxy should answer with."""

    status = 502
    code = "upstream_error"

    def __init__(self, message: str, upstream_status: int | None = None):
        super().__init__(message)
        self.upstream_status = upstream_status


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamHTTPError(UpstreamError):
    """The server answered with an error status; 4xx about the request itself are the caller's to fix."""

    def __init__(self, message: str, upstream_status: int):
        super().__init__(message, upstream_status)
        if upstream_status in (400, 413, 422):
            self.status, self.code = 400, "upstream_rejected_request"
        elif upstream_status in (429, 503):
            self.status, self.code = upstream_status, "upstream_overloaded"
        else:
            self.status, self.code = 502, "upstream_http_error"


class UpstreamProtocolError(UpstreamError):
    """The server answered, but not in the shape the chosen backend expects."""

    code = "upstream_protocol_error"


class UpstreamModelMismatch(UpstreamError):
    """The server now serves another model than the one the key belongs to: its reply is not decoded (it would
    be garbage under this key)."""

    code = "upstream_model_mismatch"


# ---------------------------------------------------------------------------------------------- data types


@dataclass
class GenerationParams:
    """What the caller asks for. ``stop`` stays on the client; everything else is sent (mapped if needed)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # plaintext token id -> bias
    stop: list[str] = field(default_factory=list)
    n: int = 1  # choices per request
    logprobs: int | None = None  # None: none; k: each reply token's log-probability and the k most likely tokens

    def sampling(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


ServerLogprob = tuple[float, list[tuple[int, float]]]  # (logprob of the sampled id, [(server id, logprob), ...])


@dataclass
class Piece:
    """Part of the server's answer, in server (permuted) ids."""

    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | None while generating
    usage: dict[str, Any] | None = None
    index: int = 0  # which choice (n > 1)
    logprobs: list[ServerLogprob] | None = None  # one per id, when asked for


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


# ----------------------------------------------------------------------------------------- text-mode codec


class TextCodec(Protocol):
    """The server's (neutral) tokenizer seen from the client: permuted ids <-> the text the server reads."""

    def ids_to_text(self, ids: Sequence[int]) -> str: ...

    def text_to_ids(self, text: str) -> list[int]: ...


class TokenizerCodec:
    """A :class:`TextCodec` over any Hugging Face tokenizer (the neutral one shipped with the server model)."""

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_hf_tokenizer(tokenizer)
        self.tokenizer = tokenizer

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text_to_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class NeutralCodec:
    """The project's neutral server tokenizer (aloepri.obfuscation.server_tokenizer: token j is the symbol ``t{j}x``, symbols
    separated by spaces), implemented exactly in Python: no tokenizer files needed on the client."""

    def __init__(self, vocab_size: int | None = None):
        from ..obfuscation import server_tokenizer

        self._st, self.vocab_size = server_tokenizer, vocab_size

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self._st.ids_to_neutral_text(ids)

    def text_to_ids(self, text: str) -> list[int]:
        return self._st.neutral_text_to_ids(text, self.vocab_size)


# --------------------------------------------------------------------------------- backends (sans-IO)


class Call:
    """One request to the server: the body to send, and parsers for what comes back."""

    method = "POST"

    def __init__(self, path: str, body: dict[str, Any]):
        self.path, self.body = path, body

    def parse_response(self, data: Any) -> Piece:
        raise NotImplementedError

    def parse_event(self, data: Any) -> Piece | None:
        raise NotImplementedError

    def flush(self) -> Piece:
        """End of the event stream: anything the parser still held back."""
        return Piece()

    def parse_response_all(self, data: Any) -> list[Piece]:
        """The whole answer, one :class:`Piece` per choice (backends without ``n`` have one)."""
        return [self.parse_response(data)]

    def parse_events(self, data: Any) -> list[Piece]:
        """One event, one :class:`Piece` per choice it carries."""
        piece = self.parse_event(data)
        return [] if piece is None else [piece]

    @staticmethod
    def _require(cond: bool, what: str) -> None:
        if not cond:
            raise UpstreamProtocolError(f"unexpected answer from the server: {what}")


class Backend:
    """One wire protocol. ``start`` turns permuted prompt ids into a :class:`Call`."""

    name = ""
    ends_with_done = True  # the stream ends with "data: [DONE]"
    features: frozenset[str] = frozenset()  # of "n" (several choices) and "logprobs"

    def start(self, server_ids: list[int], params: GenerationParams, max_tokens: int | None, stream: bool,
              model: str | None, key: KeyFile) -> Call:
        raise NotImplementedError


def _ids(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise UpstreamProtocolError(f"unexpected answer from the server: {what} is not a list of token ids")
    return value


def _openai_finish(reason: Any) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def _mapped_logit_bias(params: GenerationParams, key: KeyFile) -> dict[str, float] | None:
    if not params.logit_bias:
        return None
    plain = [int(k) for k in params.logit_bias]
    return {str(o): float(params.logit_bias[p]) for p, o in zip(plain, key.encode_ids(plain), strict=True)}


def _first_choice(data: Any) -> dict | None:
    """``choices[0]`` of an OpenAI completions answer or event; None for an event without choices (usage only)."""
    Call._require(isinstance(data, dict), "not a JSON object")
    choices = data.get("choices")
    Call._require(isinstance(choices, list), "no choices")
    if not choices:
        return None
    Call._require(isinstance(choices[0], dict), "choice is not an object")
    return choices[0]


def _token_id_label(label: Any, what: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` labels a token ``"token_id:N"``."""
    if isinstance(label, str) and label.startswith("token_id:"):
        try:
            return int(label[9:])
        except ValueError:
            pass
    raise UpstreamProtocolError(f"unexpected answer from the server: {what} is not a 'token_id:N' label (does it "
                                "support return_tokens_as_token_ids?)")


def _server_logprobs(lp: Any, ids: list[int]) -> list[ServerLogprob]:
    """A choice's ``logprobs`` in vLLM's completions shape (tokens labelled by id), one entry per id."""
    Call._require(isinstance(lp, dict), "choices[].logprobs is not an object")
    tokens, token_lps, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    Call._require(isinstance(tokens, list) and isinstance(token_lps, list) and len(tokens) == len(token_lps)
                  == len(ids), "choices[].logprobs does not have one entry per token id")
    if tops is None:
        tops = [None] * len(ids)
    Call._require(isinstance(tops, list) and len(tops) == len(ids), "choices[].logprobs.top_logprobs")
    out = []
    for label, sid, value, top in zip(tokens, ids, token_lps, tops):
        Call._require(_token_id_label(label, "a logprobs token") == sid, "logprobs name other tokens than token_ids")
        Call._require(isinstance(value, (int, float)) and not isinstance(value, bool), "a token logprob")
        pairs = []
        if top is not None:
            Call._require(isinstance(top, dict), "a top_logprobs entry is not an object")
            for k, v in top.items():
                Call._require(isinstance(v, (int, float)) and not isinstance(v, bool), "a top logprob")
                pairs.append((_token_id_label(k, "a top_logprobs token"), float(v)))
        out.append((float(value), pairs))
    return out


class _OpenAIIdsCall(Call):

    def _ids_of(self, choice: dict) -> list[int]:
        ids = choice.get("token_ids")
        if ids is None:
            if choice.get("text"):
                raise UpstreamProtocolError(
                    "the server returned text but no token ids (choices[0].token_ids): it does not support "
                    "return_token_ids; use backend 'llamacpp-native' (llama.cpp) or 'openai-text'")
            return []
        return _ids(ids, "choices[0].token_ids")

    def parse_response(self, data: Any) -> Piece:
        choice = _first_choice(data)
        self._require(choice is not None, "empty choices")
        ids = choice.get("token_ids")
        if ids is None:
            raise UpstreamProtocolError(
                "the server returned no token ids (choices[0].token_ids): it does not support return_token_ids; "
                "use backend 'llamacpp-native' (llama.cpp) or 'openai-text'")
        return Piece(_ids(ids, "choices[0].token_ids"), _openai_finish(choice.get("finish_reason")) or "stop",
                     data.get("usage"))

    def parse_event(self, data: Any) -> Piece | None:
        choice = _first_choice(data)
        if choice is None:
            return Piece(usage=data.get("usage"))
        return Piece(self._ids_of(choice), _openai_finish(choice.get("finish_reason")), data.get("usage"))

    def _piece(self, choice: Any, ids: list[int], usage: Any, finish: str | None) -> Piece:
        self._require(isinstance(choice, dict), "choice is not an object")
        index = choice.get("index", 0)
        self._require(isinstance(index, int) and not isinstance(index, bool), "choices[].index")
        lp = choice.get("logprobs")
        return Piece(ids, finish, usage, index, None if lp is None or not ids else _server_logprobs(lp, ids))

    def parse_response_all(self, data: Any) -> list[Piece]:
        self._require(isinstance(data, dict) and isinstance(data.get("choices"), list) and data["choices"],
                      "no choices")
        pieces = []
        for choice in data["choices"]:
            first = self.parse_response({"choices": [choice]})
            pieces.append(self._piece(choice, first.ids, data.get("usage") if not pieces else None,
                                      first.finish_reason))
        return pieces

    def parse_events(self, data: Any) -> list[Piece]:
        if _first_choice(data) is None:
            return [Piece(usage=data.get("usage"))]
        pieces = []
        for choice in data["choices"]:
            self._require(isinstance(choice, dict), "choice is not an object")
            pieces.append(self._piece(choice, self._ids_of(choice), data.get("usage") if not pieces else None,
                                      _openai_finish(choice.get("finish_reason"))))
        return pieces


class OpenAICompletionsBackend(Backend):
    """``/v1/completions`` with int prompts and ``return_token_ids`` (vLLM, aloepri serve-local). ``n`` and
    ``logprobs`` are forwarded; logprobs come back labelled by token id (vLLM's ``return_tokens_as_token_ids``)."""

    name = "openai-completions"
    features = frozenset({"n", "logprobs"})

    def __init__(self, send_stop_token_ids: bool = True):
        self.send_stop_token_ids = send_stop_token_ids

    def start(self, server_ids, params, max_tokens, stream, model, key):
        body: dict[str, Any] = {"prompt": server_ids, "return_token_ids": True, "stream": stream}
        if model:
            body["model"] = model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(params.sampling())
        bias = _mapped_logit_bias(params, key)
        if bias:
            body["logit_bias"] = bias
        eos = key.obfuscated_eos_ids()
        if self.send_stop_token_ids and eos:
            body["stop_token_ids"] = eos  # already the permuted ids; the server needs no plaintext for this
        if params.n != 1:
            body["n"] = params.n
        if params.logprobs is not None:
            # the server's token strings would be its neutral symbols: ask for ids, which the key maps back
            body["logprobs"], body["return_tokens_as_token_ids"] = params.logprobs, True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return _OpenAIIdsCall("/v1/completions", body)


class _LlamaCppCall(Call):
    @staticmethod
    def _finish(data: dict) -> str | None:
        if not data.get("stop"):
            return None
        return "length" if data.get("stop_type") == "limit" else "stop"

    @staticmethod
    def _usage(data: dict) -> dict | None:
        if "tokens_predicted" not in data:
            return None
        return {"prompt_tokens": data.get("tokens_evaluated", 0), "completion_tokens": data["tokens_predicted"]}

    def parse_response(self, data):
        self._require(isinstance(data, dict), "not a JSON object")
        if "tokens" not in data:
            raise UpstreamProtocolError("the server returned no 'tokens': is it llama.cpp's server (return_tokens)?")
        return Piece(_ids(data["tokens"], "tokens"), self._finish(data) or "stop", self._usage(data))

    def parse_event(self, data):
        self._require(isinstance(data, dict), "not a JSON object")
        ids = data.get("tokens")
        if ids is None:
            if data.get("content"):
                raise UpstreamProtocolError("the server streamed text without 'tokens'")
            ids = []
        return Piece(_ids(ids, "tokens"), self._finish(data), self._usage(data))


class LlamaCppNativeBackend(Backend):
    """llama.cpp's native ``/completion``: ``prompt`` as ids, ``return_tokens`` for the ids back."""

    name = "llamacpp-native"
    ends_with_done = False

    def start(self, server_ids, params, max_tokens, stream, model, key):
        body: dict[str, Any] = {"prompt": server_ids, "return_tokens": True, "stream": stream, "cache_prompt": True,
                                "n_predict": -1 if max_tokens is None else max_tokens}
        s = params.sampling()
        if "repetition_penalty" in s:
            s["repeat_penalty"] = s.pop("repetition_penalty")
        body.update(s)
        bias = _mapped_logit_bias(params, key)
        if bias:
            body["logit_bias"] = [[int(k), v] for k, v in bias.items()]
        return _LlamaCppCall("/completion", body)


class _TextCall(Call):
    def __init__(self, path, body, codec: TextCodec):
        super().__init__(path, body)
        self.codec = codec
        self._text = ""
        self._committed = 0  # ids already handed out
        self._last: list[int] = []

    def _step(self, final: bool) -> list[int]:
        try:
            ids = self.codec.text_to_ids(self._text)
        except ValueError:
            if not final:
                return []  # a symbol cut in the middle: wait for the rest of it
            raise UpstreamProtocolError("text mode: the server's reply is not text of its neutral tokenizer") from None
        # the last id may be a symbol whose text is still arriving: hand it out only at the end
        upto = len(ids) if final else max(len(ids) - 1, self._committed)
        if ids[: self._committed] != self._last[: self._committed]:
            raise UpstreamProtocolError("text mode: re-tokenizing the server's text changed earlier tokens; "
                                        "the codec is not the server's tokenizer")
        new = ids[self._committed:upto]
        self._committed = upto
        self._last = ids
        return new

    def parse_response(self, data):
        choice = _first_choice(data)
        self._require(choice is not None and isinstance(choice.get("text"), str), "no choices[0].text")
        self._text = choice["text"]
        return Piece(self._step(final=True), _openai_finish(choice.get("finish_reason")) or "stop", data.get("usage"))

    def parse_event(self, data):
        choice = _first_choice(data)
        if choice is None:
            return Piece(usage=data.get("usage"))
        text = choice.get("text") or ""
        self._require(isinstance(text, str), "choices[0].text is not a string")
        self._text += text
        finish = _openai_finish(choice.get("finish_reason"))
        return Piece(self._step(final=finish is not None), finish, data.get("usage"))

    def flush(self):
        return Piece(self._step(final=True))


class OpenAITextBackend(Backend):
    """The paper's text path: ids rendered as text with the server's neutral tokenizer, re-tokenized by it."""

    name = "openai-text"

    def __init__(self, codec: TextCodec):
        self.codec = codec

    def start(self, server_ids, params, max_tokens, stream, model, key):
        body: dict[str, Any] = {"prompt": self.codec.ids_to_text(server_ids), "stream": stream}
        if model:
            body["model"] = model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(params.sampling())
        if "repetition_penalty" in body:  # vLLM's name; llama-cpp-python's server calls it repeat_penalty
            body["repeat_penalty"] = body["repetition_penalty"]
        bias = _mapped_logit_bias(params, key)
        if bias:
            body["logit_bias"] = bias
        return _TextCall("/v1/completions", body, self.codec)


BACKENDS = ("openai-completions", "llamacpp-native", "openai-text")


def make_backend(name: str | Backend, server_tokenizer: Any = None, vocab_size: int | None = None) -> Backend:
    """``server_tokenizer`` (text mode only): None for the project's neutral tokenizer (:class:`NeutralCodec`),
    a :class:`TextCodec`, a Hugging Face tokenizer object, or a tokenizer directory / .gguf to load one from."""
    if isinstance(name, Backend):
        return name
    if name == "openai-completions":
        return OpenAICompletionsBackend()
    if name == "llamacpp-native":
        return LlamaCppNativeBackend()
    if name == "openai-text":
        if server_tokenizer is None:
            codec: Any = NeutralCodec(vocab_size)
        elif hasattr(server_tokenizer, "text_to_ids"):
            codec = server_tokenizer
        else:
            codec = TokenizerCodec(server_tokenizer)
        return OpenAITextBackend(codec)
    raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")


# ------------------------------------------------------------------------------ reply decoding (sans-IO)


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


# ---------------------------------------------------------------------------------------------- client


def normalize_base_url(url: str) -> str:
    """The server's base URL without a trailing ``/v1``; ValueError unless it is an http(s) URL with a host."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        port_ok = parts is not None and (parts.port is None or parts.port > 0)  # .port raises on a bad port
    except ValueError:
        parts, port_ok = None, False
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment:
        raise ValueError(f"{url!r} is not a server URL: give http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _upstream_error_message(resp_text: str) -> str:
    try:
        data = json.loads(resp_text)
    except ValueError:
        return resp_text.strip()[:500]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))[:500]
    if isinstance(err, str):
        return err[:500]
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])[:500]
    return resp_text.strip()[:500]


def _http_error(status: int, text: str) -> UpstreamHTTPError:
    return UpstreamHTTPError(f"the inference server answered {status}: {_upstream_error_message(text)}", status)


@contextmanager
def upstream_errors(stage: str, base_url: str = ""):
    """The one mapping of httpx transport errors to :class:`UpstreamError`; ``stage`` is what was under way:
    ``connect`` (sending a request), ``read`` (reading a whole answer) or ``stream`` (reading server-sent events)."""
    import httpx2

    try:
        yield
    except httpx2.TimeoutException as e:
        where = {"connect": f" at {base_url}", "read": "", "stream": ""}[stage]
        raise UpstreamTimeout(f"the inference server{where} timed out" + (" while streaming" if stage == "stream"
                                                                          else "")) from e
    except httpx2.TransportError as e:
        raise UpstreamUnreachable({"connect": f"cannot reach the inference server at {base_url}",
                                   "read": "the inference server dropped the connection",
                                   "stream": "the inference server dropped the stream"}[stage] + f": {e}") from e
    except httpx2.SSEError as e:
        raise UpstreamProtocolError(f"the server's stream is not server-sent events: {e}") from e


class _Core:
    """What the sync and async clients share: key, tokenizer, backend, request preparation."""

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        self.base_url = normalize_base_url(base_url)  # first: a bad URL fails before the key and tokenizer load
        self.key = key if isinstance(key, KeyFile) else load_key(key)
        self.tokenizer = load_tokenizer(self.key, tokenizer)
        self.model = model
        self.backend = make_backend(backend, server_tokenizer, self.key.vocab_size)
        self.default_max_tokens = default_max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.guard = UpstreamGuard(self.key.model_fingerprint, model, mode="stamp")

    def _timeout(self):
        import httpx2

        if isinstance(self.timeout, (int, float)):
            return httpx2.Timeout(float(self.timeout), connect=min(10.0, float(self.timeout)))
        return self.timeout

    # -- prompts
    def chat_prompt_ids(self, messages: Sequence[dict[str, Any]] | str, tools: list[dict] | None = None) -> list[int]:
        """The chat template rendered (with ``tools``, if given, for the template to describe) and tokenized."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: the key names none for this model; pass tokenizer=...")
        extra = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def completion_prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer=... or give the prompt as token ids")
            return [int(i) for i in self.tokenizer.encode(prompt)]
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < self.key.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.key.vocab_size})")
        return ids

    def prepare(self, plain_ids: list[int], params: GenerationParams, stream: bool, default_max: int | None):
        if not plain_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (they are matched on the decoded text)")
        for feature, asked in (("n", params.n != 1), ("logprobs", params.logprobs is not None)):
            if asked and feature not in self.backend.features:
                raise ValueError(f"'{feature}' is not supported with the {self.backend.name} backend (only with "
                                 "openai-completions, e.g. vLLM or aloepri serve-local)")
        max_tokens = params.max_tokens if params.max_tokens is not None else default_max
        server_ids = self.key.encode_ids(plain_ids)
        call = self.backend.start(server_ids, params, max_tokens, stream, self.model, self.key)
        decoders = [ReplyDecoder(self.key, self.tokenizer, params.stop, max_tokens, index=i) for i in range(params.n)]
        return server_ids, call, decoders

    def check_fingerprint(self, fingerprint: str | None, where: str) -> bool:
        if fingerprint is None:
            return False
        check_fingerprint(self.key, fingerprint, f"the model {where} serves")
        return True


def fetch_models(base_url: str, headers: dict | None = None, timeout: Any = 10.0, http: Any = None) -> Any:
    """GET /v1/models of a server (sync); None if it has no such endpoint."""
    import httpx2

    base = normalize_base_url(base_url)
    with upstream_errors("connect", base):
        if http is not None:
            r = http.get(base + "/v1/models", headers=headers or {})
        else:
            r = httpx2.get(base + "/v1/models", headers=headers or {}, timeout=timeout)
    return _listing_of(r.status_code, r.content)


def _listing_of(status: int, body: bytes) -> Any:
    """A /v1/models answer: its JSON, or None when the server has no usable listing (error status, not JSON)."""
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def fingerprint_in_listing(listing: Any, model: str | None = None) -> str | None:
    """The public model fingerprint in a /v1/models answer (``data[i].aloepri.model_fingerprint``), if any:
    of the entry named ``model``, or of the only entry."""
    entries = listing_entries(listing) or []
    for m in entries:
        meta = m.get("aloepri")
        if isinstance(meta, dict) and meta.get("model_fingerprint"):
            if model is None or m.get("id") == model or len(entries) == 1:
                return str(meta["model_fingerprint"])
    return None


# ------------------------------------------------------------------------- is the reply from the key's model?

FINGERPRINT_HEADER = "x-aloepri-model-fingerprint"  # aloepri serve-local stamps every answer with it (public)


def listing_entries(listing: Any) -> list[dict] | None:
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else None


def listing_identity(listing: Any) -> tuple | None:
    """What a /v1/models answer says about the models served, without what changes from call to call (vLLM's
    ``created`` and permission ids): per entry its id, root, context length, llama.cpp's ``meta`` and the
    aloepri fingerprint. None for no listing."""
    entries = listing_entries(listing)
    if entries is None:
        return None
    out = []
    for m in entries:
        meta, al = m.get("meta"), m.get("aloepri")
        out.append((str(m.get("id")), str(m.get("root")), str(m.get("max_model_len")),
                    json.dumps(meta, sort_keys=True) if isinstance(meta, dict) else "",
                    str(al.get("model_fingerprint")) if isinstance(al, dict) else ""))
    return tuple(sorted(out))


def context_in_listing(listing: Any, model: str | None = None) -> int | None:
    """The context length a /v1/models answer gives for ``model`` (or the only/first entry): ``max_model_len``
    (vLLM, aloepri serve-local) or llama.cpp's ``meta.n_ctx_train``; None if it gives none."""
    entries = listing_entries(listing) or []
    chosen = [m for m in entries if m.get("id") == model] or entries[:1]
    for m in chosen:
        meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
        for v in (m.get("max_model_len"), meta.get("n_ctx_train")):
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


class UpstreamGuard:
    """Lets a reply be decoded only if it comes from the model the key belongs to; raises
    :class:`UpstreamModelMismatch` otherwise. Sans-IO: the clients call :meth:`admit` with each reply's headers
    and connection before reading its body and, when it returns False, fetch /v1/models and pass it to
    :meth:`judge_listing` (still before reading the body).

    1. A reply stamped with a model fingerprint (header ``x-aloepri-model-fingerprint``; aloepri serve-local
       stamps every answer) is judged by its stamp: the stamp and the ids come in the same HTTP response, so no
       restart of the server can fall between the check and the reply.
    2. (``mode="pin"``) An unstamped reply on a connection not yet vouched for (the first one, or any new one,
       e.g. after the server restarted) waits for a fresh /v1/models: the fingerprint listed there must be the
       key's, or, if the server lists none, the listing must equal the one pinned when the key was checked
       (model ids, context length, llama.cpp's model metadata). A connection that passed stays vouched for
       while it lives: a TCP connection does not survive a restart of the server behind it.

    ``status`` (shown by the proxy's /health) is the last verdict: ``verified-upstream``, the status given at
    start (``verified-local-meta`` or ``unchecked``) while the listing is unchanged, or ``mismatch``.
    ``mode``: ``"pin"`` (the proxy; the SDK after ``verify()``), ``"stamp"`` (stamps only; the SDK's default),
    ``"off"`` (``--no-verify``).
    """

    def __init__(self, key_fingerprint: str, model: str | None = None, listing: Any = None,
                 status: str = "unchecked", mode: str = "pin"):
        if mode not in ("pin", "stamp", "off"):
            raise ValueError(f"unknown guard mode {mode!r}")
        self.key_fingerprint, self.model, self.mode = key_fingerprint, model, mode
        self.status = self._start_status = status
        self.problem: str | None = None
        self.identity: tuple | None = None
        self.expects_fingerprint = False
        self._vouched: weakref.WeakSet = weakref.WeakSet()
        if listing is not None:
            self.arm(listing)

    def arm(self, listing: Any) -> None:
        """Pin the server's current listing (the key was just checked against it) and check every new
        connection from now on."""
        self.identity = listing_identity(listing)
        self.expects_fingerprint = fingerprint_in_listing(listing, self.model) is not None
        if self.mode == "stamp":
            self.mode = "pin"

    def admit(self, headers: Any, connection: Any = None) -> bool:
        """True: the reply may be decoded. False: judge a fresh /v1/models first."""
        if self.mode == "off":
            return True
        stamp = headers.get(FINGERPRINT_HEADER)
        if stamp:
            if stamp != self.key_fingerprint:
                self._refuse(f"the upstream now serves another model (fingerprint {stamp[:16]}...) than the one "
                             f"the key belongs to ({self.key_fingerprint[:16]}...)")
            self.status, self.problem = "verified-upstream", None
            return True
        return self.mode == "stamp" or (self.status != "mismatch" and connection is not None
                                        and connection in self._vouched)

    def judge_listing(self, listing: Any, connection: Any = None) -> None:
        """Judge an unstamped reply by the server's current /v1/models answer (None: it has none)."""
        fp = fingerprint_in_listing(listing, self.model)
        if fp is not None and fp != self.key_fingerprint:
            self._refuse(f"the upstream now lists another model (fingerprint {fp[:16]}...) than the one the key "
                         f"belongs to ({self.key_fingerprint[:16]}...)")
        if fp is None and self.expects_fingerprint:
            self._refuse("the upstream no longer lists the model fingerprint it listed when the key was checked: "
                         "it is not the same server")
        identity = listing_identity(listing)
        if fp is None and self.identity is not None and identity != self.identity:
            self._refuse("the upstream's model listing changed since the key was checked (model id, context "
                         "length or metadata), and it lists no fingerprint to check the key against")
        if self.identity is None:  # the server was unreachable when the proxy started: pin its first listing
            self.arm(listing)
        self.status, self.problem = ("verified-upstream" if fp is not None else self._start_status), None
        if connection is not None:
            self._vouched.add(connection)

    def _refuse(self, why: str) -> None:
        self.status, self.problem = "mismatch", why
        raise UpstreamModelMismatch(f"{why}: its reply was not decoded. Point the proxy at the server of this key's "
                                    "model, or restart it with that model's key")


def check_model_meta(key: KeyFile, meta_path: str | Path) -> None:
    """Compare the key with a local copy of the server directory's public aloepri_model.json."""
    meta = json.loads(Path(meta_path).read_text())
    fp = meta.get("model_fingerprint") if isinstance(meta, dict) else None
    if not fp:
        raise ValueError(f"{meta_path}: no model_fingerprint; is it the aloepri_model.json of an obfuscated model?")
    check_fingerprint(key, fp, f"the model described by {meta_path}")


def _params(max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None, seed=None, stop=None,
            presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
            logit_bias=None, n=1, logprobs=None) -> GenerationParams:
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, not {n!r}")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise ValueError(f"logprobs must be a number of top tokens >= 0 (or None), not {logprobs!r}")
    return GenerationParams(max_tokens, temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
                            repetition_penalty, {int(k): float(v) for k, v in (logit_bias or {}).items()} or None,
                            list(stop or []), n, logprobs)


def _finish_piece(decoder: ReplyDecoder, piece: Piece, usage: dict) -> Delta:
    if piece.usage:
        usage.update({k: v for k, v in piece.usage.items() if isinstance(v, int)})
    delta = decoder.feed(piece.ids, piece.logprobs)
    if not decoder.done and piece.finish_reason is not None:
        fin = decoder.finish(piece.finish_reason)
        delta = Delta(_cat(delta.text, fin.text), delta.token_ids, fin.finish_reason, decoder.index,
                      _cat_lists(delta.logprobs, fin.logprobs))
    return delta


def _cat(a: str | None, b: str | None) -> str | None:
    return None if a is None and b is None else (a or "") + (b or "")


def _cat_lists(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else (a or []) + (b or [])


def _usage(plain_prompt: list[int], decoders: Sequence[ReplyDecoder]) -> dict[str, int]:
    done = sum(len(d.server_ids) for d in decoders)
    return {"prompt_tokens": len(plain_prompt), "completion_tokens": done, "total_tokens": len(plain_prompt) + done}


class ReplyState:
    """One reply, sans-IO: the server's answer goes in (a whole body, or server-sent events one by one), plaintext
    :class:`Delta` come out (``index`` tells the choice when ``n`` > 1), and :meth:`completions` sums them up.
    :class:`ReplyStream` and :class:`AsyncReplyStream` only move bytes from the connection into it."""

    def __init__(self, plain: list[int], server_ids: list[int], call: Call,
                 decoders: ReplyDecoder | Sequence[ReplyDecoder], upstream_stream: bool):
        self.plain, self.server_ids, self.call = plain, server_ids, call
        self.decoders = [decoders] if isinstance(decoders, ReplyDecoder) else list(decoders)
        self.upstream_stream = upstream_stream  # the server streams (events) rather than answering in one body
        self.usage: dict[str, Any] = {}
        self.ended = False  # no more events are needed
        self._read_after_end = 0
        self.t0 = time.perf_counter()

    @property
    def decoder(self) -> ReplyDecoder:
        return self.decoders[0]

    def _decoder_of(self, piece: Piece) -> ReplyDecoder:
        if not 0 <= piece.index < len(self.decoders):
            raise UpstreamProtocolError(f"the server answered choice {piece.index}; {len(self.decoders)} were "
                                        "asked for")
        return self.decoders[piece.index]

    def _all_done(self) -> bool:
        return all(d.done for d in self.decoders)

    def on_body(self, body: bytes) -> list[Delta]:
        """The whole (non-streamed) answer."""
        try:
            data = json.loads(body)
        except ValueError as e:
            raise UpstreamProtocolError("the server's answer is not JSON") from e
        self.ended = True
        pieces = self.call.parse_response_all(data)
        if len(pieces) != len(self.decoders):
            raise UpstreamProtocolError(f"the server answered {len(pieces)} choices; {len(self.decoders)} were asked "
                                        "for")
        return [_finish_piece(self._decoder_of(p), p, self.usage) for p in pieces]

    def on_event(self, data: str) -> list[Delta]:
        """One server-sent event's data -> the deltas it gives (none when it carries nothing to hand out)."""
        if data.strip() == "[DONE]":
            self.ended = True
            return []
        out = []
        for piece in self.call.parse_events(_event_json(data)):
            if not piece.ids and piece.finish_reason is None and piece.logprobs is None:
                if piece.usage:
                    self.usage.update({k: v for k, v in piece.usage.items() if isinstance(v, int)})
                continue
            delta = _finish_piece(self._decoder_of(piece), piece, self.usage)
            if delta.token_ids or delta.text or delta.finish_reason or delta.logprobs:
                out.append(delta)
        self.ended = self._all_done()
        return out

    def on_stream_end(self) -> list[Delta]:
        """The events ended: what the parser and the decoders still held back (nothing for a finished reply)."""
        out = []
        for dec in self.decoders:
            if dec.done:
                continue
            delta = _finish_piece(dec, self.call.flush(), self.usage)
            last = dec.finish(None)
            out.append(Delta(_cat(delta.text, last.text), delta.token_ids, last.finish_reason, dec.index,
                             _cat_lists(delta.logprobs, last.logprobs)))
        return out

    @property
    def stage(self) -> str:
        """What reading the answer is, for :func:`upstream_errors`."""
        return "stream" if self.upstream_stream else "read"

    def feed(self, raw: Any) -> list[Delta]:
        """One unit of the answer (the whole body, or one event's data) -> the deltas to hand out."""
        return self.on_event(raw) if self.upstream_stream else self.on_body(raw)

    def read_on_after_end(self) -> bool:
        """After the end, read on to the close of the body (a few events at most) unless the reply was cut by a
        stop string: the server stops by itself on EOS and max_tokens, and a body read to its end leaves the
        connection reusable, so the next reply on it need not be re-checked (UpstreamGuard). A stop string is
        the client's own: closing the connection then is what stops the server generating."""
        self._read_after_end += 1
        return not any(d.cut_by_stop_string for d in self.decoders) and self._read_after_end <= 4

    def end(self) -> list[Delta]:
        """The answer is over: what is still held back."""
        return self.on_stream_end() if self.upstream_stream else []

    def completions(self) -> list[Completion]:
        """One :class:`Completion` per choice; ``usage`` counts them all."""
        usage = _usage(self.plain, self.decoders)
        return [Completion(dec.text, dec.plain_ids, dec.finish_reason or "stop", self.plain, self.server_ids,
                           dec.server_ids, usage, time.perf_counter() - self.t0, dec.index, dec.logprobs)
                for dec in self.decoders]

    def completion(self) -> Completion:
        return self.completions()[0]


class Client:
    """Synchronous client. ``chat`` / ``complete`` return a :class:`Completion` (with ``n`` > 1 a list, one per
    choice), or with ``stream=True`` a :class:`ReplyStream` of :class:`Delta` (use it as a context manager, or
    iterate it to the end).

    ``tokenizer``: the plaintext tokenizer (object, directory or .gguf; default: the one the key names). Any object
    with ``apply_chat_template``, ``encode`` and ``decode`` like Hugging Face's works.
    ``backend``: ``openai-completions`` (default), ``llamacpp-native`` or ``openai-text`` (then ``server_tokenizer``
    is the server's neutral tokenizer or a :class:`TextCodec`).
    """

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT, *,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, http_client: Any = None):
        import httpx2

        self._core = _Core(key, base_url, model, tokenizer, api_key, timeout, backend, server_tokenizer,
                           default_max_tokens)
        self._http = http_client or httpx2.Client(timeout=self._core._timeout())
        self._own_http = http_client is None

    key = property(lambda self: self._core.key)
    tokenizer = property(lambda self: self._core.tokenizer)
    backend = property(lambda self: self._core.backend)
    guard = property(lambda self: self._core.guard)  # UpstreamGuard: is each reply from the key's model?

    def close(self) -> None:
        if self._own_http:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def verify(self) -> bool:
        """Check the key against the fingerprint the server publishes (``aloepri serve-local`` does, in
        ``/v1/models``). True: verified; False: the server publishes none; raises KeyMismatchError."""
        c = self._core
        listing = fetch_models(c.base_url, c.headers, c._timeout(), http=self._http)
        verified = c.check_fingerprint(fingerprint_in_listing(listing, c.model), c.base_url)
        c.guard.arm(listing)
        return verified

    def chat(self, messages: Sequence[dict[str, Any]] | str, *, stream: bool = False, **params: Any):
        plain = self._core.chat_prompt_ids(messages)
        return self._run(plain, _params(**params), stream, self._core.default_max_tokens)

    def complete(self, prompt: str | Sequence[int], *, stream: bool = False, **params: Any):
        plain = self._core.completion_prompt_ids(prompt)
        return self._run(plain, _params(**params), stream, self._core.default_max_tokens)

    def _run(self, plain: list[int], params: GenerationParams, stream: bool, default_max: int | None):
        # stop strings are checked here, so the reply is streamed from the server to end it as soon as one matches
        upstream_stream = stream or bool(params.stop)
        server_ids, call, decoders = self._core.prepare(plain, params, upstream_stream, default_max)
        rs = ReplyStream(self, plain, server_ids, call, decoders, upstream_stream)
        if stream:
            return rs
        with rs:
            for _ in rs:
                pass
        return rs.results if params.n > 1 else rs.result

    def _send(self, call: Call, stream: bool):
        req = self._http.build_request(call.method, self._core.base_url + call.path, json=call.body,
                                       headers=self._core.headers)
        with upstream_errors("connect", self._core.base_url):
            resp = self._http.send(req, stream=stream)
        if resp.status_code != 200:
            try:
                text = resp.read().decode("utf-8", "replace")
            finally:
                resp.close()
            raise _http_error(resp.status_code, text)
        guard, conn = self._core.guard, resp.extensions.get("network_stream")
        try:
            if not guard.admit(resp.headers, conn):
                c = self._core
                guard.judge_listing(fetch_models(c.base_url, c.headers, c._timeout(), http=self._http), conn)
        except BaseException:
            resp.close()
            raise
        return resp


class ReplyStream:
    """Iterator of :class:`Delta`; ``result`` holds the :class:`Completion` once it is exhausted."""

    def __init__(self, client: Client, plain, server_ids, call: Call, decoders: Sequence[ReplyDecoder],
                 upstream_stream: bool):
        self._state = ReplyState(plain, server_ids, call, decoders, upstream_stream)
        self._resp = client._send(call, upstream_stream)  # connect now, so errors surface at the call
        self.result: Completion | None = None  # the first choice
        self.results: list[Completion] = []  # every choice (n > 1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None

    def _raw(self) -> Iterator[Any]:
        import httpx2

        if not self._state.upstream_stream:
            yield self._resp.read()
        else:
            for sse in httpx2.EventSource(self._resp):
                yield sse.data

    def __iter__(self) -> Iterator[Delta]:
        st = self._state
        try:
            with upstream_errors(st.stage):
                for raw in self._raw():
                    if st.ended:  # the server's [DONE] came: read its body to the close
                        if st.read_on_after_end():
                            continue
                        break
                    yield from st.feed(raw)
                    if st.ended and not st.read_on_after_end():
                        break
            yield from st.end()
        finally:
            self.close()
        self.results = st.completions()
        self.result = self.results[0]


def _event_json(data: str) -> Any:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise UpstreamProtocolError("the server streamed an event that is not JSON") from e
    if isinstance(obj, dict) and "error" in obj and "choices" not in obj and "tokens" not in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise UpstreamHTTPError(f"the inference server reported an error mid-stream: {msg}", 500)
    return obj


class AsyncClient:
    """The asyncio twin of :class:`Client` (used by the proxy). ``open_chat`` / ``open_completion`` connect and
    return an :class:`AsyncReplyStream`; ``chat`` / ``complete`` return the finished :class:`Completion`."""

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT, *,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, http_client: Any = None, max_connections: int = 256):
        import httpx2

        self._core = _Core(key, base_url, model, tokenizer, api_key, timeout, backend, server_tokenizer,
                           default_max_tokens)
        limits = httpx2.Limits(max_connections=max_connections, max_keepalive_connections=32)
        self._http = http_client or httpx2.AsyncClient(timeout=self._core._timeout(), limits=limits)
        self._own_http = http_client is None
        # the guard's /v1/models checks get a pool of their own: a check holds back a reply that holds a connection,
        # so with every connection of the main pool held that way, checks drawing on it would wait forever
        self._check_http = http_client or httpx2.AsyncClient(timeout=self._core._timeout(),
                                                             limits=httpx2.Limits(max_connections=4))

    key = property(lambda self: self._core.key)
    tokenizer = property(lambda self: self._core.tokenizer)
    backend = property(lambda self: self._core.backend)
    guard = property(lambda self: self._core.guard)  # UpstreamGuard: is each reply from the key's model?
    core = property(lambda self: self._core)

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()
            await self._check_http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def list_models(self, http: Any = None) -> Any:
        with upstream_errors("connect", self._core.base_url):
            r = await (http or self._http).get(self._core.base_url + "/v1/models", headers=self._core.headers)
        if r.status_code != 200:
            raise _http_error(r.status_code, r.text)
        try:
            return r.json()
        except ValueError as e:
            raise UpstreamProtocolError("/v1/models did not answer JSON") from e

    async def listing(self, http: Any = None) -> Any:
        """/v1/models, or None if the server answers it with an error status (as :func:`fetch_models`)."""
        try:
            return await self.list_models(http)
        except UpstreamHTTPError:
            return None

    async def verify(self) -> bool:
        """As :meth:`Client.verify`."""
        data = await self.listing()
        verified = self._core.check_fingerprint(fingerprint_in_listing(data, self._core.model), self._core.base_url)
        self._core.guard.arm(data)
        return verified

    async def open(self, plain_ids: list[int], params: GenerationParams, stream: bool = True,
                   default_max: int | None = None) -> "AsyncReplyStream":
        upstream_stream = stream or bool(params.stop)
        server_ids, call, decoders = self._core.prepare(plain_ids, params, upstream_stream, default_max)
        rs = AsyncReplyStream(self, plain_ids, server_ids, call, decoders, upstream_stream)
        await rs._connect()
        return rs

    async def open_chat(self, messages, **params) -> "AsyncReplyStream":
        return await self.open(self._core.chat_prompt_ids(messages), _params(**params), True,
                               self._core.default_max_tokens)

    async def open_completion(self, prompt, **params) -> "AsyncReplyStream":
        return await self.open(self._core.completion_prompt_ids(prompt), _params(**params), True,
                               self._core.default_max_tokens)

    async def chat(self, messages, **params) -> Completion | list[Completion]:
        """The finished reply (a list of them, one per choice, when ``n`` > 1)."""
        p = _params(**params)
        rs = await self.open(self._core.chat_prompt_ids(messages), p, False, self._core.default_max_tokens)
        first = await rs.collect()
        return rs.results if p.n > 1 else first

    async def complete(self, prompt, **params) -> Completion | list[Completion]:
        """As :meth:`chat`."""
        p = _params(**params)
        rs = await self.open(self._core.completion_prompt_ids(prompt), p, False, self._core.default_max_tokens)
        first = await rs.collect()
        return rs.results if p.n > 1 else first


class AsyncReplyStream:
    """The asyncio twin of :class:`ReplyStream`: the same :class:`ReplyState`, driven by an async connection."""

    def __init__(self, client: AsyncClient, plain, server_ids, call: Call, decoders: Sequence[ReplyDecoder],
                 upstream_stream: bool):
        self._client = client
        self._state = ReplyState(plain, server_ids, call, decoders, upstream_stream)
        self._resp = None
        self.result: Completion | None = None  # the first choice
        self.results: list[Completion] = []  # every choice (n > 1)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._state.plain

    @property
    def server_prompt_ids(self) -> list[int]:
        return self._state.server_ids

    async def _connect(self) -> None:
        core, http, call = self._client._core, self._client._http, self._state.call
        req = http.build_request(call.method, core.base_url + call.path, json=call.body, headers=core.headers)
        with upstream_errors("connect", core.base_url):
            resp = await http.send(req, stream=True)
        if resp.status_code != 200:
            try:
                text = (await resp.aread()).decode("utf-8", "replace")
            finally:
                await resp.aclose()
            raise _http_error(resp.status_code, text)
        guard, conn = core.guard, resp.extensions.get("network_stream")
        try:
            if not guard.admit(resp.headers, conn):
                guard.judge_listing(await self._client.listing(self._client._check_http), conn)
        except BaseException:
            await resp.aclose()
            raise
        self._resp = resp

    async def aclose(self) -> None:
        if self._resp is not None:
            resp, self._resp = self._resp, None
            await resp.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def collect(self) -> Completion:
        try:
            async for _ in self:
                pass
        finally:
            await self.aclose()
        return self.result

    async def _raw(self) -> AsyncIterator[Any]:
        import httpx2

        if not self._state.upstream_stream:
            yield await self._resp.aread()
        else:
            async for sse in httpx2.EventSource(self._resp):
                yield sse.data

    async def __aiter__(self) -> AsyncIterator[Delta]:
        st = self._state
        try:
            with upstream_errors(st.stage):
                async with aclosing(self._raw()) as raws:
                    async for raw in raws:
                        if st.ended:  # the server's [DONE] came: read its body to the close
                            if st.read_on_after_end():
                                continue
                            break
                        for delta in st.feed(raw):
                            yield delta
                        if st.ended and not st.read_on_after_end():
                            break
            for delta in st.end():
                yield delta
        finally:
            await self.aclose()
        self.results = st.completions()
        self.result = self.results[0]
