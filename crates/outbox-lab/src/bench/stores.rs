//! The databases the relay benchmark's phases run on: PostgreSQL always, and MySQL /
//! MariaDB beside it with `--database mysql` (`MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`). A [`BenchStore`] is an outbox store that the
//! phases can create fresh, fill, flush before a timed phase, read back and drop.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use outboxkit_core::{NewMessage, OutboxProducer, OutboxStore, SentRetention};
use outboxkit_mysql::{MySqlConfig, MySqlOutbox};
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::AssertSqlSafe;

use crate::common;

/// The databases `--database` picks: PostgreSQL alone, or MySQL / MariaDB measured beside
/// it in every round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatabaseKind {
    /// PostgreSQL (`DATABASE_URL`).
    Postgres,
    /// MySQL / MariaDB (`MYSQL_URL`), beside PostgreSQL.
    Mysql,
}

/// `MYSQL_URL`, or the local default.
fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A schema (a database on MySQL) of the bench's own: `bench_{tag}_{8 hex digits}`.
fn schema_name(tag: &str) -> String {
    format!(
        "bench_{tag}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// What the phases need of a database beyond the [`OutboxStore`] the dispatcher uses.
#[async_trait]
pub(super) trait BenchStore: OutboxStore + Clone {
    /// Fresh outbox tables in a schema of their own, whose completions treat sent rows
    /// as `retention` says, with no payload limit (`--payload-bytes` chooses the size;
    /// the broker's limit is the one that counts here).
    async fn fresh(tag: &str, retention: SentRetention) -> anyhow::Result<Self>;

    /// Writes `messages` in one transaction, then refreshes the table's statistics.
    async fn load(&self, messages: &[NewMessage]) -> anyhow::Result<()>;

    /// Writes what the database holds in memory to disk, so that the writeback of a
    /// preload does not land in whichever phase comes first.
    async fn flush(&self);

    /// Drops the schema, ignoring errors.
    async fn drop_schema(&self);

    /// Rows of the outbox table: the `Sent` ones, or all.
    async fn rows(&self, sent_only: bool) -> anyhow::Result<i64>;

    /// Commit-to-publish latency of every `Sent` row in milliseconds (database clock:
    /// `sent_at - created_at`).
    async fn sent_latencies_ms(&self) -> anyhow::Result<Vec<f64>>;
}

fn rows_sql(schema: &str, sent_only: bool) -> String {
    let filter = if sent_only { "WHERE status = 1" } else { "" };
    format!("SELECT count(*) FROM {schema}.outbox_messages {filter}")
}

#[async_trait]
impl BenchStore for PgOutbox {
    async fn fresh(tag: &str, retention: SentRetention) -> anyhow::Result<Self> {
        let schema = schema_name(tag);
        let outbox = PgOutbox::connect(
            &PgConfig::new(common::database_url())
                .with_schema(&schema)
                .with_max_connections(8)
                .with_max_payload_bytes(usize::MAX)
                .with_sent_retention(retention),
        )
        .await?;
        outbox.migrate().await?;
        // A bench table lives for seconds: autovacuum starting on it (a preload of
        // 20,000 rows crosses its insert threshold) would land in a random phase of a
        // random round. Production tables keep autovacuum.
        sqlx::query(AssertSqlSafe(format!(
            "ALTER TABLE {schema}.outbox_messages SET (autovacuum_enabled = false)"
        )))
        .execute(outbox.pool())
        .await?;
        Ok(outbox)
    }

    async fn load(&self, messages: &[NewMessage]) -> anyhow::Result<()> {
        let mut tx = self.begin().await?;
        for chunk in messages.chunks(1000) {
            self.enqueue_batch(&mut tx, chunk).await?;
        }
        tx.commit().await?;
        sqlx::query(AssertSqlSafe(format!(
            "ANALYZE {}.outbox_messages",
            self.schema()
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    async fn flush(&self) {
        if let Err(e) = sqlx::query("CHECKPOINT").execute(self.pool()).await {
            eprintln!("note: CHECKPOINT failed ({e}); the setup's writes may land in a phase");
        }
    }

    async fn drop_schema(&self) {
        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema()
        )))
        .execute(self.pool())
        .await;
    }

    async fn rows(&self, sent_only: bool) -> anyhow::Result<i64> {
        Ok(
            sqlx::query_scalar(AssertSqlSafe(rows_sql(self.schema(), sent_only)))
                .fetch_one(self.pool())
                .await?,
        )
    }

    async fn sent_latencies_ms(&self) -> anyhow::Result<Vec<f64>> {
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT extract(epoch FROM sent_at - created_at)::float8 * 1000 FROM {}.outbox_messages WHERE status = 1",
            self.schema()
        )))
        .fetch_all(self.pool())
        .await?)
    }
}

#[async_trait]
impl BenchStore for MySqlOutbox {
    async fn fresh(tag: &str, retention: SentRetention) -> anyhow::Result<Self> {
        let outbox = MySqlOutbox::connect(
            &MySqlConfig::new(mysql_url())
                .with_schema(schema_name(tag))
                .with_max_connections(8)
                .with_max_payload_bytes(usize::MAX)
                .with_sent_retention(retention),
        )
        .await?;
        outbox.migrate().await?;
        Ok(outbox)
    }

    async fn load(&self, messages: &[NewMessage]) -> anyhow::Result<()> {
        let mut tx = self.begin().await?;
        for chunk in messages.chunks(1000) {
            self.enqueue_batch(&mut tx, chunk).await?;
        }
        tx.commit().await?;
        sqlx::query(AssertSqlSafe(format!(
            "ANALYZE TABLE {}.outbox_messages",
            self.schema()
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// InnoDB has no `CHECKPOINT`: its page cleaner flushes dirty pages in the
    /// background, so this waits (at most 10 s) until the buffer pool holds at most 64
    /// (other users of a shared server may keep a few dirty).
    async fn flush(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let dirty: Result<(String, String), _> =
                sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_buffer_pool_pages_dirty'")
                    .fetch_one(self.pool())
                    .await;
            match dirty {
                Ok((_, pages)) if pages.trim().parse::<u64>().is_ok_and(|n| n > 64) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                _ => return,
            }
        }
    }

    async fn drop_schema(&self) {
        let _ = sqlx::query(AssertSqlSafe(format!("DROP DATABASE {}", self.schema())))
            .execute(self.pool())
            .await;
    }

    async fn rows(&self, sent_only: bool) -> anyhow::Result<i64> {
        Ok(
            sqlx::query_scalar(AssertSqlSafe(rows_sql(self.schema(), sent_only)))
                .fetch_one(self.pool())
                .await?,
        )
    }

    async fn sent_latencies_ms(&self) -> anyhow::Result<Vec<f64>> {
        let micros: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, sent_at) FROM {}.outbox_messages WHERE status = 1",
            self.schema()
        )))
        .fetch_all(self.pool())
        .await?;
        Ok(micros.into_iter().map(|us| us as f64 / 1000.0).collect())
    }
}
