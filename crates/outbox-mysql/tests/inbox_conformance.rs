//! The outboxkit-core inbox conformance suite (claims, consumer dead letters, version
//! tracking, the durable inbox, and aborted transactions: a real deadlock victim), run
//! against the real MariaDB / MySQL, a fresh database per property.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outboxkit_mysql::MySqlInbox;
use sqlx::{AssertSqlSafe, MySqlConnection};
use uuid::Uuid;

/// A [`MySqlInbox`] over a fresh, migrated database (its name; dropped with the
/// guard).
struct MySqlInboxHarness(
    Arc<MySqlInbox>,
    String,
    #[allow(dead_code)] // reason: held for its Drop
    common::DropDatabase,
);

impl InboxHarness for MySqlInboxHarness {
    type Inbox = MySqlInbox;

    fn inbox(&self) -> Arc<MySqlInbox> {
        Arc::clone(&self.0)
    }
}

#[async_trait]
impl AbortingHarness for MySqlInboxHarness {
    /// Makes `conn` a real deadlock victim (see `common::make_deadlock_victim`).
    async fn swallow_a_failed_statement(&self, conn: &mut MySqlConnection) {
        common::make_deadlock_victim(conn, &self.1, self.0.pool()).await;
    }

    async fn write_effect(&self, conn: &mut MySqlConnection, id: Uuid) -> bool {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO `{}`.effects (message_id) VALUES (?)",
            self.1
        )))
        .bind(id)
        .execute(conn)
        .await
        .is_ok()
    }

    async fn effect_committed(&self, id: Uuid) -> bool {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{}`.effects WHERE message_id = ?",
            self.1
        )))
        .bind(id)
        .fetch_one(self.0.pool())
        .await
        .expect("effects")
            > 0
    }
}

async fn harness() -> MySqlInboxHarness {
    let (outbox, guard) = common::fresh_outbox().await;
    let s = outbox.schema().to_owned();
    common::create_deadlock_probe(outbox.pool(), &s).await;
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE `{s}`.effects (message_id BINARY(16) NOT NULL) ENGINE = InnoDB"
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    MySqlInboxHarness(Arc::new(outbox.inbox()), s, guard)
}

outboxkit_core::inbox_conformance_tests!(harness; dead_letters, versions, durable, aborts);
