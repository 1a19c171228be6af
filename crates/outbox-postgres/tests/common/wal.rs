//! A test's outbox with its replication slot and publication (feature `wal`).
#![allow(dead_code, unreachable_pub)] // reason: each test binary uses a different subset

use std::sync::Arc;

use outboxkit_core::EventPublisher;
use outboxkit_postgres::PgOutbox;
use outboxkit_postgres::wal::{WalConfig, WalRelay, WalRelayConfig, WalRelayStats};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{database_url, enqueue_committed, fresh_outbox_kept};

/// A schema with its slot and publication; drops all three when the test ends.
pub struct WalOutbox {
    pub outbox: PgOutbox,
    pub wal: WalConfig,
}

impl WalOutbox {
    pub async fn new() -> Self {
        let outbox = fresh_outbox_kept().await;
        let wal = WalConfig::new(outbox.schema());
        let this = Self { outbox, wal };
        outboxkit_postgres::wal::setup(&this.outbox, &this.wal)
            .await
            .expect("wal setup (wal_level = logical? `cargo xtask services`)");
        this
    }

    pub fn relay<P: EventPublisher>(
        &self,
        publisher: Arc<P>,
        config: WalRelayConfig,
    ) -> WalRelay<P> {
        WalRelay::new(self.outbox.clone(), self.wal.clone(), publisher, config)
            .expect("valid wal relay config")
    }

    pub fn spawn<P: EventPublisher>(
        &self,
        publisher: Arc<P>,
        config: WalRelayConfig,
        token: &CancellationToken,
    ) -> JoinHandle<WalRelayStats> {
        let relay = self.relay(publisher, config);
        let token = token.clone();
        tokio::spawn(async move { relay.run(token).await.expect("the relay runs") })
    }

    pub async fn enqueue(&self, messages: &[outboxkit_core::NewMessage]) {
        for chunk in messages.chunks(100) {
            enqueue_committed(&self.outbox, chunk).await;
        }
    }
}

impl Drop for WalOutbox {
    fn drop(&mut self) {
        outboxkit_testkit::pg::drop_wal_objects_blocking(
            &database_url(),
            self.wal.slot(),
            self.wal.publication(),
            self.outbox.schema(),
        );
    }
}

/// Publishes through `inner`, but holds the first batch holding `trigger` until
/// `release` is notified (`held` is notified when it starts holding). Its publish
/// timeout is none: the hold is the test's, not an outage.
pub struct HoldBatch<P> {
    inner: P,
    trigger: uuid::Uuid,
    fired: std::sync::atomic::AtomicBool,
    pub held: tokio::sync::Notify,
    pub release: tokio::sync::Notify,
}

impl<P> HoldBatch<P> {
    pub fn new(inner: P, trigger: uuid::Uuid) -> Self {
        Self {
            inner,
            trigger,
            fired: std::sync::atomic::AtomicBool::new(false),
            held: tokio::sync::Notify::new(),
            release: tokio::sync::Notify::new(),
        }
    }
}

#[async_trait::async_trait]
impl<P: EventPublisher> EventPublisher for HoldBatch<P> {
    async fn publish_batch(
        &self,
        messages: &[outboxkit_core::OutboxMessage],
    ) -> Vec<outboxkit_core::PublishOutcome> {
        if messages.iter().any(|m| m.id == self.trigger)
            && !self.fired.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            self.held.notify_one();
            self.release.notified().await;
        }
        self.inner.publish_batch(messages).await
    }

    async fn check_ready(&self) -> Result<(), outboxkit_core::PublishError> {
        self.inner.check_ready().await
    }
}
