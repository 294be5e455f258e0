"""The proxy against hostile clients and hostile web pages, on a stand-in engine (no model, so each
case takes milliseconds) and, for serve-local, a tiny obfuscated model:

* bounded requests: a body over the limit is 413 (declared or chunked), a body not sent as JSON 415, a prompt too
  long for the context is refused before it is tokenized, and tokenizing runs off the event loop (``/health``
  answers meanwhile); the same limits on serve-local;
* a damaged key (a permutation shorter than the vocabulary) is refused at start in one line, exit 2;
* web pages: a foreign ``Host`` (DNS rebinding) and a foreign ``Origin`` are 403 unless the operator allows them;
* the key file: group/world-accessible keys warned about (refused with ``--strict``), a directory named as such;
* start order: a proxy started before its upstream waits for it, and ``aloepri`` is always a name it serves.
"""
import json
import os
import threading
import time

import httpx2
import pytest

from aloepri.cli import main
from aloepri.keyfile import KeyFileError, write_key
from aloepri.serving.client import UpstreamUnreachable
from aloepri.serving.local_server import LocalServer, ServerThread
from aloepri.serving.proxy import build_proxy
from serving_helpers import CharTokenizer, EchoUpstream, synthetic_key

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class CountingTokenizer(CharTokenizer):
    """CharTokenizer that tells its vocabulary (one character per token) and records the length of every text it
    encodes; a text starting with ``SLOW`` takes a second (the tokenizer of a very long prompt)."""

    def __init__(self):
        super().__init__()
        self.encoded: list[int] = []

    def get_vocab(self) -> dict[str, int]:
        return dict(self.index)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        if text.startswith("SLOW") or "u:SLOW" in text:
            time.sleep(1.0)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def key():
    return synthetic_key(96)


@pytest.fixture(scope="module")
def upstream(key):
    up = EchoUpstream(key)
    with ServerThread(up.app()) as url:
        yield url


@pytest.fixture(scope="module")
def stack(key, upstream):
    tok = CountingTokenizer()
    proxy = build_proxy(key, upstream, tokenizer=tok, max_request_bytes=64 * 1024, allowed_hosts=["proxy.lan"],
                        allowed_origins=["http://localhost:3000"])
    with ServerThread(proxy.app()) as url:
        yield {"url": url, "proxy": proxy, "tok": tok}


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---------------------------------------------------------------------------------------- bounded requests


def test_a_body_over_the_limit_is_413_declared_or_chunked(stack):
    url = stack["url"] + "/v1/chat/completions"
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    assert _error(httpx2.post(url, content=big, headers={"content-type": "application/json"}), 413)["code"] == \
        "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert _error(httpx2.post(url, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert httpx2.post(url, json=CHAT).status_code == 200  # and the proxy serves on


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_is_415(stack, content_type):
    """What a web page can send cross-origin without a preflight (text/plain, forms) is refused."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx2.post(stack["url"] + "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
    assert _error(r, 415)["code"] == "unsupported_media_type"
    r = httpx2.post(stack["url"] + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                    headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(stack, path, field):
    """The upstream's context is 4096 tokens and no token is longer than one character here: 5000 characters are
    at least 5000 tokens. Refused without the tokenizer seeing them (it took 15.9 s on a 5 MB message)."""
    tok = stack["tok"]
    tok.encoded.clear()
    long = "y" * 5000
    body = {"prompt": long} if field == "prompt" else {"messages": [{"role": "user", "content": long}]}
    err = _error(httpx2.post(stack["url"] + path, json=body), 400)
    assert err["param"] == field and "context is 4096" in err["message"]
    assert not any(n >= 5000 for n in tok.encoded)


def test_health_answers_while_a_prompt_is_tokenized(stack):
    """Tokenizing runs in a worker thread: a slow one (1 s) does not hold up other clients."""
    done = []
    slow = threading.Thread(target=lambda: done.append(httpx2.post(
        stack["url"] + "/v1/completions", json={"prompt": "SLOW prompt", "max_tokens": 2}, timeout=30)))
    slow.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    assert httpx2.get(stack["url"] + "/health", timeout=30).status_code == 200
    waited = time.perf_counter() - t0
    slow.join()
    assert done[0].status_code == 200
    assert waited < 0.5, f"/health waited {waited:.2f} s for another request's tokenizer"


@pytest.fixture(scope="module")
def local_server(obfuscated):
    out, _ = obfuscated("llama")
    server = LocalServer(out, max_request_bytes=64 * 1024)
    with ServerThread(server.app()) as url:
        yield url


def test_serve_local_bounds_its_requests_too(local_server):
    url = local_server + "/v1/completions"
    r = httpx2.post(url, content=json.dumps({"prompt": [5] * 30_000}).encode(),
                    headers={"content-type": "application/json"})
    assert _error(r, 413)["code"] == "request_too_large"
    assert _error(httpx2.post(url, content=b'{"prompt": [5]}', headers={"content-type": "text/plain"}), 415)
    r = httpx2.post(url, json={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) >= 0


# ---------------------------------------------------------------------------------------------- damaged key


def _damaged(key, size: int):
    """The key with its permutation cut to ``size`` ids (still a permutation; the fingerprint is the model's)."""
    from dataclasses import replace

    return replace(key, vocab_permutation=[i for i in key.vocab_permutation if i < size])


def test_a_damaged_key_is_refused_at_start(key, upstream):
    with pytest.raises(KeyFileError, match="covers 50 token ids, the tokenizer has 96"):
        build_proxy(_damaged(key, 50), "http://127.0.0.1:9", tokenizer=CharTokenizer())  # no upstream to ask
    with pytest.raises(KeyFileError, match="covers 50 token ids, the upstream's model has 96"):
        build_proxy(_damaged(key, 50), upstream)  # no tokenizer: the upstream's listing tells the vocabulary


def test_the_proxy_cli_refuses_a_damaged_key_in_one_line(key, upstream, tmp_path, capsys):
    path = tmp_path / "damaged.key"
    write_key(_damaged(key, 50), path)
    assert main(["proxy", "--key", str(path), "--upstream", upstream, "--upstream-wait", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aloepri proxy: error: the key is damaged"), err


# ------------------------------------------------------------------------------------------------ web pages


def test_a_foreign_host_is_refused(stack):
    """DNS rebinding: a page on evil.example resolved to 127.0.0.1 sends its own name as Host."""
    for path in ("/v1/models", "/health"):
        err = _error(httpx2.get(stack["url"] + path, headers={"host": "evil.example:8080"}), 403)
        assert err["code"] == "host_not_allowed"
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80", "LOCALHOST", "proxy.lan:8080"):
        assert httpx2.get(stack["url"] + "/v1/models", headers={"host": host}).status_code == 200, host


def test_a_cross_origin_page_is_refused_unless_allowed(stack):
    url = stack["url"] + "/v1/chat/completions"
    for origin in ("http://evil.example", "null", "http://localhost:3001"):
        err = _error(httpx2.post(url, json=CHAT, headers={"origin": origin}), 403)
        assert err["code"] == "origin_not_allowed"
        pre = httpx2.options(url, headers={"origin": origin, "access-control-request-method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    ok = httpx2.post(url, json=CHAT, headers={"origin": "http://localhost:3000"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    pre = httpx2.options(url, headers={"origin": "http://localhost:3000", "access-control-request-method": "POST",
                                       "access-control-request-headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"


# -------------------------------------------------------------------------------------------------- key file


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_others_can_read_is_warned_about_and_refused_with_strict(key, tmp_path, capsys, mode):
    path = tmp_path / "client.key"
    write_key(key, path)
    os.chmod(path, mode)
    dead = "http://127.0.0.1:9"  # nothing listens: the proxy stops right after the key check
    assert main(["proxy", "--key", str(path), "--upstream", dead, "--upstream-wait", "0.1"]) == 2
    err = capsys.readouterr().err
    assert f"warning: the key file {path} can be accessed by other users (mode {mode:04o})" in err
    assert "chmod 600" in err
    assert main(["proxy", "--key", str(path), "--upstream", dead, "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused: --strict" in err[0]
    os.chmod(path, 0o600)
    assert main(["proxy", "--key", str(path), "--upstream", dead, "--upstream-wait", "0.1", "--strict"]) == 2
    assert "can be accessed" not in capsys.readouterr().err


def test_a_key_path_that_is_a_directory_says_so(tmp_path, capsys):
    assert main(["proxy", "--key", str(tmp_path), "--upstream", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory, not a key file" in err[0], err


# ----------------------------------------------------------------------------------------------- start order


def test_a_proxy_started_before_its_upstream_waits_for_it(key):
    """The README starts serve-local and the proxy together: the proxy must not come up without the upstream
    (unchecked key, unknown context, another model name), whichever starts first."""
    up = ServerThread(EchoUpstream(key).app())  # the port is bound, nothing answers yet
    built = []
    t = threading.Thread(target=lambda: built.append(build_proxy(key, up.url, tokenizer=CharTokenizer(),
                                                                 upstream_wait=30)))
    t.start()
    time.sleep(1.0)
    up.start()
    try:
        t.join(30)
        proxy = built[0]
        assert proxy.model_name == "echo" and proxy.fingerprint_status == "verified-upstream"
        assert proxy.context_len == 4096
        with ServerThread(proxy.app()) as url:
            for name in ("echo", "aloepri"):  # the upstream's name, and the one that never changes
                assert httpx2.post(url + "/v1/chat/completions", json={**CHAT, "model": name}).status_code == 200
                assert httpx2.get(url + f"/v1/models/{name}").status_code == 200
            assert _error(httpx2.post(url + "/v1/chat/completions", json={**CHAT, "model": "other"}), 404)
    finally:
        up.stop()


def test_an_upstream_that_never_comes_up_is_one_line(key, tmp_path, capsys):
    with pytest.raises(UpstreamUnreachable, match="did not answer within 0.5 s"):
        build_proxy(key, "http://127.0.0.1:9", tokenizer=CharTokenizer(), upstream_wait=0.5)
    path = tmp_path / "client.key"
    write_key(key, path)
    assert main(["proxy", "--key", str(path), "--upstream", "http://127.0.0.1:9", "--upstream-wait", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("aloepri proxy: error: the upstream http://127.0.0.1:9 did not answer"), err


def test_the_readme_start_order_with_real_processes(obfuscated, tmp_path):
    """The README's two commands started together, the proxy first (the losing order before): it waits for
    serve-local, checks the key, and serves the upstream's name and `aloepri`."""
    import subprocess
    import sys

    from aloepri.testing.engines import free_port

    out, _ = obfuscated("llama")
    key_path = out.parent / "key.json"
    up_port, px_port = free_port(), free_port()
    cli = [sys.executable, "-m", "aloepri.cli"]
    logs = [open(tmp_path / name, "w") for name in ("proxy.log", "serve-local.log")]
    procs = [subprocess.Popen(cli + ["proxy", "--key", str(key_path), "--upstream", f"http://127.0.0.1:{up_port}",
                                     "--port", str(px_port), "--log-level", "warning"],
                              stdout=logs[0], stderr=subprocess.STDOUT)]
    try:
        time.sleep(1.0)
        procs.append(subprocess.Popen(cli + ["serve-local", str(out), "--port", str(up_port), "--log-level",
                                             "warning"], stdout=logs[1], stderr=subprocess.STDOUT))
        url, deadline = f"http://127.0.0.1:{px_port}", time.monotonic() + 180
        while True:
            assert procs[0].poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                health = httpx2.get(url + "/health", timeout=5).json()
                break
            except httpx2.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
                time.sleep(0.5)
        assert health["key_check"] == "verified-upstream"
        assert [m["id"] for m in httpx2.get(url + "/v1/models").json()["data"]] == [out.name]
        for name in (out.name, "aloepri", None):
            body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, **({"model": name} if name else {})}
            assert httpx2.post(url + "/v1/completions", json=body, timeout=60).status_code == 200, name
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        for f in logs:
            f.close()
