//! Versioned migrations into the configured schema.
//!
//! Migrations are SQL files compiled into the crate. Each runs once, in its own
//! transaction, under a transaction-scoped advisory lock (so several processes may call
//! [`migrate`] at start-up), and is recorded in `{schema}.outbox_schema_migrations`.

use outboxkit_core::OutboxError;
// The schema name is validated before it is spliced into any statement.
use sqlx::{AssertSqlSafe, PgPool};

use crate::error::db;
use crate::sql::quoted_schema;

/// (version, description, SQL with `{schema}` placeholders, see [`render`]).
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "outbox_messages and inbox_records",
        include_str!("../migrations/0001_outbox.sql"),
    ),
    (
        2,
        "inbox_versions, inbox_failures, inbox_messages",
        include_str!("../migrations/0002_inbox.sql"),
    ),
    (
        3,
        "ordering key, first_failed_at and the per-key claim indexes",
        include_str!("../migrations/0003_ordering.sql"),
    ),
    (
        4,
        "outbox_messages_archive and inbox_records_archive",
        include_str!("../migrations/0004_archive.sql"),
    ),
    (
        5,
        "claims as HOT updates: partial indexes on phase, fillfactor 50",
        include_str!("../migrations/0005_hot_claims.sql"),
    ),
    (
        6,
        "crash-loop guard: unfinished_claims",
        include_str!("../migrations/0006_crash_loop_guard.sql"),
    ),
    (
        7,
        "push wake-up: NOTIFY outbox after inserts",
        include_str!("../migrations/0007_notify.sql"),
    ),
    (
        8,
        "crash-loop guard isolation: unfinished_alone",
        include_str!("../migrations/0008_crash_loop_isolation.sql"),
    ),
    (
        9,
        "the notification trigger sends nothing while the NOTIFY queue is half full",
        include_str!("../migrations/0009_notify_bound.sql"),
    ),
    (
        10,
        "relay heartbeats: outbox_relays",
        include_str!("../migrations/0010_relays.sql"),
    ),
    (
        11,
        "autovacuum by a fixed dead-row threshold on the claimed tables",
        include_str!("../migrations/0011_autovacuum.sql"),
    ),
    (
        12,
        "the WAL relay's parked rows: parked_until, parked_for and their indexes",
        include_str!("../migrations/0012_parked.sql"),
    ),
    (
        13,
        "the polling relay's held rows: held_for and its index",
        include_str!("../migrations/0013_held.sql"),
    ),
];

/// The highest migration version this crate knows.
pub const LATEST_VERSION: i32 = 13;

/// Creates `schema` if needed and applies every migration not yet applied. Returns the
/// versions applied by this call.
///
/// # Errors
/// [`OutboxError::Config`] for an invalid schema name, [`OutboxError::Database`] when a
/// statement fails (that migration is rolled back), or [`OutboxError::Config`] when the
/// database already has a newer version than this crate knows.
pub(crate) async fn migrate(pool: &PgPool, schema: &str) -> Result<Vec<i32>, OutboxError> {
    crate::config::validate_schema(schema)?;
    // Spliced as an identifier (quoted: `user` is a reserved word); the advisory-lock
    // key below is a value and keeps the plain name.
    let q = quoted_schema(schema);
    let mut applied = Vec::new();
    for &(version, description, sql) in MIGRATIONS {
        let mut tx = pool.begin().await.map_err(db("migrate"))?;
        // One lock per schema name, so parallel migrations of one schema serialize.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("outbox-migrate:{schema}"))
            .execute(&mut *tx)
            .await
            .map_err(db("migrate"))?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {q};
             CREATE TABLE IF NOT EXISTS {q}.outbox_schema_migrations (
                 version integer PRIMARY KEY,
                 description text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now())"
        )))
        .execute(&mut *tx)
        .await
        .map_err(db("migrate"))?;
        let newest: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max(version) FROM {q}.outbox_schema_migrations"
        )))
        .fetch_one(&mut *tx)
        .await
        .map_err(db("migrate"))?;
        if newest.is_some_and(|v| v > LATEST_VERSION) {
            return Err(OutboxError::Config(format!(
                "schema {schema} is at migration {} but this build knows only up to {LATEST_VERSION}",
                newest.unwrap_or_default()
            )));
        }
        if newest.is_some_and(|v| v >= version) {
            continue;
        }
        sqlx::raw_sql(AssertSqlSafe(render(sql, schema)))
            .execute(&mut *tx)
            .await
            .map_err(db("migrate"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {q}.outbox_schema_migrations (version, description) VALUES ($1, $2)"
        )))
        .bind(version)
        .bind(description)
        .execute(&mut *tx)
        .await
        .map_err(db("migrate"))?;
        tx.commit().await.map_err(db("migrate"))?;
        tracing::info!(schema, version, description, "applied outbox migration");
        applied.push(version);
    }
    Ok(applied)
}

/// A migration's SQL for `schema`: every `{schema}` placeholder (tables, and the
/// schema-qualified index names of `DROP INDEX`) becomes the quoted schema name.
fn render(sql: &str, schema: &str) -> String {
    sql.replace("{schema}", &quoted_schema(schema))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_quote_the_schema_everywhere() {
        for &(version, _, sql) in MIGRATIONS {
            let rendered = render(sql, "user");
            assert!(!rendered.contains("{schema}"), "migration {version}");
            // Every schema-qualified name is quoted: no bare `user.` is left.
            let bare = rendered
                .match_indices("user.")
                .filter(|&(i, _)| !rendered[..i].ends_with('"'))
                .count();
            assert_eq!(bare, 0, "migration {version}: {rendered}");
        }
        assert!(
            render(MIGRATIONS[4].2, "user")
                .contains("DROP INDEX IF EXISTS \"user\".outbox_messages_claim_new;")
        );
    }
}
