"""Proxy faults on tiny random models, real servers on loopback:

* the upstream restarted on the same port with another obfuscated model: refused before decoding (stamped
  replies, a listed fingerprint, or only the listing's metadata), /health says so, recovery when it is back;
* a client leaving a non-streaming request stops the upstream's generation;
* max_tokens capped at the model's context (or --max-tokens-limit), bad values 400;
* malformed bodies through both endpoints (and serve-local): always 4xx with an OpenAI-shaped error;
* ``aloepri proxy --upstream not-a-url``: one line, exit 2, nothing started.
"""
import json
import random
import subprocess
import sys
import time

import httpx2
import pytest
import torch

import aloepri
from aloepri.serving.client import FINGERPRINT_HEADER, Client, UpstreamModelMismatch
from aloepri.runtime.inference import load_plain_model
from aloepri.serving.proxy import build_proxy
from aloepri.serving.local_server import LocalServer, ServerThread
from aloepri.testing.engines import free_port
from serving_helpers import CharTokenizer, Recorder, greedy

PROMPT = [5, 17, 33, 40, 8, 61]
JSON = {"content-type": "application/json"}  # raw bodies say what they are (415 otherwise)
CONTEXT = 128  # aloepri.testing.tiny.TINY_COMMON max_position_embeddings


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """One tiny source obfuscated twice: two server directories with different keys (same shape, same name
    length, so only the fingerprint or the served name tells them apart)."""
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("proxy-faults")
    for name in ("model-a", "model-b"):  # fresh secrets each: two keys, two fingerprints
        aloepri.obfuscate(src, work / name, work / f"{name}.key", aloepri.resolve_params("exact"), progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"src": src, "a": work / "model-a", "b": work / "model-b", "key_a": aloepri.load_key(work / "model-a.key"),
           "key_a_path": work / "model-a.key"}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain(models):
    return load_plain_model(models["src"], dtype=torch.float64)


def _with_headers(app, rewrite):
    """``app`` with every HTTP answer's headers passed through ``rewrite(headers) -> headers``."""
    async def wrapped(scope, receive, send):
        async def tx(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": rewrite(msg["headers"])}
            await send(msg)

        await app(scope, receive, tx if scope["type"] == "http" else send)

    return wrapped


STAMP = FINGERPRINT_HEADER.encode()


def _unstamped(app):
    """An engine that lists the fingerprint in /v1/models but does not stamp its replies."""
    return _with_headers(app, lambda headers: [(k, v) for k, v in headers if k.lower() != STAMP])


class Upstream:
    """serve-local on one loopback port, restartable with another model directory (a real stop and start:
    the old server's connections die, the new one binds the same port)."""

    def __init__(self, variant: str):
        self.variant, self.port, self.thread, self.server = variant, 0, None, None

    def start(self, model_dir, slow: float = 0.0) -> "Upstream":
        server = LocalServer(model_dir)
        if self.variant == "metadata":  # like vLLM / llama.cpp: no fingerprint anywhere, only the listing
            server.meta = {}
        if slow:
            step, server.steps = server.engine._step, 0

            def slow_step(s):
                server.steps += 1
                time.sleep(slow)
                return step(s)

            server.engine._step = slow_step
        app = server.app()
        if self.variant == "listing":
            app = _unstamped(app)
        self.server, self.recorder = server, Recorder(app)
        self.thread = ServerThread(self.recorder, port=self.port, log_level="critical").start()
        self.port, self.url = self.thread.port, self.thread.url
        return self

    def stop(self) -> None:
        self.thread.stop()

    def __enter__(self) -> "Upstream":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def completion_requests(self) -> list[dict]:
        return [json.loads(e["request"]) for e in self.recorder.exchanges if e["path"] == "/v1/completions"]


def _chat(url, stream=False, **kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "stream": stream, **kw}
    return httpx2.post(url + "/v1/chat/completions", json=body, timeout=30)


def _complete(url, stream=False, **kw):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream,
            "return_token_ids": True, **kw}
    return httpx2.post(url + "/v1/completions", json=body, timeout=30)


def _is_openai_error(r, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500 if status is None else r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


# ------------------------------------------------------------------------- upstream swapped under the proxy


@pytest.mark.parametrize("variant", ["stamp", "listing", "metadata"])
def test_upstream_restarted_with_another_model_is_refused(models, plain, variant):
    """Start with model A, restart the upstream on the same port with model B: every request (chat and
    completions, streamed or not) is refused with upstream_model_mismatch instead of a decoded 200, /health
    says mismatch; back to model A, the proxy answers correctly again.

    stamp: serve-local as shipped (every reply carries the fingerprint); listing: no stamp, the fingerprint is
    re-read from /v1/models on the new connection; metadata: no fingerprint anywhere (as vLLM), the listing's
    model id differs."""
    with Upstream(variant).start(models["a"]) as up:
        want = greedy(plain, PROMPT, 8, 2)
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        good_status = "unchecked" if variant == "metadata" else "verified-upstream"
        assert proxy.fingerprint_status == good_status
        with ServerThread(proxy.app()) as url:
            r = _complete(url)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
            assert _chat(url).status_code == 200

            up.stop()
            up.start(models["b"])
            for send in (_complete, _chat):
                for stream in (False, True):
                    r = send(url, stream=stream)
                    err = _is_openai_error(r, 502)
                    assert err["code"] == "upstream_model_mismatch", (send.__name__, stream, r.text)
                    assert ("another model" in err["message"] or "changed" in err["message"]) and \
                        "not decoded" in err["message"]
            assert up.completion_requests(), "model B was asked (the refusal is the proxy's, after the reply came)"
            h = httpx2.get(url + "/health")
            assert h.status_code == 503 and h.json()["key_check"] == "mismatch" and h.json()["detail"]

            up.stop()
            up.start(models["a"])
            r = _complete(url)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
            h = httpx2.get(url + "/health")
            assert h.status_code == 200 and h.json()["key_check"] == good_status
            assert proxy.in_flight == 0


def test_a_stamp_that_changes_on_a_kept_alive_connection_is_refused(models):
    """The stamp is judged on every reply, not once per connection: no window between check and decode."""
    server = LocalServer(models["a"])
    other = LocalServer(models["b"]).meta["model_fingerprint"]
    state = {"swap": False}
    lying = _with_headers(server.app(), lambda headers: [(k, other.encode() if k == STAMP and state["swap"] else v)
                                                         for k, v in headers])

    with ServerThread(lying, log_level="critical") as up:
        proxy = build_proxy(models["key_a"], up, tokenizer=CharTokenizer())
        with ServerThread(proxy.app()) as url:
            assert _complete(url).status_code == 200
            state["swap"] = True
            assert _is_openai_error(_complete(url), 502)["code"] == "upstream_model_mismatch"
            assert proxy.fingerprint_status == "mismatch"
        # the SDK refuses a stamped reply of another model too, without verify()
        with Client(models["key_a"], up) as c:
            with pytest.raises(UpstreamModelMismatch):
                c.complete(PROMPT, max_tokens=2)


def test_connection_checks_do_not_wait_for_the_connections_they_hold_back(models):
    """Unstamped replies on new connections, three times as many at once as the main pool has connections: each
    holds its connection while its /v1/models check runs, so the checks need a pool of their own (sharing the
    main one, all twelve waited for a free connection until the timeout)."""
    import asyncio

    from aloepri.serving.client import AsyncClient

    with Upstream("listing").start(models["a"]) as up:
        async def main():
            c = AsyncClient(models["key_a"], up.url, timeout=8, max_connections=4)
            try:
                c.guard.arm(await c.listing())
                return await asyncio.gather(*(c.complete(PROMPT, max_tokens=4, temperature=0) for _ in range(12)))
            finally:
                await c.aclose()

        replies = asyncio.run(main())
    assert len(replies) == 12 and len({tuple(r.token_ids) for r in replies}) == 1


# ------------------------------------------------------------------------------- client disconnects


@pytest.mark.parametrize("send", [_complete, _chat], ids=["completions", "chat"])
def test_client_leaving_a_non_streaming_request_stops_the_upstream(models, send):
    """The upstream generates one step per 20 ms; the client gives up after 0.4 s. The upstream must stop soon
    after (before: it generated on to max_tokens)."""
    with Upstream("stamp").start(models["a"], slow=0.02) as up:
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        with ServerThread(proxy.app()) as url:
            no_eos = {"logit_bias": {"2": -100}}  # plaintext EOS banned: the reply would run to max_tokens
            with pytest.raises(httpx2.ReadTimeout):
                httpx2.post(url + ("/v1/completions" if send is _complete else "/v1/chat/completions"),
                            json={"prompt": PROMPT, "messages": [{"role": "user", "content": "q"}],
                                  "max_tokens": 100, "temperature": 0, **no_eos}, timeout=0.4)
            last, deadline = -1, time.monotonic() + 10
            while up.server.steps != last and time.monotonic() < deadline:  # until the upstream stops
                last = up.server.steps
                time.sleep(0.3)
            time.sleep(1.0)
            assert up.server.steps == last, "the upstream is still generating"
            assert 0 < last < 60, last  # ~20 steps in the 0.4 s; left alone it runs to 100
            deadline = time.monotonic() + 5
            while proxy.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proxy.in_flight == 0


# ----------------------------------------------------------------------------------------- max_tokens


def test_max_tokens_capped_at_the_context_and_bad_values_rejected(models):
    with Upstream("stamp").start(models["a"]) as up:
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        assert proxy.context_len == CONTEXT  # from the upstream's /v1/models (max_model_len)
        with ServerThread(proxy.app()) as url:
            for raw in (b"1e9", b"1000000000", b"9223372036854775807"):
                body = b'{"prompt": %s, "max_tokens": %s, "temperature": 0}' % (json.dumps(PROMPT).encode(), raw)
                r = httpx2.post(url + "/v1/completions", content=body, headers=JSON, timeout=30)
                assert r.status_code == 200, r.text
                assert up.completion_requests()[-1]["max_tokens"] == CONTEXT - len(PROMPT)
            r = _chat(url, max_tokens=10**9)
            assert r.status_code == 200 and up.completion_requests()[-1]["max_tokens"] < CONTEXT
            for bad in (0, -1, 1.5, "10", True, [8], {"n": 1}):
                err = _is_openai_error(_complete(url, max_tokens=bad), 400)
                assert err["param"] == "max_tokens", (bad, err)
            for raw in (b"1e400", b"-1e400", b"NaN", b"Infinity", b"100000000000000000000"):  # last: > int64
                body = b'{"prompt": [5], "max_tokens": %s}' % raw
                _is_openai_error(httpx2.post(url + "/v1/completions", content=body, headers=JSON), 400)
            err = _is_openai_error(_complete(url, prompt=[5] * CONTEXT), 400)
            assert "context" in err["message"] and err["param"] == "prompt"

        limited = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer(), max_tokens_limit=5)
        with ServerThread(limited.app()) as url:
            assert _complete(url, max_tokens=10**9).status_code == 200
            assert up.completion_requests()[-1]["max_tokens"] == 5
            assert _complete(url, max_tokens=3).status_code == 200
            assert up.completion_requests()[-1]["max_tokens"] == 3


def test_context_falls_back_to_the_source_config(models):
    """An upstream that lists no context length (llama-cpp-python): the key's source config.json gives it."""
    with Upstream("metadata").start(models["a"]) as up:
        listing_app = up.recorder.app

        async def no_context(scope, receive, send):
            if scope["type"] == "http" and scope["path"] == "/v1/models":
                from starlette.responses import JSONResponse

                return await JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})(
                    scope, receive, send)
            await listing_app(scope, receive, send)

        up.recorder.app = no_context
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        assert proxy.context_len == CONTEXT


# ------------------------------------------------------------------------------------- malformed bodies


@pytest.fixture(scope="module")
def fuzz_stack(models):
    """A proxy with a real Hugging Face fast tokenizer (the tiny server directory's, with a one-line chat
    template): it raises TypeError on a lone surrogate, as SmolLM2's does, so nothing but validation stands
    between a malformed string and a 500."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models["a"]))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    up = Upstream("stamp").start(models["a"])
    proxy = build_proxy(models["key_a"], up.url, tokenizer=tok, max_tokens_limit=2)  # valid cases stay quick
    px = ServerThread(proxy.app()).start()
    yield {"proxy": px.url, "upstream": up.url, "tok": tok}
    px.stop()
    up.stop()


RAW_BAD_BODIES = [b"", b"{", b"null", b'"text"', b"[1, 2]", b"NaN", b"[" * 100_000, b"{" * 50_000,
                  b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}', b'{"prompt": "ok\\udfff"}',
                  b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
                  b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
                  b'{"prompt": [5], "stop": ["\\ud800"]}', b'{"prompt": [5], "temperature": NaN}',
                  b'{"prompt": [5], "top_p": -Infinity}', b'{"prompt": [5], "seed": 1e400}',
                  b'{"prompt": [5], "\\ud800": 1}']


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_raw_malformed_bodies_are_4xx_openai_errors(fuzz_stack, path):
    for raw in RAW_BAD_BODIES:
        r = httpx2.post(fuzz_stack["proxy"] + path, content=raw, headers={"content-type": "application/json"},
                        timeout=30)
        _is_openai_error(r, 400)


def test_surrogates_are_400_on_both_endpoints(fuzz_stack):
    """The reported case: a lone surrogate gave 500 on /v1/completions (and 400 on chat)."""
    with pytest.raises(TypeError):  # what the tokenizer does with it: the proxy must never get that far
        fuzz_stack["tok"].encode("a\ud800")
    for path, body in [("/v1/completions", {"prompt": "a\ud800b"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]})]:
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \\ud800, valid JSON
        err = _is_openai_error(httpx2.post(fuzz_stack["proxy"] + path, content=raw, headers=JSON), 400)
        assert "surrogate" in err["message"]


BAD_VALUES = ["x", "", -1, 0, 1.5, -1e300, 1e300, 10**30, -(10**30), True, False, [], [1], {}, {"a": 1}, "\ud800",
              "\x00"]
FIELDS = {"/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                              "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop",
                              "stream", "stream_options", "n", "best_of", "echo", "logprobs", "suffix",
                              "return_token_ids", "max_completion_tokens"],
          "/v1/chat/completions": ["messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "logit_bias",
                                   "stop", "stream", "stream_options", "n", "tools", "tool_choice", "logprobs",
                                   "top_logprobs", "response_format", "max_completion_tokens"]}
BASE = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 3, "temperature": 0},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "t5x"}], "max_tokens": 3,
                                 "temperature": 0}}


@pytest.mark.parametrize("path", list(FIELDS))
def test_fuzzed_fields_never_give_a_5xx(fuzz_stack, path):
    """Every field of a valid request set to wrong types, huge numbers, surrogates (one and two at a time,
    fixed seed): the answer is 200 or a 4xx with an OpenAI-shaped error, never a 5xx or a dropped
    connection. Messages are also mangled inside."""
    url = fuzz_stack["proxy"] + path
    assert httpx2.post(url, json=BASE[path], timeout=30).status_code == 200
    rng = random.Random(12)
    cases = [{f: v} for f in FIELDS[path] for v in BAD_VALUES]
    cases += [{f: rng.choice(BAD_VALUES) for f in rng.sample(FIELDS[path], 2)} for _ in range(40)]
    if path == "/v1/chat/completions":
        cases += [{"messages": [{"role": r, "content": c}]} for r in ("user", ["user"], {"r": 1}, None, 5)
                  for c in ("x", 5, None, [{"type": "text", "text": 5}], [{"type": "image_url"}], ["x"], {"a": 1})]
        cases += [{"messages": [5]}, {"messages": [[]]}, {"messages": [{"role": "tool", "content": "x"}]}]
    else:
        cases += [{"prompt": p} for p in ([10**30], [-1], [1.0], [[1, 2], [3]], [[]], [["x"]], [None], [True])]
    statuses = {}
    with httpx2.Client(timeout=30) as http:
        for case in cases:
            body = {**BASE[path], **case}
            r = http.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                _is_openai_error(r)
            elif body.get("stream") is not True:
                assert "choices" in r.json(), (case, r.text)
    assert statuses.get(400, 0) > len(cases) // 2, statuses  # most of the mutations are rejected


def test_serve_local_malformed_bodies_are_400(fuzz_stack):
    """The server side: NaN, huge seeds (torch overflowed: 500), malformed logit_bias, deep nesting."""
    url = fuzz_stack["upstream"]
    for path, raw in [("/v1/completions", b'{"prompt": [5], "seed": 100000000000000000000000}'),
                      ("/v1/completions", b'{"prompt": [5], "temperature": NaN}'),
                      ("/v1/completions", b'{"prompt": [5], "temperature": 1e400}'),
                      ("/v1/completions", b'{"prompt": [5], "logit_bias": {"5": 1e400}}'),
                      ("/completion", b'{"prompt": [5], "logit_bias": [5]}'),
                      ("/completion", b'{"prompt": [5], "n_predict": 1.5}'),
                      ("/v1/completions", b"[" * 100_000), ("/v1/completions", b'{"prompt": "\\ud800"}')]:
        r = httpx2.post(url + path, content=raw, headers=JSON, timeout=30)
        _is_openai_error(r, 400)


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize("url", ["not-a-url", "ftp://127.0.0.1:8000", "http://", "http://127.0.0.1:99999",
                                 "127.0.0.1:8000"])
def test_proxy_cli_refuses_a_bad_upstream_url_before_starting(models, capsys, monkeypatch, url):
    import uvicorn

    from aloepri.cli import main

    def started(*a, **k):
        raise AssertionError("the proxy started")

    monkeypatch.setattr(uvicorn, "run", started)
    rc = main(["proxy", "--key", str(models["key_a_path"]), "--upstream", url])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and url in err[0] and "http" in err[0], err


def test_proxy_cli_bad_url_in_a_real_process(models):
    proc = subprocess.run([sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(models["key_a_path"]),
                           "--upstream", "not-a-url", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60)  # a proxy that starts anyway runs until this timeout: the test fails
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not-a-url" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_chat_cli_refuses_a_bad_server_url(models, capsys):
    from aloepri.cli import main

    rc = main(["chat", "--key", str(models["key_a_path"]), "--server", "not-a-url"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not-a-url" in err[0]
