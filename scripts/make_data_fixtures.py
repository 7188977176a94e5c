"""Writes the Parquet data fixtures of `cpl train --data` under tests/fixtures/data/.

Parquet is the format of Hugging Face datasets (what `datasets` and the Hub's parquet
conversion write, through pyarrow). The same documents are written as JSON lines, so the Rust
tests can check that both formats give the same documents:

- docs.jsonl                  the reference: one {"text": ...} object per line;
- docs-snappy.parquet         columns `id` (int64) and `text` (string), snappy (pyarrow's
                              default), two row groups, one null text (skipped by the reader);
- docs-zstd.parquet           the same, zstd, one row group, `text` stored as large_string;
- docs-gzip.parquet           the same, gzip;
- docs-lz4.parquet            the same, lz4;
- not-text.parquet            a `text` column of int64 (must be rejected with a clear error).

Run from the repository root: .venv-data/bin/python scripts/make_data_fixtures.py
"""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

OUT = pathlib.Path("tests/fixtures/data")

DOCS = [
    "To be, or not to be, that is the question.",
    "Whether 'tis nobler in the mind to suffer\nThe slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles, and by opposing end them.",
    "Ünïcödé survives: naïve café, 東京, emoji 🎭.",
    "To die, to sleep; no more.",
    "A short one.",
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "docs.jsonl", "w", encoding="utf-8") as f:
        for d in DOCS:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    # A null row between documents: readers skip it.
    texts = DOCS[:3] + [None] + DOCS[3:]
    ids = list(range(len(texts)))
    table = pa.table({"id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.string())})
    pq.write_table(table, OUT / "docs-snappy.parquet", compression="snappy", row_group_size=4)
    large = pa.table(
        {"id": pa.array(ids, pa.int64()), "text": pa.array(texts, pa.large_string())}
    )
    pq.write_table(large, OUT / "docs-zstd.parquet", compression="zstd")
    pq.write_table(table, OUT / "docs-gzip.parquet", compression="gzip")
    pq.write_table(table, OUT / "docs-lz4.parquet", compression="lz4")
    bad = pa.table({"text": pa.array([1, 2, 3], pa.int64())})
    pq.write_table(bad, OUT / "not-text.parquet")
    for p in sorted(OUT.iterdir()):
        print(p, p.stat().st_size)


if __name__ == "__main__":
    main()
