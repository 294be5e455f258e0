"""One request and its reply, sans-IO, and what the sync and async clients share.

:class:`ClientCore` holds the key, tokenizer, backend and guard, turns prompts into plaintext ids, and starts a
:class:`ReplyState` per request. The :class:`ReplyState` decides everything about the answer: its status, whether
it comes from the key's model (:class:`~.guard.UpstreamGuard`), and its body or events, decoded into plaintext.
:class:`ClientBase` gives both clients the same ``chat`` / ``stream_chat`` / ``complete`` / ``stream_complete``;
the clients themselves (:mod:`.sync`, :mod:`.aio`) only move bytes.
"""
from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from ...keyfile import KeyFile, KeyFileError, check_fingerprint, load_key
from ...runtime.tokenizer import load_tokenizer
from .decode import Completion, Delta, ReplyDecoder
from .prompt import PromptEncoder
from .errors import UpstreamProtocolError, http_error
from .guard import UpstreamGuard, fingerprint_in_listing
from .wire import Backend, Call, GenerationParams, Piece, event_json, make_backend, normalize_base_url

DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_TOKENS = 512


class ClientCore:
    """The key, plaintext tokenizer, backend and guard of a client, and request preparation."""

    def __init__(self, key: KeyFile | str | Path, base_url: str, model: str | None = None, tokenizer: Any = None,
                 api_key: str | None = None, timeout: float | Any = DEFAULT_TIMEOUT,
                 backend: str | Backend = "openai-completions", server_tokenizer: Any = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS):
        self.base_url = normalize_base_url(base_url)  # first: a bad URL fails before the key and tokenizer load
        self.key = key if isinstance(key, KeyFile) else load_key(key)
        self.tokenizer = load_tokenizer(self.key, tokenizer)
        check_key_covers_tokenizer(self.key, self.tokenizer)
        self.prompts = PromptEncoder(self.tokenizer) if self.tokenizer is not None else None
        self.model = model
        self.backend = make_backend(backend, server_tokenizer, self.key.vocab_size)
        self.default_max_tokens = default_max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.guard = UpstreamGuard(self.key.model_fingerprint, model, mode="stamp")

    def http_timeout(self):
        import httpx2

        if isinstance(self.timeout, (int, float)):
            return httpx2.Timeout(float(self.timeout), connect=min(10.0, float(self.timeout)))
        return self.timeout

    # -- prompts
    def chat_prompt_ids(self, messages: Sequence[dict[str, Any]] | str, tools: list[dict] | None = None,
                        special_tokens: bool = False) -> list[int]:
        """The chat template rendered (with ``tools``, if given, for the template to describe) and tokenized. The
        strings of ``messages`` and ``tools`` are text: control tokens come from the template only, unless
        ``special_tokens`` (see :mod:`.prompt`)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if self.prompts is None:
            raise ValueError("chat needs a tokenizer: the key names none for this model; pass tokenizer=...")
        return self.prompts.chat_ids(messages, tools, special_tokens)

    def completion_prompt_ids(self, prompt: str | Sequence[int], special_tokens: bool = False) -> list[int]:
        """A text prompt tokenized (text: no control tokens unless ``special_tokens``), or token ids checked."""
        if isinstance(prompt, str):
            if self.prompts is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer=... or give the prompt as token ids")
            return self.prompts.text_ids(prompt, special_tokens)
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < self.key.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.key.vocab_size})")
        return ids

    def start(self, plain_ids: list[int], params: GenerationParams, stream: bool,
              default_max: int | None) -> ReplyState:
        """The request for ``plain_ids`` and the state that will read its answer. ``stream``: the caller wants
        deltas; with stop strings the server streams anyway (they are checked here, and the reply is ended as
        soon as one matches)."""
        if not plain_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (they are matched on the decoded text)")
        for feature, asked in (("n", params.n != 1), ("logprobs", params.logprobs is not None)):
            if asked and feature not in self.backend.features:
                raise ValueError(f"'{feature}' is not supported with the {self.backend.name} backend (only with "
                                 "openai-completions, e.g. vLLM or aloepri serve-local)")
        upstream_stream = stream or bool(params.stop)
        max_tokens = params.max_tokens if params.max_tokens is not None else default_max
        server_ids = self.key.encode_ids(plain_ids)
        call = self.backend.start(server_ids, params, max_tokens, upstream_stream, self.model, self.key)
        decoders = [ReplyDecoder(self.key, self.tokenizer, params.stop, max_tokens, index=i) for i in range(params.n)]
        return ReplyState(plain_ids, server_ids, call, decoders, upstream_stream, self.guard, self.base_url,
                          self.headers)

    def verify_listing(self, listing: Any) -> bool:
        """Check the key against the fingerprint in a /v1/models answer and pin the listing in the guard. True:
        verified; False: the server publishes no fingerprint; raises KeyMismatchError."""
        fingerprint = fingerprint_in_listing(listing, self.model)
        if fingerprint is not None:
            check_fingerprint(self.key, fingerprint, f"the model {self.base_url} serves")
        self.guard.arm(listing)
        return fingerprint is not None


def check_key_covers_tokenizer(key: KeyFile, tokenizer: Any) -> None:
    """A key whose permutation is shorter than the tokenizer's vocabulary (or than its own EOS id) is damaged: every
    prompt would fail on an id it cannot map. Refused here, at start, in one line."""
    eos = key.special_tokens.get("eos_token_id")
    for i in (eos if isinstance(eos, list) else [eos]):
        if isinstance(i, int) and not 0 <= i < key.vocab_size:
            raise KeyFileError(f"the key is damaged: its permutation covers {key.vocab_size} token ids, but its EOS "
                               f"id is {i}; use the key written by `aloepri obfuscate`")
    size = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if size is not None and size > key.vocab_size:
        raise KeyFileError(f"the key is damaged or belongs to another model: its permutation covers {key.vocab_size} "
                           f"token ids, the tokenizer has {size}; use the key written by `aloepri obfuscate` for "
                           "this model")


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
    """One request and its reply, sans-IO. A client drives it in four steps and decides nothing itself:

    1. send ``method`` to ``url`` with ``body`` (JSON) and ``headers``;
    2. hand the answer's status, headers and connection to :meth:`on_head` and do what it returns, before reading
       the body: ``READ`` read on; ``READ_ERROR`` read the body into :meth:`on_error_body` (which raises the
       :class:`~.errors.UpstreamHTTPError`); ``CHECK_LISTING`` fetch /v1/models and hand it (None when the server
       has none) to :meth:`on_listing`, which raises :class:`~.errors.UpstreamModelMismatch` unless the reply is
       from the key's model;
    3. hand the whole body, or each server-sent event's data, to :meth:`feed` while :meth:`reads_on`, and hand out
       the plaintext :class:`Delta` it returns (``index`` tells the choice when ``n`` > 1); then :meth:`end`;
    4. :attr:`results`: one :class:`Completion` per choice.
    """

    READ, READ_ERROR, CHECK_LISTING = "read", "read-error", "check-listing"

    def __init__(self, plain: list[int], server_ids: list[int], call: Call, decoders: Sequence[ReplyDecoder],
                 upstream_stream: bool, guard: UpstreamGuard, base_url: str, headers: dict[str, str]):
        self.plain, self.server_ids, self.call = plain, server_ids, call
        self.decoders = list(decoders)
        self.upstream_stream = upstream_stream  # the server streams (events) rather than answering in one body
        self.guard, self.base_url, self.headers = guard, base_url, headers
        self.usage: dict[str, Any] = {}
        self.ended = False  # no more events are needed
        self.results: list[Completion] = []  # once the answer is over
        self._error_status: int | None = None
        self._connection: Any = None
        self._read_after_end = 0
        self.t0 = time.perf_counter()

    @property
    def method(self) -> str:
        return self.call.method

    @property
    def url(self) -> str:
        return self.base_url + self.call.path

    @property
    def body(self) -> dict[str, Any]:
        return self.call.body

    # -- 2. the answer's head: its status and whose model it comes from
    def on_head(self, status: int, headers: Any, connection: Any = None) -> str:
        """What the client must do before the body is read: ``READ``, ``READ_ERROR`` or ``CHECK_LISTING``."""
        if status != 200:
            self._error_status = status
            return self.READ_ERROR
        self._connection = connection
        return self.READ if self.guard.admit(headers, connection) else self.CHECK_LISTING

    def on_error_body(self, body: bytes) -> NoReturn:
        raise http_error(self._error_status, body)

    def on_listing(self, listing: Any) -> None:
        self.guard.judge_listing(listing, self._connection)

    # -- 3. the body, or its events
    @property
    def stage(self) -> str:
        """What reading the answer is, for :func:`~.errors.upstream_errors`."""
        return "stream" if self.upstream_stream else "read"

    def feed(self, raw: Any) -> list[Delta]:
        """One unit of the answer (the whole body, or one event's data) -> the deltas to hand out. What comes
        after the end (read only to leave the connection reusable) is ignored."""
        if self.ended:
            return []
        return self._on_event(raw) if self.upstream_stream else self._on_body(raw)

    def reads_on(self) -> bool:
        """Whether to read on. After the end, the client reads on to the close of the body (a few events at most)
        unless the reply was cut by a stop string: the server stops by itself on EOS and max_tokens, and a body
        read to its end leaves the connection reusable, so the next reply on it need not be re-checked
        (:class:`~.guard.UpstreamGuard`). A stop string is the client's own: closing the connection then is what
        stops the server generating."""
        if not self.ended:
            return True
        self._read_after_end += 1
        return not any(d.cut_by_stop_string for d in self.decoders) and self._read_after_end <= 4

    def end(self) -> list[Delta]:
        """The answer is over: what the parser and the decoders still held back; :attr:`results` is set."""
        out = self._on_stream_end() if self.upstream_stream else []
        self.results = self.completions()
        return out

    def _decoder_of(self, piece: Piece) -> ReplyDecoder:
        if not 0 <= piece.index < len(self.decoders):
            raise UpstreamProtocolError(f"the server answered choice {piece.index}; {len(self.decoders)} were "
                                        "asked for")
        return self.decoders[piece.index]

    def _on_body(self, body: bytes) -> list[Delta]:
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

    def _on_event(self, data: str) -> list[Delta]:
        if data.strip() == "[DONE]":
            self.ended = True
            return []
        out = []
        for piece in self.call.parse_events(event_json(data)):
            if not piece.ids and piece.finish_reason is None and piece.logprobs is None:
                if piece.usage:
                    self.usage.update({k: v for k, v in piece.usage.items() if isinstance(v, int)})
                continue
            delta = _finish_piece(self._decoder_of(piece), piece, self.usage)
            if delta.token_ids or delta.text or delta.finish_reason or delta.logprobs:
                out.append(delta)
        self.ended = all(d.done for d in self.decoders)
        return out

    def _on_stream_end(self) -> list[Delta]:
        out = []
        for dec in self.decoders:
            if dec.done:
                continue
            delta = _finish_piece(dec, self.call.flush(), self.usage)
            last = dec.finish(None)
            out.append(Delta(_cat(delta.text, last.text), delta.token_ids, last.finish_reason, dec.index,
                             _cat_lists(delta.logprobs, last.logprobs)))
        return out

    # -- 4. the finished reply
    def completions(self) -> list[Completion]:
        """One :class:`Completion` per choice; ``usage`` counts them all."""
        usage = _usage(self.plain, self.decoders)
        return [Completion(dec.text, dec.plain_ids, dec.finish_reason or "stop", self.plain, self.server_ids,
                           dec.server_ids, usage, time.perf_counter() - self.t0, dec.index, dec.logprobs)
                for dec in self.decoders]

    def outcome(self) -> Completion | list[Completion]:
        """What ``chat`` and ``complete`` return: the completion, or with ``n`` > 1 one per choice."""
        return self.results if len(self.decoders) > 1 else self.results[0]


class ReplyStreamBase:
    """What the sync and async reply streams show of their :class:`ReplyState`."""

    def __init__(self, state: ReplyState):
        self._state = state
        self._resp: Any = None

    @property
    def result(self) -> Completion | None:
        """The first choice, once the stream is exhausted."""
        return self._state.results[0] if self._state.results else None

    @property
    def results(self) -> list[Completion]:
        """Every choice (``n`` > 1), once the stream is exhausted."""
        return self._state.results

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._state.plain

    @property
    def server_prompt_ids(self) -> list[int]:
        return self._state.server_ids


class ClientBase:
    """The API of both clients (:class:`~.sync.Client`, and :class:`~.aio.AsyncClient` whose methods are
    coroutines with the same arguments and results):

    ``chat(messages, **params)``, ``complete(prompt, **params)``
        the finished :class:`Completion` (with ``n`` > 1 a list, one per choice);
    ``stream_chat(messages, **params)``, ``stream_complete(prompt, **params)``
        connect (errors surface here) and return the reply stream of :class:`Delta`; once exhausted its
        ``result`` / ``results`` hold the completions. Use it as a context manager, or iterate it to the end.

    ``messages``: a list of ``{"role", "content"}`` or one user message as a string; ``prompt``: text or plaintext
    token ids. ``params``: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
    ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias`` (plaintext id -> bias),
    ``n``, ``logprobs``. Text is text: a control token's string in it (``<|im_end|>``) is tokenized as text, never
    as the control token; ``special_tokens=True`` lets the caller's text hold control tokens.

    ``tokenizer``: the plaintext tokenizer (object, directory or .gguf; default: the one the key names). Any object
    with ``apply_chat_template``, ``encode`` and ``decode`` like Hugging Face's works.
    ``backend``: ``openai-completions`` (default), ``llamacpp-native`` or ``openai-text`` (then ``server_tokenizer``
    is the server's neutral tokenizer or a :class:`~.wire.TextCodec`).
    """

    core: ClientCore  # set by the client's __init__

    key = property(lambda self: self.core.key)
    tokenizer = property(lambda self: self.core.tokenizer)
    backend = property(lambda self: self.core.backend)
    guard = property(lambda self: self.core.guard)  # UpstreamGuard: is each reply from the key's model?

    def chat(self, messages: Sequence[dict[str, Any]] | str, *, special_tokens: bool = False, **params: Any):
        return self._reply(partial(self.core.chat_prompt_ids, special_tokens=special_tokens), messages, params,
                           stream=False)

    def stream_chat(self, messages: Sequence[dict[str, Any]] | str, *, special_tokens: bool = False, **params: Any):
        return self._reply(partial(self.core.chat_prompt_ids, special_tokens=special_tokens), messages, params,
                           stream=True)

    def complete(self, prompt: str | Sequence[int], *, special_tokens: bool = False, **params: Any):
        return self._reply(partial(self.core.completion_prompt_ids, special_tokens=special_tokens), prompt, params,
                           stream=False)

    def stream_complete(self, prompt: str | Sequence[int], *, special_tokens: bool = False, **params: Any):
        return self._reply(partial(self.core.completion_prompt_ids, special_tokens=special_tokens), prompt, params,
                           stream=True)

    def _reply(self, prompt_ids: Callable[[Any], list[int]], prompt: Any, params: dict[str, Any], stream: bool):
        """``prompt_ids(prompt)`` sent with ``generation_params(**params)``: the stream, or (not ``stream``) the
        finished reply (:meth:`ReplyState.outcome`)."""
        raise NotImplementedError
