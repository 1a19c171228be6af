//! The demo's consumer: an `inbox` pipeline with one handler that upserts
//! `order_projection`, wrapped to simulate consumer crashes between commit and ack.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox::{Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline};
use outbox_core::consumer::{DeliveryHandler, HandlerDecision};
use outbox_core::wire::IncomingMessage;
use outbox_postgres::PgInbox;
use sqlx::{AssertSqlSafe, PgConnection};

use crate::OrderPlaced;

/// The inbox consumer name of the projection.
pub(crate) const CONSUMER: &str = "order-projection";

/// Counters the reconciliation reports.
#[derive(Default)]
pub(crate) struct ConsumerCounters {
    pub(crate) deliveries: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) forced_redeliveries: AtomicU64,
}

impl ConsumerCounters {
    /// Deliveries whose effect the inbox suppressed.
    pub(crate) fn duplicates(&self) -> u64 {
        self.deliveries.load(Ordering::Relaxed) - self.applied.load(Ordering::Relaxed)
    }
}

/// Upserts the projection row; `times_applied` would show a second application.
struct Project {
    schema: String,
    counters: Arc<ConsumerCounters>,
}

#[async_trait]
impl Handler<PgInbox> for Project {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        _ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        let event: OrderPlaced = msg.json().map_err(HandlerError::permanent)?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.order_projection (order_id, customer, total_cents, event_id, projected_at, times_applied)
             VALUES ($1, $2, $3, $4, clock_timestamp(), 1)
             ON CONFLICT (order_id) DO UPDATE SET times_applied = {s}.order_projection.times_applied + 1",
            s = self.schema
        )))
        .bind(event.order_id)
        .bind(&event.customer)
        .bind(event.total_cents)
        .bind(msg.id)
        .execute(&mut *conn)
        .await?;
        self.counters.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The delivery handler given to the transport: the inbox's idempotent consumer, except
/// that every N-th delivery is committed but answered with a requeue the first time,
/// as if the consumer had crashed before acking (the broker delivers it again).
pub(crate) struct Projector {
    inner: IdempotentConsumer<PgInbox>,
    redeliver_every: u64,
    counters: Arc<ConsumerCounters>,
    withheld: Mutex<HashSet<uuid::Uuid>>,
}

impl Projector {
    pub(crate) fn new(
        inbox: PgInbox,
        schema: &str,
        redeliver_every: u64,
        counters: Arc<ConsumerCounters>,
    ) -> Self {
        let pipeline = Pipeline::new().on(
            "OrderPlaced",
            CONSUMER,
            Project {
                schema: schema.to_owned(),
                counters: Arc::clone(&counters),
            },
        );
        Self {
            inner: IdempotentConsumer::new(Arc::new(inbox), pipeline),
            redeliver_every,
            counters,
            withheld: Mutex::new(HashSet::new()),
        }
    }
}

#[async_trait]
impl DeliveryHandler for Projector {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let n = self.counters.deliveries.fetch_add(1, Ordering::Relaxed) + 1;
        let id = msg.id;
        let decision = self.inner.process(msg).await;
        if decision == HandlerDecision::Ack
            && self.redeliver_every > 0
            && n.is_multiple_of(self.redeliver_every)
            && self
                .withheld
                .lock()
                .map(|mut w| w.insert(id))
                .unwrap_or(false)
        {
            self.counters
                .forced_redeliveries
                .fetch_add(1, Ordering::Relaxed);
            return HandlerDecision::Requeue;
        }
        decision
    }
}
