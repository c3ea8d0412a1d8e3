"""The shipped tokenizer: byte-level BPE that round-trips any text, loads in transformers'
AutoTokenizer with bos/eos/pad, and has a chat template."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from matrixinfer.train import corpus

MODEL = Path(__file__).resolve().parents[2] / "models" / "matrixinfer-tiny-moe"


@pytest.fixture(scope="module")
def auto():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def test_byte_level_bpe_round_trips_heldout_files_and_arbitrary_bytes():
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    assert 4000 <= tok.get_vocab_size() <= 8192
    texts = corpus.read_texts(corpus.read_heldout_list()[:5]) + ["naïve café 日本語 \t\x00 🐍\r\n"]
    for text in texts:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_auto_tokenizer_has_bos_eos_pad_and_adds_bos(auto):
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    ids = auto("def f(x):\n    return x\n").input_ids
    assert ids[0] == auto.bos_token_id
    assert auto.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x\n"


def test_chat_template_renders_a_conversation_as_python_comments(auto):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list\nquickly"}]
    text = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|># system: be brief\n# user: sort a list\n# quickly\n# assistant:\n"
    ids = auto.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == auto.bos_token_id and ids.count(auto.bos_token_id) == 1
