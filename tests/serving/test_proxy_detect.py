"""The proxy finds its backend (``--backend auto``, the CLI's default): llama.cpp's ``/props`` -> llamacpp-native,
token ids back from ``/v1/completions`` -> openai-completions, neutral-tokenizer text back -> openai-text; a server
that fits none is one line at start, exit 2. Against serve-local (a tiny obfuscated model) and scripted servers
on loopback; llama-server: tests/serving/test_llama_server.py, vLLM: test_vllm.py, llama-cpp-python's text-only
server: test_proxy.py."""
import json
import sys

import pytest

from aloepri.cli import main
from aloepri.keyfile import KeyMismatchError, write_key
from aloepri.obfuscation.server_tokenizer import ids_to_neutral_text
from aloepri.serving.client import UpstreamUnreachable
from aloepri.serving.detect import NoBackend
from aloepri.serving.local_server import LocalServer, ServerThread
from aloepri.serving.proxy import build_proxy
from aloepri.testing.engines import CommandServer, free_port
from serving_helpers import CharTokenizer, EchoUpstream, synthetic_key


def _app(routes: dict):
    """A scripted server: ``routes`` maps (method, path) to a function of the request body -> (status, JSON)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen = []

    def handler(fn):
        async def h(request):
            body = json.loads(await request.body() or b"null")
            seen.append((request.url.path, body))
            status, out = fn(body)
            return JSONResponse(out, status_code=status)
        return h

    app = Starlette(routes=[Route(path, handler(fn), methods=[method]) for (method, path), fn in routes.items()])
    return app, seen


def _models(_):
    return 200, {"object": "list", "data": [{"id": "m", "object": "model"}]}


@pytest.fixture(scope="module")
def key():
    return synthetic_key(96)


def test_serve_local_is_openai_completions(obfuscated, tmp_path, capsys):
    server_dir, key = obfuscated("llama")
    with ServerThread(LocalServer(server_dir).app()) as url:
        proxy = build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        assert proxy.client.core.backend.name == "openai-completions"
        assert proxy.fingerprint_status == "verified-upstream"
        write_key(key, tmp_path / "k.key")
        (tmp_path / "k.key").chmod(0o600)
        argv = lambda port: [sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(tmp_path / "k.key"),  # noqa
                             "--upstream", url, "--port", str(port)]
        with CommandServer(argv, tmp_path / "proxy.log", name="aloepri proxy"):
            pass
    log = (tmp_path / "proxy.log").read_text()
    assert f"-> {url} (openai-completions (detected))" in log
    assert "backend: openai-completions, chosen because its /v1/completions takes token-id prompts" in log


def test_llama_cpp_props_is_llamacpp_native_and_its_fingerprint_is_checked(key):
    from aloepri.export.gguf import FINGERPRINT_TEMPLATE

    def props_for(fp):
        return lambda _: (200, {"default_generation_settings": {"n_ctx": 64}, "build_info": "b1",
                                "chat_template": FINGERPRINT_TEMPLATE.format(fingerprint=fp)})

    llama_models = lambda _: (200, {"object": "list", "data": [  # noqa: E731
        {"id": "m", "object": "model", "owned_by": "llamacpp", "meta": {"n_ctx": 64, "n_ctx_train": 4096}}]})
    app, seen = _app({("GET", "/props"): props_for(key.model_fingerprint), ("GET", "/v1/models"): llama_models})
    with ServerThread(app) as url:
        proxy = build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        assert proxy.client.core.backend.name == "llamacpp-native"
        assert proxy.fingerprint_status == "verified-upstream" and proxy.context_len == 64
        assert not [p for p, _ in seen if p.startswith("/v1/completions") or p == "/completion"]  # nothing generated
    app, _ = _app({("GET", "/props"): props_for("f" * 64), ("GET", "/v1/models"): llama_models})
    with ServerThread(app) as url:
        with pytest.raises(KeyMismatchError):
            build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        with pytest.raises(KeyMismatchError):
            build_proxy(key, url, tokenizer=CharTokenizer(), backend="llamacpp-native")
        assert build_proxy(key, url, tokenizer=CharTokenizer(), backend="llamacpp-native", verify=False)


def test_a_text_only_server_is_openai_text_and_a_plaintext_one_is_refused(key):
    probe = key.obfuscated_eos_ids()[0]

    def text_only(reply):
        def completions(body):
            if not isinstance(body.get("prompt"), str):
                return 422, {"detail": "prompt must be a string"}
            return 200, {"choices": [{"index": 0, "text": reply, "finish_reason": "length"}]}
        return completions

    app, seen = _app({("GET", "/v1/models"): _models, ("POST", "/v1/completions"): text_only(" t17x")})
    with ServerThread(app) as url:
        proxy = build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        assert proxy.client.core.backend.name == "openai-text"
    probes = [b for p, b in seen if p == "/v1/completions"]
    assert probes[0]["prompt"] == [probe] and probes[0]["max_tokens"] == 1  # one permuted id, one token back
    assert probes[1]["prompt"] == ids_to_neutral_text([probe]) and probes[1]["max_tokens"] == 1
    app, _ = _app({("GET", "/v1/models"): _models, ("POST", "/v1/completions"): text_only(" Paris")})
    with ServerThread(app) as url:
        with pytest.raises(NoBackend, match="not its neutral tokenizer's"):
            build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")


def test_ids_without_token_ids_back_fall_through_to_text(key):
    """A server that takes int prompts but returns no ids (e.g. an OpenAI server without return_token_ids) is not
    openai-completions: the text probe decides."""
    app, _ = _app({("GET", "/v1/models"): _models, ("POST", "/v1/completions"): lambda body: (
        200, {"choices": [{"index": 0, "text": " t5x", "finish_reason": "length"}]})})
    with ServerThread(app) as url:
        assert build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto").client.core.backend.name == \
            "openai-text"


def test_a_server_that_fits_none_is_one_line_at_start(key, tmp_path, capsys):
    app, _ = _app({("GET", "/v1/models"): _models})
    with ServerThread(app) as url:
        with pytest.raises(NoBackend, match="speaks none of the proxy's protocols"):
            build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        write_key(key, tmp_path / "k.key")
        (tmp_path / "k.key").chmod(0o600)
        capsys.readouterr()
        assert main(["proxy", "--key", str(tmp_path / "k.key"), "--upstream", url, "--port", str(free_port())]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "speaks none of the proxy's protocols" in err[0] and "--backend" in err[0], err


def test_backend_given_by_hand_is_not_probed(key):
    up = EchoUpstream(key)
    with ServerThread(up.app()) as url:
        proxy = build_proxy(key, url, tokenizer=CharTokenizer(), backend="openai-completions")
        assert proxy.client.core.backend.name == "openai-completions" and not up.seen
        auto = build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
        assert auto.client.core.backend.name == "openai-completions" and len(up.seen) == 1
        with pytest.raises(ValueError, match="unknown backend"):
            build_proxy(key, url, tokenizer=CharTokenizer(), backend="vllm")


def test_an_unreachable_upstream_cannot_be_probed(key):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamUnreachable, match="cannot be probed"):
        build_proxy(key, url, tokenizer=CharTokenizer(), backend="auto")
    assert build_proxy(key, url, tokenizer=CharTokenizer()).client.core.backend.name == "openai-completions"


def test_the_exported_gguf_names_its_fingerprint_where_llama_server_shows_it(obfuscated, tmp_path):
    """The chat template of a GGUF written by `aloepri export-gguf` is a Jinja comment naming the fingerprint
    (llama-server shows the template in /props, and nothing else of the file), which the proxy reads back."""
    import gguf
    import jinja2

    from aloepri.export.gguf import export_gguf
    from aloepri.serving.client.guard import fingerprint_in_props

    server_dir, key = obfuscated("llama")
    export_gguf(server_dir, tmp_path / "m.gguf", "f32")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    template = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert bytes(fields["aloepri.model_fingerprint"].parts[-1]).decode() == key.model_fingerprint
    assert fingerprint_in_props({"chat_template": template}) == key.model_fingerprint
    assert jinja2.Template(template).render(messages=[{"role": "user", "content": "hi"}]) == ""  # renders nothing
    assert fingerprint_in_props({"chat_template": "{{ messages }}"}) is None and fingerprint_in_props(None) is None
