//! # outboxkit-mysql
//!
//! The MySQL / MariaDB backend of the outbox toolkit, on sqlx (MySQL 8.0+, MariaDB
//! 10.6+: both have `FOR UPDATE SKIP LOCKED`):
//!
//! - [`MySqlOutbox::migrate`]: versioned migrations of the outbox's and the inbox's
//!   tables into a configurable database (MySQL's
//!   "schema", default `outbox`), InnoDB tables in `utf8mb4`, times as `DATETIME(6)`
//!   in UTC from the database clock, ids as `BINARY(16)`;
//! - [`MySqlOutbox`]: the [`OutboxProducer`](outboxkit_core::OutboxProducer)
//!   ([`enqueue`](outboxkit_core::OutboxProducer::enqueue) /
//!   [`enqueue_batch`](outboxkit_core::OutboxProducer::enqueue_batch) on the caller's
//!   transaction: multi-row `INSERT`, chunked), and the [`OutboxStore`](outboxkit_core::OutboxStore)
//!   the dispatcher uses: claims with `SELECT … FOR UPDATE SKIP LOCKED` in
//!   `(visible_at, seq)` order under `READ COMMITTED` (no gap locks, so claims never
//!   block producers' inserts), fenced leases, one-statement batch completion
//!   (`UPDATE … JOIN JSON_TABLE(…)`), backoff as `NOW(6) + INTERVAL` in SQL;
//! - [`MySqlInbox`] ([`MySqlOutbox::inbox`]): the [`InboxStore`](outboxkit_core::InboxStore) (`INSERT IGNORE` on the
//!   primary key inside the consumer's transaction), consumer dead letters, version
//!   tracking and the durable inbox.
//!
//! MySQL has no push notification: relays poll (the dispatcher's adaptive polling, as
//! on SQL Server). See `docs/mysql.md` for what differs from PostgreSQL.
//!
//! ```no_run
//! use outboxkit_core::{NewMessage, OutboxProducer};
//! use outboxkit_mysql::{MySqlConfig, MySqlOutbox};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = MySqlOutbox::connect(&MySqlConfig::new("mysql://root@127.0.0.1:3306/test")).await?;
//! outbox.migrate().await?;
//!
//! let mut tx = outbox.begin().await?;
//! sqlx::query("INSERT INTO orders (id, total_cents) VALUES (?, ?)")
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
mod inbox;
mod migrate;
mod ops;
mod sql;
mod store;

pub use config::{DEFAULT_SCHEMA, MySqlConfig, parse_url};
pub use inbox::{MySqlInbox, MySqlInboxTransaction};
pub use migrate::LATEST_VERSION;
pub use store::MySqlOutbox;

/// The MySQL driver this crate is built on, for its types (e.g.
/// [`Transaction`](sqlx::Transaction) from [`MySqlOutbox::begin`],
/// [`MySqlPool`](sqlx::MySqlPool) for [`MySqlOutbox::new`]).
pub use sqlx;
