"""Client SDK: talk to an obfuscated model on any OpenAI-compatible engine, with the secret key kept here.

The server only ever sees permuted token ids. The client

1. renders the chat template and tokenizes with the *plaintext* tokenizer,
2. maps the ids through the key's permutation and sends them (``prompt`` as a list of ints),
3. maps the ids that come back through the inverse permutation and detokenizes them,
4. stops on the permuted EOS and on stop strings, which it checks on the decoded plaintext itself: stop strings
   are never sent to the server (they would be plaintext),

and decodes a reply only if it comes from the model the key belongs to.

Modules, each building on the ones before it (only :mod:`.sync` and :mod:`.aio` do I/O, and import httpx only
when a client is made; nothing here imports torch):

``errors``    :class:`UpstreamError` and its kinds; the one httpx -> UpstreamError mapping (:func:`upstream_errors`)
``wire``      the generation parameters, the wire protocols (:class:`Backend`), text-mode codecs, the base URL
``decode``    server ids -> plaintext :class:`Delta` / :class:`Completion` (:class:`ReplyDecoder`)
``guard``     /v1/models listings and :class:`UpstreamGuard` (is the reply from the key's model?)
``exchange``  :class:`ReplyState` (one request and its reply: status, guard, body; sans-IO), the shared core and API
``sync``      :class:`Client`, :class:`ReplyStream`, :func:`fetch_models`
``aio``       :class:`AsyncClient`, :class:`AsyncReplyStream`
"""
from ...keyfile import KeyMismatchError
from .aio import AsyncClient, AsyncReplyStream
from .decode import Completion, Delta, IncrementalDetokenizer, ReplyDecoder, TokenLogprob
from .errors import (UpstreamError, UpstreamHTTPError, UpstreamModelMismatch, UpstreamProtocolError, UpstreamTimeout,
                     UpstreamUnreachable, upstream_errors)
from .exchange import DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, ClientCore, ReplyState
from .guard import (FINGERPRINT_HEADER, UpstreamGuard, check_model_meta, context_in_listing, fingerprint_in_listing,
                    listing_entries, listing_identity)
from .sync import Client, ReplyStream, fetch_models
from .wire import (BACKENDS, Backend, Call, GenerationParams, LlamaCppNativeBackend, NeutralCodec,
                   OpenAICompletionsBackend, OpenAITextBackend, Piece, TextCodec, TokenizerCodec, generation_params,
                   make_backend, normalize_base_url)

__all__ = [
    "AsyncClient", "AsyncReplyStream", "BACKENDS", "Backend", "Call", "Client", "ClientCore", "Completion",
    "DEFAULT_MAX_TOKENS", "DEFAULT_TIMEOUT", "Delta", "FINGERPRINT_HEADER", "GenerationParams",
    "IncrementalDetokenizer", "KeyMismatchError", "LlamaCppNativeBackend", "NeutralCodec", "OpenAICompletionsBackend",
    "OpenAITextBackend", "Piece", "ReplyDecoder", "ReplyState", "ReplyStream", "TextCodec", "TokenLogprob",
    "TokenizerCodec", "UpstreamError", "UpstreamGuard", "UpstreamHTTPError", "UpstreamModelMismatch",
    "UpstreamProtocolError", "UpstreamTimeout", "UpstreamUnreachable", "check_model_meta", "context_in_listing",
    "fetch_models", "fingerprint_in_listing", "generation_params", "listing_entries", "listing_identity",
    "make_backend", "normalize_base_url", "upstream_errors",
]
