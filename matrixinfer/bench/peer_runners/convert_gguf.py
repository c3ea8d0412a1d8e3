"""HF checkpoint -> GGUF with llama.cpp's own converter (convert_hf_to_gguf.py of a llama.cpp
source tree, e.g. vendor/llama.cpp of the llama-cpp-python sdist), run under this project's
interpreter (it needs torch, safetensors, transformers, numpy).

usage: python convert_gguf.py LLAMA_CPP_SRC MODEL_DIR OUTTYPE OUTFILE

Two adjustments, both about metadata, not weights: transformers 5 no longer writes DeepSeek-V3's
`scoring_func` / `topk_method` into config.json, which the converter reads (the architecture
implies sigmoid + noaux_tc), so a temp copy of the checkpoint gets them; and a BPE tokenizer
whose pre-tokenizer hash llama.cpp does not list (ours: plain GPT-2-style byte-level BPE) is
declared "gpt-2" instead of failing.
"""

import json
import logging
import os
import runpy
import sys
import tempfile


def main() -> None:
    src, model_dir, outtype, outfile = sys.argv[1:5]
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    import conversion.base as base

    known = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("convert_gguf").warning("pre-tokenizer hash not listed by llama.cpp: using gpt-2")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(model_dir):
            if os.path.isfile(os.path.join(model_dir, name)):
                os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(tmp, name))
        cfg_path = os.path.join(tmp, "config.json")
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        if cfg.get("model_type") == "deepseek_v3":
            cfg.setdefault("scoring_func", "sigmoid")
            cfg.setdefault("topk_method", "noaux_tc")
        os.unlink(cfg_path)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        script = os.path.join(src, "convert_hf_to_gguf.py")
        sys.argv = [script, tmp, "--outtype", outtype, "--outfile", outfile]
        runpy.run_path(script, run_name="__main__")
    if not os.path.exists(outfile):
        raise SystemExit(f"the converter wrote no {outfile}")


if __name__ == "__main__":
    main()
