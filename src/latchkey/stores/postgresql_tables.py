"""The PostgreSQL store's tables (:mod:`latchkey.stores.postgresql`): made on first use (the
driver runs :meth:`Tables.create` when a statement finds them missing) or by ``init()``, one
process at a time, and refused when a newer latchkey made them.

Kept beside the store module, not in it, only for length: the store module is its
statements, reply parsing and primitives; this one is the tables they run on — their DDL,
the schema version, the rule for the table's name — mixed into the store as :class:`Tables`.
"""

from __future__ import annotations

from typing import ClassVar

from latchkey._url import StoreURL, identifier
from latchkey.errors import StoreUnavailable
from latchkey.stores.io import Steps
from latchkey.stores.sql import Query

SCHEMA_VERSION = 1
#: The lease table's columns, in the order every INSERT lists them.
COLUMNS = "(name, slot, owner, owner_info, token, acquired_at, expires_at)"
# An acquire takes a slot over only if its lease expired (re-checked on the newest row version).
TAKE_OVER = """ON CONFLICT (name, slot) DO UPDATE SET owner = excluded.owner,
    owner_info = excluded.owner_info, token = excluded.token,
    acquired_at = excluded.acquired_at, expires_at = excluded.expires_at
WHERE l.expires_at <= now()"""
# A mutex acquire (slot 0), taken if free or expired, never from a live lease. In: name,
# owner, owner_info, ttl (s). Out: (token, expires_at) if granted, no row if busy. The store's
# ACQUIRE_MUTEX, and the first step of a queued waiter's attempt (postgresql_line).
TAKE_MUTEX = f"""INSERT INTO {{s}}"{{t}}" AS l {COLUMNS}
VALUES ($1, 0, $2, $3, nextval('{{s}}"{{t}}_fence"'), now(), now() + $4::float8 * interval '1s')
{TAKE_OVER} RETURNING l.token, l.expires_at"""
# A fixed advisory-lock key ("latchkey" in ASCII) that serialises table creation, so that
# several processes starting at once do not race in CREATE … IF NOT EXISTS.
DDL_LOCK_KEY = 0x6C6174636B6B6579


def table_name(text: str) -> str:
    """A table name short enough that ``<table>_records`` fits PostgreSQL's 63-byte limit."""
    identifier(text)
    if len(text) > 55:
        raise ValueError("must be at most 55 characters (63 minus the '_records' suffix)")
    return text


class Tables:
    """Creates the tables of a PostgreSQL store (mixed into ``PostgreSQL``, whose lease table
    renders ``{t}`` and ``{s}`` in these statements as in its own)."""

    scheme: ClassVar[str]
    url: StoreURL
    table: str
    schema: str | None

    # Creates the tables, indexes and sequence if absent and records our schema version: one
    # simple query, so one transaction, that takes DDL_LOCK_KEY first (processes take turns).
    # An index is made only if it is missing, never by CREATE INDEX IF NOT EXISTS: that takes
    # a SHARE lock on its table before it finds the index there, and two such locks taken
    # while another process's release holds the tables deadlock with it (a process that found
    # the tables missing runs this after another has made them and started using them). The
    # same for the column ``rung_at``, added to the waiters of tables made before it (version
    # 1 still: older latchkeys ignore it): a release of this one that finds it missing runs
    # this, which adds it.
    CREATE = f"""SELECT pg_advisory_xact_lock({DDL_LOCK_KEY});
CREATE TABLE IF NOT EXISTS {{s}}"{{t}}" (name bytea NOT NULL, slot integer NOT NULL,
    owner text NOT NULL, owner_info text NOT NULL, token bigint NOT NULL,
    acquired_at timestamptz NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (name, slot));
CREATE SEQUENCE IF NOT EXISTS {{s}}"{{t}}_fence" AS bigint;
CREATE TABLE IF NOT EXISTS {{s}}"{{t}}_records" (name bytea PRIMARY KEY, value text NOT NULL,
    version bigint NOT NULL);
CREATE TABLE IF NOT EXISTS {{s}}"{{t}}_meta" (key text PRIMARY KEY, value text NOT NULL);
CREATE UNLOGGED TABLE IF NOT EXISTS {{s}}"{{t}}_waiters" (name bytea NOT NULL, owner text NOT NULL,
    owner_info text NOT NULL, ttl float8 NOT NULL, ticket bigint NOT NULL,
    listener_key bigint NOT NULL, queued_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL, rung_at timestamptz, PRIMARY KEY (name, owner));
DO $$ BEGIN
IF to_regclass('{{s}}"{{t}}_expires"') IS NULL THEN
    CREATE INDEX "{{t}}_expires" ON {{s}}"{{t}}" (expires_at); END IF;
IF to_regclass('{{s}}"{{t}}_waiters_line"') IS NULL THEN
    CREATE INDEX "{{t}}_waiters_line" ON {{s}}"{{t}}_waiters" (name, queued_at, ticket); END IF;
IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('{{s}}"{{t}}_waiters"')
               AND attname = 'rung_at' AND NOT attisdropped) THEN
    ALTER TABLE {{s}}"{{t}}_waiters" ADD COLUMN rung_at timestamptz; END IF;
END $$;
INSERT INTO {{s}}"{{t}}_meta" VALUES ('schema_version', '{SCHEMA_VERSION}')
ON CONFLICT DO NOTHING"""
    # The schema version the tables were made with (newer than ours: we must not use them).
    SELECT_VERSION = """SELECT value FROM {s}"{t}_meta" WHERE key = 'schema_version'"""

    def create(self) -> Steps[None]:
        """Create what is missing, one process at a time; refuse tables from a newer version."""
        schema = f'CREATE SCHEMA IF NOT EXISTS "{self.schema}";' if self.schema else ""
        yield Query(self.CREATE.replace(";", ";" + schema, 1), None)  # None: one script
        rows, _ = yield Query(self.SELECT_VERSION)
        found = int(rows[0][0]) if rows else SCHEMA_VERSION
        if found > SCHEMA_VERSION:
            raise StoreUnavailable(f"{self.scheme} store at {self.url.redacted()}: table "
                                   f"{self.table} has schema version {found}, newer than this "
                                   f"latchkey ({SCHEMA_VERSION}); upgrade latchkey")  # fmt: skip

    init = create
