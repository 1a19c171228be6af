//! Shared helpers: every test gets its own schema in the real PostgreSQL.
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;

pub mod rabbit;

use async_trait::async_trait;
use outbox_core::NewMessage;
use outbox_core::conformance::Harness;
use outbox_postgres::{PgConfig, PgOutbox};

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A fresh, migrated schema named `t_<uuid>`.
pub async fn fresh_outbox() -> PgOutbox {
    let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
    let config = PgConfig::new(database_url())
        .with_schema(&schema)
        .with_max_connections(6);
    let outbox = PgOutbox::connect(&config)
        .await
        .expect("connect to PostgreSQL (is it running? `cargo xtask services`)");
    outbox.migrate().await.expect("migrate");
    outbox
}

pub struct PgHarness(pub Arc<PgOutbox>);

#[async_trait]
impl Harness for PgHarness {
    type Store = PgOutbox;

    fn store(&self) -> Arc<PgOutbox> {
        Arc::clone(&self.0)
    }

    async fn enqueue(&self, messages: &[NewMessage]) {
        let mut tx = self.0.pool().begin().await.expect("begin");
        for chunk in messages.chunks(1000) {
            self.0.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
        }
        tx.commit().await.expect("commit");
    }
}

pub async fn harness() -> PgHarness {
    PgHarness(Arc::new(fresh_outbox().await))
}
