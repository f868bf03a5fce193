"""Bulk writes shared by the recorders: many rows in one statement, ``COPY`` on PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import JSON, Table, insert, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session


def insert_many(s: Session, table: Table, rows: list[dict[str, Any]]) -> list[int]:
    """Insert ``rows`` (same keys each) into ``table``; returns their new ids, in order.

    PostgreSQL: the ids are drawn from the table's sequence in one query, then the rows go in
    with ``COPY``, the server's bulk path (a multi-row ``INSERT`` is a long new statement text
    each time, which psycopg parses again on every call; an executemany still runs one statement
    per row on the server). Elsewhere: one multi-row ``INSERT ... RETURNING`` on the Core table
    (the ORM's bulk insert would split the rows by their sets of non-null columns)."""
    if s.get_bind().dialect.name != "postgresql":
        stmt = insert(table).returning(table.c.id, sort_by_parameter_order=True)
        return list(s.scalars(stmt, rows))
    ids = sorted(
        s.scalars(
            text("SELECT nextval(pg_get_serial_sequence(:t, 'id')) FROM generate_series(1, :n)"),
            {"t": table.name, "n": len(rows)},
        )
    )
    copy_rows(s, table, [{**r, "id": i} for r, i in zip(rows, ids, strict=True)])
    return ids


def copy_rows(s: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """``COPY`` rows into a table on the session's own connection and transaction, with each
    column's bind processing (JSON, ``FreeText``) and the Python-side defaults (``created_at``)
    that an ``INSERT`` through SQLAlchemy would apply."""
    dialect = s.get_bind().dialect
    given = list(rows[0])
    defaults = {
        c.name: c.default
        for c in table.columns
        if c.name not in given and c.default is not None and hasattr(c.default, "arg")
    }
    cols = given + list(defaults)
    procs = [table.c[c].type._cached_bind_processor(dialect) for c in cols]
    driver = s.connection().connection.driver_connection
    assert driver is not None
    sql = f"COPY {table.name} ({', '.join(cols)}) FROM STDIN"
    import psycopg  # the PostgreSQL driver: COPY is its API

    try:
        with driver.cursor() as cur, cur.copy(sql) as cp:
            for r in rows:
                for k, d in defaults.items():
                    r[k] = d.arg(None) if callable(d.arg) else d.arg  # type: ignore[attr-defined]
                cp.write_row([p(r[c]) if p else r[c] for c, p in zip(cols, procs, strict=True)])
    except psycopg.errors.IntegrityError as e:  # as SQLAlchemy raises it for an INSERT
        raise IntegrityError(sql, None, e) from e


def insert_new(
    s: Session, table: Table, rows: list[dict[str, Any]], unique: tuple[str, ...], returning: str
) -> list[Any]:
    """PostgreSQL: insert ``rows`` (same keys each) but those that collide on the ``unique``
    columns, in one statement: the columns travel as arrays through ``unnest``, so the statement
    text is the same for any number of rows and is prepared once. Returns ``returning`` of the
    rows inserted (a writer that lost a race to another finds its rows left out)."""
    dialect = s.get_bind().dialect
    given = list(rows[0])
    defaults = {
        c.name: c.default.arg  # type: ignore[attr-defined]
        for c in table.columns
        if c.name not in given and c.default is not None and hasattr(c.default, "arg")
    }
    cols, arrays, params = given + list(defaults), [], {}
    for i, c in enumerate(cols):
        col = table.c[c]
        if c in defaults:
            d = defaults[c]
            values = [d(None) if callable(d) else d for _ in rows]
        else:
            values = [r[c] for r in rows]
        if isinstance(col.type, JSON):  # as text, cast by the server: no per-row adapter
            values = [None if v is None else json.dumps(v) for v in values]
            arrays.append(f"CAST(CAST(:p{i} AS text[]) AS {col.type.compile(dialect)}[])")
        else:
            proc = col.type._cached_bind_processor(dialect)
            values = [proc(v) for v in values] if proc else values
            arrays.append(f"CAST(:p{i} AS {col.type.compile(dialect)}[])")
        params[f"p{i}"] = values
    sql = (
        f"INSERT INTO {table.name} ({', '.join(cols)}) SELECT * FROM unnest({', '.join(arrays)}) "
        f"ON CONFLICT ({', '.join(unique)}) DO NOTHING RETURNING {returning}"
    )
    return list(s.scalars(text(sql), params))
