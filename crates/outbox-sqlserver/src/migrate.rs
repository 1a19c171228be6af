//! Versioned migrations into the configured schema.
//!
//! Migrations are SQL files compiled into the crate, split into batches at lines that
//! hold only `GO` (as `sqlcmd` does: some DDL must start its own batch). Each migration
//! runs once, in its own transaction, under an exclusive application lock
//! (`sp_getapplock`, transaction-owned, one per schema name) so several processes may
//! call [`migrate`] at start-up, and is recorded in `{schema}.outbox_schema_migrations`.

use outboxkit_core::OutboxError;

use crate::connection::MssqlPool;
use crate::error::db;
use crate::sql::quoted_schema;

/// (version, description, SQL with `{schema}` placeholders and `GO` batch separators).
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
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
        "crash-loop guard: unfinished_claims",
        include_str!("../migrations/0004_crash_loop_guard.sql"),
    ),
    (
        5,
        "archive tables: outbox_messages_archive, inbox_records_archive",
        include_str!("../migrations/0005_archive.sql"),
    ),
    (
        6,
        "crash-loop guard isolation: unfinished_alone",
        include_str!("../migrations/0006_crash_loop_isolation.sql"),
    ),
    (
        7,
        "relay heartbeats: outbox_relays",
        include_str!("../migrations/0007_relays.sql"),
    ),
    (
        8,
        "the polling relay's held rows: held_for and its index",
        include_str!("../migrations/0008_held.sql"),
    ),
];

/// The highest migration version this crate knows. Versions 1 to 3 match the PostgreSQL
/// backend's; 4 is its 6 (the crash-loop guard), 5 its 4 (the archive tables of
/// `outbox purge --archive`), 6 its 8 (the crash-loop guard's isolation), 7 its 10
/// (relay heartbeats) and 8 its 13 (held rows); PostgreSQL's 5 (HOT claims), 7 and 9
/// (NOTIFY), 11 (autovacuum) and 12 (the WAL relay) have no SQL Server counterpart.
pub const LATEST_VERSION: i32 = 8;

/// Takes the migration lock (waiting up to 60 s) and creates the schema when missing.
/// `@P1` lock resource, `@P2` schema name (validated; quoted again with QUOTENAME).
/// (`EXEC (...)` accepts only variables and literals, hence `@ddl`.)
pub(crate) const LOCK_AND_CREATE_SCHEMA: &str = "DECLARE @r int, @ddl nvarchar(300);
EXEC @r = sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 60000;
IF @r < 0
BEGIN
    RAISERROR (N'outbox migrate: could not take the migration lock within 60 s', 16, 1);
    RETURN;
END;
IF SCHEMA_ID(@P2) IS NULL
BEGIN
    SET @ddl = N'CREATE SCHEMA ' + QUOTENAME(@P2);
    EXEC (@ddl);
END;";

/// The migration's batches with `{schema}` replaced by the bracket-quoted schema:
/// the text split at lines holding only `GO` (any case, surrounding blanks ignored),
/// empty batches dropped.
pub(crate) fn batches(sql: &str, schema: &str) -> Vec<String> {
    let quoted = quoted_schema(schema);
    let mut out = Vec::new();
    let mut current = String::new();
    for line in sql.lines() {
        if line.trim().eq_ignore_ascii_case("go") {
            out.push(std::mem::take(&mut current));
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    out.push(current);
    out.into_iter()
        .filter(|b| {
            b.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"))
        })
        .map(|b| b.replace("{schema}", &quoted))
        .collect()
}

/// Creates `schema` if needed and applies every migration not yet applied. Returns the
/// versions applied by this call.
///
/// # Errors
/// [`OutboxError::Config`] for an invalid schema name, [`OutboxError::Database`] when a
/// statement fails (that migration is rolled back), or [`OutboxError::Config`] when the
/// database already has a newer version than this crate knows.
pub(crate) async fn migrate(pool: &MssqlPool, schema: &str) -> Result<Vec<i32>, OutboxError> {
    crate::config::validate_schema(schema)?;
    let q = quoted_schema(schema);
    let resource = format!("outbox-migrate:{schema}");
    let mut applied = Vec::new();
    for &(version, description, sql) in MIGRATIONS {
        let mut conn = pool.checkout("migrate").await?;
        conn.begin_transaction().await.map_err(db("migrate"))?;
        conn.execute(LOCK_AND_CREATE_SCHEMA, &[&resource.as_str(), &schema])
            .await
            .map_err(db("migrate"))?;
        conn.simple_query(format!(
            "IF OBJECT_ID(N'{q}.outbox_schema_migrations', N'U') IS NULL
             CREATE TABLE {q}.outbox_schema_migrations (
                 version int NOT NULL CONSTRAINT outbox_schema_migrations_pk PRIMARY KEY,
                 description nvarchar(400) NOT NULL,
                 applied_at datetime2(7) NOT NULL
                     CONSTRAINT outbox_schema_migrations_applied_df DEFAULT SYSUTCDATETIME())"
        ))
        .await
        .map_err(db("migrate"))?
        .into_results()
        .await
        .map_err(db("migrate"))?;
        let newest: Option<i32> = conn
            .simple_query(format!(
                "SELECT MAX(version) FROM {q}.outbox_schema_migrations"
            ))
            .await
            .map_err(db("migrate"))?
            .into_row()
            .await
            .map_err(db("migrate"))?
            .map(|row| row.try_get::<i32, _>(0))
            .transpose()
            .map_err(db("migrate"))?
            .flatten();
        if let Some(newest) = newest.filter(|v| *v > LATEST_VERSION) {
            // The connection is still in flight: dropping it rolls back.
            return Err(OutboxError::Config(format!(
                "schema {schema} is at migration {newest} but this build knows only up to {LATEST_VERSION}"
            )));
        }
        if newest.is_some_and(|v| v >= version) {
            conn.commit_transaction().await.map_err(db("migrate"))?;
            conn.settle();
            continue;
        }
        for batch in batches(sql, schema) {
            conn.simple_query(batch)
                .await
                .map_err(db("migrate"))?
                .into_results()
                .await
                .map_err(db("migrate"))?;
        }
        conn.execute(
            format!(
                "INSERT INTO {q}.outbox_schema_migrations (version, description) VALUES (@P1, @P2)"
            ),
            &[&version, &description],
        )
        .await
        .map_err(db("migrate"))?;
        conn.commit_transaction().await.map_err(db("migrate"))?;
        conn.settle();
        tracing::info!(schema, version, description, "applied outbox migration");
        applied.push(version);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_split_into_batches_with_the_schema_quoted() {
        let all: Vec<String> = MIGRATIONS
            .iter()
            .flat_map(|(_, _, sql)| batches(sql, "t_1"))
            .collect();
        assert!(all.len() >= 8, "GO separates the DDL: {}", all.len());
        for batch in &all {
            assert!(!batch.contains("{schema}"), "{batch}");
            assert!(
                !batch.lines().any(|l| l.trim().eq_ignore_ascii_case("go")),
                "{batch}"
            );
        }
        assert!(
            all.iter()
                .any(|b| b.contains("CREATE TABLE [t_1].outbox_messages"))
        );
        assert_eq!(
            MIGRATIONS.last().map(|m| m.0),
            Some(LATEST_VERSION),
            "LATEST_VERSION names the last migration"
        );
    }

    #[test]
    fn the_schema_tables_carry_the_contract() {
        let outbox = MIGRATIONS[0].2;
        for needle in [
            "payload           nvarchar(max)",
            "ISJSON(N'[' + payload + N']') = 1",
            "ISJSON(headers) = 1",
            "seq               bigint IDENTITY(1, 1)",
            "claim_token       uniqueidentifier",
            "status IN (0, 1, 3, 9)",
            "datetime2(7)",
            "WHERE status = 0",
            "WHERE status = 9",
        ] {
            assert!(outbox.contains(needle), "0001 lacks {needle}");
        }
        let ordering = MIGRATIONS[2].2;
        assert!(ordering.contains("PERSISTED"));
        assert!(ordering.contains("(order_hash, seq)"));
        assert!(ordering.contains("WHERE status IN (0, 9);"));
        assert!(ordering.contains("WHERE status = 3;"));
        // The crash-loop guard's counter: NOT NULL with a named default of 0, added once.
        let guard = batches(MIGRATIONS[3].2, "t_1");
        assert_eq!(guard.len(), 1, "one batch");
        let squashed: String = guard[0].split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            squashed.contains(
                "IF COL_LENGTH(N'[t_1].outbox_messages', N'unfinished_claims') IS NULL \
                 ALTER TABLE [t_1].outbox_messages ADD unfinished_claims int NOT NULL \
                 CONSTRAINT outbox_messages_unfinished_claims_df DEFAULT 0;"
            ),
            "{squashed}"
        );
        // Its isolation's count of claims alone: the same shape, its own constraint name.
        let isolation = batches(MIGRATIONS[5].2, "t_1");
        assert_eq!(isolation.len(), 1, "one batch");
        let squashed: String = isolation[0]
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .flat_map(str::split_whitespace)
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(
            squashed,
            "IF COL_LENGTH(N'[t_1].outbox_messages', N'unfinished_alone') IS NULL \
             ALTER TABLE [t_1].outbox_messages ADD unfinished_alone int NOT NULL \
             CONSTRAINT outbox_messages_unfinished_alone_df DEFAULT 0;"
        );
        assert_eq!(MIGRATIONS[5].0, 6);
        // Every time default is the server's UTC clock.
        for (_, _, sql) in MIGRATIONS {
            assert!(!sql.contains("GETDATE()"), "local time used");
            assert!(!sql.contains("SYSDATETIME()"), "local time used");
        }
    }

    #[test]
    fn the_archive_tables_are_valid_output_into_targets() {
        let archive = batches(MIGRATIONS[4].2, "t_1");
        assert_eq!(archive.len(), 3, "two tables and an index");
        let code: String = archive
            .iter()
            .flat_map(|b| b.lines())
            .filter(|l| !l.trim_start().starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(code.contains("CREATE TABLE [t_1].outbox_messages_archive ("));
        assert!(code.contains("CREATE TABLE [t_1].inbox_records_archive ("));
        assert!(code.contains("ON [t_1].outbox_messages_archive (created_at)"));
        // ON CONFLICT DO NOTHING of the PostgreSQL archive moves.
        assert_eq!(code.matches("WITH (IGNORE_DUP_KEY = ON)").count(), 2);
        // DELETE ... OUTPUT INTO refuses targets with triggers, CHECK constraints or
        // foreign keys.
        for banned in ["CHECK", "FOREIGN KEY", "REFERENCES", "TRIGGER", "IDENTITY"] {
            assert!(!code.contains(banned), "{banned} in an OUTPUT INTO target");
        }
        assert_eq!(code.matches("DEFAULT SYSUTCDATETIME()").count(), 2);
    }

    #[test]
    fn the_lock_statement_is_parameterised() {
        assert!(LOCK_AND_CREATE_SCHEMA.contains("@Resource = @P1"));
        assert!(LOCK_AND_CREATE_SCHEMA.contains("QUOTENAME(@P2)"));
        assert!(
            LOCK_AND_CREATE_SCHEMA.contains("EXEC (@ddl)"),
            "EXEC (...) takes no function calls"
        );
        assert!(LOCK_AND_CREATE_SCHEMA.contains("@LockOwner = 'Transaction'"));
    }
}
