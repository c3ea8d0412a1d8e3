"""Byte-level BPE tokenizer of the tiny model, trained with `tokenizers` on the training split,
saved as tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2

# Chat requests become Python comments (the model only knows Python source), then the
# assistant turn is generated as code. bos is part of the template, as in DeepSeek-V3's.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}\n"
    "{% else %}# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # encode() adds bos (like DeepSeek's tokenizer); ByteLevel offsets for decode.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]),
    ])
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each file as [bos] + tokens + [eos]."""
    eos = tok.token_to_id(EOS)
    return [e.ids + [eos] for e in tok.encode_batch(texts)]
