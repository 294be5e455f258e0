"""The neutral server-side tokenizer: one opaque symbol per token id, nothing else.

The server must be able to tokenize/detokenize (engines insist on a tokenizer) and must know when to stop, but
it must not learn anything the obfuscated weights do not already tell it. So the vocabulary shipped with the
obfuscated model is:

* token id ``j`` has the symbol ``t{j}x`` (``t0x``, ``t1x``, ... in decimal). The symbol is a function of ``j``
  alone: it says nothing about which plaintext token was permuted to ``j``. The ``x`` terminator makes every
  symbol self-delimiting (no symbol occurs inside another one or inside a concatenation of others at a
  non-boundary), so substring-based special-token matching of the engines cannot cut a symbol apart.
* exactly the permuted end-of-sequence id(s) carry an end-of-generation role (HF: ``eos_token`` and special
  added tokens; GGUF: ``eos/eot/eom_token_id`` and token type CONTROL). These ids are public anyway (the server
  directory's generation_config.json holds them, and the server sees where generations end).
* no plaintext special-token text ("<|im_end|>", "<|endoftext|>", "</s>", ...) exists in the vocabulary, so
  engines that detect end-of-generation tokens by their text (llama.cpp) find nothing to latch on to.

Neutral *text* is the symbols joined by single spaces ("t17x t4x t9x"). :func:`ids_to_neutral_text` and
:func:`neutral_text_to_ids` are the client-side codec; the engines' tokenizers map the same text to the same ids
(the round trip is exact for well-formed text). Text that is not neutral text has no meaning: both the HF and
the GGUF tokenizer map a word they do not know to one fixed "unknown" id that is never an EOS id, so no
malformed input can end a generation, and neither can any plaintext special-token text.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

SYMBOL_FORMAT = "t{}x"
_SYMBOL_RE = re.compile(r"t(0|[1-9][0-9]*)x")
SPACE_MARK = "\u2581"  # how sentencepiece-style vocabularies (llama.cpp's unigram tokenizer) store a space


class NeutralTextError(ValueError):
    """Text that is not a sequence of neutral symbols."""


def neutral_symbol(token_id: int) -> str:
    if token_id < 0:
        raise ValueError(f"token id {token_id} is negative")
    return SYMBOL_FORMAT.format(int(token_id))


def neutral_vocab(vocab_size: int) -> list[str]:
    return [SYMBOL_FORMAT.format(j) for j in range(int(vocab_size))]


def ids_to_neutral_text(ids: Iterable[int]) -> str:
    """Obfuscated ids -> the neutral text the server tokenizer maps back to exactly these ids."""
    return " ".join(neutral_symbol(int(i)) for i in ids)


def neutral_text_to_ids(text: str, vocab_size: int | None = None) -> list[int]:
    """Inverse of :func:`ids_to_neutral_text`. Tolerant of whitespace (engines add leading spaces, U+2581 is a
    space in sentencepiece-style renderings) and of symbols written without a space between them (special
    tokens are rendered unspaced); strict about everything else."""
    out = []
    for word in text.replace(SPACE_MARK, " ").split():
        pos = 0
        for m in _SYMBOL_RE.finditer(word):
            if m.start() != pos:
                break
            out.append(int(m.group(1)))
            pos = m.end()
        if pos != len(word):
            raise NeutralTextError(f"{word[:40]!r} is not a sequence of neutral token symbols (expected t<id>x)")
    if vocab_size is not None:
        bad = [j for j in out if j >= vocab_size]
        if bad:
            raise NeutralTextError(f"token id(s) {bad[:5]} out of range for a vocabulary of {vocab_size}")
    return out


def normalize_eos(eos: Any) -> list[int]:
    if eos is None:
        return []
    ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return list(dict.fromkeys(ids))


def eos_ids_of(model_dir: str | Path) -> list[int]:
    """The (already permuted) EOS id(s) of a server directory: generation_config.json, else config.json."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        p = model_dir / name
        if p.is_file():
            eos = normalize_eos(json.loads(p.read_text()).get("eos_token_id"))
            if eos:
                return eos
    return []


def unknown_id(vocab_size: int, eos_ids: Sequence[int]) -> int:
    """Where engines put words that are not symbols: the smallest id that is not an EOS id (public data only),
    so that no malformed text can ever be read as end-of-generation."""
    eos = set(eos_ids)
    for j in range(vocab_size):
        if j not in eos:
            return j
    raise ValueError("every token is an EOS token")


def _check(vocab_size: int, eos_ids: Sequence[int]) -> list[int]:
    eos = normalize_eos(list(eos_ids))
    if vocab_size <= 1:
        raise ValueError(f"vocab_size {vocab_size} is too small")
    bad = [e for e in eos if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"EOS id(s) {bad} outside the vocabulary of {vocab_size}")
    return eos


def build_hf_tokenizer(vocab_size: int, eos_ids: Sequence[int]):
    """A `tokenizers.Tokenizer`: WordLevel over the symbols, split on whitespace, EOS symbols special."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    eos = _check(vocab_size, eos_ids)
    vocab = {s: j for j, s in enumerate(neutral_vocab(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=neutral_symbol(unknown_id(vocab_size, eos))))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if eos:
        tok.add_special_tokens([AddedToken(neutral_symbol(e), special=True, normalized=False) for e in eos])
    return tok


def write_hf_tokenizer(directory: str | Path, vocab_size: int, eos_ids: Any,
                       model_max_length: int | None = None) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by AutoTokenizer, hence by vLLM/SGLang)."""
    directory = Path(directory)
    eos = _check(vocab_size, normalize_eos(eos_ids))
    build_hf_tokenizer(vocab_size, eos).save(str(directory / "tokenizer.json"), pretty=False)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length) if model_max_length else 1 << 30,
    }
    if eos:
        cfg["eos_token"] = neutral_symbol(eos[0])
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def add_gguf_tokenizer(writer, vocab_size: int, eos_ids: Sequence[int]) -> None:
    """Tokenizer metadata for llama.cpp.

    llama.cpp's unigram tokenizer ("t5") is used: it is robust to any input (a character no token covers
    becomes the unknown id, never an exception or a loop), needs no merges or byte tokens, declares no
    separator token (llama-cpp-python appends the separator to text prompts of "bert" vocabularies) and adds
    nothing unless told to. Spaces are stored as U+2581 in a unigram vocabulary, so normal token j is
    "\u2581t{j}x", read from " t{j}x" and rendered as " t{j}x"; runs of spaces count as one (only the ASCII space
    separates symbols for llama.cpp: newlines and tabs are characters of no token).

    End of generation: llama.cpp stops on the eos/eot/eom ids (and on tokens whose text is a known end-of-turn
    string, of which this vocabulary has none), so up to three EOS ids are supported. They are typed CONTROL
    (never rendered as text unless asked, like any special token) and stored without the U+2581, so that
    llama.cpp's special-token pass finds "t{j}x" in a prompt (prompts are parsed with special tokens on by
    llama-server and llama-cpp-python).
    """
    import gguf

    eos = _check(vocab_size, eos_ids)
    if len(eos) > 3:
        raise ValueError(f"{len(eos)} EOS ids {eos}: a GGUF can declare at most 3 (eos, eot, eom)")
    tokens = [SPACE_MARK + s for s in neutral_vocab(vocab_size)]
    types = [gguf.TokenType.NORMAL] * vocab_size
    for e in eos:
        types[e] = gguf.TokenType.CONTROL
        tokens[e] = neutral_symbol(e)
    # raw key names (llama.cpp's): independent of which helper methods the installed gguf package has
    writer.add_string("tokenizer.ggml.model", "t5")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    for e, name in zip(eos, ("eos", "eot", "eom")):
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", e)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", unknown_id(vocab_size, eos))
    # no BOS/PAD roles: the client builds complete prompts, and nothing but the EOS needs a role on the server
    writer.add_bool("tokenizer.ggml.add_space_prefix", True)
    writer.add_bool("tokenizer.ggml.remove_extra_whitespaces", True)
    # the client sends complete id sequences: the server must add nothing
    for name in ("bos", "eos", "sep"):
        writer.add_bool(f"tokenizer.ggml.add_{name}_token", False)
