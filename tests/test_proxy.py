"""End to end on real weights: official `openai` client -> aloepri proxy -> aloepri serve-local (transformers)
on SmolLM2-135M-Instruct obfuscated with the exact preset. The decoded greedy answer must equal the plaintext
model's, and the server must never see the plaintext prompt."""
import json
import subprocess
import sys

import pytest
import torch

import aloepri
from aloepri.client import Client
from aloepri.inference import load_plain_model
from aloepri.proxy import build_proxy
from aloepri.serve_local import LocalServer, ServerThread
from conftest import smollm2_or_skip
from serving_helpers import Recorder, greedy, ngrams

openai = pytest.importorskip("openai")

QUESTIONS = ["What is the capital of France?", "Name the three primary colors."]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smol():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def stack(smol, smollm2_exact):
    """Obfuscated SmolLM2 served by serve-local (recorded) with the proxy in front; both on loopback threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    work = smollm2_exact[1].parent
    server = LocalServer(work / "server")
    recorder = Recorder(server.app())
    up = ServerThread(recorder).start()
    try:
        proxy = build_proxy(work / "client.key", up.url, tokenizer=smol)
        px = ServerThread(proxy.app()).start()
        try:
            yield {"work": work, "upstream": up.url, "proxy": px.url, "proxy_obj": proxy, "recorder": recorder}
        finally:
            px.stop()
    finally:
        up.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def expected(smol, stack):
    """Plaintext model, same prompts, transformers' greedy generate."""
    plain = load_plain_model(smol)
    core = stack["proxy_obj"].client.core
    tok = core.tokenizer
    out = {}
    for q in QUESTIONS:
        ids = core.chat_prompt_ids([{"role": "user", "content": q}])
        reply = greedy(plain, ids, MAX_TOKENS, core.key.special_tokens["eos_token_id"])
        out[q] = {"prompt_ids": ids, "reply_ids": reply, "text": tok.decode(reply, skip_special_tokens=True)}
    return out


def _sdk(stack):
    return openai.OpenAI(base_url=stack["proxy"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _completions_seen_by_server(stack):
    return [e for e in stack["recorder"].exchanges if e["path"] == "/v1/completions"]


def _assert_server_saw_no_plaintext(exchange, prompt_ids, question, answer):
    body = json.loads(exchange["request"])
    sent = body["prompt"]
    assert len(sent) == len(prompt_ids) and sent != prompt_ids
    # no run of three plaintext prompt ids appears anywhere in what the server received
    assert not ngrams(prompt_ids, 3) & ngrams(sent, 3)
    raw = exchange["request"] + exchange["response"]
    for word in question.replace("?", "").replace(".", "").split() + answer.replace(".", "").split():
        if len(word) > 3:
            assert word.encode() not in raw, word
    assert "stop" not in body  # stop strings never leave the client


@pytest.mark.parametrize("question", QUESTIONS)
def test_openai_sdk_chat_through_proxy_equals_plaintext(stack, expected, question):
    stack["recorder"].clear()
    r = _sdk(stack).chat.completions.create(model="anything", messages=[{"role": "user", "content": question}],
                                            max_tokens=MAX_TOKENS, temperature=0)
    want = expected[question]
    assert r.choices[0].message.content == want["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if len(want["reply_ids"]) < MAX_TOKENS else "length")
    assert r.usage.prompt_tokens == len(want["prompt_ids"])
    seen = _completions_seen_by_server(stack)
    assert len(seen) == 1
    _assert_server_saw_no_plaintext(seen[0], want["prompt_ids"], question, want["text"])
    if "France" in question:
        assert "Paris" in r.choices[0].message.content


@pytest.mark.parametrize("question", QUESTIONS)
def test_openai_sdk_streaming_chat_through_proxy_equals_plaintext(stack, expected, question):
    stack["recorder"].clear()
    stream = _sdk(stack).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    want = expected[question]
    assert "".join(pieces) == want["text"]
    assert sum(1 for p in pieces if p) > 3  # really streamed, not one blob
    assert finish in ("stop", "length") and usage.prompt_tokens == len(want["prompt_ids"])
    seen = _completions_seen_by_server(stack)
    assert len(seen) == 1 and json.loads(seen[0]["request"])["stream"] is True
    _assert_server_saw_no_plaintext(seen[0], want["prompt_ids"], question, want["text"])


@pytest.mark.parametrize("backend", ["openai-completions", "llamacpp-native", "openai-text"])
def test_client_backends_equal_plaintext(stack, expected, backend):
    """The SDK over each wire protocol (text mode: the neutral tokenizer round trip) gives the plaintext ids."""
    q = QUESTIONS[1]
    core = stack["proxy_obj"].client.core
    with Client(core.key, stack["upstream"], tokenizer=core.tokenizer, backend=backend) as c:
        assert c.verify() is True
        r = c.chat(q, max_tokens=MAX_TOKENS, temperature=0)
        streamed = list(c.chat(q, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert r.token_ids == expected[q]["reply_ids"]
    assert r.text == expected[q]["text"]
    assert [i for d in streamed for i in d.token_ids] == expected[q]["reply_ids"]
    assert "".join(d.text or "" for d in streamed) == expected[q]["text"]


def test_stop_string_is_applied_on_the_client(stack, expected):
    q = QUESTIONS[0]
    stack["recorder"].clear()
    r = _sdk(stack).chat.completions.create(model="m", messages=[{"role": "user", "content": q}],
                                            max_tokens=MAX_TOKENS, temperature=0, stop=["Paris"])
    full = expected[q]["text"]
    assert r.choices[0].message.content == full[: full.index("Paris")]
    assert r.choices[0].finish_reason == "stop"
    raw = _completions_seen_by_server(stack)[0]["request"]
    assert b"Paris" not in raw and b"stop\"" not in raw


def test_chat_cli_streams_an_answer(stack, smol):
    """`aloepri chat` as a person would use it, stdin piped (one line per turn)."""
    key = stack["work"] / "client.key"
    proc = subprocess.run(
        [sys.executable, "-m", "aloepri.cli", "chat", "--key", str(key), "--server", stack["upstream"],
         "--tokenizer", str(smol), "--temperature", "0", "--max-tokens", "24"],
        input="What is the capital of France?\n/exit\n", capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def _llama_cpp_server_available() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) for m in ("llama_cpp", "fastapi", "sse_starlette", "starlette_context",
                                                           "pydantic_settings"))
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _llama_cpp_server_available(), reason="llama-cpp-python[server] is not installed")
def test_text_mode_through_llama_cpp_python_server(stack, tmp_path):
    """llama-cpp-python's OpenAI server takes no int prompts: the text path (neutral tokenizer) carries the ids.
    Its reply must equal the same engine run on the permuted ids directly (llama_cpp.Llama), and the proxy must
    serve it to the openai SDK."""
    import time as _time

    import httpx2
    from llama_cpp import Llama

    from aloepri.gguf_export import export_gguf
    from serving_helpers import free_port

    gguf = tmp_path / "obf.gguf"
    export_gguf(stack["work"] / "server", gguf, "f32")
    core = stack["proxy_obj"].client.core
    key, q, n = core.key, QUESTIONS[0], 24
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "obf",
                             "--n_threads", "1", "--n_ctx", "512", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = _time.monotonic() + 120
        while _time.monotonic() < deadline:
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                _time.sleep(0.3)
        prompt = core.chat_prompt_ids([{"role": "user", "content": q}])
        with Client(key, f"http://127.0.0.1:{port}", model="obf", tokenizer=core.tokenizer, backend="openai-text") as c:
            text_path = c.chat(q, max_tokens=n, temperature=0, repetition_penalty=1.0)
        llm = Llama(model_path=str(gguf), n_ctx=512, n_threads=1, verbose=False)
        llm.eval(key.encode_ids(prompt))
        ids = []
        for _ in range(n):
            t = llm.sample(temp=0, repeat_penalty=1.0, top_k=1)
            if t in key.obfuscated_eos_ids():
                break
            ids.append(t)
            llm.eval([t])
        assert text_path.token_ids == key.decode_ids(ids)
        proxy = build_proxy(key, f"http://127.0.0.1:{port}", tokenizer=core.tokenizer, backend="openai-text")
        with ServerThread(proxy.app()) as url:
            r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": q}], max_tokens=n, temperature=0,
                extra_body={"repetition_penalty": 1.0})
        assert r.choices[0].message.content == text_path.text and "Paris" in text_path.text
    finally:
        proc.terminate()
        proc.wait(timeout=15)
