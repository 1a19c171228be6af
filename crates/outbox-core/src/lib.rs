//! # outboxkit-core
//!
//! The driver-free heart of the transactional outbox and inbox toolkit:
//!
//! - the message model: [`NewMessage`] (built and validated by the producer),
//!   [`OutboxMessage`] (a stored row) and the [`MessageStatus`] state machine
//!   (New=0 → Processing=9 → Sent=1 / Dead=3);
//! - the required traits: [`OutboxProducer`] (enqueue in the caller's transaction),
//!   [`OutboxStore`] (claim, fenced completion, stats, dead letters, replay, purge, and
//!   the store's push wake-up of the relay), [`OutboxAdmin`] (the operator queries behind the
//!   `outbox` binary), [`InboxStore`] (consumer dedup inside the consumer's
//!   transaction) and [`EventPublisher`] (publish a batch, one [`PublishOutcome`] per
//!   message);
//! - the [`Dispatcher`] (relay) with its [`RetryPolicy`] and circuit breaker;
//! - the [`consumer`] contract every transport's consumer adapter drives
//!   ([`DeliveryHandler`], its batched sibling [`BatchDeliveryHandler`],
//!   [`HandlerDecision`]);
//! - the [`wire`] format shared by the transports (CloudEvents binary mode, W3C Trace
//!   Context);
//! - the [`domain`] events helper;
//! - the [`metrics`] the dispatcher records (names, units, labels), through the
//!   `metrics` facade;
//! - with the `conformance` feature, the store conformance suite (`conformance`) and
//!   the inbox conformance suite (`inbox_conformance`) every backend runs, and the
//!   transport conformance suite (`transport_conformance`) every transport runs against
//!   its broker.
//!
//! Backends (`outboxkit-postgres`) write messages in the caller's transaction; transports
//! (`outboxkit-rabbit`) publish them.
//!
//! **Words.** The *relay* is the role: the process that moves committed outbox rows to
//! the broker (`outbox relay` runs one). [`Dispatcher`] is the type that does it inside
//! that process (or inside your service): it claims batches and dispatches them to the
//! publisher in waves. So "relay" names what runs and "dispatcher" the engine in it;
//! the metrics and logs say `relay`, the API says `Dispatcher`. The three retention
//! settings are named apart: [`SentRetention`] (what the outbox does with confirmed
//! rows), `outboxkit_inbox::InboxRetention` (how long dedup records are kept) and
//! `outboxkit_nats::StreamRetention` (the JetStream stream's retention policy).
//!
//! ```
//! use outboxkit_core::NewMessage;
//!
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .aggregate_version(1)
//!     .tenant_id("acme")
//!     .payload(&serde_json::json!({ "order_id": 42, "total_cents": 1999 }))
//!     .build()?;
//! assert_eq!(event.event_type, "OrderPlaced");
//! # Ok::<(), outboxkit_core::OutboxError>(())
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod consumer;
pub mod database;
pub mod dispatcher;
pub mod domain;
pub mod env;
pub mod error;
pub mod inbox;
pub mod message;
pub mod metrics;
pub mod ordering;
#[cfg(feature = "opentelemetry")]
mod otel;
pub mod producer;
#[cfg(any(test, feature = "proptest"))]
pub mod proptest_support;
pub mod publisher;
pub mod retry;
pub mod store;
pub mod wire;

#[cfg(feature = "conformance")]
pub mod conformance;
#[cfg(feature = "conformance")]
pub mod inbox_conformance;
#[cfg(feature = "conformance")]
pub mod transport_conformance;

pub use admin::{
    GroupStats, InboxDeadFilter, InboxDeadKind, InboxDeadLetter, InboxReplayMode,
    InboxReplayReport, MessageCount, MessageCursor, MessagePage, MessageState, MessageSummary,
    OutboxAdmin, ReconcileRow, RelayHeartbeat, RelaySeen, SentPerMinute, VacuumPressure,
};
/// The attribute of the traits a program implements (`EventPublisher`,
/// `DeliveryHandler`, the inbox's `Handler`), re-exported so that a program needs no
/// dependency of its own on `async-trait` (and names the version the traits use).
pub use async_trait::async_trait;
pub use consumer::{
    BatchDeliveryHandler, BatchSettings, Consumer, DeliveryHandler, HandlerDecision,
    InvalidBatchSettings, TransportKind, UnknownTransport,
};
pub use database::DatabaseKind;
pub use dispatcher::{BatchReport, Dispatcher, DispatcherConfig, DispatcherStats, WakeHandle};
pub use domain::{DomainEvents, EventSource};
pub use env::EnvError;
pub use error::{BoxError, ErrorKind, InvalidMessage, OutboxError, PublishError};
pub use inbox::{
    ConsumerDeadLetter, ConsumerDeadLetters, DurableInbox, FailureCount, InboxClaim,
    InboxCompletion, InboxOutcome, StoredMessage, VersionKey, VersionTracking,
};
pub use message::{
    DEFAULT_MAX_PAYLOAD_BYTES, Headers, MAX_AGGREGATE_ID_LEN, MAX_NAME_LEN, MessageStatus,
    NewMessage, NewMessageBuilder, OutboxMessage, headers_from_json, headers_from_json_lossy,
};
pub use ordering::{BlockedKey, OnDead, OrderKey, Ordering};
pub use producer::OutboxProducer;
pub use publisher::{EventPublisher, PublishOutcome};
pub use retry::{RetryPolicies, RetryPolicy};
pub use store::{
    ClaimedBatch, CompleteReport, Completion, CompletionOutcome, DEFAULT_CRASH_LOOP_LIMIT,
    InboxStore, MessageFilter, OutboxStats, OutboxStore, Poison, PoisonRow, ReplayReport,
    SentRetention, sanitize_error,
};
/// The shutdown signal every `run` of this workspace takes (tokio-util's), re-exported
/// so that a program names the very version the relay and the consumers were built
/// with.
pub use tokio_util::sync::CancellationToken;
