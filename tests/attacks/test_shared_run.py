"""What the attacks of one run share (``aloepri attack all``, the audit) gives what each attack computes alone.

- ``corpora.encode_text``: each public text encoded once per tokenizer and process; a text or a tokenizer not
  seen before is encoded afresh, and ``tokenize_texts`` (built on it) returns what encoding the texts one by one
  returns.
- ``vma.order_statistics``: the weight signatures' sorted entries through numpy on the CPU are torch.sort's.
- ``AttackTarget.memo``: the weight attacks run one after another on one target (sharing its memo) give the
  figures each gives alone on a fresh target; a key that differs in one setting is computed anew.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from aloepri.attacks.base import AttackTarget, Budget
from aloepri.corpora import encode_text, tokenize_texts
from attack_helpers import random_private_data

CI = Budget.named("ci")


class CountingTokenizer:
    """A tokenizer of words to stable ids that counts the texts it encodes."""

    def __init__(self, offset: int = 0):
        self.calls = 0
        self.offset = offset

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False
        self.calls += 1
        return {"input_ids": [self.offset + sum(map(ord, w)) % 997 for w in text.split()]}


def test_each_text_is_encoded_once_per_tokenizer():
    tok = CountingTokenizer()
    texts = ["a day of logs", "the quick brown fox", "jumps over the lazy dog again"]
    fresh = [np.asarray(CountingTokenizer()(t, add_special_tokens=False)["input_ids"], np.int64) for t in texts]
    first = tokenize_texts(tok, texts)
    assert tok.calls == 3 and np.array_equal(first, np.concatenate(fresh)) and first.dtype == np.int64
    # cut at max_tokens (the shorter cut is the longer one's prefix), from the memo: no text encoded again
    assert np.array_equal(tokenize_texts(tok, texts, 6), np.concatenate(fresh)[:6])
    assert np.array_equal(tokenize_texts(tok, texts[::-1]), np.concatenate(fresh[::-1]))
    assert tok.calls == 3
    out = tokenize_texts(tok, texts, 5)
    out[0] = -1  # the caller's own array: the memo is not changed through it
    assert encode_text(tok, texts[0])[0] == fresh[0][0]
    with pytest.raises(ValueError):
        encode_text(tok, texts[0])[0] = -1  # what the memo holds is read-only
    # negative: a text not seen, or another tokenizer, is encoded afresh (and gives its own ids)
    assert np.array_equal(encode_text(tok, "a day of logs!"),
                          CountingTokenizer()("a day of logs!", add_special_tokens=False)["input_ids"])
    assert tok.calls == 4
    other = CountingTokenizer(offset=1000)
    assert np.array_equal(tokenize_texts(other, texts), np.concatenate(fresh) + 1000)
    assert other.calls == 3 and tok.calls == 4
    assert len(tokenize_texts(tok, [])) == 0 and tokenize_texts(tok, []).dtype == np.int64


def test_order_statistics_are_torch_sort():
    from aloepri.attacks.vma import order_statistics, sketch_positions

    g = torch.Generator().manual_seed(0)
    y = torch.randn(64, 300, generator=g)
    y[:, :40] = torch.randint(-3, 3, (64, 40), generator=g).float()  # ties
    y[:5, 50:60] = -0.0
    for k in (7, 128, 300):
        pos = sketch_positions(y.shape[1], k)
        assert torch.equal(order_statistics(y, pos), torch.sort(y, dim=1).values[:, pos])
        assert torch.equal(order_statistics(y.double(), pos), torch.sort(y.double(), dim=1).values[:, pos])
    # a dtype numpy lacks goes through torch.sort
    yb = y.bfloat16()
    pos = sketch_positions(y.shape[1], 16)
    assert torch.equal(order_statistics(yb, pos), torch.sort(yb, dim=1).values[:, pos])


WEIGHT_ATTACKS = ["attn-ia", "attn-ia-sorted", "gate-ia", "nn", "vma"]


def _figures(res) -> dict:
    return {"ttrsr": res.ttrsr, "piirsr": res.piirsr, "metrics": res.metrics}


def test_one_run_sharing_its_memo_gives_each_attack_alone(tiny_dir, obfuscated):
    from aloepri.attacks.report import run_attacks

    out, _ = obfuscated("llama", h=16, head_permutation=False)  # Attn-IA's positive control: no head permutation
    src, key = tiny_dir("llama"), out.parent / "key.json"
    data = random_private_data(96)
    shared = AttackTarget(src, out, key)
    together = run_attacks(shared, data, WEIGHT_ATTACKS, CI, 0, log=None)
    assert len(shared._memo) > 0  # the attacks did share something
    for res in together:
        alone = run_attacks(AttackTarget(src, out, key), data, [res.attack], CI, 0, log=None)[0]
        assert "error" not in res.metrics and _figures(res) == _figures(alone), res.attack
    # the positive controls still read (nn reads the key-mixed embedding rows: it fails here by design)
    assert all(r.metrics["vocab_recovery_sampled"] >= 0.9 for r in together if r.attack in ("vma", "attn-ia-sorted",
                                                                                             "gate-ia"))


def test_a_memo_key_differing_in_one_setting_is_computed_anew(tiny_dir, obfuscated):
    from aloepri.attacks.vma import as_weights, candidate_signatures, iter_sources, signatures

    out, _ = obfuscated("llama")
    target = AttackTarget(tiny_dir("llama"), out, out.parent / "key.json")
    src = next(iter_sources(as_weights(target.plain_model), ("embed.gate",), [0], []))
    a = candidate_signatures(target, src, 128)
    assert candidate_signatures(target, src, 128) is a  # the same key: the memo's value
    b = candidate_signatures(target, src, 16)  # another sketch: another key, computed anew
    assert b is not a and b.shape[1] != a.shape[1] and torch.equal(b, signatures(src, None, 16))
    calls = []
    target.memo(("probe", 1), lambda: calls.append(1) or 1)
    target.memo(("probe", 1), lambda: calls.append(1) or 1)
    target.memo(("probe", 2), lambda: calls.append(1) or 2)
    assert len(calls) == 2



def test_a_gguf_config_is_parsed_once_per_file(tmp_path, monkeypatch):
    """``plain_model.source_config``: a .gguf's config parsed once per file (each call its own copy); a file
    changed since (its modification time), another file or a checkpoint directory is parsed anew. transformers'
    parse is counted here (stood in for by a small config: the real one takes seconds)."""
    import os

    import transformers
    from transformers import LlamaConfig

    from aloepri.obfuscation.plain_model import source_config

    parsed = []

    def parse(**kw):
        parsed.append(kw)
        return LlamaConfig(vocab_size=96, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", parse)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    a, b = source_config(gguf), source_config(gguf)
    assert len(parsed) == 1 and parsed[0] == {"pretrained_model_name_or_path": str(tmp_path), "gguf_file": "m.gguf"}
    assert a is not b and a.to_dict() == b.to_dict()
    a.vocab_size = 7  # a caller's change stays its own
    assert source_config(gguf).vocab_size == 96 and len(parsed) == 1
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: parsed again
    source_config(gguf)
    other = tmp_path / "n.gguf"
    other.write_bytes(b"GGUF")
    source_config(other)
    source_config(tmp_path)  # a directory: never kept
    source_config(tmp_path)
    assert len(parsed) == 5


def test_the_trained_attacks_start_from_their_seed_not_the_process_rng():
    """SDA's decipherer and IMA's inversion model start from weights drawn from the attack's seed: whatever the
    process's torch RNG holds (which attacks ran before, a fresh process's random state), one seed gives one
    trained model; another seed gives another. And the process's RNG is left as it was."""
    from aloepri.attacks.decipher import SDAConfig, build_training_set, train_decipherer
    from aloepri.attacks.ima import IMAConfig, train_inversion_model

    rng = np.random.default_rng(0)
    prior = rng.integers(0, 64, size=3000)
    cfg = SDAConfig(steps=3, batch=4, seq_len=16, max_rank=32, pool=16, episodes=2, prior_tokens=3000, width=16,
                    depth=1)
    train = build_training_set(prior, 200, [10, 20], cfg, 64, np.arange(16), seed=0)
    icfg = IMAConfig(steps=3, batch=4, seq_len=8, negatives=16, width=16, depth=1)
    views = [torch.randn(12, 8, 24, generator=torch.Generator().manual_seed(1))]
    chunks = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(2))
    emb = torch.randn(64, 12, generator=torch.Generator().manual_seed(3))

    def trained(process_seed: int, seed: int):
        torch.manual_seed(process_seed)
        sda, sda_loss = train_decipherer(train, cfg, 17, seed)
        ima, ima_loss = train_inversion_model(views, chunks, emb, icfg, seed)
        after = torch.rand(1)
        torch.manual_seed(process_seed)
        assert torch.equal(after, torch.rand(1))  # the process's RNG untouched
        return [p.detach().clone() for p in [*sda.parameters(), *ima.parameters()]], (sda_loss, ima_loss)

    a, b, c = trained(1, 5), trained(2, 5), trained(1, 6)
    assert a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1][0] != c[1][0] and a[1][1] != c[1][1]  # negative: another seed, another model
