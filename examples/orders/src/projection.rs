//! The demo's consumer: an `inbox` pipeline with one handler that upserts
//! `order_projection`, wrapped to simulate consumer crashes between commit and ack.
//!
//! It also checks the trace context as delivered: every delivery's `traceparent` header
//! (W3C Trace Context) is validated, and the projection row records the trace id that
//! header carried and the trace id of the handler's own `inbox.handle` span, for the
//! reconciliation to compare with the trace recorded when the order was placed.

use std::collections::HashSet;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use outboxkit_core::InboxStore;
use outboxkit_core::async_trait;
use outboxkit_core::consumer::{DeliveryHandler, HandlerDecision};
use outboxkit_core::wire::{IncomingMessage, TRACEPARENT, TraceParent};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};

use crate::OrderPlaced;
use crate::db::{Database, Projection};

/// The inbox consumer name of the projection.
pub(crate) const CONSUMER: &str = "order-projection";

/// Counters the reconciliation reports.
#[derive(Default)]
pub(crate) struct ConsumerCounters {
    pub(crate) deliveries: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) forced_redeliveries: AtomicU64,
    /// Deliveries whose delivered `traceparent` header is a valid W3C traceparent.
    pub(crate) traced: AtomicU64,
    /// Deliveries without a `traceparent` header, or with a malformed one.
    pub(crate) untraced: AtomicU64,
    /// The first such delivery: message id and header value.
    pub(crate) first_untraced: Mutex<Option<(uuid::Uuid, Option<String>)>>,
}

impl ConsumerCounters {
    /// Deliveries whose effect the inbox suppressed.
    pub(crate) fn duplicates(&self) -> u64 {
        self.deliveries.load(Ordering::Relaxed) - self.applied.load(Ordering::Relaxed)
    }
}

/// Upserts the projection row; `times_applied` would show a second application.
struct Project<D> {
    schema: String,
    counters: Arc<ConsumerCounters>,
    database: PhantomData<fn() -> D>,
}

#[async_trait]
impl<D: Database> Handler<D::Inbox> for Project<D> {
    async fn handle(
        &self,
        conn: &mut <D::Inbox as InboxStore>::Connection,
        msg: &IncomingMessage,
        _ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        let event: OrderPlaced = msg.json().map_err(HandlerError::permanent)?;
        // The trace as delivered, and the one this handler runs in (the inbox's
        // `inbox.handle` span, whose parent is the delivered traceparent).
        let delivered_trace_id = delivered_traceparent(msg)
            .and_then(|(_, tp)| tp)
            .map(|tp| format!("{:032x}", tp.trace_id));
        let handler_trace_id = crate::telemetry::trace_id(&tracing::Span::current());
        let row = Projection {
            order: &event,
            event_id: msg.id,
            delivered_trace_id,
            handler_trace_id,
        };
        D::project(conn, &self.schema, row).await?;
        self.counters.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The delivery handler given to the transport: the inbox's idempotent consumer, except
/// that every N-th delivery is committed but answered with a requeue the first time,
/// as if the consumer had crashed before acking (the broker delivers it again).
pub(crate) struct Projector<D: Database> {
    inner: IdempotentConsumer<D::Inbox>,
    redeliver_every: u64,
    counters: Arc<ConsumerCounters>,
    withheld: Mutex<HashSet<uuid::Uuid>>,
}

impl<D: Database> Projector<D> {
    pub(crate) fn new(
        inbox: D::Inbox,
        schema: &str,
        redeliver_every: u64,
        counters: Arc<ConsumerCounters>,
    ) -> Self {
        let pipeline = Pipeline::new().on(
            "OrderPlaced",
            CONSUMER,
            Project::<D> {
                schema: schema.to_owned(),
                counters: Arc::clone(&counters),
                database: PhantomData,
            },
        );
        Self {
            inner: IdempotentConsumer::new(Arc::new(inbox), pipeline, ConsumerConfig::new())
                .expect("the default consumer config is valid"),
            redeliver_every,
            counters,
            withheld: Mutex::new(HashSet::new()),
        }
    }
}

#[async_trait]
impl<D: Database> DeliveryHandler for Projector<D> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        let n = self.counters.deliveries.fetch_add(1, Ordering::Relaxed) + 1;
        let id = msg.id;
        match delivered_traceparent(msg) {
            Some((_, Some(_))) => {
                self.counters.traced.fetch_add(1, Ordering::Relaxed);
            }
            header => {
                self.counters.untraced.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut first) = self.counters.first_untraced.lock() {
                    first.get_or_insert((id, header.map(|(raw, _)| raw.to_owned())));
                }
            }
        }
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

/// The `traceparent` header exactly as the broker delivered it, and its parse (`None`
/// when malformed or all-zero); `None` when the header is absent.
fn delivered_traceparent(msg: &IncomingMessage) -> Option<(&str, Option<TraceParent>)> {
    msg.headers
        .get(TRACEPARENT)
        .map(|raw| (raw.as_str(), TraceParent::parse(raw)))
}
