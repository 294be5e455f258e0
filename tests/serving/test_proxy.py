"""End to end on real weights, SmolLM2-135M-Instruct obfuscated with the exact preset, the official `openai`
client talking to `aloepri proxy`:

* against aloepri serve-local (transformers, in process): the decoded greedy answer equals the plaintext
  transformers model's;
* against a real llama.cpp server (llama-cpp-python's, its own process, f32 GGUF): the decoded greedy answer
  equals the plaintext f32 GGUF's greedy answer on the same engine, token for token.

Both times a recorder keeps what the server received and sent: it must hold no plaintext prompt id run and no
word of the question or the answer."""
import contextlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

import aloepri
from aloepri.serving.client import Client
from aloepri.runtime.inference import load_plain_model
from aloepri.serving.proxy import build_proxy
from aloepri.serving.local_server import LocalServer, ServerThread
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
    r = _sdk(stack).chat.completions.create(model="server", messages=[{"role": "user", "content": question}],
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
        model="server", messages=[{"role": "user", "content": question}], max_tokens=MAX_TOKENS, temperature=0,
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
        streamed = list(c.stream_chat(q, max_tokens=MAX_TOKENS, temperature=0))
    assert r.token_ids == expected[q]["reply_ids"]
    assert r.text == expected[q]["text"]
    assert [i for d in streamed for i in d.token_ids] == expected[q]["reply_ids"]
    assert "".join(d.text or "" for d in streamed) == expected[q]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_on_real_weights_are_plaintext_tokens(smol, stack, expected, stream):
    """SmolLM2's byte-level BPE: the returned tokens concatenate to the content, and each sampled token's
    logprob is the plaintext model's (exact preset)."""
    q = QUESTIONS[1]
    kw = dict(model="server", messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0,
              logprobs=True, top_logprobs=2)
    if stream:
        content, entries = "", []
        for chunk in _sdk(stack).chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                entries += c.logprobs.content if c.logprobs and c.logprobs.content else []
    else:
        r = _sdk(stack).chat.completions.create(**kw)
        content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
    want = expected[q]
    assert content == want["text"] == "".join(e.token for e in entries)
    assert len(entries) == len(want["reply_ids"])
    plain = load_plain_model(smol)
    with torch.no_grad():
        logits = plain(torch.tensor([want["prompt_ids"] + want["reply_ids"]])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(want["prompt_ids"]) - 1:-1]
    for j, e in enumerate(entries):
        assert abs(e.logprob - float(ref[j, want["reply_ids"][j]])) < 2e-3
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob


def test_stop_string_is_applied_on_the_client(stack, expected):
    q = QUESTIONS[0]
    stack["recorder"].clear()
    r = _sdk(stack).chat.completions.create(model="server", messages=[{"role": "user", "content": q}],
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


# ------------------------------------------------------------------ a real llama.cpp server (llama-cpp-python)


def _llama_cpp_server_available() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) for m in ("llama_cpp", "fastapi", "sse_starlette", "starlette_context",
                                                           "pydantic_settings"))
    except (ImportError, ValueError):
        return False


LLAMA_MAX_TOKENS = 24
GREEDY = {"temperature": 0, "extra_body": {"repetition_penalty": 1.0}}  # llama-cpp-python defaults to 1.1


@pytest.fixture(scope="module")
def llamacpp(smol, smollm2_exact, tmp_path_factory):
    """Two llama.cpp servers (llama-cpp-python's OpenAI server, one thread, f32 KV cache, n_ctx 512), each in
    its own process on loopback: the obfuscated SmolLM2 (exact preset) exported to f32 GGUF, and the plaintext
    SmolLM2 exported the same way (same f32 weights the obfuscation started from). A recording forwarder sits
    between `aloepri proxy` (no backend given: it finds the text backend, llama-cpp-python's server takes no int
    prompts) and the obfuscated server, so the test sees every byte that server received and sent."""
    if not _llama_cpp_server_available():
        pytest.skip("llama-cpp-python[server] is not installed")
    from aloepri.export.gguf import export_gguf, plaintext_reference_dir
    from aloepri.testing.engines import LlamaCppServer
    from serving_helpers import Forwarder

    _, server_dir, key_path = smollm2_exact
    work = tmp_path_factory.mktemp("llamacpp")
    export_gguf(server_dir, work / "obf.gguf", "f32")
    export_gguf(plaintext_reference_dir(smol, work / "plain"), work / "plain.gguf", "f32")
    with contextlib.ExitStack() as stack:
        # last out: the ~2 GB of weights go once both servers are down (pytest keeps its last temp dirs)
        stack.callback(lambda: [shutil.rmtree(work / "plain", ignore_errors=True)]
                       + [p.unlink(missing_ok=True) for p in (work / "obf.gguf", work / "plain.gguf")])
        obf_url = stack.enter_context(LlamaCppServer(work / "obf.gguf", work / "obf.log", alias="obfuscated"))
        plain_url = stack.enter_context(LlamaCppServer(work / "plain.gguf", work / "plain.log", alias="plain"))
        recorder = Recorder(Forwarder(obf_url))
        tap = stack.enter_context(ServerThread(recorder))
        # no backend given: the proxy probes llama-cpp-python's server (no /props, no int prompts, neutral text
        # back) and takes the text path
        proxy = build_proxy(key_path, tap, tokenizer=smol, backend="auto",
                            model_meta=str(server_dir / "aloepri_model.json"))
        url = stack.enter_context(ServerThread(proxy.app()))
        assert proxy.client.core.backend.name == "openai-text"
        assert proxy.fingerprint_status == "verified-local-meta"
        yield {"proxy": url, "tap": tap, "plain": plain_url, "recorder": recorder, "core": proxy.client.core}


def _plain_reference(llamacpp, question: str, stream: bool):
    """The plaintext model's greedy reply on the same engine, to the same request shape (same prompt ids, same
    stream flag, so that both servers see the same sequence of requests and reuse their KV cache alike)."""
    from serving_helpers import neutral_completion

    core = llamacpp["core"]
    prompt = core.chat_prompt_ids([{"role": "user", "content": question}])
    ids, finish = neutral_completion(llamacpp["plain"], prompt, LLAMA_MAX_TOKENS, stream)
    assert ids and finish in ("stop", "length"), (ids, finish)
    return prompt, ids, finish, core.tokenizer.decode(ids, skip_special_tokens=True)


def _llamacpp_exchange(llamacpp, stream: bool):
    """The one completion request the obfuscated llama.cpp server received, and the permuted ids it answered."""
    from aloepri.obfuscation.server_tokenizer import neutral_text_to_ids
    from serving_helpers import sse_data

    seen = [e for e in llamacpp["recorder"].exchanges if e["path"] == "/v1/completions"]
    assert len(seen) == 1 and seen[0]["status"] == 200
    ex = seen[0]
    body = json.loads(ex["request"])
    assert body["stream"] is stream
    if stream:
        text = "".join(c.get("text") or "" for ev in sse_data(ex["response"]) for c in ev.get("choices") or [])
    else:
        text = json.loads(ex["response"])["choices"][0]["text"]
    return ex, body, neutral_text_to_ids(body["prompt"]), neutral_text_to_ids(text)


def _assert_llamacpp_saw_no_plaintext(ex, body, sent_ids, prompt_ids, question, answer):
    assert len(sent_ids) == len(prompt_ids) and sent_ids != prompt_ids
    assert not ngrams(prompt_ids, 3) & ngrams(sent_ids, 3)  # no run of three plaintext prompt ids
    raw = ex["request"] + ex["response"]
    words = {w.strip(".,:;!?()\"'") for w in (question + " " + answer).split()}
    for word in sorted(w for w in words if len(w) > 3):
        assert word.encode() not in raw, word
    assert "stop" not in body  # stop strings never leave the client


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("question", QUESTIONS)
def test_openai_sdk_through_proxy_on_llama_cpp_equals_plaintext_on_llama_cpp(llamacpp, question, stream):
    """End to end: official openai SDK -> aloepri proxy -> (recording tap) -> llama.cpp server on
    the obfuscated f32 GGUF. The greedy answer equals the plaintext f32 GGUF's greedy answer on the same engine,
    token for token, and the server saw neither the plaintext ids nor any word of the question or answer."""
    key = llamacpp["core"].key
    llamacpp["recorder"].clear()
    sdk = openai.OpenAI(base_url=llamacpp["proxy"] + "/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": question}]
    if stream:
        pieces, finish, usage = [], None, None
        for chunk in sdk.chat.completions.create(model="obfuscated", messages=messages, max_tokens=LLAMA_MAX_TOKENS,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY):
            usage = chunk.usage or usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        content = "".join(pieces)
        assert sum(1 for p in pieces if p) > 3  # really streamed, not one blob
    else:
        r = sdk.chat.completions.create(model="obfuscated", messages=messages, max_tokens=LLAMA_MAX_TOKENS, **GREEDY)
        content, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert r.choices[0].message.role == "assistant"
    ex, body, sent_ids, reply_server_ids = _llamacpp_exchange(llamacpp, stream)

    prompt, want_ids, want_finish, want_text = _plain_reference(llamacpp, question, stream)
    assert sent_ids == key.encode_ids(prompt)
    assert key.decode_ids(reply_server_ids) == want_ids  # token for token, EOS excluded on both sides
    assert content == want_text
    assert finish == want_finish
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(want_ids)
    if "France" in question:
        assert "Paris" in content
    _assert_llamacpp_saw_no_plaintext(ex, body, sent_ids, prompt, question, want_text)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_sdk_text_backend_on_llama_cpp_equals_plaintext(llamacpp, stream):
    """The Python SDK straight to the llama.cpp server (no proxy), text backend, sync client."""
    core, q = llamacpp["core"], QUESTIONS[1]
    llamacpp["recorder"].clear()
    with Client(core.key, llamacpp["tap"], tokenizer=core.tokenizer, backend="openai-text") as c:
        if stream:
            deltas = list(c.stream_chat(q, max_tokens=LLAMA_MAX_TOKENS, temperature=0, repetition_penalty=1.0))
            ids, text = [i for d in deltas for i in d.token_ids], "".join(d.text or "" for d in deltas)
        else:
            r = c.chat(q, max_tokens=LLAMA_MAX_TOKENS, temperature=0, repetition_penalty=1.0)
            ids, text = r.token_ids, r.text
    ex, body, sent_ids, _ = _llamacpp_exchange(llamacpp, stream)
    prompt, want_ids, _, want_text = _plain_reference(llamacpp, q, stream)
    assert ids == want_ids and text == want_text
    _assert_llamacpp_saw_no_plaintext(ex, body, sent_ids, prompt, q, want_text)
