//! SQL text of the backend, rendered once per database. The database name is validated
//! before it is spliced (backquoted, so a reserved word such as `user` works); every
//! value is a bind parameter.
//!
//! MySQL has no `UPDATE … RETURNING` and no arrays: a claim is a short `READ COMMITTED`
//! transaction (lock candidates with `FOR UPDATE SKIP LOCKED`, update them by id, read
//! them back), and a batch completion passes its rows as one JSON document that
//! `JSON_TABLE` turns into a table joined to the outbox by primary key (one statement,
//! one prepared text whatever the batch size).

use std::sync::Arc;

use sqlx::AssertSqlSafe;

/// `` `schema` ``, for a schema name already checked by `validate_schema` (which admits
/// no backquote).
pub(crate) fn quoted_schema(schema: &str) -> String {
    format!("`{schema}`")
}

/// Wraps pre-rendered SQL for sqlx (cheap: an `Arc` clone).
pub(crate) fn sql(text: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    AssertSqlSafe(Arc::clone(text))
}

/// `?, ?, …` with `n` placeholders (at least one: `IN ()` is not SQL; callers never pass
/// 0).
pub(crate) fn placeholders(n: usize) -> String {
    let mut s = String::with_capacity(n * 3);
    for i in 0..n.max(1) {
        if i > 0 {
            s.push_str(", ");
        }
        s.push('?');
    }
    s
}

/// The statement beginning a claim's or a completion's transaction: `READ COMMITTED`
/// for that transaction only. Under InnoDB's default `REPEATABLE READ` a locking read
/// takes next-key locks (the row and the gap before it) on every index record it
/// scans, so a claim walking the pending index to its end would lock the gap where
/// producers insert new rows and stall their commits; under `READ COMMITTED` it locks
/// only the rows it returns (records that do not match are unlocked at once).
pub(crate) const BEGIN_READ_COMMITTED: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// Columns read back for an [`OutboxMessage`](outboxkit_core::OutboxMessage).
/// The queue lag in seconds over the rows in scope (`NULL`: none is late): the age of
/// the oldest pending row counted from when it became due, `visible_at` (a delayed
/// message is not late before its time), or its first failure when earlier (a row
/// waiting out a retry backoff, or held back for its destination, was due then and is
/// still not out). MySQL's `LEAST` is `NULL` when an argument is, hence the
/// `COALESCE`. Database clock.
pub(crate) const PENDING_LAG_SECS: &str = "TIMESTAMPDIFF(MICROSECOND,
        MIN(CASE WHEN status IN (0, 9)
                  AND LEAST(visible_at, COALESCE(first_failed_at, visible_at)) <= NOW(6)
                 THEN LEAST(visible_at, COALESCE(first_failed_at, visible_at)) END),
        NOW(6)) / 1e6";

pub(crate) const COLUMNS: &str = "m.id, m.seq, m.aggregate_type, m.aggregate_id, \
    m.aggregate_version, m.event_type, m.payload, m.headers, m.tenant_id, m.routing_key, \
    m.partition_key, m.occurred_at, m.created_at, m.visible_at, m.attempts, m.status, \
    m.last_error, m.claim_token, m.lease_until, m.sent_at, m.unfinished_claims, \
    m.unfinished_alone, m.order_key";

/// The optional-filter predicate shared by dead-letter listing and replay (bound by
/// `bind_filter`: ids as a JSON array of hex strings, from, to, tenant, aggregate type,
/// aggregate id, event type, error text escaped by [`like_escape`]; each twice, once
/// for its `IS NULL` test).
pub(crate) const FILTER: &str = "(? IS NULL OR JSON_CONTAINS(?, JSON_QUOTE(LOWER(HEX(m.id)))))
    AND (? IS NULL OR m.created_at >= ?)
    AND (? IS NULL OR m.created_at < ?)
    AND (? IS NULL OR m.tenant_id = ?)
    AND (? IS NULL OR m.aggregate_type = ?)
    AND (? IS NULL OR m.aggregate_id = ?)
    AND (? IS NULL OR m.event_type = ?)
    AND (? IS NULL OR LOWER(m.last_error) LIKE CONCAT('%', LOWER(?), '%') ESCAPE '!')";

/// `text` escaped for `LIKE … ESCAPE '!'`, so that an error filter matches its text
/// literally: the wildcards `%` and `_` and the escape character `!` itself are preceded
/// by `!` (not `\`, whose meaning in a string literal depends on `sql_mode`).
pub(crate) fn like_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len() + 2);
    for c in text.chars() {
        if matches!(c, '!' | '%' | '_') {
            escaped.push('!');
        }
        escaped.push(c);
    }
    escaped
}

/// The JSON table of a batch completion: `$[*]` objects with `i` the id and `t` the
/// claim token (32 hex digits each), `s` the target status, `d` the delay in
/// microseconds, `e` the error text (absent: none), `r` 1 for a release, `h` the
/// destination a held row waits for (absent: not held).
const COMPLETIONS: &str = "JSON_TABLE(?, '$[*]' COLUMNS (
        i CHAR(32) PATH '$.i', t CHAR(32) PATH '$.t', s INT PATH '$.s',
        d BIGINT PATH '$.d', e TEXT PATH '$.e', r INT PATH '$.r',
        h VARCHAR(255) PATH '$.h')) u";

/// The `visible_at` of a held row: past every claim's walk (DATETIME has no infinity).
pub(crate) const HELD_VISIBLE_AT: &str = "'9999-12-31 00:00:00'";

#[derive(Debug)]
pub(crate) struct Queries {
    pub(crate) table: String,
    pub(crate) claim_candidates: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) get: Arc<str>,
    pub(crate) stats: Arc<str>,
    pub(crate) dead_letters: Arc<str>,
    pub(crate) replay_count: Arc<str>,
    pub(crate) replay: Arc<str>,
    pub(crate) purge_sent: Arc<str>,
    pub(crate) blocked_keys: Arc<str>,
    /// One held row of destination `?` to try, lowest `seq` first, locked (skipping
    /// locked rows); with the second parameter 1 (per-key order) only a row that heads
    /// its key (and with the third 1, no earlier Dead row of its key).
    pub(crate) held_trial: Arc<str>,
    /// Releases up to `?` held rows of destination `?` (parameters: destination,
    /// limit), lowest `seq` first.
    pub(crate) release_held: Arc<str>,
    /// The destinations that hold rows after `?`, at most `?` (a loose index scan of
    /// `outbox_messages_held_for`).
    pub(crate) held_destinations: Arc<str>,
    pub(crate) inbox_claim: Arc<str>,
    pub(crate) inbox_purge: Arc<str>,
}

impl Queries {
    pub(crate) fn new(schema: &str) -> Self {
        let q = quoted_schema(schema);
        let t = format!("{q}.outbox_messages");
        let inbox = format!("{q}.inbox_records");
        let s = |text: String| -> Arc<str> { text.into() };
        Self {
            // Claimable rows in claim order, locked, skipping rows other claimers hold
            // (the pending index: phase, visible_at, seq).
            claim_candidates: s(format!(
                "SELECT m.id, m.status, m.unfinished_alone FROM {t} m
                  WHERE m.phase = 0 AND m.visible_at <= NOW(6)
                    AND (m.status = 0 OR m.lease_until < NOW(6))
                  ORDER BY m.visible_at, m.seq LIMIT ? FOR UPDATE SKIP LOCKED"
            )),
            // Every completion of a batch in one statement, each row fenced by its claim
            // token (Processing under that token, else unchanged); `completed_token`
            // takes the call's nonce (the second parameter), which says afterwards which
            // were applied.
            complete: s(format!(
                "UPDATE {t} m JOIN {COMPLETIONS} ON m.id = UNHEX(u.i)
                    SET m.attempts = CASE WHEN u.r = 1 THEN GREATEST(m.attempts - 1, 0) ELSE m.attempts END,
                        m.visible_at = CASE WHEN u.h IS NOT NULL THEN {HELD_VISIBLE_AT}
                                            WHEN u.s = 0 AND u.r = 0
                                            THEN NOW(6) + INTERVAL u.d MICROSECOND
                                            ELSE m.visible_at END,
                        m.held_for = u.h,
                        m.last_error = COALESCE(u.e, m.last_error),
                        m.first_failed_at = CASE WHEN u.e IS NULL THEN m.first_failed_at
                                                 ELSE COALESCE(m.first_failed_at, NOW(6)) END,
                        m.sent_at = CASE WHEN u.s = 1 THEN NOW(6) END,
                        m.lease_until = NULL,
                        m.claim_token = NULL,
                        m.completed_token = ?,
                        m.unfinished_claims = 0,
                        m.unfinished_alone = 0,
                        m.status = u.s
                  WHERE m.claim_token = UNHEX(u.t) AND m.status = 9"
            )),
            get: s(format!("SELECT {COLUMNS} FROM {t} m WHERE m.id = ?")),
            stats: s(format!(
                "SELECT COUNT(CASE WHEN status = 0 THEN 1 END),
                        COUNT(CASE WHEN status = 9 THEN 1 END),
                        COUNT(CASE WHEN status = 1 THEN 1 END),
                        COUNT(CASE WHEN status = 3 THEN 1 END),
                        {PENDING_LAG_SECS}
                   FROM {t}"
            )),
            dead_letters: s(format!(
                "SELECT {COLUMNS} FROM {t} m WHERE m.phase = 3 AND {FILTER}
                  ORDER BY m.created_at, m.seq LIMIT ?"
            )),
            replay_count: s(format!("SELECT COUNT(*) FROM {t} m WHERE m.phase = 3 AND {FILTER}")),
            replay: s(format!(
                "UPDATE {t} m
                    SET m.attempts = 0, m.visible_at = NOW(6), m.lease_until = NULL,
                        m.claim_token = NULL, m.unfinished_claims = 0, m.unfinished_alone = 0,
                        m.status = 0
                  WHERE m.phase = 3 AND {FILTER}"
            )),
            // MySQL refuses a subquery on the table a DELETE deletes from; ORDER BY …
            // LIMIT on the DELETE itself walks the sent index. `SKIP LOCKED` has no
            // place in a DELETE: the rows are Sent, no relay holds them.
            purge_sent: s(format!(
                "DELETE FROM {t}
                  WHERE phase = 1 AND sent_at <= NOW(6) - INTERVAL ? MICROSECOND
                  ORDER BY phase, sent_at, seq LIMIT ?"
            )),
            // Keys whose head (first unfinished row, Dead included) is Dead or waiting
            // out a retry backoff.
            blocked_keys: s(format!(
                "SELECT h.order_key, h.id, h.seq, h.status, h.attempts, h.last_error,
                        h.first_failed_at, CASE WHEN h.status = 0 THEN h.visible_at END AS retry_at,
                        (SELECT COUNT(*) FROM {t} w
                          WHERE w.phase = 0 AND w.order_key = h.order_key AND w.seq > h.seq) AS waiting
                   FROM {t} h
                   JOIN (SELECT k.order_key,
                                (SELECT MIN(p.seq) FROM {t} p
                                  WHERE p.phase IN (0, 3) AND p.order_key = k.order_key) AS head_seq
                           FROM (SELECT d.order_key FROM {t} d WHERE d.phase = 3
                                 UNION
                                 SELECT f.order_key FROM {t} f
                                  WHERE f.phase = 0 AND f.status = 0 AND f.visible_at > NOW(6)
                                    AND f.attempts > 0) k) hk
                     ON h.seq = hk.head_seq
                  WHERE h.status = 3 OR (h.status = 0 AND h.attempts > 0 AND h.visible_at > NOW(6))
                  ORDER BY h.first_failed_at IS NULL, h.first_failed_at, h.seq
                  LIMIT ?"
            )),
            held_trial: s(format!(
                "SELECT m.id FROM {t} m
                  WHERE m.held_for = ? AND m.phase = 0 AND m.status = 0
                    AND (? = 0 OR (
                         NOT EXISTS (SELECT 1 FROM {t} p
                                      WHERE p.phase = 0 AND p.order_key = m.order_key
                                        AND p.seq < m.seq)
                         AND NOT (? = 1 AND EXISTS (
                             SELECT 1 FROM {t} x
                              WHERE x.phase = 3 AND x.order_key = m.order_key
                                AND x.seq < m.seq))))
                  ORDER BY m.held_for, m.seq LIMIT 1 FOR UPDATE SKIP LOCKED"
            )),
            release_held: s(format!(
                "UPDATE {t} SET visible_at = NOW(6), held_for = NULL
                  WHERE held_for = ? AND phase = 0 AND status = 0
                  ORDER BY held_for, seq LIMIT ?"
            )),
            held_destinations: s(format!(
                "SELECT DISTINCT held_for FROM {t} WHERE held_for > ?
                  ORDER BY held_for LIMIT ?"
            )),
            // `INSERT IGNORE` on the primary key: 1 row inserted, or 0 for a duplicate.
            // A concurrent claim of the same pair waits on the first one's uncommitted
            // index record and sees the duplicate once it commits. (IGNORE also turns
            // a too-long value into a warning: consumer names are checked before.)
            inbox_claim: s(format!(
                "INSERT IGNORE INTO {inbox} (message_id, consumer) VALUES (?, ?)"
            )),
            inbox_purge: s(format!(
                "DELETE FROM {inbox}
                  WHERE processed_at <= NOW(6) - INTERVAL ? MICROSECOND
                  ORDER BY processed_at LIMIT ?"
            )),
            table: t,
        }
    }
}

/// A duration in whole microseconds (the resolution of `DATETIME(6)`), saturating.
pub(crate) fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_skip_locked_rows_and_completions_are_fenced() {
        let q = Queries::new("outbox");
        assert!(q.claim_candidates.contains("FOR UPDATE SKIP LOCKED"));
        assert!(q.claim_candidates.contains("ORDER BY m.visible_at, m.seq"));
        assert!(
            q.complete
                .contains("WHERE m.claim_token = UNHEX(u.t) AND m.status = 9")
        );
        // MySQL evaluates single-table assignments left to right: status goes last.
        assert!(q.complete.trim_end().contains("m.status = u.s\n"));
    }

    #[test]
    fn schemas_are_quoted_and_error_filters_escaped() {
        let q = Queries::new("user");
        assert!(q.get.contains("`user`.outbox_messages"));
        assert!(q.inbox_claim.contains("`user`.inbox_records"));
        assert_eq!(like_escape("50%_a!b"), "50!%!_a!!b");
        assert_eq!(placeholders(3), "?, ?, ?");
    }
}
