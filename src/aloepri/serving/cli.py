"""Command line for serving: ``aloepri serve-local``, ``aloepri proxy`` and ``aloepri chat``.

Registered into the main parser by :func:`add_serving_commands`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, TextIO

from .client import BACKENDS
from .http import DEFAULT_MAX_REQUEST_BYTES
from .limits import DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_QUEUE

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_WILDCARD = ("0.0.0.0", "::", "")


def _add_client_args(p: argparse.ArgumentParser, server_flag: str, auto_backend: bool = False) -> None:
    p.add_argument("--key", required=True, help="the client's secret key file (written by 'aloepri obfuscate')")
    p.add_argument(server_flag, required=True, dest="server",
                   help="base URL of the inference server holding the obfuscated model, e.g. http://127.0.0.1:8000")
    protocols = ("openai-completions (token-id prompts, vLLM/SGLang/aloepri serve-local), llamacpp-native "
                 "(llama.cpp's llama-server /completion), openai-text (the neutral-tokenizer text path)")
    if auto_backend:
        p.add_argument("--backend", choices=("auto",) + BACKENDS, default="auto",
                       help=f"wire protocol: auto (default: probe the server at start and choose) or {protocols}")
    else:
        p.add_argument("--backend", choices=BACKENDS, default="openai-completions",
                       help=f"wire protocol: {protocols}")
    p.add_argument("--model", default=None, help="model name on the server (default: the first it lists)")
    p.add_argument("--tokenizer", default=None,
                   help="plaintext tokenizer directory or .gguf (default: the source checkpoint the key names)")
    p.add_argument("--server-tokenizer", default=None,
                   help="text mode only: the server's tokenizer (directory or .gguf); default: the aloepri neutral "
                        "tokenizer, computed on this side")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server (default 300)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking the key against the model the server serves (at start and on every "
                        "reply; see docs/serving.md)")
    p.add_argument("--model-meta", default=None,
                   help="local copy of the server directory's aloepri_model.json to check the key against")
    p.add_argument("--strict", action="store_true",
                   help="refuse a key file that other users can access (default: warn, as ssh does)")


def add_serving_commands(sub: Any) -> None:
    """Add serve-local, proxy and chat to the ``aloepri`` subcommands."""
    p = sub.add_parser("serve-local", help="serve an obfuscated model directory with transformers (OpenAI-compatible, "
                                           "token-id prompts; holds no key)")
    p.add_argument("model_dir", help="the obfuscated model directory (the server's artifact)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="name listed in /v1/models (default: the directory name)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "float64"])
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve_local)

    p = sub.add_parser("proxy", help="local OpenAI-compatible privacy proxy: obfuscates requests to an untrusted "
                                     "server and decodes its replies")
    _add_client_args(p, "--upstream", auto_backend=True)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: the proxy holds the key)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--served-model-name", default=None, help="model name the proxy shows its clients "
                                                             "(default: the upstream's)")
    p.add_argument("--upstream-api-key", default=os.environ.get("ALOEPRI_UPSTREAM_API_KEY"),
                   help="bearer token for the upstream (default: $ALOEPRI_UPSTREAM_API_KEY)")
    p.add_argument("--api-key", action="append", default=None,
                   help="key the proxy's own clients must send (Authorization: Bearer KEY) on every /v1 route, as "
                        "'vllm serve --api-key'; repeatable: each key is one client for the limits below (default: "
                        "$ALOEPRI_PROXY_API_KEY; none: no check)")
    p.add_argument("--max-tokens", type=int, default=512,
                   help="reply length for chat requests that give no max_tokens (default 512)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens forwarded to the upstream; larger requests are capped (always also "
                        "capped at the model's context less the prompt, when the upstream or the key's source "
                        "checkpoint tells the context)")
    p.add_argument("--upstream-wait", type=float, default=60.0,
                   help="seconds to wait at start for an upstream that is not up yet (started together with the "
                        "proxy) before refusing to start (default 60; 0: start without it)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB)")
    p.add_argument("--rate-limit", type=float, default=None, metavar="PER_SECOND",
                   help="requests per second per client (per --api-key, else per address); over it: 429 with "
                        "Retry-After (default: no rate limit)")
    p.add_argument("--rate-burst", type=float, default=None, metavar="REQUESTS",
                   help="requests a client may send at once within --rate-limit (default: one second's worth)")
    p.add_argument("--max-concurrent", type=int, default=DEFAULT_MAX_CONCURRENT,
                   help=f"requests per client in flight upstream at once (default {DEFAULT_MAX_CONCURRENT}); the "
                        "next ones wait in a queue")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"requests per client waiting for --max-concurrent (default {DEFAULT_MAX_QUEUE}); any more "
                        "get 429 with Retry-After")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name clients may address besides localhost, 127.0.0.1 and ::1 (repeatable; '*': "
                        "any). Anything else is refused: a web page could reach the proxy by DNS rebinding")
    p.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (e.g. http://localhost:3000) whose pages may call the proxy from a browser "
                        "(repeatable; '*': any). Requests with any other Origin header are refused")
    p.add_argument("--log-plaintext", action="store_true",
                   help="log prompts and replies in plaintext (off by default: the log has counts and timings only)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_proxy)

    p = sub.add_parser("chat", help="chat with an obfuscated model from the terminal (streams the reply)")
    _add_client_args(p, "--server")
    p.add_argument("--api-key", default=os.environ.get("ALOEPRI_API_KEY"),
                   help="bearer token for the server (default: $ALOEPRI_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="reply length limit (default 512)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; default 0: greedy, the most likely token each step, so a question "
                        "gets the same answer every time (raise it, e.g. 0.7, to sample)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable; checked on this side)")
    p.set_defaults(func=cmd_chat)


def _check_common(a: argparse.Namespace) -> None:
    """Refuse bad flag values before anything is loaded or started (ValueError: one line, exit 2)."""
    import math

    if getattr(a, "server", None) is not None:
        from .client import normalize_base_url

        normalize_base_url(a.server)
    if getattr(a, "port", None) is not None and not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port}: give a port number in 0..65535")
    if getattr(a, "timeout", None) is not None and not (math.isfinite(a.timeout) and a.timeout > 0):
        raise ValueError(f"--timeout {a.timeout}: give a positive number of seconds")
    if getattr(a, "upstream_wait", None) is not None and not (math.isfinite(a.upstream_wait) and a.upstream_wait >= 0):
        raise ValueError(f"--upstream-wait {a.upstream_wait}: give a number of seconds, 0 or more")
    for flag in ("max_tokens", "max_tokens_limit", "threads", "max_request_bytes", "max_concurrent"):
        v = getattr(a, flag, None)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {v}: give a positive integer")
    if getattr(a, "max_queue", None) is not None and a.max_queue < 0:
        raise ValueError(f"--max-queue {a.max_queue}: give a number of requests, 0 or more")
    rate = getattr(a, "rate_limit", None)
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--rate-limit {rate}: give a positive number of requests per second")
    burst = getattr(a, "rate_burst", None)
    if burst is not None and not (math.isfinite(burst) and burst >= 1):
        raise ValueError(f"--rate-burst {burst}: give a number of requests, at least 1")
    if burst is not None and rate is None:
        raise ValueError("--rate-burst needs --rate-limit")


def _check_key_file(a: argparse.Namespace) -> None:
    """Warn about a key file other users can access (refuse it with --strict); a missing or directory path is left
    to the key loader, which says so."""
    from ..keyfile import key_file_exposure

    if not os.path.isfile(a.key):
        return
    problem = key_file_exposure(a.key)
    if problem and a.strict:
        raise ValueError(f"{problem} (refused: --strict)")
    if problem:
        print(f"warning: {problem}", file=sys.stderr)


def cmd_serve_local(a: argparse.Namespace) -> int:
    from .local_server import serve_local

    _check_common(a)
    serve_local(a.model_dir, host=a.host, port=a.port, model_name=a.model_name, threads=a.threads,
                log_level=a.log_level, dtype=a.dtype, max_request_bytes=a.max_request_bytes)
    return 0


def cmd_proxy(a: argparse.Namespace) -> int:
    import uvicorn

    from .client import UpstreamError
    from .proxy import STABLE_MODEL_NAME, build_proxy

    _check_common(a)
    _check_key_file(a)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), format="%(asctime)s %(name)s %(message)s")
    if a.log_level != "debug":  # the HTTP client's line per upstream request: noise, and the proxy logs its own
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    env_key = os.environ.get("ALOEPRI_PROXY_API_KEY")
    api_keys = a.api_key if a.api_key is not None else ([env_key] if env_key is not None else [])
    if any(not k.strip() for k in api_keys):
        raise ValueError("--api-key (or $ALOEPRI_PROXY_API_KEY) is empty: give a key, or unset it for no check")
    allowed_hosts = list(a.allowed_host)
    if a.host not in _LOOPBACK:
        who = "anyone with the --api-key" if api_keys else "anyone who reaches this port"
        print(f"warning: listening on {a.host}: {who} can use your key to read what the model says; keep the proxy "
              "on loopback unless that is intended", file=sys.stderr)
        if a.host in _WILDCARD and not allowed_hosts:
            print("warning: only requests addressed to localhost are answered; give --allowed-host NAME for each "
                  "name clients use to reach this machine", file=sys.stderr)
        elif a.host not in _WILDCARD:
            allowed_hosts.append(a.host)
    try:
        proxy = build_proxy(a.key, a.server, model=a.model, served_model_name=a.served_model_name,
                            backend=a.backend, tokenizer=a.tokenizer, server_tokenizer=a.server_tokenizer,
                            api_key=a.upstream_api_key, timeout=a.timeout, log_plaintext=a.log_plaintext,
                            chat_max_tokens=a.max_tokens, verify=not a.no_verify, model_meta=a.model_meta,
                            max_tokens_limit=a.max_tokens_limit, client_api_key=api_keys,
                            upstream_wait=a.upstream_wait, max_request_bytes=a.max_request_bytes,
                            allowed_hosts=allowed_hosts, allowed_origins=a.allowed_origin, rate_limit=a.rate_limit,
                            rate_burst=a.rate_burst, max_concurrent=a.max_concurrent, max_queue=a.max_queue)
    except UpstreamError as e:  # the upstream never came up: one line, exit 2, as for a bad flag
        raise ValueError(str(e)) from None
    backend = proxy.client.core.backend.name + (" (detected)" if a.backend == "auto" else "")
    print(f"aloepri proxy: http://{a.host}:{a.port}/v1 -> {a.server} ({backend}), model '{proxy.model_name}' "
          f"(or '{STABLE_MODEL_NAME}'), "
          f"key check: {proxy.fingerprint_status}, client API key: {'required' if api_keys else 'none'}",
          file=sys.stderr, flush=True)
    uvicorn.run(proxy.app(), host=a.host, port=a.port, log_level=a.log_level, access_log=False)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from .client import Client, UpstreamError, check_model_meta

    _check_common(a)
    _check_key_file(a)
    client = Client(a.key, a.server, model=a.model, tokenizer=a.tokenizer, api_key=a.api_key, timeout=a.timeout,
                    backend=a.backend, server_tokenizer=a.server_tokenizer, default_max_tokens=a.max_tokens)
    if a.no_verify:
        client.guard.mode = "off"
    try:
        if a.model_meta:
            check_model_meta(client.key, a.model_meta)
        if not a.no_verify:
            try:
                if not client.verify():
                    print("note: the server publishes no model fingerprint; the key could not be checked against "
                          "it (--model-meta checks it against a local aloepri_model.json)", file=sys.stderr)
            except UpstreamError as e:
                print(f"aloepri chat: error: {e}", file=sys.stderr)
                return 1
        params = {k: v for k, v in (("max_tokens", a.max_tokens), ("temperature", a.temperature), ("top_p", a.top_p),
                                    ("top_k", a.top_k), ("seed", a.seed), ("stop", a.stop)) if v is not None}
        return run_chat(client, system=a.system, params=params)
    finally:
        client.close()


def run_chat(client: Any, system: str | None = None, params: dict | None = None, stdin: TextIO | None = None,
             stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """The chat loop. Interactive on a terminal; otherwise each input line is one user turn."""
    from .client import UpstreamError

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    params = dict(params or {})
    interactive = stdin.isatty() and stdout.isatty()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    if interactive:
        try:
            import readline  # noqa: F401 - line editing for input()
        except ImportError:
            pass
        print("aloepri chat: the server sees permuted token ids only. /reset clears the conversation, "
              "/exit (or Ctrl-D) quits, Ctrl-C stops a reply.", file=stderr)
    while True:
        try:
            if interactive:
                line = input("you> ")
            else:
                line = stdin.readline()
                if not line:
                    break
                line = line.rstrip("\n")
        except EOFError:
            print(file=stdout)
            break
        except KeyboardInterrupt:
            print(file=stdout)
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = history[:1] if system else []
            print("(conversation cleared)", file=stderr)
            continue
        history.append({"role": "user", "content": line})
        if interactive:
            stdout.write("assistant> ")
        pieces: list[str] = []
        try:
            with client.stream_chat(history, **params) as reply:
                for d in reply:
                    if d.text:
                        pieces.append(d.text)
                        stdout.write(d.text)
                        stdout.flush()
        except KeyboardInterrupt:
            stdout.write(" [stopped]")
        except UpstreamError as e:
            stdout.write("\n")
            print(f"error: {e}", file=stderr)
            history.pop()
            continue
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(pieces)})
    return 0
