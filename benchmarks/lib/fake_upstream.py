"""A stand-in engine that streams a fixed reply as fast as it can (zero compute): whatever a proxy in front of it
adds shows in full. ``python -m benchmarks.lib.fake_upstream PORT REPLY_JSON`` (a JSON list of token ids)."""
from __future__ import annotations

import json
import sys


def app(reply: list[int]):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        n = min(int(body.get("max_tokens") or 16), len(reply))
        ids = reply[:n]
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})

        async def events():
            for i in ids:
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [i], "finish_reason": None}]}
                yield "data: " + json.dumps(chunk) + "\n\n"
            last = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}]}
            yield "data: " + json.dumps(last) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])


if __name__ == "__main__":
    import uvicorn

    port, reply_path = int(sys.argv[1]), sys.argv[2]
    with open(reply_path) as f:
        uvicorn.run(app(json.load(f)), host="127.0.0.1", port=port, log_level="warning")
