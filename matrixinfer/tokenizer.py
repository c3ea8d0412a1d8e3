"""Tokenizer from a Hugging Face directory (tokenizer.json + tokenizer_config.json), with the
incremental detokenization streaming needs."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = self._special("bos_token")
        self.eos_token = self._special("eos_token")
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def maybe_load(cls, model_dir: str | Path) -> "Tokenizer | None":
        return cls(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> "_DecodeStream":
        """An incremental decoder: step(id) costs O(1) and returns the new text, or None while a
        UTF-8 character split across tokens (byte-level BPE) is incomplete."""
        return _DecodeStream(self._tok, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI's tool definitions, for templates that render them (as HF passes them)."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools,
        )


class _DecodeStream:
    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool):
        self._tok, self._stream = tok, DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        return self._stream.step(self._tok, token_id)
