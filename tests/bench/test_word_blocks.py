"""Word blocks made with numpy equal ``Random.choices`` and the tokenizer, word for word."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bench.spec import RequestSpec
from kvroute.bench.workloads.mooncake import MooncakeParams, MooncakeReplay, TraceRow, tile_marked
from kvroute.bench.workloads.word_blocks import (
    WordBlockCache,
    make_blocks,
    prompt_token_ids,
    seeded_choice_indices,
)
from kvroute.common.tokenizer import OUTPUT_WORDS, Tokenizer

keys = st.text(min_size=0, max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.lists(keys, max_size=5), st.integers(1, 300), st.integers(0, 700))
def test_indices_are_those_random_choices_picks(key_list, population_size, k):
    population = list(range(population_size))
    got = seeded_choice_indices(key_list, population_size, k)
    assert got.shape == (len(key_list), k)
    for key, row in zip(key_list, got, strict=True):
        assert row.tolist() == random.Random(key).choices(population, k=k)


@settings(max_examples=40, deadline=None)
@given(st.lists(keys, min_size=1, max_size=4), st.integers(1, 600), st.data())
def test_blocks_text_heads_and_ids(key_list, num_words, data):
    blocks = make_blocks(key_list, num_words)
    words = [random.Random(key).choices(OUTPUT_WORDS, k=num_words) for key in key_list]
    assert [b.text for b in blocks] == [" ".join(w) for w in words]
    cut = data.draw(st.integers(1, num_words))
    assert blocks[-1].head(cut) == " ".join(words[-1][:cut])
    total = data.draw(st.integers(0, num_words * len(blocks)))
    text = " ".join(" ".join(w) for w in words).split(" ")[:total]
    assert prompt_token_ids(blocks, total) == Tokenizer().encode(" ".join(text))


def test_cache_keeps_the_most_recent_blocks_and_gives_the_same_ones():
    cache = WordBlockCache("7:x:", 16, max_blocks=2)
    first = cache.get([1, 2, 1])
    assert first[0] is first[2]
    assert first[0].text == " ".join(random.Random("7:x:1").choices(OUTPUT_WORDS, k=16))
    cache.get([3])  # 2 is the least recently used: dropped
    assert cache.get([1])[0] is first[0]
    assert cache.get([2])[0] is not first[1]
    assert cache.get([2])[0].text == first[1].text


def _slow_prompt(seed: int, row: TraceRow, block_tokens: int) -> str:
    """The replay's prompt as it was first written: ``Random.choices`` per block."""
    words: list[str] = []
    for h in row.hash_ids:
        words += random.Random(f"{seed}:mooncake:block:{h}").choices(OUTPUT_WORDS, k=block_tokens)
    words.extend(words[: row.input_length - len(words)])
    return " ".join(words[: row.input_length])


# as in a Mooncake trace: a prompt's length fits its 512-token blocks
row = st.lists(st.integers(0, 40), min_size=1, max_size=4).flatmap(
    lambda ids: st.builds(
        TraceRow,
        timestamp_ms=st.integers(0, 10_000).map(float),
        input_length=st.integers(1, 512 * len(ids)),
        output_length=st.integers(0, 50),
        hash_ids=st.just(tuple(ids)),
    )
)
rows = st.lists(row, min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(
    rows,
    st.integers(0, 3),
    st.sampled_from([1.0, 0.1, 0.37, 2.0]),
    st.integers(1, 3),
)
def test_replay_prompts_and_ids_equal_the_slow_path(trace, seed, input_scale, tile):
    """Prompts equal per-block ``Random.choices`` text, and the ids the spec carries equal
    ``Tokenizer.encode`` of its prompt (tiled copies marked, scaled rows included)."""
    params = MooncakeParams(input_scale=input_scale, tile=tile, spread_ms=0.0)
    replay = MooncakeReplay(trace, params, seed)
    specs: list[RequestSpec] = [s for (s,) in replay.sessions()]
    assert len(specs) == len(trace) * tile
    tokenizer = Tokenizer()
    slow = {_slow_prompt(seed, row, replay.block_tokens) for row in replay.rows}
    for spec in specs:
        ids = spec.prompt_token_ids
        assert ids is None or ids == tokenizer.encode(spec.prompt or "")
        assert len(tokenizer.encode(spec.prompt or "")) == spec.num_prompt_tokens
    prompts = [s.prompt or "" for s in specs]
    originals = [p for p in prompts if p[0].islower()]
    assert set(originals) <= slow and len(originals) == len(trace)
    marked = [tile_marked(p, k) for p in originals for k in range(1, tile)]
    assert sorted(marked) == sorted(p for p in prompts if not p[0].islower())
