//! The outbox-core inbox conformance suite (claims, consumer dead letters, version
//! tracking and the durable inbox), run against a real SQL Server, a fresh schema per
//! property: ignored unless run with `--ignored` and `MSSQL_URL` set.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outbox_sqlserver::{MssqlClient, MssqlInbox};

/// An [`MssqlInbox`] over a fresh, migrated schema.
struct MssqlInboxHarness(Arc<MssqlInbox>);

impl InboxHarness for MssqlInboxHarness {
    type Inbox = MssqlInbox;

    fn inbox(&self) -> Arc<MssqlInbox> {
        Arc::clone(&self.0)
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
}

/// A fresh schema on the SQL Server at `MSSQL_URL`.
async fn harness() -> MssqlInboxHarness {
    let outbox = common::fresh_outbox(&common::mssql_url()).await;
    MssqlInboxHarness(Arc::new(outbox.inbox()))
}

outbox_core::inbox_conformance_tests!(
    #[ignore = "needs MSSQL_URL"] harness; dead_letters, versions, durable, aborts
);
