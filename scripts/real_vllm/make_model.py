"""Write a tiny dummy-weight Llama model directory that vLLM can serve offline.

vLLM's ``--load-format dummy`` draws random weights from ``config.json``, so the
directory needs no weights: only the config, a tokenizer and a chat template. The
tokenizer is a byte-level BPE trained here on local text (this Python's own standard
library sources), so nothing is downloaded. The chat template renders exactly the text
of ``kvroute.common.chat.render_chat`` for plain string contents, so the router's
approximate keys cut the same text the engine tokenizes.

Run with the vLLM venv (it has ``tokenizers`` and ``jinja2``):

    .venv-vllm/bin/python scripts/real_vllm/make_model.py --out .venv-vllm/models/tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 4096
# The template's role markers are special tokens, as in real chat models (Llama-3's
# headers, ChatML's <|im_start|>): one id each, and the points where a tokenizer splits a
# chat before merging, which the router's tokenized-segment cache relies on.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", *ROLE_TOKENS)

# Same text as kvroute.common.chat.render_chat for string contents and no tools.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Hugging Face renders chat templates with trim_blocks, which eats a newline right
# after a block tag: every newline above is therefore an expression, not literal text.


def llama_config(hidden: int, layers: int, max_len: int) -> dict[str, object]:
    """A small Llama config; head_dim 64, two KV heads (GQA like real Llamas)."""
    heads = max(1, hidden // 64)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": min(2, heads),
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def corpus_files(limit_bytes: int) -> list[Path]:
    """Python sources of this interpreter's standard library, up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        size = path.stat().st_size
        if total + size > limit_bytes:
            break
        files.append(path)
        total += size
    if not files:
        raise SystemExit(f"no training text found under {root}")
    return files


def _lines(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield from path.read_text(errors="replace").splitlines()


def train_tokenizer(out: Path, limit_bytes: int) -> None:
    """Train a byte-level BPE (vocab 4096) and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_lines(corpus_files(limit_bytes)), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def make_model(out: Path, hidden: int, layers: int, max_len: int, corpus_bytes: int) -> None:
    """Write config.json, tokenizer.json, tokenizer_config.json and friends into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(llama_config(hidden, layers, max_len), indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=1)
    )
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1)
    )
    train_tokenizer(out, corpus_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".venv-vllm/models/tiny"))
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (multiple of 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=8192, help="max_position_embeddings")
    ap.add_argument("--corpus-mb", type=float, default=8.0, help="training text, MB")
    ap.add_argument("--force", action="store_true", help="rewrite an existing model")
    args = ap.parse_args(argv)
    if args.hidden < 64 or args.hidden % 64:
        ap.error("--hidden must be a positive multiple of 64")
    if (args.out / "tokenizer.json").exists() and not args.force:
        print(f"model exists: {args.out} (use --force to rewrite)")
        return 0
    make_model(args.out, args.hidden, args.layers, args.max_len, int(args.corpus_mb * 2**20))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
