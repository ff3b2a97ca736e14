"""Exact-mode token ids: the built-in path equals the simulator's; the HF loader (optional)."""

from __future__ import annotations

import json

import pytest

from kvroute.common.hashing import token_block_hashes
from kvroute.common.tokenizer import default_tokenizer
from kvroute.core.keys import PromptError
from kvroute.core.token_keys import BuiltinPromptTokenizer, exact_route_keys
from kvroute.sim.protocol import prompt_ids

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
BODIES = [
    ({"prompt": "hello world, the quick brown fox"}, False),
    ({"prompt": [5, 6, 7, 8]}, False),
    ({"messages": CHAT}, True),
]


@pytest.mark.parametrize(("body", "chat"), BODIES)
def test_builtin_ids_are_the_simulators(body, chat):
    ours = BuiltinPromptTokenizer().token_ids(body, chat)
    assert ours == prompt_ids(body, chat, default_tokenizer())
    keys, n = exact_route_keys(ours, 2)
    assert n == len(ours) and keys == token_block_hashes(ours, 2)


def test_builtin_rejects_a_body_without_prompt():
    with pytest.raises(PromptError):
        BuiltinPromptTokenizer().token_ids({}, False)


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def model_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path, tok


def test_hf_completion_adds_bos_and_chat_renders_the_template(model_dir):
    from kvroute.router.hf_tokenizer import load_tokenizer

    path, tok = model_dir
    hf = load_tokenizer(path)
    ids = list(hf.token_ids({"prompt": "the lazy fox"}, chat=False))
    assert ids[0] == tok.token_to_id("<s>") and ids == tok.encode("the lazy fox").ids
    assert list(hf.token_ids({"prompt": [1, 2, 3]}, chat=False)) == [1, 2, 3]
    chat = list(hf.token_ids({"messages": [{"role": "user", "content": "the dog"}]}, chat=True))
    text = "<s><|user|>the dog</s><|assistant|>"
    assert chat == tok.encode(text, add_special_tokens=False).ids
    with pytest.raises(PromptError):
        hf.token_ids({"messages": []}, chat=True)


def test_hf_loader_needs_a_tokenizer_file(tmp_path):
    pytest.importorskip("tokenizers")
    from kvroute.router.hf_tokenizer import load_tokenizer

    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
