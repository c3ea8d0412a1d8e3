"""Where benchmark results go: benchmarks/<name>.json, a plot, and a section of BENCHMARKS.md.

Each benchmark owns one section of benchmarks/BENCHMARKS.md, delimited by HTML comments,
so several benchmarks can rewrite their own tables without touching each other's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BENCH_DIR = Path("benchmarks")


def bench_dir() -> Path:
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    return BENCH_DIR


def save_json(name: str, data: dict) -> Path:
    path = bench_dir() / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, markdown: str) -> Path:
    """Replace (or append) the section `name` of benchmarks/BENCHMARKS.md."""
    path = bench_dir() / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nWritten by `matrixinfer bench ...`; each section is rewritten by its benchmark.\n"
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    return path
