"""Files and batch jobs in SQLite: every answered line is committed (WAL, fsync) as it lands,
before the line counts as done.

    files    id, purpose, filename, bytes, created_at, content
    batches  one row per job: status, counts, timestamps, input/output/error file ids, errors
    lines    (batch, line number): custom_id, the request body, and once done its result

A server killed at any point restarts with each job's finished lines in place: the runner
takes up the lines that have no result yet, so no line is answered twice or lost. The
output and error files are assembled from the lines, in input order, when a job ends.

Every call runs on the store's own thread (`call`): a commit waits for its fsync, which must
not stall the event loop's streams, and one thread means no two calls ever overlap. A lock
file keeps a second server off the same store (two runners would answer one job twice).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import sqlite3
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA_VERSION = 1
_SCHEMA = (
    """CREATE TABLE files (
        id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL, content BLOB NOT NULL)""",
    """CREATE TABLE batches (
        id TEXT PRIMARY KEY, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
        status TEXT NOT NULL, created_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
        completed_at INTEGER, failed_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
        output_file_id TEXT, error_file_id TEXT, errors TEXT, metadata TEXT)""",
    """CREATE TABLE lines (
        batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, url TEXT NOT NULL, body TEXT NOT NULL,
        status_code INTEGER, response TEXT, PRIMARY KEY (batch_id, line))""",
)
# Statuses a job can be found in after a restart with work left: the runner takes them up.
UNFINISHED = ("in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "cancelled", "expired")


class StoreError(Exception):
    """The store could not write (a full disk, a read-only file): the API answers 507/500."""


@dataclass(frozen=True)
class Line:
    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


class BatchStore:
    def __init__(self, path: Path, max_pages: int | None = None):
        """`max_pages`: a planted full disk (sqlite's SQLITE_FULL past that many pages).
        ValueError if another process holds the store."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = open(path.with_name(path.name + ".lock"), "w")  # noqa: SIM115  (held until close)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"another oxserve server uses the batch store {path}; give this one its own --batch-store") from None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        # Built here, used on the store's thread only (check_same_thread would refuse that hand-over).
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)  # transactions are explicit
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed line survives power loss, not just a kill
        self.max_pages = max_pages
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            with self._write():
                for statement in _SCHEMA:
                    self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise ValueError(f"{path} holds batch store version {version}; this oxserve reads version {SCHEMA_VERSION}")
        if max_pages is not None:
            self.db.execute(f"PRAGMA max_page_count={int(max_pages)}")

    async def call(self, method: Callable[..., T], *args: Any) -> T:
        """`method(*args)` (one of this store's) on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, method, *args)

    def close(self) -> None:
        self._thread.submit(self.db.close).result()
        self._thread.shutdown()
        self._lock.close()  # releases the lock

    def _write(self):
        return _Transaction(self.db)

    # ---- files --------------------------------------------------------------------------
    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = f"file-{uuid.uuid4().hex}"
        with self._write():
            self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                            (file_id, purpose, filename, len(content), int(time.time()), content))  # fmt: skip
        return self.file(file_id)

    def file(self, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else _file_object(row)

    def files(self, purpose: str | None, limit: int, after: str | None, descending: bool) -> list[dict[str, Any]]:
        rows = self._page("files", "id, purpose, filename, bytes, created_at", purpose, limit, after, descending)
        return [_file_object(row) for row in rows]

    def file_content(self, file_id: str) -> bytes | None:
        row = self.db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, file_id: str) -> bool:
        with self._write():
            return self.db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1

    # ---- batches ------------------------------------------------------------------------
    def add_batch(self, endpoint: str, input_file_id: str, window: str, metadata: dict | None,
                  lines: list[Line], errors: list[dict] | None) -> dict[str, Any]:  # fmt: skip
        """A new job: in progress with its lines, or failed at once with `errors` (a bad file)."""
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        status = "failed" if errors else "in_progress"
        with self._write():
            self.db.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, created_at, in_progress_at, "
                "failed_at, errors, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, endpoint, input_file_id, window, status, now, None if errors else now, now if errors else None,
                 json.dumps(errors) if errors else None, json.dumps(metadata) if metadata is not None else None),
            )  # fmt: skip
            self.db.executemany("INSERT INTO lines (batch_id, line, custom_id, url, body) VALUES (?, ?, ?, ?, ?)",
                                [(batch_id, x.line, x.custom_id, x.url, json.dumps(x.body)) for x in lines])  # fmt: skip
        return self.batch(batch_id)

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else self._batch_object(row)

    def batches(self, limit: int, after: str | None) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them."""
        return [self._batch_object(row) for row in self._page("batches", "*", None, limit, after, descending=True)]

    def _page(self, table: str, columns: str, purpose: str | None, limit: int, after: str | None, descending: bool) -> list:
        """Up to `limit` rows in creation order (rowid), from the one after id `after` (the id
        the previous page ended with; an unknown one: nothing)."""
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"rowid {'<' if descending else '>'} (SELECT rowid FROM {table} WHERE id = ?)")
            args.append(after)
        query = f"SELECT {columns} FROM {table}" + (" WHERE " + " AND ".join(where) if where else "")
        query += f" ORDER BY rowid {'DESC' if descending else 'ASC'} LIMIT ?"
        return self.db.execute(query, (*args, limit)).fetchall()

    def unfinished(self) -> list[str]:
        marks = ", ".join("?" * len(UNFINISHED))
        return [r[0] for r in self.db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at", UNFINISHED)]

    def pending_lines(self, batch_id: str) -> list[Line]:
        rows = self.db.execute("SELECT line, custom_id, url, body FROM lines WHERE batch_id = ? AND response IS NULL "
                               "ORDER BY line", (batch_id,))  # fmt: skip
        return [Line(line, custom_id, url, json.loads(body)) for line, custom_id, url, body in rows]

    def record(self, batch_id: str, line: int, status_code: int, response: dict[str, Any]) -> None:
        """A line's result, committed before this returns. A line already answered keeps its
        first answer (a rerun after a restart cannot duplicate it)."""
        with self._write():
            self.db.execute("UPDATE lines SET status_code = ?, response = ? WHERE batch_id = ? AND line = ? "
                            "AND response IS NULL", (status_code, json.dumps(response), batch_id, line))  # fmt: skip

    def set_status(self, batch_id: str, status: str) -> None:
        with self._write():
            self.db.execute(f"UPDATE batches SET status = ?, {status}_at = ? WHERE id = ?", (status, int(time.time()), batch_id))

    def finish(self, batch_id: str, status: str) -> None:
        """End a job ("completed" or "cancelled"): write its output and error files."""
        rows = self.db.execute("SELECT custom_id, status_code, response FROM lines WHERE batch_id = ? AND response IS NOT NULL "
                               "ORDER BY line", (batch_id,)).fetchall()  # fmt: skip
        ok = [r[2] for r in rows if r[1] == 200]
        bad = [r[2] for r in rows if r[1] != 200]
        with self._write():
            ids = [self._insert_file(lines, f"{batch_id}_{kind}.jsonl") if lines else None
                   for kind, lines in (("output", ok), ("error", bad))]  # fmt: skip
            self.db.execute(f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                            (status, int(time.time()), ids[0], ids[1], batch_id))  # fmt: skip

    def _insert_file(self, lines: list[str], filename: str) -> str:
        file_id = f"file-{uuid.uuid4().hex}"
        content = "".join(line + "\n" for line in lines).encode()
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                        (file_id, "batch_output", filename, len(content), int(time.time()), content))  # fmt: skip
        return file_id

    def _batch_object(self, row: tuple) -> dict[str, Any]:
        names = [d[0] for d in self.db.execute("SELECT * FROM batches LIMIT 0").description]
        b = dict(zip(names, row))
        total, done, failed = self.db.execute(
            "SELECT COUNT(*), COUNT(response), COUNT(CASE WHEN status_code != 200 THEN 1 END) FROM lines WHERE batch_id = ?",
            (b["id"],),
        ).fetchone()
        errors = json.loads(b.pop("errors")) if b["errors"] else None
        metadata = json.loads(b.pop("metadata")) if b["metadata"] else None
        return {**b, "object": "batch", "errors": {"object": "list", "data": errors} if errors else None,
                "metadata": metadata, "expires_at": None, "expired_at": None,
                "request_counts": {"total": total, "completed": done - failed, "failed": failed}}  # fmt: skip


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error; sqlite's write errors become StoreError."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            try:
                self.db.execute("COMMIT")
                return False
            except sqlite3.Error as e:
                error = e
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        if isinstance(error, sqlite3.Error):
            raise StoreError(f"the batch store could not write: {error}") from error
        return False


def _file_object(row: tuple) -> dict[str, Any]:
    file_id, purpose, filename, size, created_at = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed"}  # fmt: skip
