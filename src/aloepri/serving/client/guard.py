"""Is a reply from the model the key belongs to? What a server's ``/v1/models`` listing says (fingerprint, context
length, identity), and :class:`UpstreamGuard`, which lets a reply be decoded only when it is the key's model's."""
from __future__ import annotations

import json
import re
import weakref
from pathlib import Path
from typing import Any

from ...keyfile import KeyFile, check_fingerprint
from .errors import UpstreamModelMismatch

FINGERPRINT_HEADER = "x-aloepri-model-fingerprint"  # aloepri serve-local stamps every answer with it (public)
# llama.cpp's llama-server publishes no GGUF metadata but the chat template (in /props): the template of a GGUF
# written by `aloepri export-gguf` is a Jinja comment naming the fingerprint (aloepri.export.gguf.FINGERPRINT_TEMPLATE)
_TEMPLATE_FINGERPRINT = re.compile(r"aloepri model_fingerprint=([0-9a-f]{16,128})\b")


def listing_of(status: int, body: bytes) -> Any:
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


def fingerprint_in_props(props: Any) -> str | None:
    """The model fingerprint in llama.cpp's ``/props`` answer (its ``chat_template``, see
    :data:`aloepri.export.gguf.FINGERPRINT_TEMPLATE`), if any."""
    template = props.get("chat_template") if isinstance(props, dict) else None
    found = _TEMPLATE_FINGERPRINT.search(template) if isinstance(template, str) else None
    return found.group(1) if found else None


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
    (vLLM, aloepri serve-local), or llama.cpp's ``meta``: the context of one of its slots (``n_ctx``: what one
    request may fill), at most the model's (``n_ctx_train``); None if it gives none."""
    entries = listing_entries(listing) or []
    chosen = [m for m in entries if m.get("id") == model] or entries[:1]

    def positive(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    for m in chosen:
        if positive(m.get("max_model_len")):
            return m["max_model_len"]
        meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
        sizes = [v for v in (positive(meta.get("n_ctx")), positive(meta.get("n_ctx_train"))) if v]
        if sizes:
            return min(sizes)
    return None


class UpstreamGuard:
    """Lets a reply be decoded only if it comes from the model the key belongs to; raises
    :class:`UpstreamModelMismatch` otherwise. Sans-IO: :class:`~.exchange.ReplyState` calls :meth:`admit` with
    each reply's headers and connection before the body is read and, when it returns False, has the client fetch
    /v1/models and passes that to :meth:`judge_listing` (still before the body is read).

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
