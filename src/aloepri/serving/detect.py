"""Which wire protocol does an upstream speak? Probed once, when the proxy starts (``--backend auto``).

1. ``GET /props`` answers as llama.cpp's ``llama-server`` does (``default_generation_settings``, ``build_info``):
   ``llamacpp-native`` (its ``/completion`` takes token-id prompts and returns the ids).
2. ``POST /v1/completions`` with a one-token id prompt, ``max_tokens: 1`` and ``return_token_ids``: an answer
   that carries ``choices[0].token_ids`` is ``openai-completions`` (vLLM, SGLang, ``aloepri serve-local``).
3. The same with the id written as text of the server's neutral tokenizer: an answer whose text is again neutral
   tokenizer text is ``openai-text`` (a text-only OpenAI server holding the obfuscated model, e.g.
   llama-cpp-python's). A plaintext model answers in words, which is refused here rather than decoded into garbage.

Anything else is :class:`NoBackend` (one line at start, exit 2). The probes send one permuted token id (the
obfuscated end-of-text token), nothing of the user's, and ask for at most one token back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

class NoBackend(ValueError):
    """The upstream speaks none of the protocols the proxy knows."""


@dataclass
class Detected:
    backend: str
    reason: str
    props: dict[str, Any] | None = None  # llama.cpp's /props, when it has one
    tried: list[str] = field(default_factory=list)


def llamacpp_props(status: int, body: bytes) -> dict | None:
    """llama.cpp's ``/props`` answer as a dict, or None when the answer is not one."""
    from .client.guard import listing_of  # the JSON of a 200 answer, else None

    props = listing_of(status, body)
    if isinstance(props, dict) and ("default_generation_settings" in props or "build_info" in props):
        return props
    return None


def _first_choice(status: int, body: bytes) -> dict | None:
    from .client.guard import listing_of

    data = listing_of(status, body)
    choices = data.get("choices") if isinstance(data, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def detect_backend(http: Any, base: str, headers: dict, probe_id: int, model: str | None, codec: Any) -> Detected:
    """Probe ``base`` (an httpx client ``http``; ``codec``: the text path's server tokenizer) and choose."""
    from .client import upstream_errors

    tried = []
    with upstream_errors("connect", base):
        r = http.get(base + "/props", headers=headers)
    props = llamacpp_props(r.status_code, r.content)
    if props is not None:
        return Detected("llamacpp-native", "it answers /props as llama.cpp's llama-server does", props)
    tried.append(f"GET /props: {r.status_code} (not llama.cpp's)")

    def probe(prompt: Any, **extra: Any):
        """One-token /v1/completions: (status, choices[0] or None)."""
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra, **({"model": model} if model else {})}
        with upstream_errors("connect", base):
            r = http.post(base + "/v1/completions", json=body, headers=headers)
        return r.status_code, _first_choice(r.status_code, r.content)

    status, choice = probe([probe_id], return_token_ids=True)
    ids = choice.get("token_ids") if choice else None
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return Detected("openai-completions", "its /v1/completions takes token-id prompts and returns token_ids",
                        tried=tried)
    tried.append(f"POST /v1/completions with token ids: {status}" + (", no token_ids in the answer" if choice else ""))

    status, choice = probe(codec.ids_to_text([probe_id]))
    text = choice.get("text") if choice else None
    if isinstance(text, str):
        try:
            codec.text_to_ids(text)
        except ValueError:
            tried.append("POST /v1/completions with text: it answers in text that is not its neutral tokenizer's "
                         "(a plaintext model?)")
        else:
            return Detected("openai-text", "its /v1/completions takes text only, and answers in the neutral "
                                           "tokenizer's text", tried=tried)
    else:
        tried.append(f"POST /v1/completions with text: {status}")
    raise NoBackend(f"the upstream {base} speaks none of the proxy's protocols ({'; '.join(tried)}): point "
                    "--upstream at vLLM, llama.cpp's llama-server, aloepri serve-local or an OpenAI-compatible server "
                    "holding the obfuscated model, or give --backend")
