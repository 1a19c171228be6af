//! SQL text of the backend, rendered once per schema. The schema name is validated
//! before it is spliced (bracket-quoted); every value is a `@Pn` parameter, batches of
//! rows travel as one JSON parameter read with `OPENJSON`; every time is computed from
//! `SYSUTCDATETIME()` on the server (the application passes durations in milliseconds).

use std::sync::Arc;

/// `[schema]`, for a schema name already checked by `validate_schema`.
pub(crate) fn quoted_schema(schema: &str) -> String {
    format!("[{schema}]")
}

/// `base + ms` in T-SQL, `ms` a bigint expression of milliseconds (split into seconds
/// and milliseconds: `DATEADD` takes an int, which would overflow after 24.8 days of
/// milliseconds). Callers clamp `ms` with [`millis`].
pub(crate) fn plus_ms(base: &str, ms: &str) -> String {
    format!(
        "DATEADD(millisecond, CAST(({ms}) % 1000 AS int), DATEADD(second, CAST(({ms}) / 1000 AS int), {base}))"
    )
}

/// `base - ms` in T-SQL (see [`plus_ms`]).
pub(crate) fn minus_ms(base: &str, ms: &str) -> String {
    format!(
        "DATEADD(millisecond, -CAST(({ms}) % 1000 AS int), DATEADD(second, -CAST(({ms}) / 1000 AS int), {base}))"
    )
}

/// When a pending row became due: `visible_at` (a delayed message is not late before
/// its time), or its first failure when earlier (a row waiting out a retry backoff, or
/// held back for its destination, was due then and is still not out). A `NULL`
/// `first_failed_at` compares false.
const DUE_AT: &str =
    "CASE WHEN first_failed_at < visible_at THEN first_failed_at ELSE visible_at END";

/// The queue lag in milliseconds over the rows in scope (`NULL`: none is late), by the
/// server clock at `now` (an expression): the age of the oldest pending row counted
/// from [`DUE_AT`].
pub(crate) fn pending_lag_ms(now: &str) -> String {
    format!(
        "DATEDIFF_BIG(millisecond,
                     MIN(CASE WHEN status IN (0, 9) AND {DUE_AT} <= {now} THEN {DUE_AT} END),
                     {now})"
    )
}

/// The longest duration passed to the server: 50 years, so whole seconds fit an int
/// and `SYSUTCDATETIME() + d` stays far below year 9999.
pub(crate) const MAX_MILLIS: i64 = 50 * 365 * 24 * 3600 * 1000;

/// A duration in whole milliseconds, clamped to [`MAX_MILLIS`].
pub(crate) fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).map_or(MAX_MILLIS, |ms| ms.min(MAX_MILLIS))
}

/// The ordering key of a row, as stored in the computed `order_key` column (the
/// PostgreSQL encoding, lengths in UTF-16 code units). The migration spells it out;
/// a test keeps the two equal.
#[cfg(test)]
pub(crate) fn order_key_expr(
    partition_key: &str,
    aggregate_type: &str,
    aggregate_id: &str,
) -> String {
    format!(
        "COALESCE(N'p:' + {partition_key}, N'a:' + CAST(DATALENGTH({aggregate_type}) / 2 AS nvarchar(12)) + N':' + {aggregate_type} + N':' + {aggregate_id})"
    )
}

/// The SHA-256 key of an `inbox_versions` row (see migration 0002).
pub(crate) fn version_key_expr(consumer: &str, aggregate_type: &str, aggregate_id: &str) -> String {
    format!(
        "CAST(HASHBYTES('SHA2_256', CAST(DATALENGTH({consumer}) AS nvarchar(12)) + N':' + {consumer} + N':' + CAST(DATALENGTH({aggregate_type}) AS nvarchar(12)) + N':' + {aggregate_type} + N':' + {aggregate_id}) AS binary(32))"
    )
}

/// [`version_key_expr`] over the parameters `@P1` (consumer), `@P2` (aggregate type) and
/// `@P3` (aggregate id), each cast to `nvarchar(max)` first. tiberius declares a string
/// of up to 4,000 bytes as `nvarchar(4000)`, and concatenating non-`max` strings yields
/// at most 4,000 characters, silently cut: without the casts a key of more than 4,000
/// characters in all would hash differently from the persisted `key_hash`, which is
/// computed over the `nvarchar(max)` column `aggregate_id` and so never cut.
pub(crate) fn version_key_params() -> String {
    version_key_expr(
        "CAST(@P1 AS nvarchar(max))",
        "CAST(@P2 AS nvarchar(max))",
        "CAST(@P3 AS nvarchar(max))",
    )
}

/// Wraps `insert`, an `INSERT ... SELECT ... WHERE NOT EXISTS (... WITH (UPDLOCK,
/// ROWLOCK))` on a table's primary key, run inside the caller's transaction, so that a
/// duplicate key means "already there" instead of an error, then runs `after`. `@inserted`
/// holds the rows inserted (0 or 1).
///
/// Only key locks are taken: the existence check locks the key if the row exists (an
/// update lock, held to the end of the transaction) and nothing if it does not (no
/// `HOLDLOCK`, so no key-range lock that would serialise every claim falling in the same
/// gap). Two transactions that both find the key missing both insert; the second waits
/// on the first's exclusive lock of the new key in the primary key, then fails with 2627
/// if the first committed (caught: a duplicate) or inserts if it rolled back. The
/// primary key makes a double claim impossible; the wait makes a lost claim impossible.
///
/// The duplicate-key error must not doom the caller's transaction: under the session's
/// `XACT_ABORT ON` even a caught error leaves `XACT_STATE() = -1` and the transaction
/// must be rolled back, so the batch turns `XACT_ABORT` off around the insert (a SET in
/// an `sp_executesql` batch reverts when the batch ends; it is restored explicitly too),
/// and with it off a key violation ends only its statement. Any other error, or a doomed
/// transaction, is re-raised with `XACT_ABORT ON`, so it rolls back the transaction as
/// every other failed statement of the session does.
fn insert_unless_present(insert: &str, after: &str) -> String {
    format!(
        "SET XACT_ABORT OFF;
DECLARE @inserted int = 0;
BEGIN TRY
    {insert};
    SET @inserted = @@ROWCOUNT;
END TRY
{CATCH_DUPLICATE}
SET XACT_ABORT ON;
{after}"
    )
}

/// The `CATCH` of [`insert_unless_present`] and [`claim_unless_dead`]: a duplicate key
/// in a live transaction ends only its statement (`XACT_ABORT` is off); anything else,
/// or a doomed transaction, is re-raised with `XACT_ABORT ON`, which rolls the
/// transaction back.
const CATCH_DUPLICATE: &str = "BEGIN CATCH
    IF ERROR_NUMBER() NOT IN (2601, 2627) OR XACT_STATE() = -1
    BEGIN
        SET XACT_ABORT ON;
        THROW;
    END;
END CATCH;";

/// The idempotent consumer's claim of `(id, consumer)` (two T-SQL expressions: the
/// parameters, or the loop variables of the batch) unless it is a consumer dead letter:
/// sets `@dead` to 1 for a dead letter (nothing is written), else claims as `inbox_claim`
/// does (see [`insert_unless_present`]) and sets `@inserted` to the rows inserted (1
/// claimed, 0 duplicate). The caller declares both, at 0.
///
/// The dead-letter check is a plain read of `inbox_failures`' primary key: under read
/// committed its shared lock, if any, lasts only the read (under
/// `READ_COMMITTED_SNAPSHOT` it takes none), so the claim holds exactly the locks of
/// `inbox_claim`: the update or exclusive lock of its own key in `inbox_records`, to
/// the end of the transaction, and no key-range lock. It runs inside the `TRY` with
/// `XACT_ABORT` off like the insert, so its errors (a lock timeout) are re-raised the
/// same way.
fn claim_unless_dead(inbox: &str, failures: &str, id: &str, consumer: &str) -> String {
    format!(
        "SET XACT_ABORT OFF;
BEGIN TRY
    IF EXISTS (SELECT 1 FROM {failures} AS d
                WHERE d.message_id = {id} AND d.consumer = {consumer}
                  AND d.dead_at IS NOT NULL)
        SET @dead = 1;
    ELSE
    BEGIN
        INSERT INTO {inbox} (message_id, consumer)
        SELECT {id}, {consumer}
         WHERE NOT EXISTS (SELECT 1 FROM {inbox} AS e WITH (UPDLOCK, ROWLOCK)
                            WHERE e.message_id = {id} AND e.consumer = {consumer});
        SET @inserted = @@ROWCOUNT;
    END;
END TRY
{CATCH_DUPLICATE}
SET XACT_ABORT ON;"
    )
}

/// Columns read back for an [`OutboxMessage`](outboxkit_core::OutboxMessage), from the
/// row alias or `inserted` pseudo-table `p`.
fn columns(p: &str) -> String {
    [
        "id",
        "seq",
        "aggregate_type",
        "aggregate_id",
        "aggregate_version",
        "event_type",
        "payload",
        "headers",
        "tenant_id",
        "routing_key",
        "partition_key",
        "occurred_at",
        "created_at",
        "visible_at",
        "attempts",
        "status",
        "last_error",
        "claim_token",
        "lease_until",
        "sent_at",
    ]
    .iter()
    .map(|c| format!("{p}.{c}"))
    .collect::<Vec<_>>()
    .join(", ")
}

/// Claimable: New and visible, or Processing with an expired lease (`@now` is the
/// statement's `SYSUTCDATETIME()`).
fn claimable(a: &str) -> String {
    format!(
        "(({a}.status = 0 AND {a}.visible_at <= @now) OR ({a}.status = 9 AND {a}.lease_until < @now))"
    )
}

/// The most rows one statement of a bulk operation touches (completions, purges,
/// replays). SQL Server escalates a statement's row locks to a table lock once it holds
/// about 5,000 locks on one table or index reference; `READPAST` cannot skip a table
/// lock, so an escalated completion or purge would block producers and other relays.
/// Bulk operations therefore loop over chunks of at most this many rows inside one
/// batch (one round trip): escalation is judged per statement, so the chunks of one
/// transaction do not add up.
pub(crate) const ROWS_PER_STATEMENT: i64 = 1000;
const _: () = assert!(
    ROWS_PER_STATEMENT <= 1000,
    "far below the ~5,000 locks of escalation"
);

/// A purge or replay of up to `@P2` rows (`limit`, a bigint expression; `None`: until
/// no row is left) in statements of at most [`ROWS_PER_STATEMENT`] rows, each its own
/// autocommit transaction. `statement` deletes or updates `TOP (@step)` rows. Ends with
/// `SELECT @done AS affected` (not `@@ROWCOUNT`, and not the DONE tokens, which `SET
/// NOCOUNT ON` leaves empty).
fn in_chunks(limit: Option<&str>, statement: &str) -> String {
    let left = limit.unwrap_or("9223372036854775807");
    format!(
        "DECLARE @left bigint = {left}, @step bigint, @got bigint, @done bigint = 0;
WHILE @left > 0
BEGIN
    SET @step = CASE WHEN @left < {ROWS_PER_STATEMENT} THEN @left ELSE {ROWS_PER_STATEMENT} END;
    {statement}
    SET @got = @@ROWCOUNT;
    SET @done += @got;
    SET @left -= @got;
    IF @got < @step BREAK;
END;
SELECT @done AS affected;"
    )
}

/// A batch of outcomes (`@P1`, a JSON array of objects with the `fields`, each a name
/// and a T-SQL type, read from the JSON member of that name) applied in one
/// transaction, in statements of at most [`ROWS_PER_STATEMENT`] rows: the array is read
/// once into `@u` (`n` its index), then `body` runs for each chunk, with `{CHUNK}` a
/// predicate on `u` selecting the chunk's rows. `@now` is the batch's
/// `SYSUTCDATETIME()`.
fn chunked_outcomes(fields: &[(&str, &str)], body: &str) -> String {
    let declared: String = fields.iter().map(|(n, t)| format!(", {n} {t}")).collect();
    let names = fields
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ");
    let j_names = fields
        .iter()
        .map(|(n, _)| format!("j.{n}"))
        .collect::<Vec<_>>()
        .join(", ");
    let with = fields
        .iter()
        .map(|(n, t)| format!("{n} {t} '$.{n}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let body = body.replace(
        "{CHUNK}",
        &format!("u.n >= @from AND u.n < @from + {ROWS_PER_STATEMENT}"),
    );
    format!(
        "SET XACT_ABORT ON;
DECLARE @now datetime2(7) = SYSUTCDATETIME();
DECLARE @u TABLE (n int PRIMARY KEY{declared});
INSERT INTO @u (n, {names})
SELECT CAST(a.[key] AS int), {j_names}
  FROM OPENJSON(@P1) AS a
 CROSS APPLY OPENJSON(a.value) WITH ({with}) AS j;
DECLARE @n int = (SELECT COUNT(*) FROM @u), @from int = 0;
BEGIN TRANSACTION;
WHILE @from < @n
BEGIN
    {body}
    SET @from += {ROWS_PER_STATEMENT};
END;
COMMIT TRANSACTION;"
    )
}

/// The optional-filter predicate shared by dead-letter listing and replay
/// (`@P1` ids as a JSON array, `@P2` from, `@P3` to, `@P4` tenant, `@P5` aggregate type,
/// `@P6` aggregate id, `@P7` event type, `@P8` error text, LIKE-escaped with `\`).
const FILTER: &str = "m.status = 3
    AND (@P1 IS NULL OR m.id IN (SELECT CAST(j.value AS uniqueidentifier) FROM OPENJSON(@P1) AS j))
    AND (@P2 IS NULL OR m.created_at >= @P2)
    AND (@P3 IS NULL OR m.created_at < @P3)
    AND (@P4 IS NULL OR m.tenant_id = @P4)
    AND (@P5 IS NULL OR m.aggregate_type = @P5)
    AND (@P6 IS NULL OR m.aggregate_id = @P6)
    AND (@P7 IS NULL OR m.event_type = @P7)
    AND (@P8 IS NULL OR UPPER(m.last_error) LIKE N'%' + UPPER(@P8) + N'%' ESCAPE N'\\')";

/// The claim statement shared by the outbox and the durable inbox (same columns and
/// status codes): a CTE picks up to `@P1` rows, New and visible or Processing with an
/// expired lease, oldest `(visible_at, seq)` first, `WITH (ROWLOCK, UPDLOCK, READPAST)`
/// so rows another claimer holds are skipped, not waited for; each branch walks its own
/// filtered index. The update re-checks claimability under the lock and returns the
/// rows through `OUTPUT`. `@P1` batch size, `@P2` lease in ms, `@P3` claim token; with
/// `guard` (the outbox, not the durable inbox), `guard` names the parameter holding the
/// crash-loop limit (`@P4`, see [`claim_set`]) and the claim isolates suspects (see
/// [`guarded_claim_statement`]).
fn claim_statement(table: &str, output: &str, guard: Option<&str>) -> String {
    if let Some(limit) = guard {
        return guarded_claim_statement(table, output, limit);
    }
    let set = claim_set(None);
    let recheck = claimable("m");
    let picked = picked_cte(table, /* with_status */ false);
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
WITH {picked}
UPDATE m
   SET {set}
OUTPUT {output}
  FROM picked AS p
 INNER LOOP JOIN {table} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = p.id
 WHERE {recheck};"
    )
}

/// The CTE `picked` of a claim: up to `@P1` claimable rows, locked `WITH (ROWLOCK,
/// UPDLOCK, READPAST)`, the first `@P1` in `(visible_at, seq)` order of the first `@P1`
/// New and visible rows (in that order) and the first `@P1` expired leases (oldest lease
/// first), each read on its filtered index. It yields `id`, and `with_status` also
/// `status`, `visible_at` and `seq` (for the guarded claim's isolation). T-SQL allows
/// ORDER BY in a UNION branch only inside a derived table with TOP.
fn picked_cte(table: &str, with_status: bool) -> String {
    let (status, outer) = if with_status {
        (", c.status", ", x.status, x.visible_at, x.seq")
    } else {
        ("", "")
    };
    let f = status.replace("c.", "f.");
    let e = status.replace("c.", "e.");
    format!(
        "picked AS (
    SELECT TOP (@P1) x.id{outer} FROM (
        SELECT f.id{f}, f.visible_at, f.seq FROM (
            SELECT TOP (@P1) c.id{status}, c.visible_at, c.seq
              FROM {table} AS c WITH (ROWLOCK, UPDLOCK, READPAST)
             WHERE c.status = 0 AND c.visible_at <= @now
             ORDER BY c.visible_at, c.seq) AS f
        UNION ALL
        SELECT e.id{e}, e.visible_at, e.seq FROM (
            SELECT TOP (@P1) c.id{status}, c.visible_at, c.seq
              FROM {table} AS c WITH (ROWLOCK, UPDLOCK, READPAST)
             WHERE c.status = 9 AND c.lease_until < @now
             ORDER BY c.lease_until) AS e
    ) AS x
    ORDER BY x.visible_at, x.seq
)"
    )
}

/// The outbox claim, with the crash-loop guard's isolation (`limit` the parameter holding
/// the crash-loop limit). Still one statement: `picked` locks the candidates exactly as
/// the durable inbox's claim does, with their status as read under the lock; `isolated`
/// numbers them in claim order and gives every one the status of the first
/// (`FIRST_VALUE`). The update takes the first alone when it is a suspect (status 9:
/// Processing with an expired lease, its last claim ended without an outcome), otherwise
/// only the candidates that are not suspects (status 0), and re-checks claimability.
///
/// `picked` is referenced once: a CTE is not materialized, and a second reference could
/// be evaluated a second time and, with `READPAST` and `TOP`, see other rows than the
/// first (a row committed or unlocked between the two reads), so the decision and the
/// rows it applies to are computed in one pass (the window functions run over the
/// `TOP` result; a predicate on their result cannot be pushed below them).
///
/// The isolation relies on `i.status` (read in `picked`) being the `m.status` the update
/// finds: each candidate is update-locked by the read until the statement (its autocommit
/// transaction) ends, and any change of its status needs an exclusive lock on the key
/// the read locked (the status is the filter of the index the read seeks, `status = 0`
/// or `status = 9`, and a column of the clustered row). The kill and the alone count read `m.status`, and the update
/// re-checks claimability, so a row no longer claimable is never written. Candidates
/// left out (New rows behind a suspect, suspects behind a New row) are only unlocked at
/// the end, not changed.
fn guarded_claim_statement(table: &str, output: &str, limit: &str) -> String {
    let set = claim_set(Some(limit));
    let recheck = claimable("m");
    let picked = picked_cte(table, /* with_status */ true);
    format!(
        "DECLARE @now datetime2(7) = SYSUTCDATETIME();
WITH {picked}, isolated AS (
    SELECT p.id, p.status,
           ROW_NUMBER() OVER (ORDER BY p.visible_at, p.seq) AS n,
           FIRST_VALUE(p.status) OVER (ORDER BY p.visible_at, p.seq ROWS UNBOUNDED PRECEDING) AS first_status
      FROM picked AS p
)
UPDATE m
   SET {set}
OUTPUT {output}
  FROM isolated AS i
 INNER LOOP JOIN {table} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = i.id
 WHERE ((i.first_status = 9 AND i.n = 1) OR (i.first_status = 0 AND i.status = 0))
   AND {recheck};"
    )
}

/// The `SET` list of a claim (`@now` declared by the statement, `@P2` lease in ms, `@P3`
/// claim token). Without `guard` (the durable inbox): Processing under the claim, the
/// lease, the token, `attempts + 1`. With `guard`, the parameter holding the crash-loop
/// limit, the crash-loop guard: a row claimed while it is a suspect (`m.status = 9`, its
/// status before this update: Processing with an expired lease) is claimed alone (the
/// claim statements make sure of it) and counts one more claim alone without an outcome
/// (`unfinished_alone + 1`); a suspect already claimed alone `limit` times without an
/// outcome is moved to Dead instead (no lease, no token, `attempts` and both counts
/// unchanged, a `last_error` that says so, `first_failed_at` set if it was not). Any
/// other row (New) is claimed and counts one more claim without an outcome
/// (`unfinished_claims + 1`), as every claimed row does. Every completion and replay
/// resets both counts (see [`completion_update`]).
///
/// In a T-SQL `UPDATE` every expression of the `SET` list reads the row as it was before
/// the update (`SET a = b, b = a` swaps), so `m.status` in the later `CASE`s is still the
/// old status although `m.status` is assigned first, and each `CASE` sees the same
/// `unfinished_alone`.
fn claim_set(guard: Option<&str>) -> String {
    let lease = plus_ms("@now", "@P2");
    let Some(limit) = guard else {
        return format!(
            "m.status = 9,
       m.lease_until = {lease},
       m.claim_token = @P3,
       m.attempts = m.attempts + 1"
        );
    };
    let dead = format!("(m.status = 9 AND m.unfinished_alone >= {limit})");
    format!(
        "m.status = CASE WHEN {dead} THEN 3 ELSE 9 END,
       m.lease_until = CASE WHEN {dead} THEN NULL ELSE {lease} END,
       m.claim_token = CASE WHEN {dead} THEN NULL ELSE @P3 END,
       m.attempts = CASE WHEN {dead} THEN m.attempts ELSE m.attempts + 1 END,
       m.unfinished_claims = CASE WHEN {dead} THEN m.unfinished_claims
                                  ELSE m.unfinished_claims + 1 END,
       m.unfinished_alone = CASE WHEN {dead} OR m.status <> 9 THEN m.unfinished_alone
                                 ELSE m.unfinished_alone + 1 END,
       m.last_error = CASE WHEN {dead}
                           THEN N'suspected crash loop: claimed alone '
                                + CAST(m.unfinished_alone AS nvarchar(11))
                                + N' times without an outcome ('
                                + CAST(m.unfinished_claims AS nvarchar(11))
                                + N' claims without an outcome in all; each relay holding it stopped, crashed or lost its lease before recording one); replay it once the cause is fixed'
                           ELSE m.last_error END,
       m.first_failed_at = CASE WHEN {dead} THEN COALESCE(m.first_failed_at, @now)
                                ELSE m.first_failed_at END"
    )
}

/// The per-key claim ([`OutboxStore::claim_ordered`](outboxkit_core::OutboxStore::claim_ordered)),
/// one batch in one transaction. `block` says whether a Dead row holds its key
/// (`OnDead::Block`).
///
/// 1. Walk the keys round-robin: starting after the cursor `@P4` (the key where the
///    previous ordered claim of this store stopped) up to the greatest key, then from
///    the smallest key up to the cursor, one seek per key on the pending-key index
///    (`order_hash, seq` over New and Processing rows), read `WITH (NOLOCK)` so the walk
///    never waits. Each step yields a key and its head, the first pending row by `seq`.
///    A row another transaction is writing (an uncommitted enqueue, a claim in flight)
///    can at worst make a key look busy for this round, never free it early.
/// 2. For each key, until `@P1` keys are held (or after `16 × @P1 + 256` steps): under
///    `block`, skip the key if a Dead row precedes the head; lock the head `WITH
///    (ROWLOCK, UPDLOCK, READPAST)` on the clustered row and re-check under the lock
///    that it is still claimable (a key whose head another claimer holds is skipped) and
///    that nothing earlier became pending. The head lock is the key's mutex. The head's
///    id and status are read under that lock.
/// 3. The crash-loop guard's isolation: if a held head is a suspect (status 9:
///    Processing with an expired lease, its last claim ended without an outcome), the
///    first such head in `seq` order is the whole batch, and steps 4 and 5 are skipped.
/// 4. Otherwise runs, at most `ceil(@P1 / keys held)` rows per key (every head is New
///    then): lock the key's New and visible rows from the head on, in `seq` order (the
///    predicate keeps `status IN (0, 9)` beside `status = 0` so that it plainly matches
///    the filter of the pending-key index); cut
///    the run at the first pending row of the key (seen `WITH (NOLOCK)`) that is not
///    among them, and under `block` at the key's next Dead row, so the run is
///    consecutive even when a row was skipped as locked. A suspect is pending and never
///    among them: a run stops before a suspect, which a later claim takes alone once it
///    is its key's head.
/// 5. Fill the batch in waves (every run's first row, keys in walk order, then every
///    run's second row, ...), at most `@P1`, so each key gets a prefix of its run.
/// 6. Update the batch's rows to Processing (the suspect through the guard, see
///    [`claim_set`]) and `OUTPUT` them; return the last key visited as `next_cursor`;
///    commit. Locks on rows that did not make the batch end with the transaction.
///
/// Keys are ordered by `order_hash` (SHA-256), a fixed pseudo-random order; the all-zero
/// hash serves as "before every key" and is never visited (no SHA-256 preimage is
/// known). `@P1` batch size, `@P2` lease in ms, `@P3` claim token, `@P4` cursor
/// (`binary(32)`, NULL at first), `@P5` the crash-loop limit (see [`claim_set`]: a
/// suspect head may be moved to Dead instead of claimed, alone in its batch; under
/// `block` it then holds its key from the next claim on).
fn claim_ordered_statement(table: &str, output: &str, block: bool) -> String {
    let set = claim_set(Some("@P5"));
    let claimable_h = claimable("h");
    let dead_before_head = if block {
        format!(
            "IF EXISTS (SELECT 1 FROM {table} AS d WITH (NOLOCK)
                WHERE d.order_hash = @k AND d.status = 3 AND d.seq < @head)
        CONTINUE;"
        )
    } else {
        "-- OnDead::Skip: Dead rows do not hold the key.".to_owned()
    };
    let dead_stop = if block {
        format!(
            "SET @dead = (SELECT MIN(d.seq) FROM {table} AS d WITH (NOLOCK)
                       WHERE d.order_hash = @k AND d.status = 3 AND d.seq > @head);
        IF @dead IS NOT NULL AND (@stop IS NULL OR @dead < @stop) SET @stop = @dead;"
        )
    } else {
        "-- OnDead::Skip: the run goes on past Dead rows.".to_owned()
    };
    format!(
        "SET NOCOUNT ON;
SET XACT_ABORT ON;
DECLARE @now datetime2(7) = SYSUTCDATETIME();
DECLARE @cursor binary(32) = @P4;
DECLARE @none binary(32) = 0x0000000000000000000000000000000000000000000000000000000000000000;
DECLARE @all binary(32) = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF;
DECLARE @heads TABLE (n int IDENTITY(1, 1) PRIMARY KEY, order_hash binary(32) NOT NULL, head_seq bigint NOT NULL,
                      head_id uniqueidentifier NOT NULL, head_status smallint NOT NULL);
DECLARE @run TABLE (seq bigint PRIMARY KEY, id uniqueidentifier NOT NULL);
DECLARE @runs TABLE (rn bigint NOT NULL, n int NOT NULL, id uniqueidentifier NOT NULL, PRIMARY KEY (rn, n));
DECLARE @claim TABLE (id uniqueidentifier PRIMARY KEY);
DECLARE @k binary(32), @upper binary(32), @next binary(32), @last binary(32) = NULL;
DECLARE @lap int, @head bigint, @got bigint, @got_id uniqueidentifier, @got_status smallint;
DECLARE @stop bigint, @dead bigint, @suspect uniqueidentifier;
DECLARE @held bigint = 0, @steps bigint = 0, @per bigint, @i int = 0, @n int;
DECLARE @max_steps bigint = CASE WHEN @P1 > 1000000 THEN @P1 ELSE @P1 * 16 + 256 END;
IF @cursor IS NULL
    SELECT @lap = 2, @k = @none, @upper = @all;
ELSE
    SELECT @lap = 1, @k = @cursor, @upper = @all;
BEGIN TRANSACTION;
WHILE @held < @P1 AND @steps < @max_steps
BEGIN
    SET @next = NULL;
    SELECT TOP (1) @next = p.order_hash, @head = p.seq
      FROM {table} AS p WITH (NOLOCK)
     WHERE p.status IN (0, 9) AND p.order_hash > @k AND p.order_hash <= @upper
     ORDER BY p.order_hash, p.seq;
    IF @next IS NULL
    BEGIN
        IF @lap = 2 BREAK;
        SELECT @lap = 2, @k = @none, @upper = @cursor;
        CONTINUE;
    END;
    SELECT @k = @next, @last = @next, @steps = @steps + 1;
    {dead_before_head}
    SET @got = NULL;
    SELECT @got = h.seq, @got_id = h.id, @got_status = h.status
      FROM {table} AS h WITH (ROWLOCK, UPDLOCK, READPAST, INDEX(1))
     WHERE h.seq = @head AND h.order_hash = @k AND {claimable_h};
    IF @got IS NULL CONTINUE;
    IF EXISTS (SELECT 1 FROM {table} AS e WITH (NOLOCK)
                WHERE e.order_hash = @k AND e.status IN (0, 9) AND e.seq < @head)
        CONTINUE;
    INSERT INTO @heads (order_hash, head_seq, head_id, head_status)
    VALUES (@k, @head, @got_id, @got_status);
    SET @held += 1;
END;
SET @suspect = (SELECT TOP (1) hs.head_id FROM @heads AS hs
                 WHERE hs.head_status = 9 ORDER BY hs.head_seq);
IF @suspect IS NOT NULL
    INSERT INTO @claim (id) VALUES (@suspect);
ELSE
BEGIN
    SET @per = CASE WHEN @held = 0 THEN 0 ELSE (@P1 + @held - 1) / @held END;
    SELECT @n = COUNT(*) FROM @heads;
    WHILE @i < @n
    BEGIN
        SET @i += 1;
        SELECT @k = order_hash, @head = head_seq FROM @heads WHERE n = @i;
        DELETE FROM @run;
        INSERT INTO @run (seq, id)
        SELECT TOP (@per) r.seq, r.id
          FROM {table} AS r WITH (ROWLOCK, UPDLOCK, READPAST)
         WHERE r.order_hash = @k AND r.status IN (0, 9) AND r.seq >= @head
           AND r.status = 0 AND r.visible_at <= @now
         ORDER BY r.seq;
        SET @stop = (SELECT MIN(s.seq) FROM {table} AS s WITH (NOLOCK)
                      WHERE s.order_hash = @k AND s.status IN (0, 9) AND s.seq > @head
                        AND NOT EXISTS (SELECT 1 FROM @run AS x WHERE x.seq = s.seq));
        {dead_stop}
        INSERT INTO @runs (rn, n, id)
        SELECT ROW_NUMBER() OVER (ORDER BY seq), @i, id FROM @run
         WHERE @stop IS NULL OR seq < @stop;
    END;
    INSERT INTO @claim (id) SELECT TOP (@P1) id FROM @runs ORDER BY rn, n;
END;
UPDATE m
   SET {set}
OUTPUT {output}
  FROM @claim AS c
 INNER LOOP JOIN {table} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = c.id;
SELECT @last AS next_cursor;
COMMIT TRANSACTION;"
    )
}

/// The fields of one outbox completion in `@P1` (see [`chunked_outcomes`]).
const COMPLETION_FIELDS: &[(&str, &str)] = &[
    ("id", "uniqueidentifier"),
    ("token", "uniqueidentifier"),
    ("status", "smallint"),
    ("delay_ms", "bigint"),
    ("error", "nvarchar(max)"),
    ("release", "bit"),
    ("held_for", "nvarchar(255)"),
];

/// The `visible_at` of a held row: past every claim's walk (datetime2 has no infinity).
const HELD_VISIBLE_AT: &str = "CAST('9999-12-31T00:00:00' AS datetime2(7))";

/// The fence of every completion: the row is Processing under the completion's token.
const FENCE: &str = "m.claim_token = u.token AND m.status = 9";

/// Records the completions of the chunk of `@u` (those matching `filter` too), fenced
/// by [`FENCE`], with `@now` declared by the caller; outputs the ids applied. Every
/// applied completion resets the row's counts of claims without an outcome, all of them
/// and those alone (the crash-loop guard).
fn completion_update(table: &str, filter: &str) -> String {
    let retry_at = plus_ms("@now", "u.delay_ms");
    format!(
        "UPDATE m
                    SET m.status = u.status,
                        m.attempts = CASE WHEN u.release = 1
                                          THEN CASE WHEN m.attempts > 0 THEN m.attempts - 1 ELSE 0 END
                                          ELSE m.attempts END,
                        m.visible_at = CASE WHEN u.held_for IS NOT NULL THEN {HELD_VISIBLE_AT}
                                            WHEN u.status = 0 AND u.release = 0
                                            THEN {retry_at} ELSE m.visible_at END,
                        m.held_for = u.held_for,
                        m.last_error = COALESCE(u.error, m.last_error),
                        m.sent_at = CASE WHEN u.status = 1 THEN @now END,
                        m.first_failed_at = CASE WHEN m.first_failed_at IS NULL
                                                      AND (u.release = 0 OR u.held_for IS NOT NULL)
                                                      AND u.status IN (0, 3)
                                                 THEN @now ELSE m.first_failed_at END,
                        m.lease_until = NULL,
                        m.claim_token = NULL,
                        m.unfinished_claims = 0,
                        m.unfinished_alone = 0
                 OUTPUT inserted.id
                   FROM @u AS u
                  INNER LOOP JOIN {table} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = u.id
                  WHERE {{CHUNK}} AND {filter}{FENCE};"
    )
}

#[derive(Debug)]
pub(crate) struct Queries {
    pub(crate) enqueue: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) claim_ordered_block: Arc<str>,
    pub(crate) claim_ordered_skip: Arc<str>,
    pub(crate) blocked_keys: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) complete_deleting_sent: Arc<str>,
    pub(crate) get: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) replay_count: Arc<str>,
    pub(crate) replay: Arc<str>,
    pub(crate) purge_sent: Arc<str>,
    pub(crate) inbox_claim: Arc<str>,
    pub(crate) inbox_purge: Arc<str>,
    /// See [`claim_held_statement`].
    pub(crate) claim_held: Arc<str>,
    /// Releases up to `@P2` held rows of destination `@P1`, lowest `seq` first, in
    /// statements of at most [`ROWS_PER_STATEMENT`] rows; ends with `affected`.
    pub(crate) release_held: Arc<str>,
    /// The destinations that hold rows after `@P1`, at most `@P2`: one seek of
    /// `outbox_messages_held_for` per destination, never a scan of the rows.
    pub(crate) held_destinations: Arc<str>,
}

/// The trials of held destinations: `@P1` a JSON array of destinations; for each, its
/// held row with the lowest `seq`, locked `WITH (ROWLOCK, UPDLOCK, READPAST)`; with
/// `@P4 = 1` (per-key order) only a row that heads its key (no earlier pending row, and
/// with `@P5 = 1` no earlier Dead one). Claimed as the claim claims (`@P2` lease in ms,
/// `@P3` claim token) and no longer held: visible now, so that a relay that dies holding
/// it leaves an ordinary expired lease. Outputs the claimed rows as the claim does.
fn claim_held_statement(table: &str, output: &str) -> String {
    let lease = plus_ms("@now", "@P2");
    format!(
        "SET NOCOUNT ON;
SET XACT_ABORT ON;
DECLARE @now datetime2(7) = SYSUTCDATETIME();
DECLARE @claim TABLE (id uniqueidentifier PRIMARY KEY);
BEGIN TRANSACTION;
INSERT INTO @claim (id)
SELECT DISTINCT h.id
  FROM OPENJSON(@P1) AS d
 CROSS APPLY (
    SELECT TOP (1) c.id FROM {table} AS c WITH (ROWLOCK, UPDLOCK, READPAST)
     WHERE c.held_for = CAST(d.value AS nvarchar(255)) AND c.status = 0
       AND (@P4 = 0 OR (
            NOT EXISTS (SELECT 1 FROM {table} AS p WITH (NOLOCK)
                         WHERE p.order_hash = c.order_hash AND p.status IN (0, 9)
                           AND p.seq < c.seq)
            AND NOT (@P5 = 1 AND EXISTS (
                SELECT 1 FROM {table} AS x WITH (NOLOCK)
                 WHERE x.order_hash = c.order_hash AND x.status = 3 AND x.seq < c.seq))))
     ORDER BY c.seq) AS h;
UPDATE m
   SET m.status = 9,
       m.lease_until = {lease},
       m.claim_token = @P3,
       m.attempts = m.attempts + 1,
       m.unfinished_claims = m.unfinished_claims + 1,
       m.visible_at = @now,
       m.held_for = NULL
OUTPUT {output}
  FROM @claim AS c
 INNER LOOP JOIN {table} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = c.id;
COMMIT TRANSACTION;"
    )
}

impl Queries {
    pub(crate) fn new(schema: &str) -> Self {
        let q = quoted_schema(schema);
        let t = format!("{q}.outbox_messages");
        let inbox = format!("{q}.inbox_records");
        let s = |text: String| -> Arc<str> { text.into() };
        let visible = plus_ms("SYSUTCDATETIME()", "j.delay_ms");
        let sent_cutoff = minus_ms("SYSUTCDATETIME()", "@P1");
        let cols_m = columns("m");
        let cols_out = columns("inserted");
        // A claim also returns the counts of claims without an outcome (all of them, and
        // those alone): `status` 3 tells a row the crash-loop guard moved to Dead from a
        // claimed one, and `unfinished_alone` is its `Poison::CrashLoop { claims_alone }`.
        let claim_out =
            format!("{cols_out}, inserted.unfinished_claims, inserted.unfinished_alone");
        Self {
            claim_held: s(claim_held_statement(&t, &claim_out)),
            release_held: s(in_chunks(
                Some("@P2"),
                &format!(
                    "WITH r AS (
        SELECT TOP (@step) visible_at, held_for FROM {t} WITH (ROWLOCK, READPAST)
         WHERE held_for = @P1 AND status = 0
         ORDER BY held_for, seq)
    UPDATE r SET visible_at = SYSUTCDATETIME(), held_for = NULL;"
                ),
            )),
            held_destinations: s(format!(
                "SET NOCOUNT ON;
DECLARE @k nvarchar(255) = @P1, @next nvarchar(255), @n bigint = 0;
DECLARE @out TABLE (n int IDENTITY PRIMARY KEY, destination nvarchar(255));
WHILE @n < @P2
BEGIN
    SET @next = NULL;
    SELECT TOP (1) @next = held_for FROM {t}
     WHERE held_for > @k ORDER BY held_for;
    IF @next IS NULL BREAK;
    INSERT INTO @out (destination) VALUES (@next);
    SELECT @k = @next, @n = @n + 1;
END;
SELECT destination FROM @out ORDER BY n;"
            )),
            // One statement for any number of messages: `@P1` is a JSON array of
            // objects. `ORDER BY` the array index makes IDENTITY assign `seq` in the
            // caller's order (INSERT ... SELECT ... ORDER BY guarantees that).
            enqueue: s(format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                     payload, headers, tenant_id, routing_key, partition_key, occurred_at, visible_at)
                 SELECT j.id, j.aggregate_type, j.aggregate_id, j.aggregate_version, j.event_type,
                     j.payload, j.headers, j.tenant_id, j.routing_key, j.partition_key,
                     COALESCE(j.occurred_at, SYSUTCDATETIME()), {visible}
                   FROM OPENJSON(@P1) AS a
                  CROSS APPLY OPENJSON(a.value) WITH (
                     id uniqueidentifier '$.id',
                     aggregate_type nvarchar(255) '$.aggregate_type',
                     aggregate_id nvarchar(max) '$.aggregate_id',
                     aggregate_version bigint '$.aggregate_version',
                     event_type nvarchar(255) '$.event_type',
                     payload nvarchar(max) '$.payload',
                     headers nvarchar(max) '$.headers',
                     tenant_id nvarchar(255) '$.tenant_id',
                     routing_key nvarchar(255) '$.routing_key',
                     partition_key nvarchar(255) '$.partition_key',
                     occurred_at datetime2(7) '$.occurred_at',
                     delay_ms bigint '$.delay_ms') AS j
                  ORDER BY CAST(a.[key] AS int)"
            )),
            claim: s(claim_statement(&t, &claim_out, Some("@P4"))),
            claim_ordered_block: s(claim_ordered_statement(&t, &claim_out, true)),
            claim_ordered_skip: s(claim_ordered_statement(&t, &claim_out, false)),
            // Keys whose head (first unfinished row, Dead included) is Dead or waiting
            // out a retry backoff, longest blocked first (never-failed heads last).
            // Candidates: keys with a Dead row, and keys with a retried New row not yet
            // visible (the claim_new index's future range); each key's head is the
            // first of one seek on the pending-key index and one on the dead-key index. `waiting` counts the key's pending (New or Processing)
            // rows behind the head, as the PostgreSQL backend does. `@P1` limit.
            blocked_keys: s(format!(
                "SELECT TOP (@P1) h.order_key, h.id, h.seq, h.status, h.attempts, h.last_error,
                        h.first_failed_at,
                        CASE WHEN h.status = 0 THEN h.visible_at END AS retry_at,
                        (SELECT COUNT_BIG(*) FROM {t} AS w
                          WHERE w.order_hash = h.order_hash AND w.status IN (0, 9)
                            AND w.seq > h.seq) AS waiting
                   FROM (SELECT d.order_hash FROM {t} AS d WHERE d.status = 3
                         UNION
                         SELECT f.order_hash FROM {t} AS f
                          WHERE f.status = 0 AND f.visible_at > SYSUTCDATETIME()
                            AND f.attempts > 0) AS k
                  CROSS APPLY (
                        SELECT TOP (1) x.* FROM (
                            SELECT f.* FROM (
                                SELECT TOP (1) p.order_key, p.order_hash, p.id, p.seq, p.status,
                                       p.attempts, p.last_error, p.first_failed_at, p.visible_at
                                  FROM {t} AS p
                                 WHERE p.order_hash = k.order_hash AND p.status IN (0, 9)
                                 ORDER BY p.seq) AS f
                            UNION ALL
                            SELECT g.* FROM (
                                SELECT TOP (1) p.order_key, p.order_hash, p.id, p.seq, p.status,
                                       p.attempts, p.last_error, p.first_failed_at, p.visible_at
                                  FROM {t} AS p
                                 WHERE p.order_hash = k.order_hash AND p.status = 3
                                 ORDER BY p.seq) AS g
                        ) AS x
                        ORDER BY x.seq) AS h
                  WHERE h.status = 3
                     OR (h.status = 0 AND h.attempts > 0 AND h.visible_at > SYSUTCDATETIME())
                  ORDER BY CASE WHEN h.first_failed_at IS NULL THEN 1 ELSE 0 END,
                           h.first_failed_at, h.seq"
            )),
            // Completion of a whole batch (`@P1`, a JSON array), each row fenced by its
            // claim token and by `status = 9` (Processing → * enforced in SQL), under
            // SentRetention::Keep; one transaction, chunks of ROWS_PER_STATEMENT rows.
            complete: s(chunked_outcomes(COMPLETION_FIELDS, &completion_update(&t, ""))),
            // The same under SentRetention::Delete: the Sent completions delete their
            // rows, the others update as above; one transaction, so a failure (which
            // XACT_ABORT turns into a rollback) changes nothing.
            complete_deleting_sent: s(chunked_outcomes(
                COMPLETION_FIELDS,
                &format!(
                    "DELETE m
                 OUTPUT deleted.id
                   FROM @u AS u
                  INNER LOOP JOIN {t} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = u.id
                  WHERE {{CHUNK}} AND u.status = 1 AND {FENCE};
                 {}",
                    completion_update(&t, "u.status <> 1 AND ")
                ),
            )),
            get: s(format!("SELECT {cols_m} FROM {t} AS m WHERE m.id = @P1")),
            stats: s(format!(
                "SELECT COUNT_BIG(CASE WHEN status = 0 THEN 1 END),
                        COUNT_BIG(CASE WHEN status = 9 THEN 1 END),
                        COUNT_BIG(CASE WHEN status = 1 THEN 1 END),
                        COUNT_BIG(CASE WHEN status = 3 THEN 1 END),
                        {lag}
                   FROM {t}",
                lag = pending_lag_ms("SYSUTCDATETIME()")
            )),
            dead_letters: s(format!(
                "SELECT TOP (@P9) {cols_m} FROM {t} AS m WHERE {FILTER}
                  ORDER BY m.created_at, m.seq OPTION (RECOMPILE)"
            )),
            replay_count: s(format!(
                "SELECT COUNT_BIG(*) FROM {t} AS m WHERE {FILTER} OPTION (RECOMPILE)"
            )),
            // Dead → New only (`m.status = 3` leads FILTER). The counts of claims
            // without an outcome start again, or a row the crash-loop guard killed
            // would be killed again by its first claim alone.
            // In chunks (see ROWS_PER_STATEMENT): a replayed row is New, so it leaves
            // FILTER (`m.status = 3`) and the next chunk takes the next rows.
            replay: s(in_chunks(
                None,
                &format!(
                    "UPDATE TOP (@step) m
                    SET m.status = 0, m.attempts = 0, m.visible_at = SYSUTCDATETIME(),
                        m.lease_until = NULL, m.claim_token = NULL, m.unfinished_claims = 0,
                        m.unfinished_alone = 0
                   FROM {t} AS m
                  WHERE {FILTER} OPTION (RECOMPILE);"
                ),
            )),
            // Small batches, skipping rows others hold, so retention never blocks the
            // relay. `@P1` age in ms, `@P2` batch size.
            purge_sent: s(in_chunks(
                Some("@P2"),
                &format!(
                    "WITH d AS (
                     SELECT TOP (@step) m.id FROM {t} AS m WITH (ROWLOCK, READPAST)
                      WHERE m.status = 1 AND m.sent_at <= {sent_cutoff}
                      ORDER BY m.sent_at)
                 DELETE FROM d;"
                ),
            )),
            // Key locks only, a duplicate key read as "already claimed": see
            // `insert_unless_present`. Returns `claimed` 1 or 0.
            inbox_claim: s(insert_unless_present(
                &format!(
                    "INSERT INTO {inbox} (message_id, consumer)
    SELECT @P1, @P2
     WHERE NOT EXISTS (SELECT 1 FROM {inbox} AS e WITH (UPDLOCK, ROWLOCK)
                        WHERE e.message_id = @P1 AND e.consumer = @P2)"
                ),
                "SELECT CAST(@inserted AS int) AS claimed;",
            )),
            inbox_purge: s(in_chunks(
                Some("@P2"),
                &format!(
                    "WITH d AS (
                     SELECT TOP (@step) r.message_id FROM {inbox} AS r WITH (ROWLOCK, READPAST)
                      WHERE r.processed_at <= {sent_cutoff}
                      ORDER BY r.processed_at)
                 DELETE FROM d;"
                ),
            )),
        }
    }
}

/// The session-context key under which [`INBOX_BEGIN`] keeps its transaction's id.
const INBOX_TRANSACTION_KEY: &str = "N'outbox_inbox_transaction'";

/// The inbox's transaction, begun by [`INBOX_BEGIN`], is not the session's current one:
/// it ended (a failed statement under `XACT_ABORT ON` rolled it back, or the handler
/// sent `ROLLBACK`), and a statement sent since began another (under
/// `IMPLICIT_TRANSACTIONS ON`). Never true outside an inbox transaction (no id kept).
fn not_the_inbox_transaction() -> String {
    let key = INBOX_TRANSACTION_KEY;
    format!(
        "SESSION_CONTEXT({key}) IS NOT NULL
   AND CURRENT_TRANSACTION_ID() <> CAST(SESSION_CONTEXT({key}) AS bigint)"
    )
}

/// Begins the inbox's transaction (a plain batch, one round trip): `BEGIN
/// TRANSACTION`, then `IMPLICIT_TRANSACTIONS ON` (after it: turned on first, the
/// `BEGIN` would itself open an implicit transaction and nest in it), so that a statement
/// sent after the transaction ended (under `XACT_ABORT ON`, a handler's failed
/// statement rolls it back at once) begins a transaction of its own instead of
/// committing on its own; and the transaction's id kept in the session context, which
/// tells the statements after the handler whether they still run in it.
fn inbox_begin() -> String {
    let key = INBOX_TRANSACTION_KEY;
    format!(
        "BEGIN TRANSACTION;
SET IMPLICIT_TRANSACTIONS ON;
DECLARE @begun bigint = CURRENT_TRANSACTION_ID();
EXEC sys.sp_set_session_context @key = {key}, @value = @begun;"
    )
}

/// Commits the inbox's transaction only if it is still the one [`inbox_begin`] began
/// and can commit, as [`COMMIT_IF_COMMITTABLE`](crate::connection::COMMIT_IF_COMMITTABLE)
/// does (same `state` answer: 1 committed, 0 or -1 aborted and rolled back), then
/// turns `IMPLICIT_TRANSACTIONS` off and forgets the id, so the connection goes back to
/// the pool as it came. A transaction that a statement after the abort began
/// (`XACT_STATE()` 1, another id) is state 0: rolled back, with what it holds.
fn inbox_commit() -> String {
    let key = INBOX_TRANSACTION_KEY;
    let not_ours = not_the_inbox_transaction();
    format!(
        "SET XACT_ABORT ON;
DECLARE @state int = XACT_STATE();
IF @state = 1 AND {not_ours}
    SET @state = 0;
IF @state = 1
BEGIN
    WHILE @@TRANCOUNT > 0 COMMIT TRANSACTION;
END
ELSE IF @@TRANCOUNT > 0
    ROLLBACK TRANSACTION;
SET IMPLICIT_TRANSACTIONS OFF;
EXEC sys.sp_set_session_context @key = {key}, @value = NULL;
SELECT @state AS state;"
    )
}

/// Rolls back whatever transaction is open (the inbox's, or one a statement after its
/// abort began), turns `IMPLICIT_TRANSACTIONS` off and forgets the id.
fn inbox_rollback() -> String {
    let key = INBOX_TRANSACTION_KEY;
    format!(
        "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION;
SET IMPLICIT_TRANSACTIONS OFF;
EXEC sys.sp_set_session_context @key = {key}, @value = NULL;"
    )
}

/// SQL of the inbox capabilities (version tracking, failures, durable inbox).
#[derive(Debug)]
pub(crate) struct InboxQueries {
    /// Plain batches (no parameters) beginning and ending the inbox's transaction.
    pub(crate) begin: Arc<str>,
    pub(crate) commit: Arc<str>,
    pub(crate) rollback: Arc<str>,
    pub(crate) version_get: Arc<str>,
    pub(crate) version_set: Arc<str>,
    pub(crate) failure: Arc<str>,
    pub(crate) is_dead: Arc<str>,
    pub(crate) claim_unless_dead: Arc<str>,
    pub(crate) claim_batch_unless_dead: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) store: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) purge_processed: Arc<str>,
}

/// Columns read back for a stored durable-inbox message (`inserted` of the claim).
fn inbox_columns(p: &str) -> String {
    let mut cols: Vec<String> = [
        "id",
        "seq",
        "event_type",
        "source",
        "aggregate_type",
        "aggregate_id",
        "aggregate_version",
        "tenant_id",
        "partition_key",
        "correlation_id",
        "causation_id",
        "occurred_at",
        "traceparent",
        "tracestate",
        "headers",
        "payload",
        "received_at",
        "attempts",
        "claim_token",
    ]
    .iter()
    .map(|c| format!("{p}.{c}"))
    .collect();
    cols.push(format!(
        "DATEDIFF_BIG(millisecond, {p}.received_at, @now) AS age_ms"
    ));
    cols.join(", ")
}

impl InboxQueries {
    pub(crate) fn new(schema: &str) -> Self {
        let q = quoted_schema(schema);
        let v = format!("{q}.inbox_versions");
        let f = format!("{q}.inbox_failures");
        let t = format!("{q}.inbox_messages");
        let r = format!("{q}.inbox_records");
        let s = |text: String| -> Arc<str> { text.into() };
        let key = version_key_params();
        let retry_at = plus_ms("@now", "u.delay_ms");
        let cutoff = minus_ms("SYSUTCDATETIME()", "@P1");
        let not_ours = not_the_inbox_transaction();
        Self {
            begin: s(inbox_begin()),
            commit: s(inbox_commit()),
            rollback: s(inbox_rollback()),
            // Make sure a row exists to lock (`insert_unless_present`: key locks only,
            // race-free), then read it under an update lock, which is held to the end of
            // the caller's transaction: two messages of one aggregate for one consumer
            // are handled one after the other, other aggregates are not held up.
            version_get: s(insert_unless_present(
                &format!(
                    "INSERT INTO {v} (consumer, aggregate_type, aggregate_id)
    SELECT @P1, @P2, @P3
     WHERE NOT EXISTS (SELECT 1 FROM {v} AS e WITH (UPDLOCK, ROWLOCK)
                        WHERE e.key_hash = {key})"
                ),
                &format!(
                    "SELECT x.version FROM {v} AS x WITH (UPDLOCK, ROWLOCK)
 WHERE x.key_hash = {key}
   AND x.consumer = @P1 AND x.aggregate_type = @P2 AND x.aggregate_id = @P3;"
                ),
            )),
            // Only ever raises the stored version, and only inside the inbox's
            // transaction while it can still commit: after a handler's failed statement
            // `XACT_ABORT ON` has rolled the transaction back (the version row's lock
            // and the inbox record with it), and this update would otherwise commit
            // with a transaction a later statement began (or on its own, outside the
            // inbox's transactions), so the redelivered message would find its own
            // version applied and be skipped as stale. Returns `state`: 1 updated, else
            // not (0 or the `XACT_STATE()` found).
            version_set: s(format!(
                "DECLARE @state int = XACT_STATE();
IF @state = 1 AND {not_ours}
    SET @state = 0;
IF @state = 1
    UPDATE x
                    SET x.version = CASE WHEN x.version IS NULL OR x.version < @P4
                                         THEN @P4 ELSE x.version END,
                        x.updated_at = SYSUTCDATETIME()
                   FROM {v} AS x
                  WHERE x.key_hash = {key}
                    AND x.consumer = @P1 AND x.aggregate_type = @P2 AND x.aggregate_id = @P3;
SELECT @state AS state;"
            )),
            // One failure more; dead (with the message kept) once attempts reach @P5.
            failure: s(format!(
                "MERGE INTO {f} WITH (HOLDLOCK) AS x
                 USING (SELECT @P1 AS message_id, @P2 AS consumer) AS s
                    ON x.message_id = s.message_id AND x.consumer = s.consumer
                 WHEN MATCHED THEN UPDATE
                     SET x.attempts = x.attempts + 1,
                         x.last_error = @P4,
                         x.last_failed_at = SYSUTCDATETIME(),
                         x.dead_at = COALESCE(x.dead_at,
                             CASE WHEN x.attempts + 1 >= @P5 THEN SYSUTCDATETIME() END)
                 WHEN NOT MATCHED THEN
                     INSERT (message_id, consumer, event_type, attempts, last_error, payload,
                             headers, dead_at)
                     VALUES (@P1, @P2, @P3, 1, @P4, @P6, @P7,
                             CASE WHEN 1 >= @P5 THEN SYSUTCDATETIME() END)
                 OUTPUT inserted.attempts,
                        CAST(CASE WHEN inserted.dead_at IS NULL THEN 0 ELSE 1 END AS bit);"
            )),
            is_dead: s(format!(
                "SELECT CAST(CASE WHEN EXISTS (
                     SELECT 1 FROM {f} WHERE message_id = @P1 AND consumer = @P2
                        AND dead_at IS NOT NULL) THEN 1 ELSE 0 END AS bit)"
            )),
            // The idempotent consumer's one inbox statement per message and handler, on
            // its transaction's connection (`@P1` message id, `@P2` consumer): the
            // dead-letter check and the claim together, so that it never needs a second
            // connection while it holds one (with every pooled connection held by a
            // consumer transaction, a check on the pool would wait for itself). Returns
            // `claimed` (1 or 0) and `dead` (1 for a consumer dead letter, nothing
            // written).
            claim_unless_dead: s(format!(
                "DECLARE @inserted int = 0, @dead int = 0;
{}
SELECT CAST(@inserted AS int) AS claimed, CAST(@dead AS int) AS dead;",
                claim_unless_dead(&r, &f, "@P1", "@P2")
            )),
            // The same for a batch (`@P1`: a JSON array of `{"id", "consumer"}`
            // objects, distinct pairs in the caller's lock order): one round trip, the
            // pairs claimed one statement at a time in array order, so two batches
            // sharing pairs lock them in the same order and wait instead of
            // deadlocking (a set-based INSERT would lock in whatever order its plan
            // reads and sorts). One row per pair: `ord` (its array index), `claimed`,
            // `dead`.
            claim_batch_unless_dead: s(format!(
                "DECLARE @pairs TABLE (ord int NOT NULL PRIMARY KEY, message_id uniqueidentifier NOT NULL,
                       consumer nvarchar(255) NOT NULL, claimed int NOT NULL, dead int NOT NULL);
INSERT INTO @pairs (ord, message_id, consumer, claimed, dead)
SELECT CAST(a.[key] AS int), j.message_id, j.consumer, 0, 0
  FROM OPENJSON(@P1) AS a
 CROSS APPLY OPENJSON(a.value) WITH (
       message_id uniqueidentifier '$.id',
       consumer nvarchar(255) '$.consumer') AS j;
DECLARE @i int = 0, @n int, @id uniqueidentifier, @consumer nvarchar(255),
        @inserted int, @dead int;
SELECT @n = COUNT(*) FROM @pairs;
WHILE @i < @n
BEGIN
SELECT @id = p.message_id, @consumer = p.consumer FROM @pairs AS p WHERE p.ord = @i;
SET @inserted = 0;
SET @dead = 0;
{}
UPDATE @pairs SET claimed = @inserted, dead = @dead WHERE ord = @i;
SET @i = @i + 1;
END;
SELECT ord, claimed, dead FROM @pairs ORDER BY ord;",
                claim_unless_dead(&r, &f, "@id", "@consumer")
            )),
            dead_letters: s(format!(
                "SELECT TOP (@P2) message_id, consumer, event_type, last_error, attempts, dead_at,
                        COALESCE(payload, 0x)
                   FROM {f}
                  WHERE dead_at IS NOT NULL AND (@P1 IS NULL OR consumer = @P1)
                  ORDER BY dead_at"
            )),
            // INSERT ... WHERE NOT EXISTS under (UPDLOCK, HOLDLOCK): the equivalent of
            // MERGE ... WITH (HOLDLOCK); without the hints two deliveries of one id race.
            store: s(format!(
                "INSERT INTO {t} (id, event_type, source, aggregate_type, aggregate_id,
                     aggregate_version, tenant_id, partition_key, correlation_id, causation_id,
                     occurred_at, traceparent, tracestate, headers, payload)
                 OUTPUT inserted.id
                 SELECT @P1, @P2, @P3, @P4, @P5, @P6, @P7, @P8, @P9, @P10, @P11, @P12, @P13,
                        @P14, @P15
                  WHERE NOT EXISTS (SELECT 1 FROM {t} AS x WITH (UPDLOCK, HOLDLOCK)
                                     WHERE x.id = @P1)"
            )),
            // No crash-loop guard: `inbox_messages` has no `unfinished_claims`.
            claim: s(claim_statement(&t, &inbox_columns("inserted"), None)),
            // Outcome codes: 1 done, 0 retry, 3 dead, 10 defer (New without charge).
            complete: s(chunked_outcomes(
                &[
                    ("id", "uniqueidentifier"),
                    ("token", "uniqueidentifier"),
                    ("kind", "smallint"),
                    ("delay_ms", "bigint"),
                    ("error", "nvarchar(max)"),
                ],
                &format!(
                    "UPDATE m
                    SET m.status = CASE WHEN u.kind = 10 THEN 0 ELSE u.kind END,
                        m.attempts = CASE WHEN u.kind = 10
                                          THEN CASE WHEN m.attempts > 0 THEN m.attempts - 1 ELSE 0 END
                                          ELSE m.attempts END,
                        m.visible_at = CASE WHEN u.kind IN (0, 10) THEN {retry_at}
                                            ELSE m.visible_at END,
                        m.last_error = COALESCE(u.error, m.last_error),
                        m.processed_at = CASE WHEN u.kind = 1 THEN @now END,
                        m.lease_until = NULL,
                        m.claim_token = NULL
                 OUTPUT inserted.id
                   FROM @u AS u
                  INNER LOOP JOIN {t} AS m WITH (ROWLOCK, FORCESEEK) ON m.id = u.id
                  WHERE {{CHUNK}} AND m.claim_token = u.token AND m.status = 9;"
                ),
            )),
            purge_processed: s(in_chunks(
                Some("@P2"),
                &format!(
                    "WITH d AS (
                     SELECT TOP (@step) m.id FROM {t} AS m WITH (ROWLOCK, READPAST)
                      WHERE m.status = 1 AND m.processed_at <= {cutoff}
                      ORDER BY m.processed_at)
                 DELETE FROM d;"
                ),
            )),
        }
    }
}

/// `text` escaped for `LIKE ... ESCAPE N'\'`: the wildcards `%`, `_`, `[` and the escape
/// character itself match literally.
pub(crate) fn like_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '[' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Strips the contents of N'...' / '...' literals, leaving the quotes (for the unit
/// tests of the rendered SQL here and in `ops`).
#[cfg(test)]
pub(crate) fn without_literals(sql: &str) -> String {
    let mut out = String::new();
    let mut in_lit = false;
    for c in sql.chars() {
        if c == '\'' {
            in_lit = !in_lit;
            out.push(c);
        } else if !in_lit {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_outbox(q: &Queries) -> Vec<(&'static str, &str)> {
        vec![
            ("enqueue", &*q.enqueue),
            ("claim", &*q.claim),
            ("claim_ordered_block", &*q.claim_ordered_block),
            ("claim_ordered_skip", &*q.claim_ordered_skip),
            ("blocked_keys", &*q.blocked_keys),
            ("complete", &*q.complete),
            ("complete_deleting_sent", &*q.complete_deleting_sent),
            ("get", &*q.get),
            ("stats", &*q.stats),
            ("dead_letters", &*q.dead_letters),
            ("replay_count", &*q.replay_count),
            ("replay", &*q.replay),
            ("purge_sent", &*q.purge_sent),
            ("inbox_claim", &*q.inbox_claim),
            ("inbox_purge", &*q.inbox_purge),
        ]
    }

    fn all_inbox(q: &InboxQueries) -> Vec<(&'static str, &str)> {
        vec![
            ("version_get", &*q.version_get),
            ("version_set", &*q.version_set),
            ("failure", &*q.failure),
            ("is_dead", &*q.is_dead),
            ("claim_unless_dead", &*q.claim_unless_dead),
            ("claim_batch_unless_dead", &*q.claim_batch_unless_dead),
            ("inbox_dead_letters", &*q.dead_letters),
            ("store", &*q.store),
            ("inbox_claim_stored", &*q.claim),
            ("inbox_complete", &*q.complete),
            ("purge_processed", &*q.purge_processed),
        ]
    }

    #[test]
    #[ignore = "prints the rendered SQL for review"]
    fn dump_sql() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        for (name, sql) in all_outbox(&q).into_iter().chain(all_inbox(&iq)) {
            println!("-- ===== {name}\n{sql}\nGO\n");
        }
        let commit = crate::connection::COMMIT_IF_COMMITTABLE;
        println!("-- ===== commit\n{commit}\nGO\n");
        for (name, sql) in [
            ("inbox_begin", &iq.begin),
            ("inbox_commit", &iq.commit),
            ("inbox_rollback", &iq.rollback),
        ] {
            println!("-- ===== {name}\n{sql}\nGO\n");
        }
    }

    #[test]
    fn claim_uses_readpast_updlock_rowlock_and_the_server_clock() {
        let q = Queries::new("outbox");
        for (name, sql) in [
            ("claim", &*q.claim),
            ("inbox claim", &*InboxQueries::new("outbox").claim),
        ] {
            assert!(
                sql.contains("WITH picked AS ("),
                "{name}: a CTE picks the rows"
            );
            assert!(sql.contains("SELECT TOP (@P1)"), "{name}");
            assert_eq!(
                sql.matches("WITH (ROWLOCK, UPDLOCK, READPAST)").count(),
                2,
                "{name}: both claim paths skip locked rows"
            );
            assert!(sql.contains("ORDER BY x.visible_at, x.seq"), "{name}");
            assert!(
                sql.contains("DECLARE @now datetime2(7) = SYSUTCDATETIME();"),
                "{name}"
            );
            assert!(
                sql.contains("c.status = 0 AND c.visible_at <= @now"),
                "{name}"
            );
            assert!(
                sql.contains("c.status = 9 AND c.lease_until < @now"),
                "{name}"
            );
            assert!(
                sql.contains("m.claim_token = @P3")
                    || sql.contains("m.claim_token = CASE WHEN (m.status = 9 AND m.unfinished_alone >= @P4) THEN NULL ELSE @P3 END"),
                "{name}"
            );
            assert!(
                sql.contains("m.attempts = m.attempts + 1")
                    || sql.contains("THEN m.attempts ELSE m.attempts + 1 END"),
                "{name}"
            );
            assert!(sql.contains("OUTPUT inserted.id"), "{name}");
            assert!(
                sql.contains("INNER LOOP JOIN") && sql.contains("WITH (ROWLOCK, FORCESEEK)"),
                "{name}: the update seeks the picked rows, never scans into rows others hold"
            );
            assert!(
                sql.contains(&plus_ms("@now", "@P2")),
                "{name}: lease = server now + duration"
            );
        }
    }

    #[test]
    fn ordered_claim_locks_the_key_head_and_runs_in_one_transaction() {
        let q = Queries::new("outbox");
        for (sql, block) in [
            (&*q.claim_ordered_block, true),
            (&*q.claim_ordered_skip, false),
        ] {
            assert!(sql.contains("SET XACT_ABORT ON;"));
            assert!(sql.contains("BEGIN TRANSACTION;"));
            assert!(sql.trim_end().ends_with("COMMIT TRANSACTION;"));
            // Round-robin walk from the cursor, one seek per key, never waiting.
            assert!(sql.contains("DECLARE @cursor binary(32) = @P4;"));
            assert!(sql.contains(
                "WHERE p.status IN (0, 9) AND p.order_hash > @k AND p.order_hash <= @upper"
            ));
            assert!(
                sql.contains("SELECT @lap = 2, @k = @none, @upper = @cursor;"),
                "wraps"
            );
            assert!(sql.contains("SELECT @last AS next_cursor;"));
            let zeros = format!("@none binary(32) = 0x{}", "0".repeat(64));
            let ones = format!("@all binary(32) = 0x{}", "F".repeat(64));
            assert!(
                sql.contains(&zeros) && sql.contains(&ones),
                "32-byte bounds"
            );
            // The head (on its clustered row) and the run are locked; keys other
            // claimers hold are skipped.
            assert!(sql.contains(
                "FROM [outbox].outbox_messages AS h WITH (ROWLOCK, UPDLOCK, READPAST, INDEX(1))"
            ));
            assert!(
                sql.contains(
                    "FROM [outbox].outbox_messages AS r WITH (ROWLOCK, UPDLOCK, READPAST)"
                )
            );
            assert!(sql.contains("WHERE h.seq = @head AND h.order_hash = @k AND ((h.status = 0"));
            assert!(
                sql.contains("WHILE @held < @P1 AND @steps < @max_steps"),
                "at most @P1 keys"
            );
            assert!(sql.contains(
                "SET @per = CASE WHEN @held = 0 THEN 0 ELSE (@P1 + @held - 1) / @held END;"
            ));
            assert!(
                sql.contains("SELECT TOP (@per) r.seq, r.id"),
                "runs capped per key"
            );
            assert!(
                sql.contains("SELECT TOP (@P1) id FROM @runs ORDER BY rn, n;"),
                "at most batch_size in total, filled in waves"
            );
            assert!(sql.contains(
                "INNER LOOP JOIN [outbox].outbox_messages AS m WITH (ROWLOCK, FORCESEEK) ON m.id = c.id;"
            ));
            assert_eq!(
                sql.contains("d.status = 3 AND d.seq < @head"),
                block,
                "a Dead row holds its key only under Block"
            );
            assert_eq!(sql.contains("d.status = 3 AND d.seq > @head"), block);
            let head = sql.find("AS h WITH (ROWLOCK").unwrap_or(usize::MAX);
            let run = sql.find("AS r WITH (ROWLOCK").unwrap_or(0);
            let update = sql.find("UPDATE m").unwrap_or(0);
            assert!(head < run && run < update, "head, then run, then update");
        }
    }

    /// The `UPDATE m ... OUTPUT` part of a claim statement.
    fn claim_update(sql: &str) -> &str {
        let at = sql.rfind("UPDATE m\n").expect("the claim updates");
        let end = sql[at..].find(" FROM ").map_or(sql.len(), |e| at + e);
        &sql[at..end]
    }

    #[test]
    fn outbox_claims_apply_the_crash_loop_guard() {
        let q = Queries::new("outbox");
        for (name, sql, limit) in [
            ("claim", &*q.claim, "@P4"),
            ("claim_ordered_block", &*q.claim_ordered_block, "@P5"),
            ("claim_ordered_skip", &*q.claim_ordered_skip, "@P5"),
        ] {
            let update = claim_update(sql);
            // Killed: a suspect (the old status, Processing: every SET expression of a
            // T-SQL UPDATE reads the row before the update) already claimed alone
            // `limit` times without an outcome. A New row is never killed, whatever
            // its counts.
            let killed = format!("(m.status = 9 AND m.unfinished_alone >= {limit})");
            let dead = format!("CASE WHEN {killed}");
            // Every assignment takes the Dead branch on the same condition.
            assert_eq!(update.matches(&dead).count(), 8, "{name}: {update}");
            assert_eq!(
                update.matches("m.unfinished_alone >=").count(),
                8,
                "{name}: only the limit parameter is compared"
            );
            assert!(
                !update.contains("m.unfinished_claims >="),
                "{name}: the count of all claims without an outcome kills nothing"
            );
            for needle in [
                format!("SET m.status = {dead} THEN 3 ELSE 9 END"),
                format!(
                    "m.lease_until = {dead} THEN NULL ELSE {} END",
                    plus_ms("@now", "@P2")
                ),
                format!("m.claim_token = {dead} THEN NULL ELSE @P3 END"),
                format!("m.attempts = {dead} THEN m.attempts ELSE m.attempts + 1 END"),
                // Every claim counts one more claim without an outcome ...
                format!("m.unfinished_claims = {dead} THEN m.unfinished_claims\n"),
                "ELSE m.unfinished_claims + 1 END".to_owned(),
                // ... and a suspect's (old status 9) one more claim alone.
                format!("m.unfinished_alone = {dead} OR m.status <> 9 THEN m.unfinished_alone\n"),
                "ELSE m.unfinished_alone + 1 END".to_owned(),
                format!("m.last_error = {dead}"),
                "THEN N'suspected crash loop: claimed alone '".to_owned(),
                "+ CAST(m.unfinished_alone AS nvarchar(11))".to_owned(),
                "+ N' times without an outcome ('".to_owned(),
                "+ CAST(m.unfinished_claims AS nvarchar(11))".to_owned(),
                "+ N' claims without an outcome in all; each relay holding it stopped, crashed or lost its lease before recording one); replay it once the cause is fixed'".to_owned(),
                "ELSE m.last_error END".to_owned(),
                format!("m.first_failed_at = {dead} THEN COALESCE(m.first_failed_at, @now)"),
                "ELSE m.first_failed_at END".to_owned(),
            ] {
                assert!(update.contains(&needle), "{name} lacks {needle}:\n{update}");
            }
            // The status is assigned first: the later CASEs still read the old one
            // (T-SQL's all-at-once UPDATE), so a suspect's alone count and its
            // last_error agree with the Dead/claimed branch its status took.
            let status_at = update.find("SET m.status = ").unwrap_or(usize::MAX);
            let alone_at = update.find("m.unfinished_alone = ").unwrap_or(0);
            assert!(status_at < alone_at, "{name}");
            // The store tells a crash-loop row (status 3) from a claimed one by the
            // returned status and reads both counts beside it; `unfinished_alone` is
            // `Poison::CrashLoop { claims_alone }` (unchanged by the kill).
            let output = &update[update.find("OUTPUT ").expect("OUTPUT")..];
            assert!(output.contains("inserted.status"), "{name}");
            assert!(
                output
                    .trim_end()
                    .ends_with(", inserted.unfinished_claims, inserted.unfinished_alone"),
                "{name}: {output}"
            );
            // The limit is the next parameter after those the statement had.
            let next = if limit == "@P4" { "@P5" } else { "@P6" };
            assert!(!sql.contains(next), "{name} uses {next}");
        }
        // Crash-loop rows are only ever rows that were claimable: the plain claim's
        // update re-checks claimability under the lock, the ordered claim updates only
        // rows it locked (UPDLOCK, held to the commit) as claimable.
        assert!(q.claim.trim_end().ends_with(
            "AND ((m.status = 0 AND m.visible_at <= @now) OR (m.status = 9 AND m.lease_until < @now));"
        ));
        for sql in [&*q.claim_ordered_block, &*q.claim_ordered_skip] {
            assert!(sql.contains("ON m.id = c.id;\nSELECT @last AS next_cursor;"));
            assert!(sql.contains(
                "WHERE h.seq = @head AND h.order_hash = @k AND ((h.status = 0 AND h.visible_at <= @now) OR (h.status = 9 AND h.lease_until < @now));"
            ));
        }
        // The cursor stays @P4 of the ordered claim; the limit is @P5.
        assert!(
            q.claim_ordered_block
                .contains("DECLARE @cursor binary(32) = @P4;")
        );
    }

    #[test]
    fn the_outbox_claim_takes_a_first_suspect_alone_and_no_other_suspect() {
        let q = Queries::new("outbox");
        let sql = &*q.claim;
        // The candidates carry their status, read under the claim's lock, through every
        // level of the pick (both branches, the union, the TOP).
        for needle in [
            "SELECT TOP (@P1) x.id, x.status, x.visible_at, x.seq FROM (",
            "SELECT f.id, f.status, f.visible_at, f.seq FROM (",
            "SELECT e.id, e.status, e.visible_at, e.seq FROM (",
        ] {
            assert!(sql.contains(needle), "lacks {needle}:\n{sql}");
        }
        assert_eq!(
            sql.matches("SELECT TOP (@P1) c.id, c.status, c.visible_at, c.seq\n              FROM [outbox].outbox_messages AS c WITH (ROWLOCK, UPDLOCK, READPAST)").count(),
            2,
            "{sql}"
        );
        // Numbered in claim order, each with the first candidate's status, in one pass
        // over the picked rows: `picked` is referenced once (a CTE is not materialized;
        // a second reference could read other rows past READPAST and TOP).
        assert!(sql.contains(
            "), isolated AS (
    SELECT p.id, p.status,
           ROW_NUMBER() OVER (ORDER BY p.visible_at, p.seq) AS n,
           FIRST_VALUE(p.status) OVER (ORDER BY p.visible_at, p.seq ROWS UNBOUNDED PRECEDING) AS first_status
      FROM picked AS p
)"
        ));
        assert_eq!(sql.matches("picked").count(), 2, "defined and read once");
        assert_eq!(sql.matches("isolated").count(), 2, "defined and read once");
        // The same order as the pick's TOP: the first candidate is the first claimable
        // row in claim order that no other claimer holds.
        assert!(sql.contains("    ORDER BY x.visible_at, x.seq\n), isolated AS ("));
        // The first alone when it is a suspect, else only the New candidates, each
        // re-checked under the update's lock.
        assert!(sql.contains(
            "  FROM isolated AS i
 INNER LOOP JOIN [outbox].outbox_messages AS m WITH (ROWLOCK, FORCESEEK) ON m.id = i.id
 WHERE ((i.first_status = 9 AND i.n = 1) OR (i.first_status = 0 AND i.status = 0))
   AND ((m.status = 0 AND m.visible_at <= @now) OR (m.status = 9 AND m.lease_until < @now));"
        ));
        // One statement (one autocommit transaction): the candidates' update locks last
        // until the update is done.
        assert_eq!(
            without_literals(sql).matches(';').count(),
            2,
            "DECLARE and the claim:\n{sql}"
        );
        assert!(!sql.contains("BEGIN TRANSACTION"));
        // The durable inbox's claim has no suspects: unchanged, no isolation.
        let inbox = &*InboxQueries::new("outbox").claim;
        for absent in ["isolated", "FIRST_VALUE", "x.status", "first_status"] {
            assert!(!inbox.contains(absent), "inbox claim has {absent}");
        }
        assert!(inbox.contains(
            "SELECT TOP (@P1) x.id FROM (\n        SELECT f.id, f.visible_at, f.seq FROM ("
        ));
        assert!(inbox.contains("  FROM picked AS p\n INNER LOOP JOIN [outbox].inbox_messages AS m WITH (ROWLOCK, FORCESEEK) ON m.id = p.id\n WHERE ((m.status = 0"));
    }

    #[test]
    fn the_ordered_claim_takes_a_suspect_head_alone_and_stops_runs_before_suspects() {
        let q = Queries::new("outbox");
        for sql in [&*q.claim_ordered_block, &*q.claim_ordered_skip] {
            // The head's id and status are read under the head's lock and kept.
            assert!(sql.contains(
                "    SELECT @got = h.seq, @got_id = h.id, @got_status = h.status
      FROM [outbox].outbox_messages AS h WITH (ROWLOCK, UPDLOCK, READPAST, INDEX(1))"
            ));
            assert!(
                sql.contains("head_id uniqueidentifier NOT NULL, head_status smallint NOT NULL);")
            );
            assert!(sql.contains(
                "    INSERT INTO @heads (order_hash, head_seq, head_id, head_status)
    VALUES (@k, @head, @got_id, @got_status);"
            ));
            // After the walk: the first suspect head in seq order is the whole batch;
            // the runs are built only when no head is a suspect.
            let suspect = "SET @suspect = (SELECT TOP (1) hs.head_id FROM @heads AS hs
                 WHERE hs.head_status = 9 ORDER BY hs.head_seq);
IF @suspect IS NOT NULL
    INSERT INTO @claim (id) VALUES (@suspect);
ELSE
BEGIN
    SET @per = ";
            assert!(sql.contains(suspect), "{sql}");
            let at = |needle: &str| sql.find(needle).unwrap_or_else(|| panic!("no {needle}"));
            let walk_end = at("    SET @held += 1;\nEND;\n");
            let decide = at("SET @suspect = ");
            let runs = at("        INSERT INTO @run (seq, id)");
            let waves = at(
                "    INSERT INTO @claim (id) SELECT TOP (@P1) id FROM @runs ORDER BY rn, n;\nEND;\nUPDATE m",
            );
            let update = at("UPDATE m\n");
            assert!(walk_end < decide && decide < runs && runs < waves && waves < update);
            assert_eq!(sql.matches("INSERT INTO @claim").count(), 2);
            // A run takes only New and visible rows (every head is one then) ...
            assert!(sql.contains(
                "         WHERE r.order_hash = @k AND r.status IN (0, 9) AND r.seq >= @head
           AND r.status = 0 AND r.visible_at <= @now
         ORDER BY r.seq;"
            ));
            assert!(!sql.contains("r.status = 9"), "no suspect in a run");
            // ... and is cut at the first pending row it does not hold: a suspect is
            // pending (status 9), so the run stops before it.
            assert!(sql.contains(
                "WHERE s.order_hash = @k AND s.status IN (0, 9) AND s.seq > @head
                        AND NOT EXISTS (SELECT 1 FROM @run AS x WHERE x.seq = s.seq));"
            ));
            assert!(sql.contains("         WHERE @stop IS NULL OR seq < @stop;"));
            // Still one batch in one transaction.
            assert_eq!(sql.matches("BEGIN TRANSACTION;").count(), 1);
            assert_eq!(sql.matches("COMMIT TRANSACTION;").count(), 1);
        }
    }

    #[test]
    fn the_durable_inbox_claim_has_no_crash_loop_guard() {
        let iq = InboxQueries::new("outbox");
        let update = claim_update(&iq.claim);
        assert!(!iq.claim.contains("unfinished_claims"), "{update}");
        assert!(!iq.claim.contains("crash loop"));
        assert!(!iq.claim.contains("@P4"), "three parameters only");
        assert!(update.contains(
            "SET m.status = 9,\n       m.lease_until = DATEADD(millisecond, CAST((@P2) % 1000 AS int)"
        ));
        assert!(
            update.contains("m.claim_token = @P3,\n       m.attempts = m.attempts + 1\nOUTPUT ")
        );
        assert!(!iq.complete.contains("unfinished_claims"));
        assert!(
            !iq.claim.contains("unfinished_alone") && !iq.complete.contains("unfinished_alone")
        );
    }

    #[test]
    fn completions_and_replays_reset_the_crash_loop_count() {
        let q = Queries::new("outbox");
        let reset = "m.unfinished_claims = 0,\n                        m.unfinished_alone = 0\n                 OUTPUT inserted.id";
        for count in ["m.unfinished_claims = 0", "m.unfinished_alone = 0"] {
            assert_eq!(q.complete.matches(count).count(), 1, "{}", q.complete);
            assert_eq!(q.complete_deleting_sent.matches(count).count(), 1);
        }
        assert!(q.complete.contains(reset), "{}", q.complete);
        // Under SentRetention::Delete the Sent rows are deleted; the other outcomes
        // (retry, dead, release) reset both counts.
        let d = &q.complete_deleting_sent;
        let update = &d[d.find("UPDATE m").expect("update")..];
        assert!(update.contains(&format!(
            "m.claim_token = NULL,\n                        {reset}"
        )));
        assert!(!d[..d.find("UPDATE m").unwrap_or(0)].contains("unfinished_"));
        // A replayed row starts counting again, or the guard would kill it at its first
        // claim alone.
        assert!(q.replay.contains(
            "m.claim_token = NULL, m.unfinished_claims = 0,\n                        m.unfinished_alone = 0\n"
        ));
    }

    #[test]
    fn union_branches_order_only_inside_derived_tables() {
        // `SELECT TOP (n) ... ORDER BY ... UNION ALL ...` is a syntax error in T-SQL:
        // each ordered branch must sit in a derived table.
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        for sql in [&*q.claim, &*q.blocked_keys, &*iq.claim] {
            let mut rest = sql;
            while let Some(at) = rest.find("UNION ALL") {
                let before = rest[..at].trim_end();
                let alias = before.rsplit(") AS ").next().unwrap_or_default();
                assert!(
                    before.contains(") AS ") && alias.chars().all(|c| c.is_ascii_alphabetic()),
                    "an ORDER BY branch precedes UNION ALL bare: {before}"
                );
                rest = &rest[at + 9..];
            }
        }
    }

    #[test]
    fn row_counts_do_not_depend_on_nocount() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        for (name, sql) in [
            ("replay", &*q.replay),
            ("purge_sent", &*q.purge_sent),
            ("inbox_purge", &*q.inbox_purge),
            ("purge_processed", &*iq.purge_processed),
        ] {
            assert!(
                sql.trim_end().ends_with("SELECT @done AS affected;"),
                "{name}"
            );
        }
        assert!(
            q.inbox_claim
                .contains("SELECT CAST(@inserted AS int) AS claimed;")
        );
        assert!(iq.store.contains("OUTPUT inserted.id"));
    }

    #[test]
    fn claims_in_the_handlers_transaction_lock_only_their_own_key() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        // What runs inside the consumer's transaction, held for the whole handler:
        // no key-range locks (HOLDLOCK / SERIALIZABLE), no MERGE.
        for (name, sql) in [
            ("inbox_claim", &*q.inbox_claim),
            ("claim_unless_dead", &*iq.claim_unless_dead),
            ("claim_batch_unless_dead", &*iq.claim_batch_unless_dead),
            ("version_get", &*iq.version_get),
            ("version_set", &*iq.version_set),
        ] {
            let upper = sql.to_uppercase();
            for banned in ["HOLDLOCK", "SERIALIZABLE", "MERGE", "TABLOCK", "PAGLOCK"] {
                assert!(!upper.contains(banned), "{name} uses {banned}:\n{sql}");
            }
        }
        assert!(q.inbox_claim.contains(
            "INSERT INTO [outbox].inbox_records (message_id, consumer)\n    SELECT @P1, @P2\n     WHERE NOT EXISTS (SELECT 1 FROM [outbox].inbox_records AS e WITH (UPDLOCK, ROWLOCK)\n                        WHERE e.message_id = @P1 AND e.consumer = @P2);"
        ));
        assert!(
            q.inbox_claim
                .trim_end()
                .ends_with("SELECT CAST(@inserted AS int) AS claimed;")
        );
        assert!(iq.version_get.contains(
            "INSERT INTO [outbox].inbox_versions (consumer, aggregate_type, aggregate_id)\n    SELECT @P1, @P2, @P3\n     WHERE NOT EXISTS (SELECT 1 FROM [outbox].inbox_versions AS e WITH (UPDLOCK, ROWLOCK)"
        ));
        // The version record stays locked (an update lock lasts to the end of the
        // transaction) while the handler runs.
        assert!(iq.version_get.contains(
            "SELECT x.version FROM [outbox].inbox_versions AS x WITH (UPDLOCK, ROWLOCK)"
        ));
        // The statements outside the handler's transaction keep their one-statement
        // range locks (they commit at once).
        assert!(
            iq.failure
                .contains("MERGE INTO [outbox].inbox_failures WITH (HOLDLOCK)")
        );
        assert!(iq.store.contains("WITH (UPDLOCK, HOLDLOCK)"));
    }

    #[test]
    fn a_duplicate_key_does_not_doom_the_handlers_transaction() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        for (name, sql) in [
            ("inbox_claim", &*q.inbox_claim),
            ("version_get", &*iq.version_get),
        ] {
            let at = |needle: &str| {
                sql.find(needle)
                    .unwrap_or_else(|| panic!("{name} lacks {needle}:\n{sql}"))
            };
            // XACT_ABORT is off around the insert (a caught error would otherwise
            // still doom the transaction), and on again before anything else runs.
            assert!(sql.starts_with("SET XACT_ABORT OFF;\n"), "{name}");
            let (try_, insert, catch) = (at("BEGIN TRY"), at("INSERT INTO"), at("BEGIN CATCH"));
            assert!(
                try_ < insert && insert < catch,
                "{name}: the insert is in the TRY"
            );
            assert!(
                sql.contains("SET @inserted = @@ROWCOUNT;\nEND TRY"),
                "{name}"
            );
            // Only a duplicate key in a live transaction is swallowed; the rest is
            // re-raised under XACT_ABORT ON.
            assert!(sql.contains(
                "IF ERROR_NUMBER() NOT IN (2601, 2627) OR XACT_STATE() = -1\n    BEGIN\n        SET XACT_ABORT ON;\n        THROW;\n    END;\nEND CATCH;\nSET XACT_ABORT ON;\n"
            ), "{name}:\n{sql}");
            assert_eq!(sql.matches("SET XACT_ABORT ON;").count(), 2, "{name}");
            let select = sql.rfind("SELECT ").unwrap_or(0);
            assert!(
                at("END CATCH;\nSET XACT_ABORT ON;") < select,
                "{name}: the read runs after"
            );
        }
    }

    /// The claim of `inbox_claim` (the insert and its duplicate-key handling) with the
    /// parameters spelled `id` and `consumer`.
    fn the_claim_of_try_claim(id: &str, consumer: &str) -> String {
        format!(
            "INSERT INTO [outbox].inbox_records (message_id, consumer)
        SELECT {id}, {consumer}
         WHERE NOT EXISTS (SELECT 1 FROM [outbox].inbox_records AS e WITH (UPDLOCK, ROWLOCK)
                            WHERE e.message_id = {id} AND e.consumer = {consumer});
        SET @inserted = @@ROWCOUNT;
    END;
END TRY
BEGIN CATCH
    IF ERROR_NUMBER() NOT IN (2601, 2627) OR XACT_STATE() = -1
    BEGIN
        SET XACT_ABORT ON;
        THROW;
    END;
END CATCH;
SET XACT_ABORT ON;"
        )
    }

    #[test]
    fn the_dead_letter_check_and_the_claim_are_one_statement() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        let sql = &*iq.claim_unless_dead;
        let at = |needle: &str| {
            sql.find(needle)
                .unwrap_or_else(|| panic!("lacks {needle}:\n{sql}"))
        };
        // Two parameters, the pair; nothing is read from the pool's other connections.
        assert!(sql.contains("@P1") && sql.contains("@P2") && !sql.contains("@P3"));
        assert!(sql.starts_with(
            "DECLARE @inserted int = 0, @dead int = 0;\nSET XACT_ABORT OFF;\nBEGIN TRY\n"
        ));
        // A dead letter is a failure row of this pair with dead_at set, read by its
        // primary key, without hints: no lock outlives the read, and an in-flight
        // failure count of the same pair is waited for, not skipped.
        assert!(sql.contains(
            "    IF EXISTS (SELECT 1 FROM [outbox].inbox_failures AS d
                WHERE d.message_id = @P1 AND d.consumer = @P2
                  AND d.dead_at IS NOT NULL)
        SET @dead = 1;
    ELSE
    BEGIN
"
        ));
        assert!(!sql.contains("inbox_failures AS d WITH"), "{sql}");
        // Then exactly try_claim's insert, locks and duplicate-key handling.
        assert!(sql.contains(&the_claim_of_try_claim("@P1", "@P2")), "{sql}");
        assert!(
            q.inbox_claim.contains(
                "WHERE NOT EXISTS (SELECT 1 FROM [outbox].inbox_records AS e WITH (UPDLOCK, ROWLOCK)\n                        WHERE e.message_id = @P1 AND e.consumer = @P2)"
            ),
            "the same lock hints as try_claim"
        );
        assert_eq!(sql.matches("INSERT INTO").count(), 1);
        assert_eq!(sql.matches("WITH (").count(), 1, "one hinted table: {sql}");
        // Order: XACT_ABORT off, the check, the insert, the catch, XACT_ABORT on, the
        // answer.
        let (off, check, insert, catch, on, answer) = (
            at("SET XACT_ABORT OFF;"),
            at("IF EXISTS"),
            at("INSERT INTO"),
            at("BEGIN CATCH"),
            sql.rfind("SET XACT_ABORT ON;").unwrap_or(0),
            at("SELECT CAST(@inserted"),
        );
        assert!(off < check && check < insert && insert < catch && catch < on && on < answer);
        assert!(
            sql.trim_end()
                .ends_with("SELECT CAST(@inserted AS int) AS claimed, CAST(@dead AS int) AS dead;")
        );
    }

    #[test]
    fn a_batch_claims_pair_by_pair_in_the_callers_order() {
        let iq = InboxQueries::new("outbox");
        let sql = &*iq.claim_batch_unless_dead;
        // One parameter: the pairs as a JSON array, in the caller's (sorted) order.
        assert!(sql.contains("@P1") && !sql.contains("@P2"));
        assert!(sql.contains(
            "SELECT CAST(a.[key] AS int), j.message_id, j.consumer, 0, 0
  FROM OPENJSON(@P1) AS a
 CROSS APPLY OPENJSON(a.value) WITH (
       message_id uniqueidentifier '$.id',
       consumer nvarchar(255) '$.consumer') AS j;"
        ));
        // A loop over the array index, ascending, one pair per iteration: the locks are
        // taken in the array's order, whatever plan a set-based insert would choose.
        for needle in [
            "(ord int NOT NULL PRIMARY KEY,",
            "DECLARE @i int = 0, @n int,",
            "SELECT @n = COUNT(*) FROM @pairs;",
            "WHILE @i < @n\nBEGIN\n",
            "SELECT @id = p.message_id, @consumer = p.consumer FROM @pairs AS p WHERE p.ord = @i;",
            "SET @inserted = 0;\nSET @dead = 0;\nSET XACT_ABORT OFF;\nBEGIN TRY\n",
            "UPDATE @pairs SET claimed = @inserted, dead = @dead WHERE ord = @i;\nSET @i = @i + 1;\nEND;\n",
        ] {
            assert!(sql.contains(needle), "lacks {needle}:\n{sql}");
        }
        // Each pair: the single claim's dead-letter check, insert and catch, on the
        // loop's variables.
        assert!(
            sql.contains(&the_claim_of_try_claim("@id", "@consumer")),
            "{sql}"
        );
        assert!(sql.contains("WHERE d.message_id = @id AND d.consumer = @consumer"));
        assert_eq!(sql.matches("INSERT INTO [outbox].inbox_records").count(), 1);
        let single = &*iq.claim_unless_dead;
        let body = |sql: &str, id: &str, consumer: &str| -> String {
            let from = sql.find("SET XACT_ABORT OFF;").unwrap_or(0);
            let to = sql.rfind("SET XACT_ABORT ON;").unwrap_or(0);
            sql[from..to]
                .replace(id, "ID")
                .replace(consumer, "CONSUMER")
        };
        assert_eq!(
            body(sql, "@id", "@consumer"),
            body(single, "@P1", "@P2"),
            "the loop's body is the single claim"
        );
        assert!(
            sql.trim_end()
                .ends_with("SELECT ord, claimed, dead FROM @pairs ORDER BY ord;")
        );
    }

    /// The inbox's transaction: `IMPLICIT_TRANSACTIONS ON` after its `BEGIN`, its id
    /// kept; every statement of the inbox after the handler (the version, the commit)
    /// runs only in that transaction; the session is left as it came.
    #[test]
    fn the_inbox_transaction_lets_nothing_after_an_abort_commit() {
        let iq = InboxQueries::new("outbox");
        let lines =
            |sql: &str| -> Vec<String> { sql.lines().map(|l| l.trim().to_owned()).collect() };
        let key = "N'outbox_inbox_transaction'";
        let not_ours = [
            "IF @state = 1 AND SESSION_CONTEXT(N'outbox_inbox_transaction') IS NOT NULL".to_owned(),
            "AND CURRENT_TRANSACTION_ID() <> CAST(SESSION_CONTEXT(N'outbox_inbox_transaction') AS bigint)".to_owned(),
            "SET @state = 0;".to_owned(),
        ];
        assert_eq!(
            lines(&iq.begin),
            [
                // Implicit transactions on only once the transaction is open: turned on
                // before, the BEGIN would open an implicit one and nest in it.
                "BEGIN TRANSACTION;".to_owned(),
                "SET IMPLICIT_TRANSACTIONS ON;".to_owned(),
                "DECLARE @begun bigint = CURRENT_TRANSACTION_ID();".to_owned(),
                format!("EXEC sys.sp_set_session_context @key = {key}, @value = @begun;"),
            ]
        );
        let commit = lines(&iq.commit);
        assert_eq!(
            commit[..2],
            ["SET XACT_ABORT ON;", "DECLARE @state int = XACT_STATE();"]
        );
        assert_eq!(
            commit[2..5],
            not_ours,
            "another transaction than the one begun: 0"
        );
        assert_eq!(
            commit[5..],
            [
                "IF @state = 1".to_owned(),
                "BEGIN".to_owned(),
                "WHILE @@TRANCOUNT > 0 COMMIT TRANSACTION;".to_owned(),
                "END".to_owned(),
                // Doomed, or begun by a statement after the abort: rolled back.
                "ELSE IF @@TRANCOUNT > 0".to_owned(),
                "ROLLBACK TRANSACTION;".to_owned(),
                // The connection goes back to the pool as it came.
                "SET IMPLICIT_TRANSACTIONS OFF;".to_owned(),
                format!("EXEC sys.sp_set_session_context @key = {key}, @value = NULL;"),
                "SELECT @state AS state;".to_owned(),
            ]
        );
        assert_eq!(
            lines(&iq.rollback),
            [
                "IF @@TRANCOUNT > 0 ROLLBACK TRANSACTION;".to_owned(),
                "SET IMPLICIT_TRANSACTIONS OFF;".to_owned(),
                format!("EXEC sys.sp_set_session_context @key = {key}, @value = NULL;"),
            ]
        );
        // Plain batches (`simple_query`): through sp_executesql, the changed
        // @@TRANCOUNT would raise error 266 and the SET would end with the call.
        for batch in [&iq.begin, &iq.commit, &iq.rollback] {
            assert!(!batch.contains("@P"), "{batch}");
        }
        // The version is raised under the same test as the commit.
        let version = lines(&iq.version_set);
        assert_eq!(version[0], "DECLARE @state int = XACT_STATE();");
        assert_eq!(version[1..4], not_ours);
        assert_eq!(version[4..6], ["IF @state = 1", "UPDATE x"]);
    }

    #[test]
    fn a_version_is_recorded_only_in_a_transaction_that_can_commit() {
        let iq = InboxQueries::new("outbox");
        let sql = &*iq.version_set;
        assert!(sql.starts_with("DECLARE @state int = XACT_STATE();\n"));
        assert!(sql.contains("\nIF @state = 1\n    UPDATE x\n"));
        assert!(sql.trim_end().ends_with(
            "AND x.consumer = @P1 AND x.aggregate_type = @P2 AND x.aggregate_id = @P3;\nSELECT @state AS state;"
        ));
        assert_eq!(sql.matches("UPDATE").count(), 1);
    }

    #[test]
    fn version_keys_hash_the_whole_text() {
        let iq = InboxQueries::new("outbox");
        // Every parameter is widened to nvarchar(max) before concatenation: tiberius
        // declares strings up to 4,000 bytes as nvarchar(4000), and a concatenation of
        // non-max strings is cut at 4,000 characters, which would no longer match the
        // persisted key_hash (computed over the nvarchar(max) aggregate_id column).
        let key = version_key_params();
        for p in ["@P1", "@P2", "@P3"] {
            assert!(
                key.contains(&format!("CAST({p} AS nvarchar(max))")),
                "{key}"
            );
            assert!(
                !key.contains(&format!("+ {p} ")) && !key.contains(&format!("({p})")),
                "bare {p}: {key}"
            );
        }
        for (name, sql) in [
            ("version_get", &*iq.version_get),
            ("version_set", &*iq.version_set),
        ] {
            assert_eq!(
                sql.matches(&*key).count(),
                if name == "version_get" { 2 } else { 1 },
                "{name}"
            );
            assert!(!sql.contains("N':' + @P3"), "{name}");
        }
        // The same expression as the column's, with the parameters in the columns' place.
        assert_eq!(
            key,
            version_key_expr("consumer", "aggregate_type", "aggregate_id")
                .replace(
                    "DATALENGTH(consumer)",
                    "DATALENGTH(CAST(@P1 AS nvarchar(max)))"
                )
                .replace("+ consumer +", "+ CAST(@P1 AS nvarchar(max)) +")
                .replace(
                    "DATALENGTH(aggregate_type)",
                    "DATALENGTH(CAST(@P2 AS nvarchar(max)))"
                )
                .replace("+ aggregate_type +", "+ CAST(@P2 AS nvarchar(max)) +")
                .replace("+ aggregate_id)", "+ CAST(@P3 AS nvarchar(max)))")
        );
    }

    #[test]
    fn completion_is_fenced_by_token_and_status() {
        let q = Queries::new("outbox");
        for complete in [&q.complete, &q.complete_deleting_sent] {
            assert!(complete.contains("m.claim_token = u.token AND m.status = 9;"));
            assert!(complete.contains("OPENJSON(@P1)"));
            assert!(complete.contains(&plus_ms("@now", "u.delay_ms")));
            assert!(complete.contains("m.first_failed_at = CASE WHEN m.first_failed_at IS NULL"));
            assert!(complete.contains("DECLARE @now datetime2(7) = SYSUTCDATETIME();"));
        }
        assert!(!q.complete.contains("DELETE"));
        // Under SentRetention::Delete only a Sent completion deletes, fenced the same
        // way, and the delete and the update commit or roll back together.
        let d = &q.complete_deleting_sent;
        assert!(d.contains(
            "DELETE m\n                 OUTPUT deleted.id\n                   FROM @u AS u"
        ));
        assert!(d.contains(
            "WHERE u.n >= @from AND u.n < @from + 1000 AND u.status = 1 AND m.claim_token = u.token AND m.status = 9;"
        ));
        assert!(d.contains(
            "WHERE u.n >= @from AND u.n < @from + 1000 AND u.status <> 1 AND m.claim_token = u.token AND m.status = 9;"
        ));
        assert_eq!(
            d.matches("INNER LOOP JOIN [outbox].outbox_messages AS m WITH (ROWLOCK, FORCESEEK)")
                .count(),
            2
        );
        let (begin, commit) = (d.find("BEGIN TRANSACTION;"), d.find("COMMIT TRANSACTION;"));
        assert!(d.contains("SET XACT_ABORT ON;"));
        assert!(begin < d.find("DELETE m") && d.find("UPDATE m") < commit && begin.is_some());
        let iq = InboxQueries::new("outbox");
        assert!(
            iq.complete
                .contains("AND m.claim_token = u.token AND m.status = 9;")
        );
    }

    #[test]
    fn bulk_statements_stay_below_the_lock_escalation_threshold() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        // Completions: read once into @u, applied chunk by chunk in one transaction.
        for (name, sql) in [
            ("complete", &*q.complete),
            ("complete_deleting_sent", &*q.complete_deleting_sent),
            ("inbox complete", &*iq.complete),
        ] {
            assert!(sql.contains("CROSS APPLY OPENJSON(a.value) WITH (id uniqueidentifier '$.id', token uniqueidentifier '$.token'"), "{name}");
            assert!(sql.contains("DECLARE @n int = (SELECT COUNT(*) FROM @u), @from int = 0;\nBEGIN TRANSACTION;\nWHILE @from < @n\nBEGIN"), "{name}");
            assert!(
                sql.contains("SET @from += 1000;\nEND;\nCOMMIT TRANSACTION;"),
                "{name}"
            );
            // Every statement touching the table joins only the chunk's rows of @u.
            let touching = sql.matches("INNER LOOP JOIN").count();
            assert!(touching >= 1, "{name}");
            assert_eq!(
                sql.matches("FROM @u AS u\n").count(),
                touching,
                "{name}: {sql}"
            );
            assert_eq!(
                sql.matches("WHERE u.n >= @from AND u.n < @from + 1000 AND ")
                    .count(),
                touching,
                "{name}"
            );
            assert!(
                !sql.contains("FROM OPENJSON(@P1) WITH"),
                "{name}: no unchunked join"
            );
        }
        // Purges and the replay: TOP (@step), at most 1,000, until done or @P2 reached.
        for (name, sql) in [
            ("purge_sent", &*q.purge_sent),
            ("inbox_purge", &*q.inbox_purge),
            ("purge_processed", &*iq.purge_processed),
            ("replay", &*q.replay),
        ] {
            assert!(
                sql.contains("SET @step = CASE WHEN @left < 1000 THEN @left ELSE 1000 END;"),
                "{name}"
            );
            assert!(sql.contains("TOP (@step)"), "{name}");
            assert!(!sql.contains("TOP (@P2)"), "{name}: an unbounded statement");
            assert!(sql.contains("IF @got < @step BREAK;"), "{name}");
        }
        for sql in [&*q.purge_sent, &*q.inbox_purge, &*iq.purge_processed] {
            assert!(sql.starts_with("DECLARE @left bigint = @P2,"));
        }
        assert!(q.replay.contains("UPDATE TOP (@step) m"));
    }

    #[test]
    fn every_time_comes_from_the_server_clock() {
        let q = Queries::new("outbox");
        let iq = InboxQueries::new("outbox");
        for (name, sql) in all_outbox(&q).into_iter().chain(all_inbox(&iq)) {
            for local in [
                "GETDATE(",
                "GETUTCDATE(",
                "SYSDATETIME(",
                "CURRENT_TIMESTAMP",
            ] {
                assert!(!sql.contains(local), "{name} uses {local}");
            }
        }
        // Wherever a time is written, it derives from SYSUTCDATETIME() (directly or via
        // @now); the only client-supplied instant is the producer's occurred_at and the
        // filter bounds of dead-letter queries.
        for (name, sql) in [
            ("claim", &*q.claim),
            ("complete", &*q.complete),
            ("complete_deleting_sent", &*q.complete_deleting_sent),
            ("replay", &*q.replay),
            ("purge_sent", &*q.purge_sent),
            ("enqueue", &*q.enqueue),
            ("stats", &*q.stats),
            ("inbox complete", &*iq.complete),
            ("failure", &*iq.failure),
        ] {
            assert!(sql.contains("SYSUTCDATETIME()"), "{name}");
        }
        assert!(
            q.enqueue
                .contains("COALESCE(j.occurred_at, SYSUTCDATETIME())")
        );
        assert!(
            q.enqueue
                .contains(&plus_ms("SYSUTCDATETIME()", "j.delay_ms"))
        );
    }

    #[test]
    fn values_are_parameters_never_spliced() {
        // Outside string literals the only text that varies per call would be values;
        // every statement is built once per schema, so no value can be spliced. Check
        // that each statement refers to parameters, and that literals hold only
        // constants (JSON paths, lock names, fixed strings).
        let q = Queries::new("s_1");
        let iq = InboxQueries::new("s_1");
        for (name, sql) in all_outbox(&q).into_iter().chain(all_inbox(&iq)) {
            if name != "stats" {
                assert!(sql.contains("@P1"), "{name} takes parameters");
            }
            let bare = without_literals(sql);
            assert!(!bare.contains("{schema}"), "{name}");
            assert!(bare.contains("[s_1]."), "{name}: bracket-quoted schema");
        }
        // The statements do not depend on anything but the schema.
        assert_eq!(Queries::new("s_1").claim, q.claim);
    }

    #[test]
    fn reserved_words_are_bracket_quoted_schemas() {
        // `user` and `select` are reserved words in T-SQL: only `[user]` is the schema.
        for schema in ["user", "select"] {
            let q = Queries::new(schema);
            let iq = InboxQueries::new(schema);
            let quoted = format!("[{schema}].");
            for (name, sql) in all_outbox(&q).into_iter().chain(all_inbox(&iq)) {
                let bare = without_literals(sql);
                assert!(bare.contains(&quoted), "{name}");
                assert!(
                    !bare.contains(&format!(" {schema}."))
                        && !bare.contains(&format!("({schema}.")),
                    "{name}: unquoted schema"
                );
            }
            let batches: Vec<String> = crate::migrate::MIGRATIONS
                .iter()
                .flat_map(|(_, _, sql)| crate::migrate::batches(sql, schema))
                .collect();
            assert!(batches.iter().all(|b| !b.contains(&format!(" {schema}."))));
            assert!(
                batches
                    .iter()
                    .any(|b| b.contains(&format!("COL_LENGTH(N'[{schema}].outbox_messages'")))
            );
        }
    }

    #[test]
    fn order_key_expression_matches_the_migration() {
        let squash = |s: &str| s.split_whitespace().collect::<String>();
        let migration = squash(include_str!("../migrations/0003_ordering.sql"));
        let expr = squash(&order_key_expr(
            "partition_key",
            "aggregate_type",
            "aggregate_id",
        ));
        assert!(migration.contains(&format!("order_keyAS{expr}PERSISTED")));
        assert!(migration.contains(&format!("HASHBYTES('SHA2_256',{expr})")));
        let inbox = squash(include_str!("../migrations/0002_inbox.sql"));
        let key = squash(&version_key_expr(
            "consumer",
            "aggregate_type",
            "aggregate_id",
        ));
        assert!(inbox.contains(&format!("key_hashAS{key}PERSISTEDNOTNULL")));
    }

    #[test]
    fn durations_are_clamped_milliseconds() {
        use std::time::Duration;
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), MAX_MILLIS);
        assert!(
            MAX_MILLIS / 1000 < i64::from(i32::MAX),
            "seconds fit DATEADD's int"
        );
        assert_eq!(
            plus_ms("@now", "@P2"),
            "DATEADD(millisecond, CAST((@P2) % 1000 AS int), DATEADD(second, CAST((@P2) / 1000 AS int), @now))"
        );
    }

    #[test]
    fn like_patterns_are_escaped() {
        assert_eq!(like_escape("50%_[x]\\"), "50\\%\\_\\[x]\\\\");
        assert!(FILTER.contains("ESCAPE N'\\'"));
    }
}
