"""The application's own database, as the row-claiming tests see it: a plain driver
connection (autocommit) to the store's database, opened from the store's URL, to create an
events table, fill it and read what the workers did. Not latchkey: the tests check latchkey
against it.
"""

from __future__ import annotations

import sqlite3
import uuid
from typing import Any
from urllib.parse import unquote, urlsplit

#: The stores that claim rows (the SQL lease-table stores), by URL scheme.
ROW_STORES = ("sqlite", "postgresql", "mysql")


class AppDB:
    """One autocommit connection; statements use ``%s`` placeholders whatever the driver."""

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.scheme = parts.scheme
        if self.scheme == "sqlite":
            self.conn: Any = sqlite3.connect(
                url.split("?")[0][len("sqlite:///") :],
                isolation_level=None,
                timeout=30,
                check_same_thread=False,
            )
            self.placeholder = "?"
        elif self.scheme == "postgresql":
            import psycopg

            self.conn = psycopg.connect(url.split("?")[0], autocommit=True)
            self.placeholder = "%s"
        elif self.scheme == "mysql":
            import pymysql

            self.conn = pymysql.connect(
                host=parts.hostname, port=parts.port or 3306, user=unquote(parts.username or ""),
                password=unquote(parts.password or ""), database=parts.path.lstrip("/"),
                autocommit=True,
            )  # fmt: skip
            self.placeholder = "%s"
        else:
            raise ValueError(f"no application database for {self.scheme}")

    @staticmethod
    def placeholder_of(url: str) -> str:
        """The placeholder of the store driver for ``url``."""
        return "?" if url.startswith("sqlite:") else "%s"

    def sql(self, text: str) -> str:
        """``text`` (``%s`` placeholders) in the store driver's style."""
        return text.replace("%s", self.placeholder)

    def execute(self, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
        cur = self.conn.cursor()
        if params:
            cur.execute(self.sql(sql), params)
        else:  # no parameters: sent as is ('%' needs no escaping)
            cur.execute(sql)
        rows = [tuple(row) for row in cur.fetchall()] if cur.description else []
        cur.close()
        return rows

    def create_events(self, count: int, *, extra: str = "") -> str:
        """A new events table (``id``, ``body``, ``processed_at``, ``worker``) holding ``count``
        due rows with ids 1..count; its name."""
        table = f"ev_{uuid.uuid4().hex[:10]}"
        when = "BIGINT" if self.scheme != "sqlite" else "INTEGER"
        self.execute(
            f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, body VARCHAR(50), "
            f"processed_at {when} NULL, worker VARCHAR(50) NULL{extra})"
        )
        self.insert(table, range(1, count + 1))
        return table

    def insert(self, table: str, ids: Any) -> None:
        rows = [(i, f"event {i}") for i in ids]
        if rows:
            cur = self.conn.cursor()
            cur.executemany(self.sql(f"INSERT INTO {table} (id, body) VALUES (%s, %s)"), rows)
            cur.close()

    def create_done(self) -> str:
        """A table where workers record each row's work: (seq, event id, worker, token), seq
        increasing in commit order."""
        table = f"done_{uuid.uuid4().hex[:10]}"
        seq = {
            "sqlite": "seq INTEGER PRIMARY KEY AUTOINCREMENT",
            "postgresql": "seq BIGSERIAL PRIMARY KEY",
            "mysql": "seq BIGINT AUTO_INCREMENT PRIMARY KEY",
        }[self.scheme]
        self.execute(
            f"CREATE TABLE {table} ({seq}, event_id INTEGER, worker VARCHAR(50), token BIGINT)"
        )
        return table

    def close(self) -> None:
        self.conn.close()
