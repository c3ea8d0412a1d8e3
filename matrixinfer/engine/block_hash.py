"""The one name of a block of KV, everywhere: the engine's prefix cache, the EMS page key and
the P/D hand-off all call `block_hashes`.

Block i of a token sequence is named h_i = H(h_{i-1} || its token ids), with h_{-1} = H(model
identity || KV dtype || namespace). So a name covers the *whole* prefix up to the end of its
block: two sequences share block i only if they agree on every token before it, and blocks of
different models, KV dtypes or tenants (namespaces) never collide. Only full blocks are named.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def model_identity(model_dir: str | Path) -> str:
    """A fingerprint of a checkpoint that is the same for every process loading the same files:
    its config.json and the names and sizes of its weight files (not their paths)."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    cfg = model_dir / "config.json"
    h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode() if cfg.exists() else b"")
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()


def root_hash(model_id: str, namespace: str = "", kv_dtype: str = "") -> bytes:
    return hashlib.blake2b(f"{model_id}\0{kv_dtype}\0{namespace}".encode(), digest_size=16).digest()


def block_hashes(token_ids, block_size: int, root: bytes, start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Names of full blocks start, start+1, ... of token_ids; `parent` is block start-1's name
    (the root when start == 0)."""
    toks = np.asarray(token_ids, dtype=np.int64)
    if toks.ndim != 1:
        raise ValueError("token_ids must be a flat sequence of ints")
    h = root if start == 0 else parent
    out = []
    for i in range(start, len(toks) // block_size):
        h = hashlib.blake2b(h + toks[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def page_key(block_hash: bytes) -> str:
    """The EMS key of a block's KV page."""
    return "kv:" + block_hash.hex()
