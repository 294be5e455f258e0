"""The proxy's upstream re-check costs one /v1/models per upstream connection, not one per request: replies on
a kept-alive connection that already passed are decoded without asking again."""
import time

import pytest

from aloepri.serving.local_server import ServerThread
from aloepri.serving.proxy import build_proxy
from serving_helpers import CharTokenizer
from test_proxy_faults import Upstream, _chat, _complete, models  # noqa: F401  (module fixture)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_unstamped_upstream_is_rechecked_once_per_connection(models, stream):  # noqa: F811
    with Upstream("metadata").start(models["a"]) as up:
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        with ServerThread(proxy.app()) as url:
            before = sum(e["path"] == "/v1/models" for e in up.recorder.exchanges)
            for i in range(12):
                send = _complete if i % 2 else _chat
                r = send(url, stream=stream)
                assert r.status_code == 200, r.text
            checks = sum(e["path"] == "/v1/models" for e in up.recorder.exchanges) - before
    print("models checks for 12 requests:", checks)
    assert checks <= 2, f"{checks} /v1/models checks for 12 sequential requests"


def test_a_stop_string_still_stops_the_upstream(models):  # noqa: F811
    """Reading on after the end is only for replies the server ends itself: a stop string is matched by the
    client, so the connection is closed at once and the upstream stops generating."""
    no_eos = {"logit_bias": {"2": -100}}  # plaintext EOS banned: left alone the reply runs to max_tokens
    with Upstream("metadata").start(models["a"], slow=0.02) as up:
        proxy = build_proxy(models["key_a"], up.url, tokenizer=CharTokenizer())
        with ServerThread(proxy.app()) as url:
            text = _complete(url, max_tokens=6, **no_eos).json()["choices"][0]["text"]
            assert len(text) >= 4, text
            steps = up.server.steps
            r = _complete(url, max_tokens=200, stop=[text[2:4]], **no_eos)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
            time.sleep(1.0)
            assert up.server.steps - steps < 60, up.server.steps - steps  # left alone: 200
