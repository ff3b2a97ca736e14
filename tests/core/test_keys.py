import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.common.chat import ChatFormatError, render_chat
from kvroute.common.hashing import ROOT_SEED, chain_seed, text_block_hashes, token_block_hashes
from kvroute.common.tokenizer import OUTPUT_WORDS, Tokenizer
from kvroute.core.keys import Prompt, PromptError, prompt_block_hashes, prompt_of, salt_of


@given(st.text(max_size=300))
def test_tokenizer_counts_and_is_deterministic_on_any_text(text):
    tok = Tokenizer()
    assert tok.count(text) == len(tok.encode(text)) == len(Tokenizer().encode(text))
    assert (len(text) == 0) == (tok.count(text) == 0)


@given(st.text(max_size=200), st.text(max_size=200))
def test_tokenizer_ids_do_not_depend_on_what_it_saw_before(seen, text):
    """A warm tokenizer (pieces interned by earlier texts) and a fresh one agree."""
    warm = Tokenizer()
    warm.encode(seen + text[: len(text) // 2])
    assert warm.encode(text) == Tokenizer().encode(text)


@given(st.lists(st.sampled_from([*OUTPUT_WORDS, ",", ".", "\n", " 42"]), max_size=60))
def test_tokenizer_round_trips_generated_text(words):
    text = "".join(w if not w.isalpha() else " " + w for w in words)
    tok = Tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_is_about_four_chars_per_token_on_english():
    text = (
        "Prefix caching lets an inference engine reuse the attention keys and values "
        "computed for a prompt it has already seen, which saves most of the prefill. "
    ) * 20
    ratio = len(text) / len(Tokenizer().encode(text))
    assert 3.0 <= ratio <= 5.0


def test_tokenizer_ids_are_stable_across_instances():
    assert Tokenizer().encode("hello world 42!") == Tokenizer().encode("hello world 42!")


@given(st.text(min_size=0, max_size=400), st.text(max_size=200))
def test_text_keys_of_a_prefix_are_a_prefix_of_the_keys(prefix, suffix):
    a = text_block_hashes(prefix, 16)
    b = text_block_hashes(prefix + suffix, 16)
    assert b[: len(a)] == a
    assert len(a) == len(prefix.encode()) // 16


@given(st.lists(st.integers(-(2**63), 2**70), min_size=16, max_size=48))
def test_token_keys_hash_any_int_as_its_low_64_bits(ids):
    assert token_block_hashes(ids, 16) == token_block_hashes([t % 2**64 for t in ids], 16)


def test_keys_chain_so_a_changed_first_block_changes_all():
    a = token_block_hashes(list(range(64)), 16)
    b = token_block_hashes([99, *range(1, 64)], 16)
    assert len(a) == 4 and all(x != y for x, y in zip(a, b, strict=True))


def test_chat_shared_system_prompt_is_a_shared_prefix():
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    a = render_chat([system, {"role": "user", "content": "first"}])
    b = render_chat([system, {"role": "user", "content": [{"type": "text", "text": "second"}]}])
    ka, kb = text_block_hashes(a, 64), text_block_hashes(b, 64)
    assert len(ka) >= 9 and ka[:9] == kb[:9]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        None,
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"text": "no type"}]}],
    ],
)
def test_chat_rejects_malformed_messages(messages):
    with pytest.raises(ChatFormatError):
        render_chat(messages)


def test_prompt_of_reads_every_completions_form():
    assert prompt_of({"prompt": "abc"}, chat=False).text == "abc"
    assert prompt_of({"prompt": ["abc", "d"]}, chat=False).text == "abc"
    assert prompt_of({"prompt": [1, 2, 3]}, chat=False).token_ids == (1, 2, 3)
    assert prompt_of({"prompt": [[4, 5]]}, chat=False).token_ids == (4, 5)
    for bad in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [1, "a"]}):
        with pytest.raises(PromptError):
            prompt_of(bad, chat=False)
    with pytest.raises(PromptError):
        prompt_of({"messages": "x"}, chat=True)


def test_prompt_block_hashes_uses_tokens_when_given():
    p = prompt_of({"prompt": list(range(40))}, chat=False)
    assert prompt_block_hashes(p, 16) == token_block_hashes(list(range(40)), 16)


def test_a_salt_gives_its_own_key_chain_in_text_and_token_keys():
    assert chain_seed(None) == ROOT_SEED
    assert chain_seed("a") == chain_seed("a") != chain_seed("b") != ROOT_SEED
    for prompt in (Prompt("x" * 640, None), Prompt(None, tuple(range(160)))):
        plain = prompt_block_hashes(prompt, 16)
        salted = prompt_block_hashes(prompt, 16, chain_seed("a"))
        assert len(plain) == len(salted) == 10
        assert not set(plain) & set(salted)  # no block of a salted prompt matches
        assert salted == prompt_block_hashes(prompt, 16, chain_seed("a"))


@pytest.mark.parametrize(
    ("body", "salt"),
    [
        ({"cache_salt": "t1"}, "t1"),
        ({}, None),
        ({"cache_salt": ""}, None),
        ({"cache_salt": 7}, None),
    ],
)
def test_salt_of_reads_only_a_non_empty_string(body, salt):
    assert salt_of(body) == salt
