"""SegmentCache: cached per-segment ids equal a full tokenization, for any text.

Three tokenizer families (byte-level BPE with a BOS post-processor; the same with added
tokens that strip whitespace beside them; a Metaspace pre-tokenizer that marks only the
start of the text) and three chat template shapes (role markers, Llama-3 headers,
ChatML), on random chats whose contents may contain the special tokens themselves.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, models, pre_tokenizers, processors, trainers  # noqa: E402

from kvroute.router.hf_tokenizer import SegmentCache  # noqa: E402

SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|im_start|>",
           "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
CORPUS = ["the quick brown fox jumps over the lazy dog", "You are a helpful assistant.",
          "def f(x):\n    return x + 1\n", "  spaces   and\ttabs\n\nnew lines"] * 30  # fmt: skip


def _trained(kind: str) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE(unk_token=None))
    if kind == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if kind != "metaspace" else []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL[:2],
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    strip = kind == "stripping"
    tok.add_special_tokens([AddedToken(t, lstrip=strip, rstrip=strip, normalized=False)
                            for t in SPECIAL[2:]])  # fmt: skip
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", bos)])  # fmt: skip
    return tok


TOKENIZERS = {kind: _trained(kind) for kind in ("bytelevel", "stripping", "metaspace")}


def render(shape: str, messages: list[tuple[str, str]]) -> str:
    if shape == "roles":
        return "".join(f"<|{r}|>\n{c}\n" for r, c in messages) + "<|assistant|>\n"
    if shape == "llama3":
        body = "".join(f"<|start_header_id|>{r}<|end_header_id|>\n\n{c}<|eot_id|>"
                       for r, c in messages)  # fmt: skip
        return "<s>" + body + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages) + (
        "<|im_start|>assistant\n"
    )


pieces = st.sampled_from(["the", " quick", "fox", " ", "  ", "\n", "\n\n", "\t", "x+1", "é",
                          "<|", "|>", "<|im_end|>", "<s>", "You are", "ünï", "1234"])  # fmt: skip
content = st.lists(pieces, max_size=12).map("".join)
chat = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), content),
                min_size=1, max_size=5)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(sorted(TOKENIZERS)),
    shape=st.sampled_from(["roles", "llama3", "chatml"]),
    chats=st.lists(chat, min_size=1, max_size=4),
    specials=st.booleans(),
    tiny=st.booleans(),
)
def test_segment_ids_equal_the_full_encoding(kind, shape, chats, specials, tiny) -> None:
    tok = TOKENIZERS[kind]
    cache = SegmentCache(tok, max_bytes=64 if tiny else 1 << 20)
    history: list[tuple[str, str]] = []
    for turn in chats:  # a conversation that grows: earlier segments come back cached
        history += turn
        text = render(shape, history)
        assert (
            list(cache.encode(text, specials)) == tok.encode(text, add_special_tokens=specials).ids
        )
    assert cache.num_bytes <= cache.max_bytes


def test_repeated_segments_are_encoded_once() -> None:
    tok = TOKENIZERS["bytelevel"]
    cache = SegmentCache(tok, max_bytes=1 << 20)
    system = ("system", "You are a helpful assistant. " * 50)
    cache.encode(render("chatml", [system, ("user", "the fox")]), False)
    misses = cache.misses
    ids = cache.encode(render("chatml", [system, ("user", "the dog")]), False)
    assert cache.misses == misses + 1  # only the new user message
    assert list(ids) == tok.encode(render("chatml", [system, ("user", "the dog")]),
                             add_special_tokens=False).ids  # fmt: skip


def test_memory_stays_within_the_bound() -> None:
    tok = TOKENIZERS["bytelevel"]
    cache = SegmentCache(tok, max_bytes=4096)
    for k in range(200):
        cache.encode(render("roles", [("user", f"message number {k} " * 3)]), False)
        assert cache.num_bytes <= 4096
    assert 0 < len(cache._cache) < 200
