//! The outbox-core inbox conformance suite (claims, consumer dead letters, version
//! tracking and the durable inbox), run against a real SQL Server when `MSSQL_URL` is
//! set, a fresh schema per property; otherwise each property prints that it was skipped
//! and asserts nothing.

mod common;

use std::sync::Arc;

use outbox_core::inbox_conformance::InboxHarness;
use outbox_sqlserver::MssqlInbox;

/// An [`MssqlInbox`] over a fresh, migrated schema.
struct MssqlInboxHarness(Arc<MssqlInbox>);

impl InboxHarness for MssqlInboxHarness {
    type Inbox = MssqlInbox;

    fn inbox(&self) -> Arc<MssqlInbox> {
        Arc::clone(&self.0)
    }
}

/// A fresh schema on the SQL Server at `MSSQL_URL`, or `None` (after printing that
/// `test` was skipped) when it is not set.
async fn harness(test: &str) -> Option<MssqlInboxHarness> {
    let url = common::mssql_url(test)?;
    let outbox = common::fresh_outbox(&url).await;
    let inbox = MssqlInbox::new(outbox.pool().clone(), outbox.schema()).expect("inbox");
    Some(MssqlInboxHarness(Arc::new(inbox)))
}

outbox_core::inbox_conformance_tests!(optional harness; dead_letters, versions, durable);
