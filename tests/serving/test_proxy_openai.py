"""The OpenAI surface of `aloepri proxy`, tried with the official `openai` SDK on a tiny random model behind
aloepri serve-local (and scripted upstreams where the reply must be fixed): client API keys, unknown models,
models.retrieve, embeddings, logprobs, n > 1, tool calling, response_format; and the table of supported
features in docs/serving.md, request by request."""
import hmac
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import torch

import aloepri
from aloepri.runtime.inference import load_plain_model
from aloepri.serving.local_server import LocalServer, ServerThread
from aloepri.serving.proxy import build_proxy
from aloepri.serving.tools import ToolCallStream, parse_tool_calls
from aloepri.testing.engines import free_port
from serving_helpers import CharTokenizer, Recorder, greedy

openai = pytest.importorskip("openai")

MODEL = "server"  # serve-local lists the directory's name; the proxy shows the upstream's
PROMPT = [5, 17, 33, 40, 8, 61]
DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


class ToolTokenizer(CharTokenizer):
    """CharTokenizer with a chat template that renders tools, assistant tool calls and tool results in the
    manner of Qwen2.5's (tools in a system turn, calls as JSON with the arguments as an object, results as tool
    turns), tersely: the tiny model's context is 128 tokens. Two characters of the tiny vocabulary are swapped
    for the newline and the closing brace that JSON and tool calls need."""

    def __init__(self):
        super().__init__()
        self.chars = [{"\\": "\n", "^": "}"}.get(c, c) for c in self.chars]
        self.index = {c: i + 3 for i, c in enumerate(self.chars)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, tools=None, **_):
        text = ""
        if tools:
            text += "s:tools " + " ".join(t["function"]["name"] for t in tools) + "\n"
        for m in messages:
            body = m.get("content") or ""
            for c in m.get("tool_calls") or []:
                body += "call:" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             separators=(",", ":"))
            text += f"{m['role'][0]}:{body}\n"
        text += "a:" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


@pytest.fixture(scope="module")
def tiny(tiny_dir, tmp_path_factory):
    src = tiny_dir("llama")
    work = tmp_path_factory.mktemp("proxy-openai")
    aloepri.obfuscate(src, work / MODEL, work / "client.key", aloepri.resolve_params("exact"), seed=11,
                      allow_weak_seed=True, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"src": src, "server_dir": work / MODEL, "key": aloepri.load_key(work / "client.key"),
           "key_path": work / "client.key"}
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain(tiny):
    return load_plain_model(tiny["src"], dtype=torch.float64)


@pytest.fixture(scope="module")
def stack(tiny):
    """serve-local (recorded) with the proxy in front, which asks its clients for an API key."""
    server = LocalServer(tiny["server_dir"], dtype=torch.float64)
    rec = Recorder(server.app())
    up = ServerThread(rec).start()
    proxy = build_proxy(tiny["key"], up.url, tokenizer=ToolTokenizer(), chat_max_tokens=12, client_api_key="k-123")
    px = ServerThread(proxy.app()).start()
    yield {"url": px.url, "upstream": up.url, "recorder": rec, "proxy": proxy}
    px.stop()
    up.stop()


def sdk(url, api_key="k-123"):
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def _upstream_requests(stack) -> list[dict]:
    return [json.loads(e["request"]) for e in stack["recorder"].exchanges if e["path"] == "/v1/completions"]


def _chat_prompt(msgs, tools=None):
    return ToolTokenizer().apply_chat_template(msgs, tools=tools)


# ------------------------------------------------------------------------------------------- API keys


def test_api_key_is_required_on_every_v1_route(stack):
    url = stack["url"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-123"},
                    {"Authorization": "Bearer k-1234"}):
        for method, path, body in [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                                   ("POST", "/v1/completions", {"prompt": PROMPT}),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                                   ("POST", "/v1/embeddings", {"input": "x"}), ("GET", "/v1/nope", None)]:
            r = httpx2.request(method, url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert "k-123" not in r.text
    assert httpx2.get(url + "/health").status_code == 200  # a liveness probe needs no key
    with pytest.raises(openai.AuthenticationError):
        sdk(url, api_key="wrong").models.list()
    assert [m.id for m in sdk(url).models.list().data] == [MODEL]


def test_api_keys_are_compared_in_constant_time(stack, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert httpx2.get(stack["url"] + "/v1/models", headers={"Authorization": "Bearer k-999"}).status_code == 401
    assert calls == [(b"k-999", b"k-123")]


def test_proxy_cli_takes_the_api_key_from_the_environment(tiny):
    """`aloepri proxy` in its own process, key from $ALOEPRI_PROXY_API_KEY (the flag is --api-key)."""
    import os
    import time

    from aloepri.cli import build_parser

    args = build_parser().parse_args(["proxy", "--key", "k", "--upstream", "http://127.0.0.1:1", "--api-key", "abc",
                                      "--api-key", "def"])
    assert args.api_key == ["abc", "def"]
    server = LocalServer(tiny["server_dir"])
    with ServerThread(server.app()) as up:
        port = free_port()
        env = dict(os.environ, ALOEPRI_PROXY_API_KEY="env-key", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-m", "aloepri.cli", "proxy", "--key", str(tiny["key_path"]),
                                 "--upstream", up, "--port", str(port), "--log-level", "warning"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.2)
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            base = f"http://127.0.0.1:{port}/v1/completions"
            assert httpx2.post(base, json=body, timeout=60).status_code == 401
            assert httpx2.post(base, json=body, headers={"Authorization": "Bearer env-key"},
                               timeout=60).status_code == 200
        finally:
            proc.terminate()
            proc.wait(timeout=30)


# ------------------------------------------------------------------------ models, unknown models, embeddings


def test_unknown_model_is_404_and_never_reaches_the_upstream(stack):
    c = sdk(stack["url"])
    stack["recorder"].clear()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-4o" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4o", prompt=PROMPT, stream=True)
    assert not _upstream_requests(stack)
    m = c.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


def test_embeddings_are_refused_with_the_reason(stack):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(stack["url"]).embeddings.create(model=MODEL, input="hello")
    assert e.value.body["code"] == "unsupported_endpoint"
    assert "not supported" in e.value.body["message"] and "obfuscated" in e.value.body["message"]


# ---------------------------------------------------------------------------------------------- logprobs


def _plain_logprobs(plain, prompt_ids, reply_ids):
    """The plaintext model's log-softmax at each reply position (teacher-forced)."""
    with torch.no_grad():
        logits = plain(torch.tensor([prompt_ids + reply_ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(reply_ids)]


def _check_chat_logprobs(content, entries, plain, prompt, k):
    tok = ToolTokenizer()
    assert "".join(e["token"] for e in entries) == content
    ids = tok.encode(content, add_special_tokens=False)
    assert len(entries) == len(ids)
    ref = _plain_logprobs(plain, prompt, ids)
    for j, e in enumerate(entries):
        assert math.isclose(e["logprob"], float(ref[j, ids[j]]), abs_tol=1e-4)
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == k
        want_top = torch.topk(ref[j], k).indices.tolist()
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([i], skip_special_tokens=False)
                                                           for i in want_top]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_plaintext_models(stack, plain, stream):
    """Each token's logprob is the plaintext model's at that step (the exact preset keeps the logits), its
    top_logprobs are the plaintext top tokens, and the tokens concatenate to the content."""
    msgs = [{"role": "user", "content": "hi!"}]
    kw = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    c = sdk(stack["url"])
    stack["recorder"].clear()
    if stream:
        content, entries = "", []
        for ch in c.chat.completions.create(stream=True, **kw):
            for choice in ch.choices:
                content += choice.delta.content or ""
                if choice.logprobs and choice.logprobs.content:
                    entries += [e.model_dump() for e in choice.logprobs.content]
    else:
        r = c.chat.completions.create(**kw)
        content, entries = r.choices[0].message.content, [e.model_dump() for e in r.choices[0].logprobs.content]
    assert content == ToolTokenizer().decode(greedy(plain, _chat_prompt(msgs), 10, 2))
    _check_chat_logprobs(content, entries, plain, _chat_prompt(msgs), 3)
    sent = _upstream_requests(stack)[0]
    assert sent["logprobs"] == 3 and sent["return_tokens_as_token_ids"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_with_a_stop_string(stack, plain, stream):
    """Completions' logprobs (vLLM's shape); a stop string cuts the text, and the logprobs with it."""
    tok = ToolTokenizer()
    full = tok.decode(greedy(plain, tok.encode("a:b"), 12, 2))
    stop = full[4:6]
    want = full[: full.index(stop)]
    kw = dict(model=MODEL, prompt="a:b", max_tokens=12, temperature=0, logprobs=2, stop=[stop])
    c = sdk(stack["url"])
    if stream:
        text, tokens, token_lps, offsets = "", [], [], []
        for ch in c.completions.create(stream=True, **kw):
            for choice in ch.choices:
                text += choice.text
                if choice.logprobs:
                    tokens += choice.logprobs.tokens
                    token_lps += choice.logprobs.token_logprobs
                    offsets += choice.logprobs.text_offset
    else:
        r = c.completions.create(**kw)
        lp = r.choices[0].logprobs
        text, tokens, token_lps, offsets = r.choices[0].text, lp.tokens, lp.token_logprobs, lp.text_offset
    assert text == want and "".join(tokens) == want
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    ref = _plain_logprobs(plain, tok.encode("a:b"), tok.encode(want, add_special_tokens=False))
    ids = tok.encode(want, add_special_tokens=False)
    assert all(math.isclose(lp, float(ref[j, ids[j]]), abs_tol=1e-4) for j, lp in enumerate(token_lps))


def test_serve_local_logprobs_are_shaped_as_vllms(stack, tiny):
    """The engine side: ids as "token_id:N" labels, the sampled token first in top_logprobs, k + 1 at most."""
    prompt = tiny["key"].encode_ids(PROMPT)
    r = httpx2.post(stack["upstream"] + "/v1/completions", json={
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "return_tokens_as_token_ids": True,
        "return_token_ids": True}, timeout=60).json()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ch["token_ids"]]
    for label, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert next(iter(top)) == label and top[label] == value and len(top) in (2, 3)
    assert httpx2.post(stack["upstream"] + "/v1/completions", json={"prompt": prompt, "logprobs": 21},
                       timeout=30).status_code == 400


# -------------------------------------------------------------------------------------------------- n > 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_are_forwarded_and_each_decoded(stack, tiny, stream):
    """n = 3 sampled choices in one upstream request; each equals the reply that choice's seed gives alone
    (serve-local seeds choice i with seed + i), indexes kept."""
    c = sdk(stack["url"])
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=40, extra_body={"return_token_ids": True})
    stack["recorder"].clear()
    got: dict[int, list[int]] = {}
    if stream:
        finishes = {}
        for ch in c.completions.create(n=3, stream=True, **kw):
            for choice in ch.choices:
                got.setdefault(choice.index, []).extend(choice.model_extra.get("token_ids") or [])
                finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        assert all(f in ("stop", "length") for f in finishes.values())
    else:
        r = c.completions.create(n=3, **kw)
        got = {ch.index: ch.model_extra["token_ids"] for ch in r.choices}
        assert r.usage.completion_tokens >= sum(len(v) for v in got.values())
    assert sorted(got) == [0, 1, 2]
    sent = _upstream_requests(stack)
    assert len(sent) == 1 and sent[0]["n"] == 3
    for i in range(3):
        alone = c.completions.create(n=1, **{**kw, "seed": 40 + i})
        assert got[i] == alone.choices[0].model_extra["token_ids"]
    assert len({tuple(v) for v in got.values()}) > 1  # sampled: the choices differ


def test_n_greedy_chat_choices_equal_plaintext(stack, plain):
    msgs = [{"role": "user", "content": "ok?"}]
    want = ToolTokenizer().decode(greedy(plain, _chat_prompt(msgs), 8, 2))
    r = sdk(stack["url"]).chat.completions.create(model=MODEL, messages=msgs, n=2, temperature=0, max_tokens=8)
    assert [(ch.index, ch.message.content) for ch in r.choices] == [(0, want), (1, want)]
    pieces: dict[int, str] = {}
    for ch in sdk(stack["url"]).chat.completions.create(model=MODEL, messages=msgs, n=2, temperature=0,
                                                        max_tokens=8, stream=True):
        for choice in ch.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
    assert pieces == {0: want, 1: want}


# ---------------------------------------------------------------------------------------- tool calling

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _scripted_upstream(key, reply_text: str, seen: list):
    """An engine that answers every request with ``reply_text`` (as permuted ids of the CharTokenizer, then
    the permuted EOS), in vLLM's completions shape, streamed one token per event or whole."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    ids = key.encode_ids(ToolTokenizer().encode(reply_text, add_special_tokens=False)) + key.obfuscated_eos_ids()

    async def completions(request):
        body = await request.json()
        seen.append(body)
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}})

        async def events():
            for i in ids:
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [i]}]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "token_ids": [],
                                                      "finish_reason": "stop"}]}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def scripted(tiny):
    """``scripted(reply_text)`` -> (proxy url, requests the upstream got)."""
    import contextlib

    with contextlib.ExitStack() as st:
        def make(reply_text):
            seen: list = []
            up = st.enter_context(ServerThread(_scripted_upstream(tiny["key"], reply_text, seen),
                                               log_level="critical"))
            p = build_proxy(tiny["key"], up, tokenizer=ToolTokenizer(), served_model_name=MODEL)
            return st.enter_context(ServerThread(p.app())), seen
        yield make


def _stream_chat(url, **kw):
    content, calls, finish = "", {}, None
    for ch in sdk(url, "unused").chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in ch.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


BARE_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("before,reply", [("", CALL_TEXT), ("Let me see. ", CALL_TEXT), ("", BARE_CALL),
                                          ("", "```json\n" + BARE_CALL + "\n```")],
                         ids=["tagged", "text-then-tagged", "bare", "fenced"])
def test_tool_call_is_parsed_into_openai_tool_calls(scripted, before, reply):
    url, seen = scripted(before + reply)
    msgs = [{"role": "user", "content": "Paris?"}]
    r = sdk(url, "unused").chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == (before.strip() or None)
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools were rendered into the prompt on this side: the server got only their permuted ids
    assert b"get_weather" not in json.dumps(seen[0]).encode()
    content, calls, finish = _stream_chat(url, messages=msgs, tools=[WEATHER])
    assert content == before and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"].startswith("call_")


def test_tools_are_rendered_by_the_template_on_the_client(scripted, tiny):
    url, seen = scripted("Sunny.")
    msgs = [{"role": "user", "content": "Paris?"}]
    r = sdk(url, "unused").chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="auto")
    assert r.choices[0].message.content == "Sunny." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    prompt = ToolTokenizer().decode(tiny["key"].decode_ids(seen[0]["prompt"]))
    assert prompt == ToolTokenizer().apply_chat_template(msgs, tools=[WEATHER], tokenize=False)
    # tool_choice "none": the model is not shown the tools
    sdk(url, "unused").chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in ToolTokenizer().decode(tiny["key"].decode_ids(seen[1]["prompt"]))


def test_a_conversation_with_tool_calls_and_results_renders(scripted, tiny):
    url, seen = scripted("Sunny, 21 C.")
    msgs = [{"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = sdk(url, "unused").chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    assert r.choices[0].message.content == "Sunny, 21 C."
    prompt = ToolTokenizer().decode(tiny["key"].decode_ids(seen[0]["prompt"]))
    # the call's arguments reach the template as an object (templates write them with tojson), the result as a turn
    assert 'a:call:{"name":"get_weather","arguments":{"city":"Paris"}}\n' in prompt
    assert "t:sunny, 21 C\n" in prompt


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
                                  '{"name": "not_a_tool", "arguments": {}}', '{"city": "Paris"}', "[1, 2]"],
                         ids=["broken-json", "unknown-tool", "other-json", "a-list"])
def test_text_that_is_not_a_tool_call_stays_content(scripted, text):
    url, _ = scripted(text)
    msgs = [{"role": "user", "content": "x"}]
    r = sdk(url, "unused").chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER])
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    content, calls, finish = _stream_chat(url, messages=msgs, tools=[WEATHER])
    assert content == text and not calls and finish == "stop"


def test_tool_call_parsing_units():
    two = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Oslo")
    content, calls = parse_tool_calls(two)
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"]
    assert parse_tool_calls("no call here") is None
    unclosed = '<tool_call>{"name": "f", "arguments": {}}'  # cut by max_tokens after the JSON: still a call
    assert parse_tool_calls(unclosed)[1][0]["function"]["name"] == "f"
    s = ToolCallStream()
    out = "".join(s.push(ch) for ch in "Hi <tool" + "x <tool_call>{\"name\": \"f\"}</tool_call>")
    assert out == "Hi <toolx "
    rest, calls = s.finish()
    assert rest == "" and calls[0]["function"]["name"] == "f" and calls[0]["function"]["arguments"] == "{}"
    # a bare call object counts only when it names one of the request's tools
    assert parse_tool_calls('{"name": "f", "arguments": {"x": 1}}') is None
    assert parse_tool_calls('{"name": "f", "arguments": {"x": 1}}', {"f"})[1][0]["function"]["arguments"] == \
        '{"x": 1}'
    assert parse_tool_calls('{"name": "f", "arguments": {}, "extra": 1}', {"f"}) is None
    s = ToolCallStream({"f"})
    assert s.push("  ") == "" and s.push('{"name": "f",') == "" and s.push(' "arguments": {}}') == ""
    assert s.finish()[1][0]["function"]["name"] == "f"
    s = ToolCallStream({"f"})
    assert s.push(" Sure") == " Sure" and s.push(' {"name": "f"}') == ' {"name": "f"}'  # mid-text: content


def test_tool_requests_the_proxy_cannot_serve_are_refused(stack):
    url = stack["url"]
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    head = {"Authorization": "Bearer k-123"}
    for extra, needle in [({"tool_choice": "required"}, "obfuscated vocabulary"),
                          ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                           "obfuscated vocabulary"),
                          ({"tools": [{"type": "function", "function": {}}]}, "name"),
                          ({"functions": [WEATHER["function"]]}, "'tools'")]:
        r = httpx2.post(url + "/v1/chat/completions", json={**base, **extra}, headers=head, timeout=30)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (extra, r.text)
    r = httpx2.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [WEATHER]}, headers=head)
    assert r.status_code == 400 and "chat" in r.json()["error"]["message"]


def test_a_template_without_tools_refuses_them(tiny):
    class NoToolTemplate(CharTokenizer):
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    server = LocalServer(tiny["server_dir"])
    with ServerThread(server.app()) as up:
        p = build_proxy(tiny["key"], up, tokenizer=NoToolTemplate())
        with ServerThread(p.app()) as url:
            with pytest.raises(openai.BadRequestError) as e:
                sdk(url, "unused").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                           tools=[WEATHER])
    assert "does not render tools" in e.value.body["message"]


def test_response_format_json_is_refused_with_the_reason(stack):
    for rf in ({"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            sdk(stack["url"]).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                      response_format=rf)
        assert "obfuscated vocabulary" in e.value.body["message"] and e.value.body["param"] == "response_format"


# ------------------------------------------------------------------- docs/serving.md's table, row by row


def _doc_rows() -> list[dict[str, str]]:
    """The rows of the table under '### What the proxy supports' in docs/serving.md."""
    text = DOC.read_text()
    lines = text[text.index("### What the proxy supports"):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        table.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return [dict(zip(table[0], cells)) for cells in table[2:]]


def _full(c, endpoint, **kw):
    if endpoint == "chat":
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi!"}], **kw)
        return [(ch.index, ch.message.content) for ch in r.choices]
    r = c.completions.create(model=MODEL, prompt="a:b", **kw)
    return [(ch.index, ch.text) for ch in r.choices]


def _streamed(c, endpoint, **kw):
    out: dict[int, str] = {}
    if endpoint == "chat":
        for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi!"}], stream=True,
                                            **kw):
            for x in ch.choices:
                out[x.index] = out.get(x.index, "") + (x.delta.content or "")
    else:
        for ch in c.completions.create(model=MODEL, prompt="a:b", stream=True, **kw):
            for x in ch.choices:
                out[x.index] = out.get(x.index, "") + x.text
    return sorted(out.items())


CHAT_ONLY = ("tools", "tool_choice", "response_format")


def _run(c, endpoint, stream, **kw):
    if endpoint == "completions":  # the SDK's completions.create has no such arguments: send them anyway
        extra = {k: kw.pop(k) for k in CHAT_ONLY if k in kw}
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return (_streamed if stream else _full)(c, endpoint, **kw)


GREEDY = {"temperature": 0, "max_tokens": 10}


def _feature_sampling(c, endpoint, stream):
    kw = dict(temperature=0.8, top_p=0.9, seed=3, presence_penalty=0.2, frequency_penalty=0.1, max_tokens=8,
              extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1})
    assert _run(c, endpoint, stream, **kw) == _full(c, endpoint, **kw)  # seeded: the same reply either way


def _feature_stop(c, endpoint, stream):
    [(_, full)] = _full(c, endpoint, **GREEDY)
    stop = full[3:5]
    assert _run(c, endpoint, stream, stop=[stop], **GREEDY) == [(0, full[: full.index(stop)])]


def _feature_logit_bias(c, endpoint, stream):
    z = ToolTokenizer().encode("Z", add_special_tokens=False)[0]
    assert _run(c, endpoint, stream, logit_bias={str(z): 100}, temperature=0, max_tokens=4) == [(0, "ZZZZ")]


def _feature_logprobs(c, endpoint, stream):
    kw = dict(logprobs=True, top_logprobs=2) if endpoint == "chat" else dict(logprobs=2)
    if not stream:
        if endpoint == "chat":
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi!"}], **kw, **GREEDY)
            tokens = [e.token for e in r.choices[0].logprobs.content]
            text = r.choices[0].message.content
        else:
            r = c.completions.create(model=MODEL, prompt="a:b", **kw, **GREEDY)
            tokens, text = r.choices[0].logprobs.tokens, r.choices[0].text
        assert "".join(tokens) == text and tokens
        return
    tokens, text = [], ""
    if endpoint == "chat":
        for ch in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi!"}], stream=True,
                                            **kw, **GREEDY):
            for x in ch.choices:
                text += x.delta.content or ""
                tokens += [e.token for e in (x.logprobs.content if x.logprobs and x.logprobs.content else [])]
    else:
        for ch in c.completions.create(model=MODEL, prompt="a:b", stream=True, **kw, **GREEDY):
            for x in ch.choices:
                text += x.text
                tokens += x.logprobs.tokens if x.logprobs else []
    assert "".join(tokens) == text and tokens


def _feature_n(c, endpoint, stream):
    [(_, one)] = _full(c, endpoint, **GREEDY)
    assert _run(c, endpoint, stream, n=3, **GREEDY) == [(0, one), (1, one), (2, one)]


def _feature_tools(c, endpoint, stream):
    _run(c, endpoint, stream, tools=[WEATHER], **GREEDY)  # the tiny random model calls no tool: a plain reply


def _feature_tool_choice_forced(c, endpoint, stream):
    _run(c, endpoint, stream, tools=[WEATHER], tool_choice="required", **GREEDY)


def _feature_response_format(c, endpoint, stream):
    _run(c, endpoint, stream, response_format={"type": "json_object"}, **GREEDY)


def _feature_echo(c, endpoint, stream):
    _run(c, endpoint, stream, echo=True, **GREEDY)


def _feature_suffix(c, endpoint, stream):
    _run(c, endpoint, stream, suffix="x", **GREEDY)


def _feature_best_of(c, endpoint, stream):
    _run(c, endpoint, stream, best_of=2, **GREEDY)


def _feature_images(c, endpoint, stream):
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    if stream:
        list(c.chat.completions.create(model=MODEL, messages=msgs, stream=True, **GREEDY))
    else:
        c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)


FEATURES = {
    "sampling parameters": _feature_sampling,
    "`stop`": _feature_stop,
    "`logit_bias`": _feature_logit_bias,
    "`logprobs` / `top_logprobs`": _feature_logprobs,
    "`n` > 1": _feature_n,
    "`tools`, `tool_choice` auto / none": _feature_tools,
    "`tool_choice` required / a named function": _feature_tool_choice_forced,
    "`response_format` json_object / json_schema": _feature_response_format,
    "`echo`": _feature_echo,
    "`suffix`": _feature_suffix,
    "`best_of` > 1": _feature_best_of,
    "image / audio content parts": _feature_images,
}


def test_the_doc_table_lists_exactly_the_features_tested_here():
    assert [r["feature"] for r in _doc_rows()] == list(FEATURES)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_doc_table_row_holds(stack, feature, endpoint):
    """A "yes" in the table: the feature works through the SDK (streamed too when the streamed column says
    yes); a "no": the proxy answers 400; "–": the endpoint has no such field."""
    row = next(r for r in _doc_rows() if r["feature"] == feature)
    claim, streamed = row[endpoint], row["streamed"]
    c = sdk(stack["url"])
    if claim == "–":
        return
    for stream in (False, True):
        works = claim == "yes" and (not stream or streamed == "yes")
        if works:
            FEATURES[feature](c, endpoint, stream)
        else:
            with pytest.raises(openai.BadRequestError):
                FEATURES[feature](c, endpoint, stream)


# ------------------------------------------------------- a model trained for tool calls: Qwen2.5-Coder-0.5B


@pytest.mark.slow
def test_qwen_coder_calls_a_tool_through_the_proxy(tmp_path):
    """Qwen2.5-Coder-0.5B-Instruct (trained on Qwen2.5's tool format), obfuscated with the exact preset, served
    by serve-local: asked a question only the tool can answer, it calls the tool, and the proxy returns it as
    OpenAI tool_calls, streamed and not; with the tool's result in the conversation it answers in text."""
    from aloepri.models import ModelNotInstalledError, qwen25_coder_05b_gguf

    try:
        gguf = qwen25_coder_05b_gguf()
    except ModelNotInstalledError as e:
        pytest.skip(str(e))
    aloepri.obfuscate(gguf, tmp_path / "server", tmp_path / "client.key", aloepri.resolve_params("exact"),
                      seed=5, allow_weak_seed=True, progress=False, dtype="float32")
    server = LocalServer(tmp_path / "server", dtype=torch.float32)
    with ServerThread(server.app()) as up:
        p = build_proxy(tmp_path / "client.key", up, tokenizer=str(gguf), served_model_name="qwen")
        with ServerThread(p.app()) as url:
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            msgs = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
            r = c.chat.completions.create(model="qwen", messages=msgs, tools=[WEATHER], temperature=0, max_tokens=64)
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", ch.message.content
            [call] = ch.message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"].lower().startswith("paris")
            content, calls, finish = "", {}, None
            for chunk in c.chat.completions.create(model="qwen", messages=msgs, tools=[WEATHER], temperature=0,
                                                   max_tokens=64, stream=True):
                for x in chunk.choices:
                    content += x.delta.content or ""
                    for tc in x.delta.tool_calls or []:
                        calls[tc.index] = (tc.function.name, tc.function.arguments)
                    finish = x.finish_reason or finish
            assert finish == "tool_calls" and calls[0] == (call.function.name, call.function.arguments)
            history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, '
                                                                                   '"sky": "sunny"}'}]
            r = c.chat.completions.create(model="qwen", messages=history, tools=[WEATHER], temperature=0,
                                          max_tokens=48)
            assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
            assert re.search(r"21|sunny", r.choices[0].message.content, re.I), r.choices[0].message.content


def test_reply_decoder_logprobs_follow_the_text_across_multibyte_characters_and_stop_strings():
    """Byte tokens (a character spans several): each entry's token is the text it adds ("" inside a character),
    entries are handed out with their text, and a stop string cuts them with it."""
    import numpy as np

    from aloepri.keyfile import KeyFile
    from aloepri.serving.client import ReplyDecoder

    class ByteTokenizer:
        def decode(self, ids, skip_special_tokens=True, **_):
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    perm = np.random.default_rng(3).permutation(257).tolist()
    key = KeyFile(vocab_permutation=perm, model_fingerprint="0" * 64, params={}, seed=0, h_effective=0,
                  hidden_size=0, source="", architecture="llama", special_tokens={"eos_token_id": 256})
    text = "né 🙂 ok"
    ids = list(text.encode())
    server = key.encode_ids(ids)
    lps = [(-0.1 * (j + 1), [(server[j], -0.1 * (j + 1)), (key.encode_ids([65])[0], -5.0)]) for j in range(len(ids))]
    for stop, want in [(None, text), ("ok", "né 🙂 "), ("🙂", "né ")]:
        dec = ReplyDecoder(key, ByteTokenizer(), stop=[stop] if stop else [])
        deltas = [dec.feed([sid], [lp]) for sid, lp in zip(server, lps)]
        if not dec.done:
            deltas.append(dec.finish("stop"))
        out_text = "".join(d.text for d in deltas)
        handed = [e for d in deltas for e in d.logprobs]
        assert out_text == want == "".join(e.token for e in handed) == "".join(e.token for e in dec.logprobs)
        for d in deltas:  # each delta carries the entries of its own text, no more
            assert "".join(e.token for e in d.logprobs) == d.text
        assert [e.token_id for e in handed] == ids[: len(handed)]
        assert handed[0].top == [(ids[0], "n", -0.1), (65, "A", -5.0)]
        assert len(handed) == len(want.encode())


def test_the_text_backend_refuses_logprobs_and_choices(stack, tiny):
    """The text path gets text back, not ids: logprobs and n are refused with the reason."""
    backend = "openai-text"
    p = build_proxy(tiny["key"], stack["upstream"], tokenizer=ToolTokenizer(), backend=backend)
    with ServerThread(p.app()) as url:
        c = sdk(url, "unused")
        for kw, needle in [({"logprobs": 1}, "'logprobs'"), ({"n": 2}, "'n'")]:
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
            assert needle in e.value.body["message"] and backend in e.value.body["message"]
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices[0].text


def test_sdk_client_n_and_logprobs(stack, tiny, plain):
    """The Python SDK straight to serve-local: n > 1 gives one Completion per choice; logprobs per token."""
    from aloepri.serving.client import Client

    want = greedy(plain, PROMPT, 6, 2)
    with Client(tiny["key"], stack["upstream"]) as c:
        both = c.complete(PROMPT, max_tokens=6, temperature=0, n=2, logprobs=1)
        streamed = list(c.stream_complete(PROMPT, max_tokens=6, temperature=0, n=2))
        one = c.complete(PROMPT, max_tokens=6, temperature=0, logprobs=0)
    assert [(r.index, r.token_ids) for r in both] == [(0, want), (1, want)]
    assert [e.token_id for e in both[1].logprobs] == want and all(len(e.top) in (1, 2) for e in both[1].logprobs)
    for i in (0, 1):
        assert [t for d in streamed if d.index == i for t in d.token_ids] == want
    assert one.token_ids == want and [e.token_id for e in one.logprobs] == want
    ref = _plain_logprobs(plain, PROMPT, want)
    assert all(math.isclose(e.logprob, float(ref[j, want[j]]), abs_tol=1e-4) for j, e in enumerate(one.logprobs))
    assert all(e.token is None and e.top == [(want[j], None, e.logprob)] for j, e in enumerate(one.logprobs))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_llamacpp_native_n_and_logprobs_as_llama_server_gives_them(stack, tiny, plain, stream):
    """llama.cpp's /completion shape (serve-local imitates llama-server's: n answers as a list or events with their
    index, logprobs in completion_probabilities by id): n greedy choices each equal plaintext greedy, and each
    token's logprob is the plaintext model's. The real llama-server: tests/serving/test_llama_server.py."""
    from aloepri.serving.client import Client

    want = greedy(plain, PROMPT, 6, 2)
    ref = _plain_logprobs(plain, PROMPT, want)
    with Client(tiny["key"], stack["upstream"], backend="llamacpp-native") as c:
        if stream:
            deltas = list(c.stream_complete(PROMPT, max_tokens=6, temperature=0, n=2, logprobs=2))
            got = {i: ([t for d in deltas if d.index == i for t in d.token_ids],
                       [e for d in deltas if d.index == i for e in d.logprobs or []]) for i in (0, 1)}
        else:
            both = c.complete(PROMPT, max_tokens=6, temperature=0, n=2, logprobs=2)
            got = {r.index: (r.token_ids, r.logprobs) for r in both}
    for i in (0, 1):
        ids, lps = got[i]
        assert ids == want and [e.token_id for e in lps] == want
        assert all(math.isclose(e.logprob, float(ref[j, want[j]]), abs_tol=1e-4) for j, e in enumerate(lps))
        assert all(len(e.top) == 2 and e.top[0][0] == want[j] for j, e in enumerate(lps))
    sent = json.loads([e for e in stack["recorder"].exchanges if e["path"] == "/completion"][-1]["request"])
    assert sent["n"] == 2 and sent["n_probs"] == 2 and sent["return_tokens"] is True
