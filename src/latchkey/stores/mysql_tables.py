"""The MySQL/MariaDB store's tables (:mod:`latchkey.stores.mysql`): created by the script
every new connection runs first (``IF NOT EXISTS`` and ``INSERT IGNORE`` make that safe when
many processes start at once), with the schema version beside them.

Kept beside the store module, not in it, only for length (as ``postgresql_tables``): the
store module is its statements, reply parsing and primitives; this one is the tables they
run on, mixed into the store as :class:`Tables`.
"""

from __future__ import annotations

from latchkey.stores.sql import Query

SCHEMA_VERSION = 1

# {t}: the validated table name. Sent at every (re)connect; IF NOT EXISTS and INSERT IGNORE
# make that safe when many processes start at once.
CREATE = """
CREATE TABLE IF NOT EXISTS {t} (
    name        VARBINARY(255) NOT NULL,  -- the lock name's UTF-8 bytes
    slot        INT            NOT NULL,  -- 0 for a mutex; 0..limit-1 for a semaphore
    owner       CHAR(32)       NOT NULL,  -- the holder's secret owner token
    owner_info  TEXT           NOT NULL,  -- JSON: host, pid, started, thread, metadata
    token       BIGINT         NOT NULL AUTO_INCREMENT,  -- fencing token, never reused
    acquired_at DATETIME(6)    NOT NULL,  -- UTC, server clock
    expires_at  DATETIME(6)    NOT NULL,  -- UTC, server clock; <= now means free
    waited      TINYINT        NOT NULL DEFAULT 0,  -- 1: someone waits (MariaDB's bells)
    PRIMARY KEY (name, slot),
    KEY {t}_token (token),
    KEY {t}_expires (expires_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
CREATE TABLE IF NOT EXISTS {t}_meta (
    k VARCHAR(32) NOT NULL PRIMARY KEY,   -- 'schema_version'
    v BIGINT      NOT NULL
) ENGINE=InnoDB;
INSERT IGNORE INTO {t}_meta (k, v) VALUES ('schema_version', {version});
CREATE TABLE IF NOT EXISTS {t}_bells (
    name   VARBINARY(255)  NOT NULL,      -- a name some process waits for
    server INT UNSIGNED    NOT NULL,      -- @@server_id of the server the process waits on
    conn   BIGINT UNSIGNED NOT NULL,      -- CONNECTION_ID() of that process's bell
    since  DATETIME(6)     NOT NULL,      -- when it began to wait: rung in this order
    heir   CHAR(32)        NULL,          -- the owner a release hands the lease to (or none)
    info   VARBINARY({info_max}) NULL,     -- that owner's JSON
    ttl    BIGINT          NULL,          -- that owner's TTL, microseconds
    PRIMARY KEY (name, server, conn) USING BTREE,
    KEY {t}_bells_since (name, server, since) USING BTREE
) ENGINE=MEMORY;
CREATE TABLE IF NOT EXISTS {t}_records (
    name    VARBINARY(255) NOT NULL PRIMARY KEY,
    value   LONGTEXT       NOT NULL,      -- JSON
    version BIGINT         NOT NULL       -- 1 after the first write, +1 per write
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
"""


#: The longest owner JSON a bell names its heir with (bytes; a MEMORY table stores this
#: column at its full width): a waiter with a longer one is rung, not handed the lease.
INFO_MAX = 512

# MariaDB: tables made before the lease table's ``waited`` column (latchkey 0.1) or the bells'
# heir (0.2) get them once, by the first connection that finds them missing; looked up first
# (a compound statement), so later connections take no table lock for them.
ADD_WAITED = """
BEGIN NOT ATOMIC
  IF NOT EXISTS (SELECT 1 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()
                 AND TABLE_NAME = '{t}' AND COLUMN_NAME = 'waited') THEN
    ALTER TABLE {t} ADD COLUMN IF NOT EXISTS waited TINYINT NOT NULL DEFAULT 0;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE()
                 AND TABLE_NAME = '{t}_bells' AND COLUMN_NAME = 'heir') THEN
    ALTER TABLE {t}_bells ADD COLUMN IF NOT EXISTS heir CHAR(32) NULL,
        ADD COLUMN IF NOT EXISTS info VARBINARY({info_max}) NULL,
        ADD COLUMN IF NOT EXISTS ttl BIGINT NULL;
  END IF;
END"""


def micros(seconds: float) -> int:
    """A TTL as the tables and statements take it: whole microseconds, at least one."""
    return max(1, round(seconds * 1_000_000))


class Tables:
    """Creates the tables of a MySQL store (mixed into ``MySQL``, whose validated table name
    renders ``{t}``)."""

    table: str

    def tables(self) -> Query:
        """The script creating the tables if they do not exist (multi-statement)."""
        return Query(CREATE.format(t=self.table, version=SCHEMA_VERSION, info_max=INFO_MAX))

    def add_waited(self) -> Query:
        """MariaDB: the lease table's ``waited`` column and the bells' heir added to tables
        made without them."""
        return Query(ADD_WAITED.format(t=self.table, info_max=INFO_MAX))
