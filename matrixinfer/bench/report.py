"""Where benchmark results go: <dir>/<name>.json, a plot, and a section of <dir>/BENCHMARKS.md.

<dir> is `--out` (default ./bench-results/, git-ignored), so running a benchmark never dirties
a checkout; `--save` writes to benchmarks/ instead, the results tracked in the repository.
Each benchmark owns one section of BENCHMARKS.md, delimited by HTML comments, so several
benchmarks can rewrite their own tables without touching each other's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SAVED_DIR = Path("benchmarks")  # tracked results, written only with --save
DEFAULT_OUT = Path("bench-results")
BENCH_DIR = DEFAULT_OUT


def configure(out: str | Path | None = None, save: bool = False) -> Path:
    """Set where every benchmark of this process writes (from `matrixinfer bench ... --out/--save`)."""
    global BENCH_DIR
    BENCH_DIR = SAVED_DIR if save else Path(out or DEFAULT_OUT)
    return BENCH_DIR


def add_output_args(parser) -> None:
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results directory (default %(default)s)")
    parser.add_argument("--save", action="store_true", help="write to benchmarks/ (the tracked results) instead")


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
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
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
