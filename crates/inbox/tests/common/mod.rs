//! Fixtures shared by the inbox's PostgreSQL tests (`tests/inbox.rs`, per message, and
//! `tests/batch.rs`, batch mode): a fresh schema with an `effects` table, its queries,
//! and versioned messages. Each test binary uses part of it.
#![allow(dead_code)]

use std::sync::Arc;

use outboxkit_core::wire::IncomingMessage;
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

pub(crate) fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub(crate) struct Db {
    pub(crate) inbox: Arc<PgInbox>,
    pub(crate) pool: PgPool,
    pub(crate) schema: String,
    /// Last (fields drop in order): the schema goes with the test.
    _drop: outboxkit_testkit::pg::DropSchema,
}

/// A fresh schema with an `effects` table: one row per handler run that committed,
/// `version` the message's version (or whatever the test's handler records there).
pub(crate) async fn db() -> Db {
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let outbox = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(&schema)
            .with_max_connections(8),
    )
    .await
    .expect("connect to PostgreSQL");
    outbox.migrate().await.expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {schema}.effects (id bigserial PRIMARY KEY, message_id uuid NOT NULL, consumer text NOT NULL, version bigint, stale boolean NOT NULL)"
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    Db {
        inbox: Arc::new(
            PgOutbox::new(
                outbox.pool().clone(),
                &PgConfig::default().with_schema(&schema),
            )
            .expect("outbox")
            .inbox(),
        ),
        pool: outbox.pool().clone(),
        _drop: outboxkit_testkit::pg::DropSchema::new(&database_url(), &schema),
        schema,
    }
}

impl Db {
    /// `(message_id, version, stale)` of `consumer`'s effects, in the order written.
    pub(crate) async fn effects(&self, consumer: &str) -> Vec<(Uuid, Option<i64>, bool)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT message_id, version, stale FROM {}.effects WHERE consumer = $1 ORDER BY id",
            self.schema
        )))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .expect("effects")
    }

    /// How many effects message `id` has, all consumers together.
    pub(crate) async fn effects_of(&self, id: Uuid) -> usize {
        self.effects_all()
            .await
            .iter()
            .filter(|(m, _)| *m == id)
            .count()
    }

    /// `(message_id, consumer)` of every effect, in the order written.
    pub(crate) async fn effects_all(&self) -> Vec<(Uuid, String)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT message_id, consumer FROM {}.effects ORDER BY id",
            self.schema
        )))
        .fetch_all(&self.pool)
        .await
        .expect("effects")
    }

    /// `(attempts, dead)` of the failure record of `(id, consumer)`, if any.
    pub(crate) async fn failures(&self, id: Uuid, consumer: &str) -> Option<(i32, bool)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT attempts, dead_at IS NOT NULL FROM {}.inbox_failures WHERE message_id = $1 AND consumer = $2",
            self.schema
        )))
        .bind(id)
        .bind(consumer)
        .fetch_optional(&self.pool)
        .await
        .expect("failures")
    }
}

/// A new message of `event_type` on aggregate `order`/`aggregate` at `version`.
pub(crate) fn message(event_type: &str, aggregate: &str, version: i64) -> IncomingMessage {
    let mut m = IncomingMessage::new(Uuid::now_v7(), event_type, br#"{"ok":true}"#.to_vec());
    m.aggregate_type = Some("order".into());
    m.aggregate_id = Some(aggregate.into());
    m.aggregate_version = Some(version);
    m
}
