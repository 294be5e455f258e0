"""lm-evaluation-harness adapter: run any lm-eval task through an obfuscated model, ids mapped client-side.

    python -m aloepri.eval.lm_eval_adapter --model aloepri \
        --model_args server_dir=./server-model,key=client.key[,tokenizer=model.gguf][,max_length=2048] \
        --tasks mmlu,piqa,ifeval

(``python -m aloepri.eval.lm_eval_adapter`` is lm-eval's own CLI with the ``aloepri`` model registered; lm-eval
has no plugin discovery, so plain ``lm_eval --model aloepri`` only works in a process that imported this module,
e.g. ``lm_eval.simple_evaluate(model="aloepri", ...)`` after ``import aloepri.eval.lm_eval_adapter``.)

Every request is tokenized with the client's plaintext tokenizer, the ids are mapped by the key, the stock
obfuscated model scores them, and its logits are mapped back (column i = plain token i) before any log-softmax;
generation maps every produced id back and checks the stop strings on plaintext. The "server" model never sees
text or plaintext ids. Needs ``pip install lm-eval`` (an optional extra).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # pragma: no cover - exercised only without the optional extra
    raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install lm-eval") from e

from .humaneval import greedy_until


def _as_bool(v: Any) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


@register_model("aloepri")
class AloePriLM(TemplateLM):
    """An obfuscated model plus the client's key, as an lm-eval model (batch size 1, CPU friendly)."""

    def __init__(self, server_dir: str, key: str, tokenizer: str | None = None, max_length: int = 2048,
                 max_gen_toks: int = 256, dtype: str = "float32", verify_fingerprint: Any = True,
                 batch_size: Any = 1, device: str = "cpu", **unused: Any) -> None:
        super().__init__()
        from ..runtime.inference import PrivateModel

        pm = PrivateModel(key, server_dir, tokenizer=tokenizer, dtype=getattr(torch, str(dtype)),
                          verify_fingerprint=_as_bool(verify_fingerprint))
        if pm.tokenizer is None:
            raise ValueError("the key names no tokenizer for this model; pass model_args tokenizer=PATH")
        self.private, self.model, self.tokenizer, self.key = pm, pm.model, pm.tokenizer, pm.key
        self._perm = torch.from_numpy(self.key.permutation)
        self.max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)

    # --- TemplateLM plumbing -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            e = self.key.special_tokens.get("eos_token_id")
            eos = e[0] if isinstance(e, list) else e
        return int(eos)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "aloepri")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    # --- scoring --------------------------------------------------------------------------------------
    @torch.no_grad()
    def plain_log_probs(self, plain_ids: list[int]) -> torch.Tensor:
        """log p(next | prefix) over the plain vocabulary for every position (server sees mapped ids)."""
        x = torch.tensor([self.key.encode_ids(plain_ids)])
        logits = self.model(x).logits[0].double()[:, self._perm]  # column i = logit of plain token i
        return F.log_softmax(logits, dim=-1)

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        whole = (context + continuation)[-(self.max_length + 1):]
        n = len(continuation)
        lp = self.plain_log_probs(whole[:-1])[-n:]
        target = torch.tensor(whole[-n:])
        logprob = lp.gather(1, target[:, None]).sum().item()
        return logprob, bool((lp.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for _, ctx, cont in requests:
            if not cont:
                out.append((0.0, True))
                continue
            out.append(self._score(list(ctx), list(cont)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for (string,) in [r.args for r in requests]:
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            out.append(sum(self._score(list(c), list(t))[0] for c, t in windows))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for context, gen_kwargs in [r.args for r in requests]:
            kw = dict(gen_kwargs or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
            if kw.get("do_sample") or float(kw.get("temperature", 0) or 0) > 0:
                raise ValueError("the aloepri lm-eval adapter decodes greedily; set do_sample=False/temperature=0")
            ids = self.tok_encode(context, add_special_tokens=None)[-self.max_length:]
            eos = [self.eot_token_id]
            _, text, _ = greedy_until(self.model, ids, lambda v: self.tokenizer.decode(v, skip_special_tokens=True),
                                      self.key.encode_ids, self.key.decode_ids, eos, max_new, stops=until)
            out.append(text)
        return out


def main() -> None:
    """lm-eval's command line with the ``aloepri`` model registered (this module is imported)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
