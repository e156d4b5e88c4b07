"""Row leases on PostgreSQL (``store.rows(...).lease``, :mod:`latchkey.stores.rows_sql`), as
one statement, and a take's BEGIN and COMMIT through libpq's fast path: mixed into
:class:`latchkey.stores.postgresql.PostgreSQL` as :class:`RowLeases`.

Kept beside the store module, not in it, only for length (as ``postgresql_tables``): the
generic row claiming (its reads, takes and the read-claim-read lease of the other SQL
stores) is in ``rows_sql``; this is PostgreSQL's own way to lease, which reads and claims
in one round trip.
"""

from __future__ import annotations

from typing import Any, ClassVar

from latchkey._types import Grant, RowSpec
from latchkey.stores.io import Steps
from latchkey.stores.io.psycopg import Prepared, utc
from latchkey.stores.postgresql_tables import COLUMNS, TAKE_OVER
from latchkey.stores.rows_sql import LEASE_ROUNDS, Dialect, Statement
from latchkey.stores.sql import Query

#: A take's BEGIN and COMMIT through libpq's fast path (prepared once per connection):
#: through psycopg's execute, each cost a one-row take a tenth more CPU.
BEGIN = Prepared(b"latchkey_begin", b"BEGIN", (), ())
COMMIT = Prepared(b"latchkey_commit", b"COMMIT", (), ())


class RowLeases:
    """``rows_lease`` as one statement per round (see :meth:`rows_lease`), and a take's
    BEGIN and COMMIT through the fast path."""

    ROWS: ClassVar[Dialect]  # RowClaims's
    rows_select: Any  # RowClaims's reader of the due rows

    # A row lease (store.rows(...).lease) in one statement, in autocommit: {due} is the due
    # rows with no live lease, locked FOR UPDATE SKIP LOCKED (RowClaims.rows_select; its '%'
    # doubled: the statement has parameters), {name} a due row's lease name. The due rows are
    # numbered in their order (they come out of the locking read in it), their names claimed
    # as CLAIM claims (in name order, never from a live lease nor a name held as a semaphore)
    # and every due row comes back, in order, with its token and expiry — NULL where another
    # lessee's lease, committed after this statement's snapshot began, kept us out. One round
    # trip and one commit for the batch, where BEGIN, the read, the claim and COMMIT were
    # four. In (%s, psycopg's style): owner, owner_info, ttl (s). Out: the row's columns,
    # latchkey_pos, latchkey_name, token, expires_at.
    ROWS_LEASE = f"""WITH latchkey_rows_due AS ({{due}}
), latchkey_rows_named AS (
    SELECT latchkey_rows_due.*, row_number() OVER () AS latchkey_pos, {{name}} AS latchkey_name
    FROM latchkey_rows_due
), latchkey_rows_taken AS (
    INSERT INTO {{s}}"{{t}}" AS l {COLUMNS}
    SELECT n.latchkey_name, 0, %s, %s, nextval('{{s}}"{{t}}_fence"'), now(),
           now() + %s::float8 * interval '1s'
    FROM latchkey_rows_named AS n
    WHERE NOT EXISTS (SELECT 1 FROM {{s}}"{{t}}" AS o
                      WHERE o.name = n.latchkey_name AND o.slot > 0 AND o.expires_at > now())
    ORDER BY n.latchkey_name {TAKE_OVER} RETURNING l.name, l.token, l.expires_at
)
SELECT n.*, t.token, t.expires_at FROM latchkey_rows_named AS n
LEFT JOIN latchkey_rows_taken AS t ON t.name = n.latchkey_name ORDER BY n.latchkey_pos"""

    def rows_begin(self) -> Any:
        """BEGIN as a prepared statement."""
        return BEGIN

    def rows_end(self, commit: bool) -> Steps[None]:
        """COMMIT as a prepared statement; ROLLBACK through psycopg, which then forgets its
        own prepared statements (what the rolled-back transaction dropped may come back)."""
        yield COMMIT if commit else Query("ROLLBACK")

    def rows_lease(
        self, spec: RowSpec, owner: str, owner_info: str, ttl: float, limit: int
    ) -> Steps[list[tuple[dict[str, Any], Grant]]]:
        """ROWS_LEASE: one statement per round. A round that lost a claim (a lessee committed
        its leases after the statement's snapshot began: those rows were not locked any more,
        and looked unleased) is followed by another for the rest of the batch, whose fresh
        snapshot sees those leases (and ours), up to ``LEASE_ROUNDS``, until the batch is full
        or nothing more is due. A row finished by another worker is never leased: its lock
        made us skip it until its commit, and after that it is no longer due (the locking
        read re-checks ``where`` on the newest row version)."""
        key = f"latchkey_rows_due.{self.ROWS.quote}{spec.key}{self.ROWS.quote}"
        name = self.ROWS.LEASE_NAME.format(prefix=f"'{spec.table}:'", key=key)
        leased: list[tuple[dict[str, Any], Grant]] = []
        for _ in range(LEASE_ROUNDS):
            due = self.rows_select(spec, limit - len(leased), self.ROWS.LOCKING, "")
            sql = self.ROWS_LEASE.format(due=due.replace("%", "%%"), name=name)
            columns, rows = yield Statement(sql, (owner, owner_info, float(ttl)))
            width = len(columns) - 4  # the row's own columns; then ours
            lost = False
            for row in rows:
                token, expires = row[-2], row[-1]
                if token is None:
                    lost = True
                    continue
                leased.append((dict(zip(columns[:width], row[:width], strict=True)),
                               Grant(token, utc(expires))))  # fmt: skip
            if not lost or len(leased) >= limit:
                break
        return leased
