//! # outboxkit-postgres
//!
//! The PostgreSQL backend of the outbox toolkit, on sqlx:
//!
//! - [`PgOutbox::migrate`]: versioned migrations of the outbox's and the inbox's tables
//!   into a configurable schema (default `outbox`);
//! - [`PgOutbox`]: the [`OutboxProducer`](outboxkit_core::OutboxProducer)
//!   ([`enqueue`](outboxkit_core::OutboxProducer::enqueue) /
//!   [`enqueue_batch`](outboxkit_core::OutboxProducer::enqueue_batch) on the caller's
//!   transaction), and the [`OutboxStore`](outboxkit_core::OutboxStore) the
//!   dispatcher uses, with a push wake-up (`LISTEN`/`NOTIFY`) the dispatcher starts itself: claims with `FOR UPDATE SKIP LOCKED` in `(visible_at, seq)` order,
//!   fenced leases, one-statement batch completion, backoff as `now() + delay` in SQL.
//!   Claims change no indexed column and find room on their page, so PostgreSQL
//!   performs them as heap-only-tuple (HOT) updates (migration 5: partial indexes on
//!   the generated `phase` column, `fillfactor = 50`);
//! - [`PgInbox`] ([`PgOutbox::inbox`]): the [`InboxStore`](outboxkit_core::InboxStore)
//!   (`ON CONFLICT DO NOTHING` inside the consumer's transaction).
//!
//! ```no_run
//! use outboxkit_core::{NewMessage, OutboxProducer};
//! use outboxkit_postgres::{PgConfig, PgOutbox};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = PgOutbox::connect(&PgConfig::new("postgres://postgres@127.0.0.1/test")).await?;
//! outbox.migrate().await?;
//!
//! let mut tx = outbox.begin().await?;
//! sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, $2)")
//!     .bind(42_i64).bind(1999_i64)
//!     .execute(&mut *tx).await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! outbox.enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // the order and its event commit together, or neither does
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod floor;
mod inbox;
mod listen;
mod migrate;
mod ops;
mod sql;
mod store;
#[cfg(feature = "wal")]
#[cfg_attr(docsrs, doc(cfg(feature = "wal")))]
pub mod wal;

pub use config::{DEFAULT_SCHEMA, PgConfig, parse_url};
pub use inbox::PgInbox;
pub use listen::{KEEPALIVE_INTERVAL, NOTIFY_CHANNEL, OUTAGE_WAKE_INTERVAL};
pub use migrate::LATEST_VERSION;
pub use store::PgOutbox;

/// The PostgreSQL driver this crate is built on, for its types (e.g.
/// [`Transaction`](sqlx::Transaction) from [`PgOutbox::begin`], [`PgPool`](sqlx::PgPool)
/// for [`PgOutbox::new`]), as the transports re-export `lapin` and `async-nats`.
pub use sqlx;
