//! The outboxkit-core inbox conformance suite (claims, consumer dead letters, version
//! tracking and the durable inbox), run against the real PostgreSQL, a fresh schema per
//! property.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outboxkit_postgres::PgInbox;
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// A [`PgInbox`] over a fresh, migrated schema (with a table `effects` for the
/// `aborts` properties), dropped with the harness.
struct PgInboxHarness {
    inbox: Arc<PgInbox>,
    schema: common::TestOutbox,
}

impl InboxHarness for PgInboxHarness {
    type Inbox = PgInbox;

    fn inbox(&self) -> Arc<PgInbox> {
        Arc::clone(&self.inbox)
    }
}

#[async_trait]
impl AbortingHarness for PgInboxHarness {
    async fn swallow_a_failed_statement(&self, conn: &mut PgConnection) {
        let failed = sqlx::query("SELECT 1 / 0").execute(conn).await;
        assert!(failed.is_err(), "the statement fails");
    }

    async fn write_effect(&self, conn: &mut PgConnection, id: Uuid) -> bool {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id) VALUES ($1)",
            self.schema.schema()
        )))
        .bind(id)
        .execute(conn)
        .await
        .is_ok()
    }

    async fn effect_committed(&self, id: Uuid) -> bool {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {}.effects WHERE message_id = $1)",
            self.schema.schema()
        )))
        .bind(id)
        .fetch_one(self.schema.pool())
        .await
        .expect("effects")
    }
}

async fn harness() -> PgInboxHarness {
    let outbox = common::fresh_outbox().await;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {}.effects (message_id uuid NOT NULL)",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    let inbox = outbox.inbox();
    PgInboxHarness {
        inbox: Arc::new(inbox),
        schema: outbox,
    }
}

outboxkit_core::inbox_conformance_tests!(harness; dead_letters, versions, durable, aborts);
