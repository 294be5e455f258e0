"""Client SDK, serve-local, proxy and chat CLI on a tiny random model (fast): protocols, decoding, errors, load."""
import asyncio
import io
import json
import logging
import os
import subprocess
import sys
import time

import httpx2
import numpy as np
import pytest
import torch

import aloepri
from aloepri.serving.client import (Client, KeyMismatchError, NeutralCodec, ReplyDecoder, TokenizerCodec,
                            UpstreamUnreachable)
from aloepri.runtime.inference import load_plain_model
from aloepri.keyfile import KeyFile
from aloepri.serving.proxy import build_proxy
from aloepri.serving.local_server import LocalServer, ServerThread
from aloepri.serving.cli import run_chat
from aloepri.testing.engines import free_port
from serving_helpers import CharTokenizer, Recorder, greedy

openai = pytest.importorskip("openai")


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("tiny-serving")
    aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=7,
                      allow_weak_seed=True,
                      progress=False)
    aloepri.obfuscate(src, work / "other", work / "other.key", aloepri.resolve_params("exact"), seed=8,
                      allow_weak_seed=True,
                      progress=False)
    return {"src": src, "server_dir": work / "server", "key": aloepri.load_key(work / "client.key"),
            "key_path": work / "client.key", "other_key": aloepri.load_key(work / "other.key"), "work": work}


@pytest.fixture(scope="module")
def plain(tiny):
    return load_plain_model(tiny["src"], dtype=torch.float64)


@pytest.fixture(scope="module")
def upstream(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = LocalServer(tiny["server_dir"])
    rec = Recorder(server.app())
    st = ServerThread(rec).start()
    yield {"url": st.url, "recorder": rec, "server": server}
    st.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def proxy(tiny, upstream):
    p = build_proxy(tiny["key"], upstream["url"], tokenizer=CharTokenizer(), chat_max_tokens=24)
    st = ServerThread(p.app()).start()
    yield {"url": st.url, "proxy": p}
    st.stop()


def sdk(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=kw.pop("timeout", 60), **kw)


PROMPT = [5, 17, 33, 40, 8, 61]


# ---------------------------------------------------------------------------------------- the client SDK


@pytest.mark.parametrize("backend", ["openai-completions", "llamacpp-native", "openai-text"])
def test_client_raw_ids_equal_plaintext_greedy(tiny, plain, upstream, backend):
    want = greedy(plain, PROMPT, 20, 2)
    with Client(tiny["key"], upstream["url"], backend=backend) as c:
        assert c.tokenizer is None  # the tiny model has none: raw ids in, raw ids out
        r = c.complete(PROMPT, max_tokens=20, temperature=0)
        s = list(c.stream_complete(PROMPT, max_tokens=20, temperature=0))
    assert r.token_ids == want and r.text is None
    assert [i for d in s for i in d.token_ids] == want
    assert r.server_prompt_ids == tiny["key"].encode_ids(PROMPT) != PROMPT
    assert r.server_reply_ids[: len(want)] == tiny["key"].encode_ids(want)
    assert r.finish_reason == ("length" if len(want) == 20 else "stop")


def test_client_sampling_passthrough_is_deterministic_with_seed(tiny, upstream):
    with Client(tiny["key"], upstream["url"]) as c:
        a = c.complete(PROMPT, max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=123)
        b = c.complete(PROMPT, max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=123)
    assert a.token_ids == b.token_ids
    body = json.loads([e for e in upstream["recorder"].exchanges if e["path"] == "/v1/completions"][-1]["request"])
    assert body["temperature"] == 0.9 and body["top_k"] == 20 and body["top_p"] == 0.9 and body["seed"] == 123


def test_logit_bias_is_mapped_through_the_permutation(tiny, upstream):
    target = 50  # plaintext id
    with Client(tiny["key"], upstream["url"]) as c:
        r = c.complete(PROMPT, max_tokens=5, temperature=0, logit_bias={target: 100})
    assert r.token_ids == [target] * 5
    body = json.loads([e for e in upstream["recorder"].exchanges if e["path"] == "/v1/completions"][-1]["request"])
    assert body["logit_bias"] == {str(tiny["key"].encode_ids([target])[0]): 100.0}


def test_key_checks(tiny, upstream):
    with Client(tiny["key"], upstream["url"]) as c:
        assert c.verify() is True
    with Client(tiny["other_key"], upstream["url"]) as c:
        with pytest.raises(KeyMismatchError):
            c.verify()
    with pytest.raises(KeyMismatchError):
        build_proxy(tiny["other_key"], upstream["url"])
    with pytest.raises(KeyMismatchError):
        build_proxy(tiny["other_key"], upstream["url"], verify=False,
                    model_meta=tiny["server_dir"] / "aloepri_model.json")
    assert build_proxy(tiny["key"], upstream["url"], verify=False,
                       model_meta=tiny["server_dir"] / "aloepri_model.json").fingerprint_status == "verified-local-meta"


def test_client_errors(tiny):
    assert aloepri.Client is Client  # the public name
    with Client(tiny["key"], f"http://127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(UpstreamUnreachable):
            c.complete(PROMPT, max_tokens=4)
        with pytest.raises(ValueError, match="tokenizer"):
            c.chat("hello")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            c.complete([1, 2, 10_000])


def _run_client(kind, key, url, calls, **kw):
    """Run ``calls``, each (method name, args, params), on one ``kind`` ("sync" or "async") client: their results,
    a stream's as (its deltas, its results)."""
    from aloepri.serving.client import AsyncClient

    if kind == "sync":
        with Client(key, url, **kw) as c:
            return [_drain_sync(getattr(c, m)(*a, **p)) for m, a, p in calls]

    async def main():
        async with AsyncClient(key, url, **kw) as c:
            out = []
            for m, a, p in calls:
                r = await getattr(c, m)(*a, **p)
                if m.startswith("stream_"):
                    async with r:
                        deltas = [d async for d in r]
                    r = (deltas, r.results)
                out.append(r)
            return out

    return asyncio.run(main())


def _drain_sync(r):
    if isinstance(r, (list, aloepri.serving.client.Completion)):
        return r
    with r:
        deltas = list(r)
    return deltas, r.results


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_chat_and_stream_chat_alike(tiny, plain, upstream, kind):
    """chat / stream_chat / complete / stream_complete: the same arguments and results on both clients, equal to
    plaintext greedy decoding; a stop string ends the streamed reply on the decoded text."""
    tok = CharTokenizer()
    msgs = [{"role": "user", "content": "hi!"}]
    want = greedy(plain, tok.apply_chat_template(msgs), 12, 2)
    want_text = tok.decode(want)
    stop = want_text[3:5]
    calls = [("chat", (msgs,), {"max_tokens": 12, "temperature": 0}),
             ("stream_chat", (msgs,), {"max_tokens": 12, "temperature": 0}),
             ("complete", (PROMPT,), {"max_tokens": 12, "temperature": 0, "n": 2}),
             ("stream_complete", (PROMPT,), {"max_tokens": 12, "temperature": 0, "n": 2}),
             ("stream_chat", ("hi!",), {"max_tokens": 12, "temperature": 0, "stop": stop})]
    chat, (deltas, streamed), both, (n_deltas, n_streamed), (s_deltas, s_results) = _run_client(
        kind, tiny["key"], upstream["url"], calls, tokenizer=tok)
    assert chat.token_ids == want and chat.text == want_text
    assert chat.finish_reason == ("length" if len(want) == 12 else "stop")
    assert "".join(d.text for d in deltas) == want_text and [i for d in deltas for i in d.token_ids] == want
    assert len(streamed) == 1 and streamed[0].text == want_text and streamed[0].finish_reason == chat.finish_reason
    want_ids = greedy(plain, PROMPT, 12, 2)
    assert [r.index for r in both] == [0, 1] and all(r.token_ids == want_ids for r in both)
    assert [r.token_ids for r in n_streamed] == [want_ids, want_ids]
    assert sorted({d.index for d in n_deltas}) == [0, 1]
    cut = want_text[: want_text.index(stop)]
    assert "".join(d.text for d in s_deltas) == cut and s_results[0].text == cut
    assert s_results[0].finish_reason == "stop"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_both_clients_refuse_errors_and_another_models_reply(tiny, upstream, kind):
    """The status and key checks are the same on both clients: an error status is an UpstreamHTTPError with the
    server's message; a reply stamped with another model's fingerprint is never decoded."""
    from aloepri.serving.client import UpstreamHTTPError, UpstreamModelMismatch

    with pytest.raises(UpstreamHTTPError, match="top_p") as err:
        _run_client(kind, tiny["key"], upstream["url"], [("complete", (PROMPT,), {"top_p": 2.0})])
    assert err.value.upstream_status == 400 and err.value.code == "upstream_rejected_request"
    for method in ("complete", "stream_complete"):
        with pytest.raises(UpstreamModelMismatch):
            _run_client(kind, tiny["other_key"], upstream["url"], [(method, (PROMPT,), {"max_tokens": 2})])
    with pytest.raises(UpstreamUnreachable):
        _run_client(kind, tiny["key"], f"http://127.0.0.1:{free_port()}", [("stream_complete", (PROMPT,), {})],
                    timeout=5)


def test_reply_state_judges_the_head_before_the_body(tiny):
    """Sans-IO: the status and the model check decide before any body is read."""
    from aloepri.serving.client import (FINGERPRINT_HEADER, ClientCore, GenerationParams, UpstreamHTTPError,
                                        UpstreamModelMismatch)

    core = ClientCore(tiny["key"], "http://127.0.0.1:9")
    fp, other = tiny["key"].model_fingerprint, tiny["other_key"].model_fingerprint
    st = core.start(PROMPT, GenerationParams(max_tokens=2), stream=False, default_max=None)
    assert st.url == "http://127.0.0.1:9/v1/completions" and st.body["prompt"] == tiny["key"].encode_ids(PROMPT)
    assert st.on_head(503, {}) == st.READ_ERROR
    with pytest.raises(UpstreamHTTPError, match="busy") as err:
        st.on_error_body(b'{"error": {"message": "busy"}}')
    assert err.value.status == 503 and err.value.code == "upstream_overloaded"
    assert st.on_head(200, {FINGERPRINT_HEADER: fp}) == st.READ  # stamped with the key's model
    assert st.on_head(200, {}) == st.READ  # the SDK's default: stamps only
    with pytest.raises(UpstreamModelMismatch):
        st.on_head(200, {FINGERPRINT_HEADER: other})
    listing = {"data": [{"id": "m", "aloepri": {"model_fingerprint": fp}}]}
    assert core.verify_listing(listing) is True  # from now on unstamped replies wait for /v1/models
    conn = type("Connection", (), {})()  # what httpx gives as the network stream: any weakly referable object
    assert st.on_head(200, {}, conn) == st.CHECK_LISTING
    with pytest.raises(UpstreamModelMismatch):
        st.on_listing({"data": [{"id": "m", "aloepri": {"model_fingerprint": other}}]})
    st.on_listing(listing)
    assert st.on_head(200, {}, conn) == st.READ  # a connection that passed stays vouched for


# ---------------------------------------------------------------------------------- reply decoding (units)


def _key(vocab: int, eos: int, seed: int = 0) -> KeyFile:
    perm = np.random.default_rng(seed).permutation(vocab).tolist()
    return KeyFile(vocab_permutation=perm, model_fingerprint="0" * 64, params={}, seed=0, h_effective=0,
                   hidden_size=0, source="", architecture="llama", special_tokens={"eos_token_id": eos})


class ByteTokenizer:
    """ids 0..255 are bytes (a multi-byte character spans several tokens), 256 is EOS."""

    def decode(self, ids, skip_special_tokens=True, **_):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_reply_decoder_multibyte_eos_and_stop_strings():
    key, tok = _key(257, 256), ByteTokenizer()
    text = "héllo wörld 🙂 end"
    ids = list(text.encode())
    dec = ReplyDecoder(key, tok)
    out = "".join(dec.feed([sid]).text for sid in key.encode_ids(ids))
    out += dec.feed(key.encode_ids([256, 65])).text  # EOS, then a token that must be ignored
    assert out == text and dec.finish_reason == "stop" and "\ufffd" not in out
    assert dec.plain_ids == ids

    for stop, want in [("wörld", "héllo "), ("🙂", "héllo wörld "), ("zzz", text), ("d 🙂 e", "héllo wörl")]:
        dec = ReplyDecoder(key, tok, stop=[stop, "never"])
        pieces = [dec.feed([sid]) for sid in key.encode_ids(ids)]
        tail = dec.finish("stop") if not dec.done else None
        got = "".join(p.text for p in pieces) + (tail.text if tail else "")
        assert got == want and dec.text == want and dec.finish_reason == "stop"
        # nothing past the stop string was ever handed out, even transiently
        assert all(stop not in p.text for p in pieces)

    dec = ReplyDecoder(key, tok, max_tokens=3)
    d = dec.feed(key.encode_ids(ids))
    assert dec.finish_reason == "length" and d.token_ids == ids[:3] and d.text == "hé"


def test_text_mode_codec_round_trip_is_exact(tiny):
    """The paper's text path: neutral text of the permuted ids, read back by the server's own tokenizer."""
    from transformers import AutoTokenizer

    server_tok = AutoTokenizer.from_pretrained(str(tiny["server_dir"]))  # shipped with the obfuscated model
    key = tiny["key"]
    codec, hf = NeutralCodec(key.vocab_size), TokenizerCodec(server_tok)
    rng = np.random.default_rng(0)
    seqs = [list(range(key.vocab_size))] + [rng.integers(0, key.vocab_size, 50).tolist() for _ in range(50)]
    for ids in seqs:
        text = codec.ids_to_text(ids)
        assert server_tok.encode(text, add_special_tokens=False) == ids  # what the server reads
        assert codec.text_to_ids(hf.ids_to_text(ids)) == ids  # what the server writes, read back here


# -------------------------------------------------------------------------------------------- the proxy


def test_proxy_chat_and_completions_with_openai_sdk(tiny, plain, upstream, proxy):
    tok = CharTokenizer()
    msgs = [{"role": "user", "content": "hi!"}]
    want = tok.decode(greedy(plain, tok.apply_chat_template(msgs), 24, 2))
    c = sdk(proxy["url"])
    r = c.chat.completions.create(model="server", messages=msgs, temperature=0)
    assert r.choices[0].message.content == want and r.model == proxy["proxy"].model_name
    r = c.completions.create(model="server", prompt=PROMPT, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    ids = greedy(plain, PROMPT, 10, 2)
    assert r.choices[0].text == tok.decode(ids) and r.choices[0].model_extra["token_ids"] == ids
    texts = [ch.choices[0].text for ch in c.completions.create(model="server", prompt="a:b", max_tokens=8,
                                                                  temperature=0, stream=True) if ch.choices]
    assert "".join(texts) == tok.decode(greedy(plain, tok.encode("a:b"), 8, 2))
    assert [m.id for m in c.models.list().data] == [proxy["proxy"].model_name]


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"model": "server"}).encode(), "'messages'"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "'role'"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "'content'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), "'temperature'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(), "'temperature'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), "'max_tokens'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}).encode(), "'n'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": 7}).encode(), "'stop'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), "'stream'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}).encode(), "'logprobs': true"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "function"}]}).encode(), "tools[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}).encode(), "logit_bias"),
])
def test_proxy_malformed_chat_requests_are_400(proxy, body, needle):
    r = httpx2.post(proxy["url"] + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_proxy_malformed_completion_requests_and_unknown_routes(proxy):
    for body, needle in [({"prompt": [1, "a"]}, "'prompt'"), ({"prompt": []}, "'prompt'"),
                         ({"prompt": [1, 2], "echo": True}, "echo"), ({"prompt": [1, 100000]}, "outside"),
                         ({"prompt": ["a", "b"]}, "one prompt"), ({"prompt": [3], "suffix": "x"}, "suffix")]:
        r = httpx2.post(proxy["url"] + "/v1/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    r = httpx2.get(proxy["url"] + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        sdk(proxy["url"]).chat.completions.create(model="server", messages=[])


def _fake_upstream(behaviour: str, state: dict):
    """An upstream that misbehaves on purpose."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        if behaviour == "slow":
            await asyncio.sleep(3)
            return JSONResponse({})
        if behaviour == "500":
            return JSONResponse({"error": {"message": "engine exploded", "type": "server_error"}}, status_code=500)
        if behaviour == "400":
            return JSONResponse({"error": {"message": "prompt too long", "type": "invalid_request_error"}},
                                status_code=400)
        if behaviour == "no-ids":
            return JSONResponse({"choices": [{"index": 0, "text": "abc", "finish_reason": "stop"}]})

        async def events():
            state["started"] = True
            try:
                for i in range(400 if behaviour == "endless" else 2):
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'token_ids': [10 + i % 50]}]})}\n\n"
                    await asyncio.sleep(0.02)
                if behaviour == "drop":
                    raise RuntimeError("connection lost")  # uvicorn aborts the response mid-stream
            finally:
                state["finished"] = True
        assert body["stream"]
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.mark.parametrize("behaviour,status,code", [("500", 502, "upstream_http_error"),
                                                    ("400", 400, "upstream_rejected_request"),
                                                    ("no-ids", 502, "upstream_protocol_error"),
                                                    ("slow", 504, "upstream_timeout")])
def test_proxy_upstream_errors_are_openai_errors(tiny, behaviour, status, code):
    with ServerThread(_fake_upstream(behaviour, {}), log_level="critical") as up:
        p = build_proxy(tiny["key"], up, tokenizer=CharTokenizer(), timeout=1.0)
        with ServerThread(p.app()) as url:
            r = httpx2.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
            assert r.status_code == status and r.json()["error"]["code"] == code, r.text
            with pytest.raises(openai.APIStatusError) as e:
                sdk(url).chat.completions.create(model="aloepri", messages=[{"role": "user", "content": "q"}])
            assert e.value.status_code == status


def test_proxy_upstream_down_is_502(tiny):
    p = build_proxy(tiny["key"], f"http://127.0.0.1:{free_port()}", tokenizer=CharTokenizer(), timeout=5)
    assert p.fingerprint_status == "unchecked"
    with ServerThread(p.app()) as url:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                sdk(url).chat.completions.create(model="aloepri", messages=[{"role": "user", "content": "q"}],
                                                 stream=stream)
            assert e.value.status_code == 502
            assert e.value.body["code"] == "upstream_unreachable"


def test_proxy_upstream_dropping_mid_stream_gives_an_error_event(tiny):
    with ServerThread(_fake_upstream("drop", {}), log_level="critical") as up:
        p = build_proxy(tiny["key"], up, tokenizer=CharTokenizer(), timeout=5)
        with ServerThread(p.app()) as url:
            stream = sdk(url).chat.completions.create(model="aloepri", messages=[{"role": "user", "content": "q"}],
                                                      stream=True)
            with pytest.raises(openai.APIError, match="dropped|error"):
                for _ in stream:
                    pass


def test_proxy_client_disconnect_cancels_the_upstream_request(tiny):
    state: dict = {}
    with ServerThread(_fake_upstream("endless", state), log_level="critical") as up:
        p = build_proxy(tiny["key"], up, tokenizer=CharTokenizer(), timeout=5)
        with ServerThread(p.app()) as url:
            with httpx2.stream("POST", url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "q"}], "stream": True,
                                     "max_tokens": 1000}) as r:
                lines = r.iter_lines()
                while not next(lines).startswith("data:"):
                    pass
            deadline = time.monotonic() + 5
            # the proxy closes the upstream stream, then counts the request out: wait for both
            while not (state.get("finished") and p.in_flight == 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert state.get("started") and state.get("finished"), "upstream stream was not closed"
            assert p.in_flight == 0
            assert httpx2.get(url + "/health").json()["in_flight"] == 0


def test_proxy_logs_no_plaintext_unless_asked(tiny, upstream, caplog):
    secret = "my-secret-word"
    for log_plaintext in (False, True):
        p = build_proxy(tiny["key"], upstream["url"], tokenizer=CharTokenizer(), log_plaintext=log_plaintext)
        with ServerThread(p.app()) as url, caplog.at_level(logging.DEBUG):
            caplog.clear()
            sdk(url).chat.completions.create(model="server", messages=[{"role": "user", "content": secret}],
                                             max_tokens=4, temperature=0)
            sdk(url).chat.completions.create(model="server", messages=[{"role": "user", "content": secret}],
                                             max_tokens=4, temperature=0, stream=True).close()
            logged = "\n".join(r.getMessage() for r in caplog.records)
            assert "completion_tokens=" in logged
            assert (secret in logged) is log_plaintext


def test_load_sixteen_concurrent_streaming_chats(tiny, plain, upstream, proxy):
    """N concurrent streaming chats through the proxy: every reply complete and exactly the plaintext one."""
    n = 20
    tok = CharTokenizer()
    questions = [f"q{i}:{chr(65 + i) * 3}?" for i in range(n)]
    want = {q: tok.decode(greedy(plain, tok.apply_chat_template([{"role": "user", "content": q}]), 24, 2))
            for q in questions}
    assert len(set(want.values())) > n // 2  # distinct replies, so a mix-up would show

    async def one(client, q):
        stream = await client.chat.completions.create(model="server", messages=[{"role": "user", "content": q}],
                                                      temperature=0, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(parts), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=proxy["url"] + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, q) for q in questions)), 120)

    t = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t
    assert all(finish in ("stop", "length") for _, finish in results)
    assert [text for text, _ in results] == [want[q] for q in questions]
    assert proxy["proxy"].in_flight == 0
    assert elapsed < 60


# ------------------------------------------------------------------------------------------ CLI and chat


def test_run_chat_keeps_the_conversation(tiny, plain, upstream):
    tok = CharTokenizer()
    out = io.StringIO()
    with Client(tiny["key"], upstream["url"], tokenizer=tok) as c:
        rc = run_chat(c, params={"max_tokens": 12, "temperature": 0}, stdin=io.StringIO("hi\n/reset\nhi\nho\n"),
                      stdout=out, stderr=io.StringIO())
    assert rc == 0
    lines = out.getvalue().splitlines()
    first = tok.decode(greedy(plain, tok.apply_chat_template([{"role": "user", "content": "hi"}]), 12, 2))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "ho"}]
    third = tok.decode(greedy(plain, tok.apply_chat_template(history), 12, 2))
    assert lines == [first, first, third]


def test_cli_serve_local_and_proxy_subprocesses(tiny, plain):
    """The commands as shipped: `aloepri serve-local` and `aloepri proxy` in their own processes."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    up_port, px_port = free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "aloepri.cli", "serve-local", str(tiny["server_dir"]),
                                       "--port", str(up_port), "--threads", "1", "--log-level", "warning"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        _wait_http(f"http://127.0.0.1:{up_port}/health", procs[0])
        procs.append(subprocess.Popen([sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(tiny["key_path"]),
                                       "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(px_port),
                                       "--log-level", "warning"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        _wait_http(f"http://127.0.0.1:{px_port}/health", procs[1])
        health = httpx2.get(f"http://127.0.0.1:{px_port}/health").json()
        assert health["key_check"] == "verified-upstream"
        r = httpx2.post(f"http://127.0.0.1:{px_port}/v1/completions",
                        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(plain, PROMPT, 12, 2)  # no tokenizer: ids come back
        r = httpx2.post(f"http://127.0.0.1:{px_port}/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "x"}]}, timeout=60)
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited: {proc.stdout.read()}")
        try:
            if httpx2.get(url, timeout=1).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")
