"""What travels to the server and how its answers are read, sans-IO: the generation parameters, the three wire
protocols (one :class:`Backend` each: request body out, parsed :class:`Piece` in), the text-mode codecs, and the
server's base URL.

``openai-completions``
    ``POST /v1/completions`` with ``prompt: [ids]`` and ``return_token_ids: true``; the ids come back in
    ``choices[0].token_ids`` (vLLM's field; ``aloepri serve-local`` speaks it too).
``llamacpp-native``
    llama.cpp's own ``POST /completion`` with ``prompt: [ids]`` and ``return_tokens: true``; the ids come back in
    ``tokens`` (the C++ ``llama-server``), ``n`` choices as a list of answers (or events) with their ``index``,
    and logprobs (``n_probs``) in ``completion_probabilities``, each labelled by token ``id``.
``openai-text``
    the paper's text path: ``POST /v1/completions`` with the permuted ids rendered as *text* by the server's
    neutral tokenizer (a :class:`TextCodec`); the server re-tokenizes, and its text reply is tokenized back
    into ids here. Needed for servers whose OpenAI endpoint takes no int prompts (llama-cpp-python's server).

Sampling parameters that do not depend on which token is which (temperature, top-k, top-p, min-p, seed,
penalties) pass through unchanged; ``logit_bias`` keys are plaintext ids and are mapped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

from ...keyfile import KeyFile
from ...runtime.tokenizer import load_hf_tokenizer
from .errors import UpstreamHTTPError, UpstreamProtocolError


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


def generation_params(max_tokens=None, temperature=None, top_p=None, top_k=None, min_p=None, seed=None, stop=None,
                      presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
                      logit_bias=None, n=1, logprobs=None) -> GenerationParams:
    """The keyword arguments of the clients' ``chat`` / ``complete``, checked, as :class:`GenerationParams`."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, not {n!r}")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise ValueError(f"logprobs must be a number of top tokens >= 0 (or None), not {logprobs!r}")
    return GenerationParams(max_tokens, temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty,
                            repetition_penalty, {int(k): float(v) for k, v in (logit_bias or {}).items()} or None,
                            list(stop or []), n, logprobs)


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
        from ...obfuscation import server_tokenizer

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

    def __init__(self, path, body, top: int | None = None):
        super().__init__(path, body)
        self.top = top  # logprobs asked for: this many top entries per token (None: no logprobs)

    @staticmethod
    def _index(data: dict) -> int:
        index = data.get("index", 0)
        Call._require(isinstance(index, int) and not isinstance(index, bool) and index >= 0, "'index'")
        return index

    def _logprobs(self, data: dict, ids: list[int]) -> list[ServerLogprob] | None:
        """llama.cpp's ``completion_probabilities`` (one entry per token, each labelled by ``id``)."""
        if self.top is None or not ids:
            return None
        probs = data.get("completion_probabilities")
        self._require(isinstance(probs, list) and len(probs) == len(ids),
                      "completion_probabilities does not have one entry per token (does it support n_probs?)")
        out = []
        for entry, sid in zip(probs, ids):
            self._require(isinstance(entry, dict) and entry.get("id") == sid and _number(entry.get("logprob")),
                          "a completion_probabilities entry does not name its token id and logprob")
            top = entry.get("top_logprobs") or []
            self._require(isinstance(top, list) and all(isinstance(t, dict) and _token_id(t.get("id"))
                                                          and _number(t.get("logprob")) for t in top),
                          "completion_probabilities[].top_logprobs")
            out.append((float(entry["logprob"]), [(t["id"], float(t["logprob"])) for t in top[:self.top]]))
        return out

    def _piece(self, data: Any, final: bool) -> Piece:
        self._require(isinstance(data, dict), "not a JSON object")
        ids = data.get("tokens")
        if ids is None:
            if final:
                raise UpstreamProtocolError("the server returned no 'tokens': is it llama.cpp's server "
                                            "(return_tokens)?")
            if data.get("content"):
                raise UpstreamProtocolError("the server streamed text without 'tokens'")
            ids = []
        ids = _ids(ids, "tokens")
        finish = self._finish(data)
        return Piece(ids, (finish or "stop") if final else finish, self._usage(data), self._index(data),
                     self._logprobs(data, ids))

    def parse_response(self, data):
        return self._piece(data, final=True)

    def parse_event(self, data):
        return self._piece(data, final=False)

    def parse_response_all(self, data):
        """One answer, or (``n`` > 1) a list of them, one per choice."""
        if isinstance(data, list):
            self._require(bool(data), "an empty list of answers")
            return [self._piece(d, final=True) for d in data]
        return [self._piece(data, final=True)]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class LlamaCppNativeBackend(Backend):
    """llama.cpp's native ``/completion``: ``prompt`` as ids, ``return_tokens`` for the ids back; ``n`` choices
    (llama-server's ``n_cmpl``, alias ``n``) and logprobs (``n_probs``: logprobs of the whole distribution, before
    sampling, as vLLM gives them), both labelled by token id."""

    name = "llamacpp-native"
    ends_with_done = False
    features = frozenset({"n", "logprobs"})

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
        if params.n != 1:
            body["n"] = params.n
        if params.logprobs is not None:  # llama.cpp gives the sampled token's logprob only along with the top ones
            body["n_probs"] = max(params.logprobs, 1)
        return _LlamaCppCall("/completion", body, params.logprobs)


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


def event_json(data: str) -> Any:
    """One server-sent event's JSON; an error event mid-stream raises :class:`UpstreamHTTPError`."""
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise UpstreamProtocolError("the server streamed an event that is not JSON") from e
    if isinstance(obj, dict) and "error" in obj and "choices" not in obj and "tokens" not in obj:
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise UpstreamHTTPError(f"the inference server reported an error mid-stream: {msg}", 500)
    return obj


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
