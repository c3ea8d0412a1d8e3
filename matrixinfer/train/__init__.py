"""Training of the small DeepSeek-V3-architecture model shipped with matrixinfer
(models/matrixinfer-tiny-moe): corpus, tokenizer, training loop and evaluation."""
