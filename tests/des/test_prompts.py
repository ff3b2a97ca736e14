"""The chunk-cached prompt encoder gives the tokenizer's ids, on any text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.common.chat import render_chat
from kvroute.common.tokenizer import Tokenizer
from kvroute.des.prompts import PromptEncoder

TEXT = st.text(
    alphabet=st.sampled_from(list("ab cd\n\t  xyZ0129.,<|>é漢")), min_size=0, max_size=400
)


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=5), chunk=st.integers(1, 40))
def test_ids_equal_a_whole_tokenization(texts: list[str], chunk: int) -> None:
    reference = Tokenizer()
    encoder = PromptEncoder(Tokenizer(), chunk_chars=chunk, max_cached_chars=200)
    for text in texts:  # later texts meet chunks cached by earlier ones
        assert encoder.encode(text) == reference.encode(text)
        assert encoder.encode(texts[0] + text) == reference.encode(texts[0] + text)


@settings(max_examples=100, deadline=None)
@given(system=TEXT, turns=st.lists(TEXT, min_size=1, max_size=4))
def test_chat_prompts_sharing_a_system_prompt(system: str, turns: list[str]) -> None:
    reference, encoder = Tokenizer(), PromptEncoder(chunk_chars=16)
    messages = [{"role": "system", "content": system}]
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        text = render_chat(messages)
        assert encoder.encode(text) == reference.encode(text)


def test_the_cache_stays_within_its_bound() -> None:
    encoder = PromptEncoder(chunk_chars=8, max_cached_chars=100)
    for i in range(200):
        encoder.encode(f"prompt number {i} with some words in it")
    assert encoder._chars <= 100


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.text(alphabet="abcXYZ", min_size=1, max_size=6), min_size=1, max_size=60),
    lead=st.booleans(),
    chunk=st.integers(1, 30),
)
def test_word_texts_split_on_spaces_equal_a_tokenization(words, lead, chunk) -> None:
    text = (" " if lead else "") + " ".join(words)  # words of 5+ letters take two tokens
    assert PromptEncoder(chunk_chars=chunk).encode(text) == Tokenizer().encode(text)
