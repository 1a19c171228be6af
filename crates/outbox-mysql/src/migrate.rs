//! Versioned migrations into the configured database.
//!
//! Migrations are SQL files compiled into the crate. MySQL commits DDL implicitly (a
//! migration cannot be rolled back), so every statement is idempotent
//! (`CREATE … IF NOT EXISTS`) and a migration that failed half-way is simply run again.
//! Migrations of one database are serialized by a named lock (`GET_LOCK`), so several
//! processes may call [`migrate`] at start-up; each applied version is recorded in
//! `{schema}.outbox_schema_migrations`.

use outboxkit_core::OutboxError;
// The schema name is validated before it is spliced into any statement.
use sqlx::{AssertSqlSafe, MySqlPool};

use crate::error::db;
use crate::sql::quoted_schema;

/// (version, description, SQL with `{schema}` placeholders, see [`render`]).
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "outbox_messages, inbox_records and their archives",
        include_str!("../migrations/0001_outbox.sql"),
    ),
    (
        2,
        "inbox_versions, inbox_failures, inbox_messages",
        include_str!("../migrations/0002_inbox.sql"),
    ),
    (
        3,
        "relay heartbeats: outbox_relays",
        include_str!("../migrations/0003_relays.sql"),
    ),
    (
        4,
        "the polling relay's held rows: held_for and its key",
        include_str!("../migrations/0004_held.sql"),
    ),
];

/// The highest migration version this crate knows.
pub const LATEST_VERSION: i32 = 4;

/// How long [`migrate`] waits for another process's migration of the same database, in
/// seconds.
const LOCK_WAIT_SECS: i32 = 60;

/// Creates the database `schema` if needed (`utf8mb4`) and applies every migration not
/// yet applied. Returns the versions applied by this call.
///
/// # Errors
/// [`OutboxError::Config`] for an invalid schema name or when the database already has
/// a newer version than this crate knows; [`OutboxError::Database`] when a statement
/// fails (the migration is not recorded and runs again next time) or the migration lock
/// is not had within 60 s.
pub(crate) async fn migrate(pool: &MySqlPool, schema: &str) -> Result<Vec<i32>, OutboxError> {
    crate::config::validate_schema(schema)?;
    let q = quoted_schema(schema);
    // A named lock belongs to a session: hold one connection throughout.
    let mut conn = pool.acquire().await.map_err(db("migrate"))?;
    let lock = format!("outbox-migrate:{schema}");
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(&lock)
        .bind(LOCK_WAIT_SECS)
        .fetch_one(&mut *conn)
        .await
        .map_err(db("migrate"))?;
    if got != Some(1) {
        return Err(OutboxError::Config(format!(
            "could not take the migration lock of {schema} within {LOCK_WAIT_SECS} s"
        )));
    }
    let result = apply(&mut conn, schema, &q).await;
    let _ = sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut *conn)
        .await;
    result
}

async fn apply(
    conn: &mut sqlx::MySqlConnection,
    schema: &str,
    q: &str,
) -> Result<Vec<i32>, OutboxError> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE DATABASE IF NOT EXISTS {q} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin;
         CREATE TABLE IF NOT EXISTS {q}.outbox_schema_migrations (
             version     INT          NOT NULL PRIMARY KEY,
             description VARCHAR(255) NOT NULL,
             applied_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
         ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4"
    )))
    .execute(&mut *conn)
    .await
    .map_err(db("migrate"))?;
    let newest: Option<i32> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT MAX(version) FROM {q}.outbox_schema_migrations"
    )))
    .fetch_one(&mut *conn)
    .await
    .map_err(db("migrate"))?;
    if newest.is_some_and(|v| v > LATEST_VERSION) {
        return Err(OutboxError::Config(format!(
            "schema {schema} is at migration {} but this build knows only up to {LATEST_VERSION}",
            newest.unwrap_or_default()
        )));
    }
    let mut applied = Vec::new();
    for &(version, description, sql) in MIGRATIONS {
        if newest.is_some_and(|v| v >= version) {
            continue;
        }
        sqlx::raw_sql(AssertSqlSafe(render(sql, schema)))
            .execute(&mut *conn)
            .await
            .map_err(db("migrate"))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {q}.outbox_schema_migrations (version, description) VALUES (?, ?)"
        )))
        .bind(version)
        .bind(description)
        .execute(&mut *conn)
        .await
        .map_err(db("migrate"))?;
        tracing::info!(schema, version, description, "applied outbox migration");
        applied.push(version);
    }
    Ok(applied)
}

/// A migration's SQL for `schema`: every `{schema}` placeholder becomes the backquoted
/// database name.
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
            let bare = rendered
                .match_indices("user.")
                .filter(|&(i, _)| !rendered[..i].ends_with('`'))
                .count();
            assert_eq!(bare, 0, "migration {version}: {rendered}");
        }
        assert_eq!(MIGRATIONS.len(), LATEST_VERSION as usize);
    }
}
