"""A gpt2/qwen2 tokenizer of any size >= the shared one: real tokens first, placeholders after.

The shared tokenizer (fixtures/tokenizer.json, 2048 tokens) keeps its ids, merges
and special tokens, so text tokenises exactly as in the tiny fixtures. Ids from
2048 up are ``<|synthetic_N|>`` typed UNUSED: no merge or pre-tokeniser rule
can produce them, neither llama.cpp nor our tokenizer treats them as special
text, and they give token_embd/output the row count of the real model
(151936 for Qwen3).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "fixtures"))
from gguf_tokenizer import CHAT_TEMPLATE, TOKENIZER_JSON  # noqa: E402  (fixtures/ is a script folder)


def placeholder(i: int) -> str:
    return f"<|synthetic_{i}|>"


def shared_vocab(path: Path = TOKENIZER_JSON) -> tuple[list[str], list[int], list[str], int]:
    """(tokens, token types, merges, id of <|endoftext|>) of the shared tokenizer."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    for added in spec["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, vocab["<|endoftext|>"]


def add_padded_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> int:
    """Write the shared tokenizer padded with placeholders to ``vocab_size`` tokens; returns how many are real."""
    tokens, types, merges, eot = shared_vocab()
    real = len(tokens)
    if vocab_size < real:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the shared tokenizer ({real})")
    tokens += [placeholder(i) for i in range(real, vocab_size)]
    types += [int(gguf.TokenType.UNUSED)] * (vocab_size - real)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return real
