//! # outboxkit-memory
//!
//! The in-memory reference backend of the outbox toolkit:
//!
//! - [`MemoryOutbox`]: an [`OutboxStore`](outboxkit_core::OutboxStore) (claims with leases
//!   and fencing tokens, per-key ordered claims, the crash-loop guard, every completion
//!   outcome, both sent retentions, dead letters, replay, purge, a push wake-up on
//!   commit) and an [`OutboxProducer`](outboxkit_core::OutboxProducer) on a
//!   [`MemoryOutboxTransaction`] of its own ([`MemoryOutbox::begin`]): enqueued messages
//!   are stored when it commits;
//! - [`MemoryInbox`]: an [`InboxStore`](outboxkit_core::InboxStore) whose transactions
//!   buffer their claims until commit, plus
//!   [`ConsumerDeadLetters`](outboxkit_core::ConsumerDeadLetters) and
//!   [`VersionTracking`](outboxkit_core::VersionTracking);
//! - [`MemoryPublisher`]: an [`EventPublisher`](outboxkit_core::EventPublisher) that records
//!   what it confirms and fails on demand ([`Scripted`] outcomes per message or per
//!   call, rules, a broker that is down, a slow broker, a stated publish timeout);
//! - [`Clock`]: where the stores take `now()` from, following tokio's time by default so
//!   that `tokio::time::pause()` makes leases and backoffs expire in virtual time.
//!
//! ## What it is for
//! Tests of code built on the toolkit without a database or a broker (the dispatcher's
//! own fast tests run on it), examples, and a reference: it passes the same store
//! conformance suite as the SQL backends (`outboxkit_core::store_conformance_tests!`),
//! and its code reads as the contract in plain Rust.
//!
//! ## What it does not promise
//! No durability: everything is lost with the process. No sharing between processes:
//! several dispatchers may share one store only inside one process (clones share the
//! table). One mutex guards each table, so every operation is atomic but none runs in
//! parallel with another; it is not built for throughput.
//!
//! ## Example
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use outboxkit_core::{Dispatcher, DispatcherConfig, MessageStatus, NewMessage, OutboxProducer};
//! use outboxkit_memory::{MemoryOutbox, MemoryPublisher, Scripted};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), outboxkit_core::OutboxError> {
//! let store = MemoryOutbox::new();
//! let publisher = MemoryPublisher::new();
//! let mut tx = store.begin();
//! store
//!     .enqueue_batch(&mut tx, &[
//!         NewMessage::builder("order", "1", "OrderPlaced").payload(&1).build()?,
//!         NewMessage::builder("order", "2", "OrderPlaced").payload(&2).build()?,
//!     ])
//!     .await?;
//! tx.commit()?;
//! // The broker cannot route the first message published.
//! publisher.script([Scripted::Unroutable]);
//!
//! let dispatcher = Dispatcher::new(
//!     Arc::new(store.clone()),
//!     Arc::new(publisher.clone()),
//!     DispatcherConfig::new(),
//! )?;
//! let report = dispatcher.run_batch().await?;
//! assert_eq!((report.published, report.dead), (1, 1));
//! assert_eq!(publisher.published_count(), 1);
//! assert_eq!(store.messages_with_status(MessageStatus::Dead).len(), 1);
//! # Ok(())
//! # }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod clock;
mod inbox;
mod publisher;
mod store;

pub use clock::Clock;
pub use inbox::{MemoryConnection, MemoryInbox, MemoryTransaction};
pub use publisher::{MemoryPublisher, Scripted};
pub use store::{MemoryOutbox, MemoryOutboxTransaction};
