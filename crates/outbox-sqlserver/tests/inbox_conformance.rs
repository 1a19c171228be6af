//! The outboxkit-core inbox conformance suite (claims, consumer dead letters, version
//! tracking and the durable inbox), run against a real SQL Server, a fresh schema per
//! property: ignored unless run with `--ignored` and `MSSQL_URL` set.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use outboxkit_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outboxkit_sqlserver::{MssqlClient, MssqlInbox, MssqlOutbox};
use uuid::Uuid;

/// An [`MssqlInbox`] over a fresh, migrated schema (with a table `effects` for the
/// `aborts` properties).
struct MssqlInboxHarness {
    inbox: Arc<MssqlInbox>,
    outbox: MssqlOutbox,
}

impl InboxHarness for MssqlInboxHarness {
    type Inbox = MssqlInbox;

    fn inbox(&self) -> Arc<MssqlInbox> {
        Arc::clone(&self.inbox)
    }
}

#[async_trait]
impl AbortingHarness for MssqlInboxHarness {
    /// A division by zero under the session's `XACT_ABORT ON`: the error rolls the whole
    /// transaction back at once.
    async fn swallow_a_failed_statement(&self, conn: &mut MssqlClient) {
        let failed = match conn.simple_query("SELECT 1 / 0").await {
            Ok(stream) => stream.into_results().await.map(drop),
            Err(e) => Err(e),
        };
        assert!(failed.is_err(), "the statement fails");
    }

    async fn write_effect(&self, conn: &mut MssqlClient, id: Uuid) -> bool {
        let sql = format!(
            "INSERT INTO [{}].effects (message_id) VALUES (@P1)",
            self.outbox.schema()
        );
        conn.execute(sql, &[&id]).await.is_ok()
    }

    /// Reads past rows another transaction holds (`READPAST`): an uncommitted row is
    /// not counted, and the read does not wait for the test's own open transaction.
    async fn effect_committed(&self, id: Uuid) -> bool {
        let sql = format!(
            "SELECT COUNT(*) FROM [{}].effects WITH (READPAST) WHERE message_id = @P1",
            self.outbox.schema()
        );
        let mut conn = self.outbox.pool().get().await.expect("connection");
        let row = conn
            .query(sql, &[&id])
            .await
            .expect("effects")
            .into_row()
            .await
            .expect("effects")
            .expect("a row");
        row.get::<i32, _>(0).unwrap_or(0) > 0
    }
}

/// A fresh schema on the SQL Server at `MSSQL_URL`.
async fn harness() -> MssqlInboxHarness {
    let outbox = common::fresh_outbox(&common::mssql_url()).await;
    let create = format!(
        "CREATE TABLE [{}].effects (message_id uniqueidentifier NOT NULL)",
        outbox.schema()
    );
    let mut conn = outbox.pool().get().await.expect("connection");
    conn.simple_query(create)
        .await
        .expect("effects table")
        .into_results()
        .await
        .expect("effects table");
    drop(conn);
    MssqlInboxHarness {
        inbox: Arc::new(outbox.inbox()),
        outbox,
    }
}

outboxkit_core::inbox_conformance_tests!(
    #[ignore = "needs MSSQL_URL"] harness; dead_letters, versions, durable, aborts
);
