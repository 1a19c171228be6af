//! The outbox-core inbox conformance suite (claims, consumer dead letters, version
//! tracking and the durable inbox), run against the real PostgreSQL, a fresh schema per
//! property.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::inbox_conformance::{AbortingHarness, InboxHarness};
use outbox_postgres::PgInbox;
use sqlx::PgConnection;

/// A [`PgInbox`] over a fresh, migrated schema, dropped with the harness.
struct PgInboxHarness {
    inbox: Arc<PgInbox>,
    _schema: common::TestOutbox,
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
}

async fn harness() -> PgInboxHarness {
    let outbox = common::fresh_outbox().await;
    let inbox = outbox.inbox();
    PgInboxHarness {
        inbox: Arc::new(inbox),
        _schema: outbox,
    }
}

outbox_core::inbox_conformance_tests!(harness; dead_letters, versions, durable, aborts);
