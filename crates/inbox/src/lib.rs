//! # inbox
//!
//! Exactly-once **effects** from at-least-once **delivery**, on any backend that
//! implements the `outboxkit-core` inbox traits (PostgreSQL: `outboxkit_postgres::PgInbox`).
//!
//! - [`Pipeline`]: handlers subscribed to event types, in order, each under its own
//!   consumer name; each handler's success is recorded `(message_id, consumer)` in the
//!   same transaction as its effects, so a retry re-runs only the handlers that have
//!   not succeeded yet.
//! - [`IdempotentConsumer`] (mode 1): plugged into a transport's consumer adapter, it
//!   runs the pipeline per delivery and acks after commit; failures are redelivered up
//!   to a limit, then recorded as consumer dead letters and acked.
//! - [`DurableReceiver`] + [`InboxProcessor`] (mode 2): deliveries are stored and acked
//!   at once; processors claim them with fenced leases and run the pipeline with their
//!   own backoff, attempts, dead state and a reorder window for version gaps.
//! - Stale versions: the last applied `aggregate_version` is tracked per consumer and
//!   aggregate; a stale message is skipped or delivered flagged ([`StalePolicy`]).
//! - [`InboxRetention`]: purges in batches, and warns when the dedup window is shorter than
//!   the redelivery or replay horizon.
//! - [`metrics`]: what the consumers record (processed, duplicates, dead, handler and
//!   end-to-end latency) through the `metrics` facade.
//!
//! ```no_run
//! use std::sync::Arc;
//! use outboxkit_inbox::{ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline, async_trait};
//! use outboxkit_core::wire::IncomingMessage;
//! use outboxkit_postgres::PgInbox;
//!
//! struct Project;
//!
//! #[async_trait]
//! impl Handler<PgInbox> for Project {
//!     async fn handle(&self, conn: &mut sqlx::PgConnection, msg: &IncomingMessage, _: &HandlerContext)
//!         -> Result<(), HandlerError> {
//!         sqlx::query("INSERT INTO projection (id) VALUES ($1)").bind(msg.id).execute(conn).await?;
//!         Ok(())
//!     }
//! }
//!
//! # fn demo(store: PgInbox) -> Result<(), outboxkit_core::OutboxError> {
//! let pipeline = Pipeline::new().on("OrderPlaced", "order-projection", Project);
//! let consumer = IdempotentConsumer::new(Arc::new(store), pipeline, ConsumerConfig::new())?;
//! // RabbitConsumer::run(consumer, shutdown) / NatsConsumer::run(...)
//! # Ok(()) }
//! ```
//!
//! Trace context: each handler runs in an `inbox.handle` span carrying the message id,
//! event type, consumer, tenant, aggregate, version and attempt (never the payload).
//! The message's W3C `traceparent`/`tracestate` is recorded on it (`trace_id`,
//! `parent_span_id`) and, with the default `opentelemetry` feature and a
//! `tracing-opentelemetry` layer installed, becomes the span's OpenTelemetry parent, so
//! the handler joins the producer's trace.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
mod consumer;
mod durable;
mod fault;
mod handler;
pub mod metrics;
#[cfg(feature = "opentelemetry")]
mod otel;
mod pipeline;
mod retention;

/// The attribute of [`Handler`] implementations (`#[outboxkit_inbox::async_trait]`), re-exported
/// so that a program needs no dependency of its own on `async-trait`.
pub use async_trait::async_trait;
pub use consumer::{
    ConsumerConfig, DEFAULT_MAX_DELIVERIES, IdempotentConsumer, UNDECODABLE_CONSUMER,
    UNHANDLED_CONSUMER, UnhandledPolicy,
};
pub use durable::{DurableReceiver, GapPolicy, InboxProcessor, ProcessReport, ProcessorConfig};
pub use handler::{BatchHandlerError, Handler, HandlerContext, HandlerError, StalePolicy};
pub use pipeline::{DEFAULT_MAX_VERSION_JUMP, Pipeline};
pub use retention::{InboxRetention, PurgeReport};
