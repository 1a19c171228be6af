//! Shared helpers: every test gets its own schema in the real PostgreSQL.
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;

pub mod rabbit;
#[cfg(feature = "wal")]
pub mod wal;

use async_trait::async_trait;
use outboxkit_core::conformance::Harness;
use outboxkit_core::{NewMessage, OutboxProducer};
use outboxkit_postgres::{PgConfig, PgOutbox};

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Drops test schemas (`t_<uuid>`) migrated more than an hour ago: left behind by
/// earlier runs, never by a test still running. Once per test binary.
async fn sweep_old_schemas(pool: &sqlx::PgPool) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let schemas: Vec<String> = sqlx::query_scalar(
                r"SELECT nspname::text FROM pg_namespace WHERE nspname ~ '^t_[0-9a-f]{32}$'",
            )
            .fetch_all(pool)
            .await
            .unwrap_or_default();
            for schema in schemas {
                let old: Option<bool> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT max(applied_at) < now() - interval '1 hour' FROM {schema}.outbox_schema_migrations"
                )))
                .fetch_one(pool)
                .await
                .ok()
                .flatten();
                if old == Some(true) {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
                        .execute(pool)
                        .await;
                }
            }
        })
        .await;
}

/// A test's outbox over a fresh, migrated schema (derefs to the [`PgOutbox`]); the
/// schema is dropped when it goes out of scope, also when the test panics.
pub type TestOutbox = outboxkit_testkit::pg::InSchema<PgOutbox>;

/// A fresh, migrated schema named `t_<uuid>`, dropped with the returned value.
pub async fn fresh_outbox() -> TestOutbox {
    let outbox = fresh_outbox_kept().await;
    let schema = outbox.schema().to_owned();
    TestOutbox::new(outbox, &database_url(), &schema)
}

/// A fresh, migrated schema named `t_<uuid>` that the caller drops (its own guard).
pub async fn fresh_outbox_kept() -> PgOutbox {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let config = PgConfig::new(database_url())
        .with_schema(&schema)
        .with_max_connections(6);
    let outbox = PgOutbox::connect(&config)
        .await
        .expect("connect to PostgreSQL (is it running? `cargo xtask services`)");
    sweep_old_schemas(outbox.pool()).await;
    outbox.migrate().await.expect("migrate");
    outbox
}

/// Enqueues `messages` in one transaction and commits it (one statement per 1,000).
pub async fn enqueue_committed(outbox: &PgOutbox, messages: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    for chunk in messages.chunks(1000) {
        outbox.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

pub struct PgHarness(pub Arc<PgOutbox>, outboxkit_testkit::pg::DropSchema);

#[async_trait]
impl Harness for PgHarness {
    type Store = PgOutbox;

    fn store(&self) -> Arc<PgOutbox> {
        Arc::clone(&self.0)
    }

    fn store_deleting_sent(&self) -> Arc<PgOutbox> {
        let config = outboxkit_postgres::PgConfig::default()
            .with_schema(self.0.schema())
            .with_sent_retention(outboxkit_core::SentRetention::Delete);
        Arc::new(PgOutbox::new(self.0.pool().clone(), &config).expect("outbox"))
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        enqueue_committed(&self.0, messages).await;
    }

    async fn set_headers_json(&self, id: uuid::Uuid, json: &str) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {}.outbox_messages SET headers = $2::jsonb WHERE id = $1",
            self.0.schema()
        )))
        .bind(id)
        .bind(json)
        .execute(self.0.pool())
        .await
        .expect("set headers");
    }
}

pub async fn harness() -> PgHarness {
    let (outbox, schema) = fresh_outbox().await.into_parts();
    PgHarness(Arc::new(outbox), schema)
}
