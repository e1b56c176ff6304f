"""Storage of the events on their way through `process`: streams of record batches of
one schema, in a scratch file or in memory (the spill's buckets, pair's ranges).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa


class Stream:
    """Record batches of one schema, in a file (uncompressed IPC, read back with plain
    reads, so that nothing of it stays mapped) or in memory."""

    def __init__(self, schema: pa.Schema, path: Path | None) -> None:
        self.schema, self.path, self.rows = schema, path, 0
        self.parts: list[pa.RecordBatch] = []
        self.writer: pa.ipc.RecordBatchStreamWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        self.rows += batch.num_rows
        if self.path is None:
            self.parts.append(batch)
            return
        if self.writer is None:
            self.writer = pa.ipc.new_stream(pa.OSFile(str(self.path), "wb"), self.schema)
        self.writer.write_batch(batch)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def batches(self) -> Iterator[pa.RecordBatch]:
        self.close()
        if self.path is None:
            yield from self.parts
        elif self.rows:
            with pa.OSFile(str(self.path)) as f:
                yield from pa.ipc.open_stream(f)

    def table(self) -> pa.Table:
        return pa.Table.from_batches(list(self.batches()), schema=self.schema)

    def remove(self) -> None:
        """Let go of what the stream holds."""
        self.close()
        self.parts = []
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def pieces(self, rows: int = 1 << 20) -> Iterator[pa.Table]:
        """The batches gathered into tables of about `rows` (DuckDB's insert of a
        table costs ~30 ms however small)."""
        yield from as_pieces(self.batches(), self.schema, rows)


def as_pieces(batches: Iterable[pa.RecordBatch], schema: pa.Schema, rows: int = 1 << 20
              ) -> Iterator[pa.Table]:
    """Record batches gathered into tables of at least `rows` (the last: the rest)."""
    held: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        held.append(b)
        n += b.num_rows
        if n >= rows:
            yield pa.Table.from_batches(held, schema=schema)
            held, n = [], 0
    if held:
        yield pa.Table.from_batches(held, schema=schema)
