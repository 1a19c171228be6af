//! SQL text of the backend, rendered once per schema. The schema name is validated
//! before it is spliced (double-quoted, so a reserved word such as `user` works); every
//! value is a bind parameter.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

/// `"schema"`, for a schema name already checked by `validate_schema` (which admits no
/// `"`). Quoting keeps a reserved word (`user`, `select`) an identifier; a lower-case
/// name quoted means the same schema as unquoted. Only where the schema is an
/// identifier: where it is a value (`nspname = $1`, advisory-lock keys) it stays as is.
pub(crate) fn quoted_schema(schema: &str) -> String {
    format!("\"{schema}\"")
}

/// Columns read back for an [`OutboxMessage`](outboxkit_core::OutboxMessage).
pub(crate) const COLUMNS: &str = "m.id, m.seq, m.aggregate_type, m.aggregate_id, m.aggregate_version, \
    m.event_type, m.payload::text AS payload, m.headers, m.tenant_id, m.routing_key, \
    m.partition_key, m.occurred_at, m.created_at, m.visible_at, m.attempts, m.status, \
    m.last_error, m.claim_token, m.lease_until, m.sent_at";

/// The optional-filter predicate shared by dead-letter listing and replay
/// (`$1` ids, `$2` from, `$3` to, `$4` tenant, `$5` aggregate type, `$6` aggregate id,
/// `$7` event type, `$8` error text, escaped by [`like_escape`]).
const FILTER: &str = "m.phase = 3
    AND ($1::uuid[] IS NULL OR m.id = ANY($1))
    AND ($2::timestamptz IS NULL OR m.created_at >= $2)
    AND ($3::timestamptz IS NULL OR m.created_at < $3)
    AND ($4::text IS NULL OR m.tenant_id = $4)
    AND ($5::text IS NULL OR m.aggregate_type = $5)
    AND ($6::text IS NULL OR m.aggregate_id = $6)
    AND ($7::text IS NULL OR m.event_type = $7)
    AND ($8::text IS NULL OR m.last_error ILIKE '%' || $8 || '%' ESCAPE E'\\\\')";

/// The claim statement shared by the outbox and the durable inbox (same columns and
/// status codes): New and visible, or Processing with an expired lease, oldest
/// `(visible_at, seq)` first, skipping rows locked by concurrent claimers; times come
/// from the database clock only.
///
/// Both kinds are found by one walk of the pending index (`phase = 0`, migration 5): a
/// Processing row stays in it (its `visible_at` has passed) and its lease is checked on
/// the row, so the walk also passes over the rows in flight (at most `concurrency ×
/// batch_size` per relay). In exchange the update changes no indexed column, and
/// PostgreSQL makes it a heap-only-tuple update: no index entries, and with the
/// table's fillfactor the new version on the same page. The chosen ids are updated
/// through `id = ANY(ARRAY(...))`, a primary-key lookup, so the cost does not grow with
/// the table (a join let the planner hash the whole table).
/// `$1` batch size, `$2` lease in seconds, `$3` claim token; with `guard` (the
/// outbox's claim), `$4` the crash-loop limit (see [`claim_set`]) and `$5` the claim
/// floor, the `visible_at` the walk starts at (`NULL`: the start of the index; see
/// [`crate::floor`]).
fn claim_statement(table: &str, returning: &str, guard: bool) -> String {
    if !guard {
        return format!(
            "UPDATE {table} m
                SET {PLAIN_CLAIM_SET}
              WHERE m.id = ANY(ARRAY(
                    SELECT c.id FROM {table} c
                     WHERE c.phase = 0 AND c.visible_at <= now()
                       AND (c.status = 0 OR c.lease_until < now())
                     ORDER BY c.visible_at, c.seq LIMIT $1 FOR UPDATE SKIP LOCKED))
             RETURNING {returning}"
        );
    }
    // The crash-loop guard's isolation: of the claimable rows (locked in claim order),
    // the first alone when it is a suspect (status 9: Processing with an expired lease,
    // its last claim ended without an outcome), otherwise every one that is not.
    format!(
        "WITH candidates AS (
             SELECT c.id, c.status, c.visible_at, c.seq FROM {table} c
              WHERE c.phase = 0 AND c.visible_at <= now()
                AND c.visible_at >= COALESCE($5, '-infinity'::timestamptz)
                AND (c.status = 0 OR c.lease_until < now())
              ORDER BY c.visible_at, c.seq LIMIT $1 FOR UPDATE SKIP LOCKED
         ), first AS (
             SELECT id, status FROM candidates ORDER BY visible_at, seq LIMIT 1
         )
         UPDATE {table} m
            SET {set}
          WHERE m.id = ANY(ARRAY(
                SELECT id FROM first WHERE status = 9
                UNION ALL
                SELECT id FROM candidates
                 WHERE status = 0 AND NOT EXISTS (SELECT 1 FROM first WHERE status = 9)))
         RETURNING {returning}",
        set = claim_set("$4")
    )
}

/// The queue lag in seconds over the rows in scope (`NULL`: none is late): the age of
/// the oldest pending row counted from when it became due, `visible_at` (a delayed
/// message is not late before its time), or its first failure when earlier (a row
/// waiting out a retry backoff, or held back for its destination, was due then and is
/// still not out; `LEAST` ignores a `NULL` `first_failed_at`). Database clock.
pub(crate) const PENDING_LAG_SECS: &str = "extract(epoch FROM now() - min(LEAST(visible_at, first_failed_at))
             FILTER (WHERE status IN (0, 9) AND LEAST(visible_at, first_failed_at) <= now()))::float8";

/// A claim's assignments without the crash-loop guard (the durable inbox).
/// `$2` lease in seconds, `$3` claim token.
const PLAIN_CLAIM_SET: &str = "status = 9,
                lease_until = now() + make_interval(secs => $2),
                claim_token = $3,
                attempts = m.attempts + 1";

/// A claim's assignments with the crash-loop guard, `limit` being the parameter that
/// holds the crash-loop limit. A row claimed while it is a suspect (`m.status = 9`: the
/// old value, Processing with an expired lease) is claimed alone (the statements make
/// sure of it) and counts one more claim alone without an outcome; one already claimed
/// alone `limit` times without an outcome is moved to Dead instead, with a `last_error`
/// that says so. Any other row becomes Processing under the claim, one more claim
/// without an outcome. Every branch leaves the indexed columns alone for a claimed row
/// (its `phase` stays 0), so the claim is still a HOT update; only a row moved to Dead
/// changes its index entries. `$2` lease in seconds, `$3` claim token.
fn claim_set(limit: &str) -> String {
    let dead = format!("(m.status = 9 AND m.unfinished_alone >= {limit})");
    format!(
        "status = CASE WHEN {dead} THEN 3 ELSE 9 END,
                lease_until = CASE WHEN {dead} THEN NULL ELSE now() + make_interval(secs => $2) END,
                claim_token = CASE WHEN {dead} THEN NULL ELSE $3 END,
                attempts = CASE WHEN {dead} THEN m.attempts ELSE m.attempts + 1 END,
                unfinished_claims = CASE WHEN {dead} THEN m.unfinished_claims ELSE m.unfinished_claims + 1 END,
                unfinished_alone = CASE WHEN {dead} OR m.status <> 9 THEN m.unfinished_alone
                                        ELSE m.unfinished_alone + 1 END,
                last_error = CASE WHEN {dead}
                    THEN 'suspected crash loop: claimed alone ' || m.unfinished_alone
                         || ' times without an outcome (' || m.unfinished_claims
                         || ' claims without an outcome in all; each relay holding it stopped, crashed or lost its lease before recording one); replay it once the cause is fixed'
                    ELSE m.last_error END,
                first_failed_at = CASE WHEN {dead} THEN COALESCE(m.first_failed_at, now()) ELSE m.first_failed_at END"
    )
}

/// Whether a row may be claimed now: New and visible, or Processing with an expired
/// lease (database clock).
const CLAIMABLE: &str =
    "((p.status = 0 AND p.visible_at <= now()) OR (p.status = 9 AND p.lease_until < now()))";

/// The per-key claim of [`Ordering::PerKey`](outboxkit_core::Ordering) mode.
/// `$1` batch size, `$2` lease in seconds, `$3` claim token, `$4` whether Dead blocks,
/// `$5` the round-robin cursor (the last key claimed before; `''` at first), `$6` the
/// crash-loop limit (see [`claim_set`]).
///
/// 1. `keys`: the distinct keys with pending (New or Processing) messages, walked as a
///    loose index scan of `outbox_messages_key_pending` (one probe per key, never a
///    scan of the rows), starting after the cursor and wrapping around to it. The walk
///    is lazy: it stops once `$1` free keys are found, so its cost is the number of keys
///    passed over (held by other claims, blocked), not the backlog.
/// 2. `heads`: each key's first pending row, kept when claimable and, under `$4`, not
///    preceded by a Dead row of its key (`outbox_messages_key_dead`).
/// 3. `locked`: the heads locked `FOR UPDATE SKIP LOCKED` with the claimability checked
///    again on the latest row version: a key whose head another claimer holds, or took
///    since our snapshot, is skipped. The head lock is the key's mutex.
/// 4. `run_locked`: up to `$1 / keys` of each key's pending rows from its head (under
///    `$4`, only those before the key's next Dead row), locked and read at their latest
///    version; `runs` keeps the prefix that is all claimable (a not-yet-visible row
///    stops the run).
/// 5. The final cut orders by `seq`, so it keeps a prefix of every key's run.
fn claim_ordered_statement(table: &str, returning: &str) -> String {
    let head_claimable = CLAIMABLE.replace("p.", "h.");
    format!(
        "WITH RECURSIVE after_cursor(k) AS (
             SELECT (SELECT p.order_key FROM {table} p
                      WHERE p.phase = 0 AND p.order_key > $5 ORDER BY p.order_key LIMIT 1)
             UNION ALL
             SELECT (SELECT p.order_key FROM {table} p
                      WHERE p.phase = 0 AND p.order_key > a.k ORDER BY p.order_key LIMIT 1)
               FROM after_cursor a WHERE a.k IS NOT NULL
         ), from_start(k) AS (
             SELECT (SELECT p.order_key FROM {table} p
                      WHERE p.phase = 0 ORDER BY p.order_key LIMIT 1)
             UNION ALL
             SELECT (SELECT p.order_key FROM {table} p
                      WHERE p.phase = 0 AND p.order_key > s.k ORDER BY p.order_key LIMIT 1)
               FROM from_start s WHERE s.k <= $5
         ), keys AS (
             SELECT k FROM after_cursor WHERE k IS NOT NULL
             UNION ALL
             SELECT k FROM from_start WHERE k <= $5
         ), heads AS (
             SELECT h.id FROM keys CROSS JOIN LATERAL (
                 SELECT p.id, p.seq, p.status, p.visible_at, p.lease_until FROM {table} p
                  WHERE p.order_key = keys.k AND p.phase = 0
                  ORDER BY p.seq LIMIT 1) h
              WHERE {head_claimable}
                AND NOT ($4 AND EXISTS (
                    SELECT 1 FROM {table} d WHERE d.order_key = keys.k AND d.phase = 3 AND d.seq < h.seq))
              LIMIT $1
         ), locked AS (
             SELECT p.id, p.order_key, p.seq, p.status FROM {table} p
              WHERE p.id = ANY(ARRAY(SELECT id FROM heads)) AND {CLAIMABLE}
              FOR UPDATE SKIP LOCKED
         ), suspect AS (
             SELECT id FROM locked WHERE status = 9 ORDER BY seq LIMIT 1
         ), run_rows AS (
             SELECT r.id FROM locked h CROSS JOIN LATERAL (
                 SELECT p.id FROM {table} p
                  WHERE p.order_key = h.order_key AND p.phase = 0 AND p.seq >= h.seq
                    AND (NOT $4 OR NOT EXISTS (
                        SELECT 1 FROM {table} d
                         WHERE d.order_key = h.order_key AND d.phase = 3
                           AND d.seq > h.seq AND d.seq < p.seq))
                  ORDER BY p.seq
                  LIMIT greatest(1, $1 / greatest(1, (SELECT count(*) FROM locked)))) r
              WHERE NOT EXISTS (SELECT 1 FROM suspect)
         ), run_locked AS (
             SELECT p.id, p.seq, p.order_key, {CLAIMABLE} AND p.status = 0 AS ok FROM {table} p
              WHERE p.id = ANY(ARRAY(SELECT id FROM run_rows))
              FOR UPDATE
         ), runs AS (
             SELECT id, seq, bool_and(ok) OVER (PARTITION BY order_key ORDER BY seq) AS free
               FROM run_locked
         )
         UPDATE {table} m
            SET {set}
          WHERE m.id = ANY(ARRAY(
                (SELECT id FROM suspect)
                UNION ALL
                (SELECT id FROM runs WHERE free ORDER BY seq LIMIT $1)))
         RETURNING {returning}, m.order_key",
        set = claim_set("$6")
    )
}

/// The completions of a batch as rows `u(id, token, status, delay_secs, error,
/// release, held_for)`: `$1` ids, `$2` claim tokens, `$3` target status codes, `$4` retry
/// delays in seconds, `$5` errors, `$6` whether the outcome is a release, `$7` the
/// destination a held row waits for (`NULL`: not held).
const COMPLETIONS: &str =
    "UNNEST($1::uuid[], $2::uuid[], $3::int2[], $4::float8[], $5::text[], $6::bool[], $7::text[])
                        AS u(id, token, status, delay_secs, error, release, held_for)";

/// Sent completions as rows `u(id, token)`: `$1` ids, `$2` claim tokens.
const SENT_COMPLETIONS: &str = "UNNEST($1::uuid[], $2::uuid[]) AS u(id, token)";

/// The fence of every completion: the row is Processing under the completion's token.
/// `status + 0 = 9` still enforces Processing → * in SQL but keeps the planner from
/// trusting the column's statistics, which are always stale on a queue table (estimated
/// 1 row at Processing): with them it scanned the table, or (with the partial index of
/// migration 1) drove a nested loop over the whole UNNEST for every Processing row,
/// O(batch × in-flight). The primary key lookup per completion is linear.
const FENCE: &str = "m.id = u.id AND m.claim_token = u.token AND m.status + 0 = 9";

/// Records the completions `u` read from `source` (those matching `filter` too), fenced
/// by [`FENCE`], returning the ids applied. A release (Processing → New, no charge)
/// changes no indexed column: a HOT update when its page has room. A held row
/// (`held_for` set: a release that waits for its destination's trial) moves to
/// [`HELD_VISIBLE_AT`], out of every claim's walk, once.
fn completion_update(table: &str, source: &str, filter: &str) -> String {
    format!(
        "UPDATE {table} m
            SET status = u.status,
                attempts = CASE WHEN u.release THEN greatest(m.attempts - 1, 0) ELSE m.attempts END,
                visible_at = CASE WHEN u.held_for IS NOT NULL THEN {HELD_VISIBLE_AT}
                                  WHEN u.status = 0 AND NOT u.release
                                  THEN now() + make_interval(secs => u.delay_secs)
                                  ELSE m.visible_at END,
                held_for = u.held_for,
                last_error = COALESCE(u.error, m.last_error),
                first_failed_at = CASE WHEN u.error IS NULL THEN m.first_failed_at
                                       ELSE COALESCE(m.first_failed_at, now()) END,
                sent_at = CASE WHEN u.status = 1 THEN now() END,
                lease_until = NULL,
                claim_token = NULL,
                unfinished_claims = 0,
                unfinished_alone = 0
           FROM {source}
          WHERE {filter}{FENCE}
         RETURNING m.id"
    )
}

/// The trials of held destinations: for each destination of `$1`, its held row with the
/// lowest `seq`, locked `FOR UPDATE SKIP LOCKED`; with `$4` (per-key order) only a row
/// that heads its key (no earlier pending row, and under `$5` no earlier Dead one).
/// Claimed as [`claim_statement`] claims, and no longer held: visible now, so that a
/// relay that dies holding it leaves an ordinary expired lease. `$2` lease in seconds,
/// `$3` claim token.
fn claim_held_statement(table: &str, returning: &str) -> String {
    format!(
        "UPDATE {table} m
            SET status = 9,
                lease_until = now() + make_interval(secs => $2),
                claim_token = $3,
                attempts = m.attempts + 1,
                unfinished_claims = m.unfinished_claims + 1,
                visible_at = now(),
                held_for = NULL
          WHERE m.id = ANY(ARRAY(
                SELECT h.id FROM UNNEST($1::text[]) AS d(dest) CROSS JOIN LATERAL (
                    SELECT c.id FROM {table} c
                     WHERE c.held_for = d.dest AND c.phase = 0 AND c.status = 0
                       AND (NOT $4 OR (
                            NOT EXISTS (SELECT 1 FROM {table} p
                                         WHERE p.order_key = c.order_key AND p.phase = 0
                                           AND p.seq < c.seq)
                            AND NOT ($5 AND EXISTS (
                                SELECT 1 FROM {table} x
                                 WHERE x.order_key = c.order_key AND x.phase = 3
                                   AND x.seq < c.seq))))
                     ORDER BY c.seq LIMIT 1 FOR UPDATE SKIP LOCKED) h))
         RETURNING {returning}"
    )
}

/// The `visible_at` of a held row: past every claim's walk, and still a time every
/// client decodes (`'infinity'` is not one for chrono, which `get` and the admin
/// listings would fail on).
pub(crate) const HELD_VISIBLE_AT: &str = "'9999-12-31 00:00:00+00'::timestamptz";

#[derive(Debug)]
pub(crate) struct Queries {
    pub(crate) enqueue: Arc<str>,
    pub(crate) claim: Arc<str>,
    /// The oldest pending row's `visible_at` at or above `$1` (`NULL`: any), for the
    /// claim floor.
    pub(crate) claim_floor: Arc<str>,
    pub(crate) claim_ordered: Arc<str>,
    /// See [`claim_held_statement`].
    pub(crate) claim_held: Arc<str>,
    /// Releases up to `$2` held rows of destination `$1`, lowest `seq` first.
    pub(crate) release_held: Arc<str>,
    /// The destinations that hold rows after `$1`, at most `$2`: a loose index scan of
    /// `outbox_messages_held_for` (one probe per destination, never the rows).
    pub(crate) held_destinations: Arc<str>,
    pub(crate) blocked_keys: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) complete_deleting_sent: Arc<str>,
    /// [`Self::complete`] for a batch whose outcomes are all `Sent` (a relay's usual
    /// batch): `$1` ids, `$2` claim tokens; the same fence and the same row afterwards.
    pub(crate) complete_sent: Arc<str>,
    /// [`Self::complete_deleting_sent`] for a batch whose outcomes are all `Sent`.
    pub(crate) delete_sent: Arc<str>,
    pub(crate) get: Arc<str>,
    /// The rows of `$1` (ids), for the WAL relay's read-back.
    #[cfg(feature = "wal")]
    pub(crate) get_many: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) replay_count: Arc<str>,
    pub(crate) replay: Arc<str>,
    pub(crate) purge_sent: Arc<str>,
    pub(crate) inbox_claim: Arc<str>,
    pub(crate) inbox_purge: Arc<str>,
}

/// `text` escaped for `ILIKE ... ESCAPE E'\\'`, so that an error filter matches its text
/// literally: the wildcards `%` and `_` and the escape character `\` itself are
/// preceded by `\`. (`E'\\'` is one backslash whatever `standard_conforming_strings`
/// says.)
pub(crate) fn like_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        if matches!(c, '\\' | '%' | '_') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Wraps pre-rendered SQL for sqlx (cheap: an `Arc` clone).
pub(crate) fn sql(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

impl Queries {
    pub(crate) fn new(schema: &str) -> Self {
        let q = quoted_schema(schema);
        let t = format!("{q}.outbox_messages");
        let inbox = format!("{q}.inbox_records");
        let s = |text: String| -> Arc<str> { text.into() };
        Self {
            // One statement for any number of messages; WITH ORDINALITY keeps `seq` in
            // the caller's order.
            enqueue: s(format!(
                "INSERT INTO {t} (id, aggregate_type, aggregate_id, aggregate_version, event_type,
                     payload, headers, tenant_id, routing_key, partition_key, occurred_at, visible_at)
                 SELECT u.id, u.aggregate_type, u.aggregate_id, u.aggregate_version, u.event_type,
                     u.payload::json, u.headers::jsonb, u.tenant_id, u.routing_key, u.partition_key,
                     COALESCE(u.occurred_at, now()), now() + make_interval(secs => u.delay_secs)
                 FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::int8[], $5::text[], $6::text[],
                             $7::text[], $8::text[], $9::text[], $10::text[], $11::timestamptz[],
                             $12::float8[])
                     WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, aggregate_version,
                         event_type, payload, headers, tenant_id, routing_key, partition_key,
                         occurred_at, delay_secs, ord)
                 ORDER BY u.ord"
            )),
            claim: s(claim_statement(&t, &format!("{COLUMNS}, m.unfinished_claims, m.unfinished_alone"), true)),
            claim_floor: s(format!(
                "SELECT visible_at FROM {t}
                  WHERE phase = 0 AND visible_at >= COALESCE($1, '-infinity'::timestamptz)
                  ORDER BY visible_at, seq LIMIT 1"
            )),
            claim_ordered: s(claim_ordered_statement(&t, &format!("{COLUMNS}, m.unfinished_claims, m.unfinished_alone"))),
            claim_held: s(claim_held_statement(&t, &format!("{COLUMNS}, m.unfinished_claims, m.unfinished_alone"))),
            release_held: s(format!(
                "UPDATE {t} m SET visible_at = now(), held_for = NULL
                  WHERE m.id = ANY(ARRAY(
                        SELECT c.id FROM {t} c
                         WHERE c.held_for = $1 AND c.phase = 0 AND c.status = 0
                         ORDER BY c.seq LIMIT $2 FOR UPDATE SKIP LOCKED))"
            )),
            held_destinations: s(format!(
                "WITH RECURSIVE d(k) AS (
                     SELECT (SELECT c.held_for FROM {t} c WHERE c.held_for > $1
                              ORDER BY c.held_for LIMIT 1)
                     UNION ALL
                     SELECT (SELECT c.held_for FROM {t} c WHERE c.held_for > d.k
                              ORDER BY c.held_for LIMIT 1)
                       FROM d WHERE d.k IS NOT NULL
                 )
                 SELECT k FROM d WHERE k IS NOT NULL LIMIT $2"
            )),
            // Keys whose head (first unfinished row, Dead included) is Dead or waiting out
            // a retry backoff. Candidates: keys with a Dead row, and keys with a retried
            // New row not yet visible (the pending index's future range).
            blocked_keys: s(format!(
                "SELECT h.order_key, h.id, h.seq, h.status, h.attempts, h.last_error,
                        h.first_failed_at, CASE WHEN h.status = 0 THEN h.visible_at END AS retry_at,
                        (SELECT count(*) FROM {t} w
                          WHERE w.order_key = h.order_key AND w.phase = 0 AND w.seq > h.seq) AS waiting
                   FROM (SELECT d.order_key FROM {t} d WHERE d.phase = 3
                         UNION
                         SELECT f.order_key FROM {t} f
                          WHERE f.phase = 0 AND f.status = 0 AND f.visible_at > now() AND f.attempts > 0) k
                   CROSS JOIN LATERAL (
                        SELECT x.* FROM (
                            (SELECT p.* FROM {t} p WHERE p.order_key = k.order_key AND p.phase = 0
                              ORDER BY p.seq LIMIT 1)
                            UNION ALL
                            (SELECT p.* FROM {t} p WHERE p.order_key = k.order_key AND p.phase = 3
                              ORDER BY p.seq LIMIT 1)) x
                         ORDER BY x.seq LIMIT 1) h
                  WHERE h.status = 3 OR (h.status = 0 AND h.attempts > 0 AND h.visible_at > now())
                  ORDER BY h.first_failed_at NULLS LAST, h.seq
                  LIMIT $1"
            )),
            // Completion of a whole batch in one statement, each row fenced by its
            // claim token (SentRetention::Keep).
            complete: s(completion_update(&t, COMPLETIONS, "")),
            // The same under SentRetention::Delete: the Sent completions delete their
            // rows (no new row version, no index entries), the others update as above.
            // `u` is referenced twice, so PostgreSQL materialises it once.
            complete_deleting_sent: s(format!(
                "WITH u AS (SELECT * FROM {COMPLETIONS}),
                 sent AS (DELETE FROM {t} m USING u WHERE u.status = 1 AND {FENCE} RETURNING m.id),
                 other AS ({})
                 SELECT id FROM sent UNION ALL SELECT id FROM other",
                completion_update(&t, "u", "u.status <> 1 AND ")
            )),
            // The common case apart: two arrays to bind and no per-row CASEs. What it
            // writes is what `complete` writes for a Sent outcome (attempts, visible_at,
            // last_error and first_failed_at are left as they are).
            complete_sent: s(format!(
                "UPDATE {t} m
                    SET status = 1, sent_at = now(), lease_until = NULL, claim_token = NULL,
                        unfinished_claims = 0, unfinished_alone = 0
                   FROM {SENT_COMPLETIONS}
                  WHERE {FENCE}
                 RETURNING m.id"
            )),
            delete_sent: s(format!(
                "DELETE FROM {t} m USING {SENT_COMPLETIONS} WHERE {FENCE} RETURNING m.id"
            )),
            get: s(format!("SELECT {COLUMNS} FROM {t} m WHERE m.id = $1")),
            #[cfg(feature = "wal")]
            get_many: s(format!("SELECT {COLUMNS} FROM {t} m WHERE m.id = ANY($1)")),
            stats: s(format!(
                "SELECT count(*) FILTER (WHERE status = 0),
                        count(*) FILTER (WHERE status = 9),
                        count(*) FILTER (WHERE status = 1),
                        count(*) FILTER (WHERE status = 3),
                        {PENDING_LAG_SECS}
                   FROM {t}"
            )),
            dead_letters: s(format!(
                "SELECT {COLUMNS} FROM {t} m WHERE {FILTER} ORDER BY m.created_at, m.seq LIMIT $9"
            )),
            replay_count: s(format!("SELECT count(*) FROM {t} m WHERE {FILTER}")),
            replay: s(format!(
                "UPDATE {t} m
                    SET status = 0, attempts = 0, visible_at = now(), lease_until = NULL,
                        claim_token = NULL, unfinished_claims = 0, unfinished_alone = 0
                  WHERE {FILTER}"
            )),
            purge_sent: s(format!(
                "DELETE FROM {t} WHERE id IN (
                     SELECT id FROM {t}
                      WHERE phase = 1 AND sent_at <= now() - make_interval(secs => $1)
                      ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
            )),
            inbox_claim: s(format!(
                "INSERT INTO {inbox} (message_id, consumer) VALUES ($1, $2)
                 ON CONFLICT (message_id, consumer) DO NOTHING"
            )),
            inbox_purge: s(format!(
                "DELETE FROM {inbox} WHERE (message_id, consumer) IN (
                     SELECT message_id, consumer FROM {inbox}
                      WHERE processed_at <= now() - make_interval(secs => $1)
                      ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_uses_skip_locked_and_the_database_clock() {
        let q = Queries::new("outbox");
        assert!(q.claim.contains("FOR UPDATE SKIP LOCKED"));
        assert!(q.claim.contains("visible_at <= now()"));
        assert!(q.claim.contains("lease_until < now()"));
        // The walk is over the pending index, whose predicate a claim leaves unchanged.
        assert!(q.claim.contains("c.phase = 0 AND c.visible_at <= now()"));
        for complete in [
            &q.complete,
            &q.complete_deleting_sent,
            &q.complete_sent,
            &q.delete_sent,
        ] {
            assert!(complete.contains("m.claim_token = u.token AND m.status + 0 = 9"));
        }
        // Under SentRetention::Delete only a Sent completion deletes, fenced the same way.
        assert!(q.complete_deleting_sent.contains(
            "DELETE FROM \"outbox\".outbox_messages m USING u WHERE u.status = 1 AND m.id = u.id"
        ));
        assert!(
            q.complete_deleting_sent
                .contains("WHERE u.status <> 1 AND m.id = u.id")
        );
        assert!(!q.complete.contains("DELETE"));
        assert!(q.purge_sent.contains("LIMIT $2"));
    }

    #[test]
    fn ordered_claim_locks_heads_and_rechecks_the_latest_version() {
        let q = Queries::new("outbox");
        // The head lock is the key's mutex: skipped when held by another claimer.
        assert!(q.claim_ordered.contains("AND ((p.status = 0 AND p.visible_at <= now()) OR (p.status = 9 AND p.lease_until < now()))\n              FOR UPDATE SKIP LOCKED"));
        // The run is locked and judged at its latest version.
        assert!(
            q.claim_ordered
                .contains("AS ok FROM \"outbox\".outbox_messages p")
        );
        assert!(
            q.claim_ordered
                .contains("bool_and(ok) OVER (PARTITION BY order_key ORDER BY seq)")
        );
        // Keys are walked from the round-robin cursor, wrapping around to it.
        assert!(q.claim_ordered.contains("p.order_key > $5"));
        assert!(q.claim_ordered.contains("WHERE k <= $5"));
        assert!(!q.claim_ordered.contains("clock_timestamp"));
    }

    #[test]
    fn batch_statements_lock_in_the_callers_order() {
        let iq = InboxQueries::new("outbox");
        for text in [
            &iq.claim_batch,
            &iq.claim_batch_unless_dead,
            &iq.version_lock_batch,
            &iq.store_batch,
        ] {
            assert!(text.contains("WITH ORDINALITY"), "{text}");
            assert!(text.contains("ORDER BY u.ord"), "{text}");
        }
        // A consumer dead letter is never claimed.
        assert!(
            iq.claim_batch_unless_dead
                .contains("WHERE u.ord NOT IN (SELECT ord FROM dead)")
        );
        assert!(iq.claim_batch_unless_dead.contains("f.dead_at IS NOT NULL"));
        // Versions only ever go up.
        assert!(
            iq.version_set_batch
                .contains("greatest(coalesce(x.version, u.version), u.version)")
        );
    }

    #[test]
    fn schemas_are_quoted_and_error_filters_escaped() {
        let q = Queries::new("user");
        for text in [
            &q.enqueue,
            &q.claim,
            &q.claim_ordered,
            &q.dead_letters,
            &q.replay,
        ] {
            assert!(text.contains("\"user\".outbox_messages"), "{text}");
            assert!(!text.contains(" user."), "{text}");
        }
        assert!(q.inbox_claim.contains("INSERT INTO \"user\".inbox_records"));
        let iq = InboxQueries::new("select");
        for text in [
            &iq.version_lock,
            &iq.failure,
            &iq.claim,
            &iq.complete,
            &iq.claim_batch,
            &iq.claim_batch_unless_dead,
            &iq.version_lock_batch,
            &iq.version_set_batch,
            &iq.store_batch,
        ] {
            assert!(text.contains("\"select\"."), "{text}");
        }
        assert_eq!(like_escape(r"50%_a\b"), r"50\%\_a\\b");
        assert_eq!(like_escape("plain"), "plain");
        assert!(FILTER.contains(r"ILIKE '%' || $8 || '%' ESCAPE E'\\'"));
    }
}

/// SQL of the inbox capabilities (version tracking, failures, durable inbox).
#[derive(Debug)]
pub(crate) struct InboxQueries {
    pub(crate) claim_unless_dead: Arc<str>,
    pub(crate) claim_batch: Arc<str>,
    pub(crate) claim_batch_unless_dead: Arc<str>,
    pub(crate) version_lock: Arc<str>,
    pub(crate) version_lock_batch: Arc<str>,
    pub(crate) version_set: Arc<str>,
    pub(crate) version_set_batch: Arc<str>,
    pub(crate) store_batch: Arc<str>,
    pub(crate) failure: Arc<str>,
    pub(crate) is_dead: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) store: Arc<str>,
    pub(crate) claim: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) purge_processed: Arc<str>,
}

/// Columns read back for a stored durable-inbox message.
const INBOX_COLUMNS: &str = "m.id, m.event_type, m.source, m.aggregate_type, m.aggregate_id, \
    m.aggregate_version, m.tenant_id, m.partition_key, m.correlation_id, m.causation_id, \
    m.occurred_at, m.traceparent, m.tracestate, m.headers, m.payload, m.received_at, \
    m.attempts, m.claim_token, extract(epoch FROM now() - m.received_at)::float8 AS age_secs";

impl InboxQueries {
    pub(crate) fn new(schema: &str) -> Self {
        let q = quoted_schema(schema);
        let v = format!("{q}.inbox_versions");
        let f = format!("{q}.inbox_failures");
        let t = format!("{q}.inbox_messages");
        let r = format!("{q}.inbox_records");
        let s = |text: String| -> Arc<str> { text.into() };
        Self {
            // The idempotent consumer's one inbox statement per message and handler:
            // skip a consumer dead letter, else claim. `claimed` is 1 for a new record;
            // `dead` says why nothing was inserted when it is 0.
            claim_unless_dead: s(format!(
                "WITH dead AS (
                     SELECT 1 FROM {f}
                      WHERE message_id = $1 AND consumer = $2 AND dead_at IS NOT NULL
                 ), claimed AS (
                     INSERT INTO {r} (message_id, consumer)
                     SELECT $1, $2 WHERE NOT EXISTS (SELECT 1 FROM dead)
                     ON CONFLICT (message_id, consumer) DO NOTHING
                     RETURNING 1
                 )
                 SELECT (SELECT count(*) FROM claimed) AS claimed, EXISTS (SELECT 1 FROM dead) AS dead"
            )),
            // A batch's claims in one statement (`$1` message ids, `$2` consumers: distinct
            // pairs, sorted by the caller). Rows are inserted in that order (`ORDER BY
            // ord`), so two transactions claiming overlapping batches wait for each other
            // on the first shared pair instead of deadlocking. Returns the pairs inserted.
            claim_batch: s(format!(
                "INSERT INTO {r} (message_id, consumer)
                 SELECT u.message_id, u.consumer
                   FROM UNNEST($1::uuid[], $2::text[]) WITH ORDINALITY AS u(message_id, consumer, ord)
                  ORDER BY u.ord
                 ON CONFLICT (message_id, consumer) DO NOTHING
                 RETURNING message_id, consumer"
            )),
            // The batched idempotent consumer's one inbox statement per batch: for each
            // pair (`$1` message ids, `$2` consumers: distinct, sorted by the caller),
            // skip a consumer dead letter, else claim, in `ord` order as `claim_batch`.
            // One row per pair: its `ord`, whether it was claimed, whether it is dead.
            claim_batch_unless_dead: s(format!(
                "WITH u AS (
                     SELECT * FROM UNNEST($1::uuid[], $2::text[]) WITH ORDINALITY AS u(message_id, consumer, ord)
                 ), dead AS (
                     SELECT u.ord FROM u
                       JOIN {f} f ON f.message_id = u.message_id AND f.consumer = u.consumer
                      WHERE f.dead_at IS NOT NULL
                 ), claimed AS (
                     INSERT INTO {r} (message_id, consumer)
                     SELECT u.message_id, u.consumer FROM u
                      WHERE u.ord NOT IN (SELECT ord FROM dead)
                      ORDER BY u.ord
                     ON CONFLICT (message_id, consumer) DO NOTHING
                     RETURNING message_id, consumer
                 )
                 SELECT u.ord, c.message_id IS NOT NULL AS claimed, d.ord IS NOT NULL AS dead
                   FROM u
                   LEFT JOIN claimed c ON c.message_id = u.message_id AND c.consumer = u.consumer
                   LEFT JOIN dead d ON d.ord = u.ord"
            )),
            // The last applied version, its row created if missing and locked until the
            // transaction ends, in one statement: `DO UPDATE` takes the row lock of an
            // existing row (a no-op update), `RETURNING` gives its version either way.
            version_lock: s(format!(
                "INSERT INTO {v} AS x (consumer, aggregate_type, aggregate_id) VALUES ($1, $2, $3)
                 ON CONFLICT (consumer, aggregate_type, aggregate_id)
                    DO UPDATE SET version = x.version
                 RETURNING x.version"
            )),
            version_set: s(format!(
                "UPDATE {v} SET version = greatest(coalesce(version, $4), $4), updated_at = now()
                  WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3"
            )),
            // `version_lock` for a batch's keys (`$1` consumers, `$2` aggregate types, `$3`
            // aggregate ids: distinct, sorted by the caller), locked in that order so that
            // two batches sharing aggregates cannot deadlock.
            version_lock_batch: s(format!(
                "INSERT INTO {v} AS x (consumer, aggregate_type, aggregate_id)
                 SELECT u.consumer, u.aggregate_type, u.aggregate_id
                   FROM UNNEST($1::text[], $2::text[], $3::text[])
                        WITH ORDINALITY AS u(consumer, aggregate_type, aggregate_id, ord)
                  ORDER BY u.ord
                 ON CONFLICT (consumer, aggregate_type, aggregate_id)
                    DO UPDATE SET version = x.version
                 RETURNING x.consumer, x.aggregate_type, x.aggregate_id, x.version"
            )),
            // `version_set` for a batch's keys (distinct; rows locked by
            // `version_lock_batch`).
            version_set_batch: s(format!(
                "UPDATE {v} x
                    SET version = greatest(coalesce(x.version, u.version), u.version), updated_at = now()
                   FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int8[])
                        AS u(consumer, aggregate_type, aggregate_id, version)
                  WHERE x.consumer = u.consumer AND x.aggregate_type = u.aggregate_type
                    AND x.aggregate_id = u.aggregate_id"
            )),
            // One failure more; dead (with the message kept) once attempts reach $5.
            failure: s(format!(
                "INSERT INTO {f} AS x (message_id, consumer, event_type, attempts, last_error, payload, headers, dead_at)
                 VALUES ($1, $2, $3, 1, $4, $6, $7::jsonb, CASE WHEN 1 >= $5 THEN now() END)
                 ON CONFLICT (message_id, consumer) DO UPDATE
                    SET attempts = x.attempts + 1,
                        last_error = EXCLUDED.last_error,
                        last_failed_at = now(),
                        dead_at = coalesce(x.dead_at, CASE WHEN x.attempts + 1 >= $5 THEN now() END)
                 RETURNING attempts, dead_at IS NOT NULL"
            )),
            is_dead: s(format!(
                "SELECT EXISTS (SELECT 1 FROM {f} WHERE message_id = $1 AND consumer = $2 AND dead_at IS NOT NULL)"
            )),
            dead_letters: s(format!(
                "SELECT message_id, consumer, event_type, last_error, attempts, dead_at, coalesce(payload, ''::bytea)
                   FROM {f} WHERE dead_at IS NOT NULL AND ($1::text IS NULL OR consumer = $1)
                  ORDER BY dead_at LIMIT $2"
            )),
            store: s(format!(
                "INSERT INTO {t} (id, event_type, source, aggregate_type, aggregate_id, aggregate_version,
                     tenant_id, partition_key, correlation_id, causation_id, occurred_at, traceparent,
                     tracestate, headers, payload)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::jsonb, $15)
                 ON CONFLICT (id) DO NOTHING"
            )),
            // `store` for a batch (distinct ids, sorted by the caller and inserted in that
            // order, so that two receivers storing overlapping batches cannot deadlock).
            // Returns the ids inserted.
            store_batch: s(format!(
                "INSERT INTO {t} (id, event_type, source, aggregate_type, aggregate_id, aggregate_version,
                     tenant_id, partition_key, correlation_id, causation_id, occurred_at, traceparent,
                     tracestate, headers, payload)
                 SELECT u.id, u.event_type, u.source, u.aggregate_type, u.aggregate_id, u.aggregate_version,
                     u.tenant_id, u.partition_key, u.correlation_id, u.causation_id, u.occurred_at,
                     u.traceparent, u.tracestate, u.headers::jsonb, u.payload
                   FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::int8[],
                               $7::text[], $8::text[], $9::text[], $10::text[], $11::timestamptz[],
                               $12::text[], $13::text[], $14::text[], $15::bytea[])
                        WITH ORDINALITY AS u(id, event_type, source, aggregate_type, aggregate_id,
                            aggregate_version, tenant_id, partition_key, correlation_id, causation_id,
                            occurred_at, traceparent, tracestate, headers, payload, ord)
                  ORDER BY u.ord
                 ON CONFLICT (id) DO NOTHING
                 RETURNING id"
            )),
            claim: s(claim_statement(&t, &format!("{INBOX_COLUMNS}, m.seq"), false)),
            // Outcome codes: 1 done, 0 retry, 3 dead, 10 defer (New without charge).
            complete: s(format!(
                "UPDATE {t} m
                    SET status = CASE WHEN u.kind = 10 THEN 0 ELSE u.kind END,
                        attempts = CASE WHEN u.kind = 10 THEN greatest(m.attempts - 1, 0) ELSE m.attempts END,
                        visible_at = CASE WHEN u.kind IN (0, 10)
                                          THEN now() + make_interval(secs => u.delay_secs)
                                          ELSE m.visible_at END,
                        last_error = coalesce(u.error, m.last_error),
                        processed_at = CASE WHEN u.kind = 1 THEN now() END,
                        lease_until = NULL,
                        claim_token = NULL
                   FROM UNNEST($1::uuid[], $2::uuid[], $3::int2[], $4::float8[], $5::text[])
                        AS u(id, token, kind, delay_secs, error)
                  WHERE m.id = u.id AND m.claim_token = u.token AND m.status + 0 = 9
                 RETURNING m.id"
            )),
            purge_processed: s(format!(
                "DELETE FROM {t} WHERE id IN (
                     SELECT id FROM {t}
                      WHERE phase = 1 AND processed_at <= now() - make_interval(secs => $1)
                      ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
            )),
        }
    }
}
