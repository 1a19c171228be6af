//! # outboxkit-sqlserver
//!
//! The SQL Server backend of the outbox toolkit, on tiberius (TDS over tokio, rustls for
//! TLS, no OpenSSL) with a bb8 pool:
//!
//! - [`MssqlOutbox::migrate`]: versioned migrations of the outbox's and the inbox's
//!   tables into a configurable schema (default `outbox`),
//!   versions 1 to 3 as in the PostgreSQL backend, 4 its 6 (the crash-loop guard), 5 its
//!   4 (the archive tables), 6 its 8 (the crash-loop guard's count of claims alone);
//! - [`MssqlOutbox`]: the [`OutboxProducer`](outboxkit_core::OutboxProducer)
//!   ([`enqueue`](outboxkit_core::OutboxProducer::enqueue) /
//!   [`enqueue_batch`](outboxkit_core::OutboxProducer::enqueue_batch) on the caller's
//!   client inside the caller's transaction), and the [`OutboxStore`](outboxkit_core::OutboxStore) the
//!   dispatcher uses: claims `WITH (ROWLOCK, UPDLOCK, READPAST)` in `(visible_at, seq)`
//!   order, per-key ordered claims that lock each key's head, fenced leases, the
//!   crash-loop guard that claims a suspect alone before it kills it
//!   ([`MssqlConfig::with_crash_loop_limit`]), one-round-trip batch
//!   completion in statements of at most 1,000 rows, every time from `SYSUTCDATETIME()`;
//! - [`MssqlInbox`] ([`MssqlOutbox::inbox`]): the [`InboxStore`](outboxkit_core::InboxStore) (an insert that locks
//!   only its own key inside the consumer's transaction) and the inbox capabilities
//!   ([`VersionTracking`](outboxkit_core::VersionTracking),
//!   [`ConsumerDeadLetters`](outboxkit_core::ConsumerDeadLetters),
//!   [`DurableInbox`](outboxkit_core::DurableInbox));
//! - the operator queries of the `outbox` binary
//!   ([`OutboxAdmin`](outboxkit_core::OutboxAdmin) for [`MssqlOutbox`]: grouped stats,
//!   bounded gauges, reconcile, archiving, consumer-side dead letters and their replay);
//! - [`MssqlTransaction`]: tiberius has no transaction object, so this is one: a pooled
//!   connection with an open transaction that dereferences to the client.
//!
//! Requires SQL Server 2016 or later (or Azure SQL) at database compatibility level 130
//! or higher (`OPENJSON`, `DATEDIFF_BIG`).
//!
//! Exercised against: unit tests of the generated SQL only; this crate has never run
//! against a real SQL Server in this project's CI. `tests/conformance.rs` runs the
//! shared store conformance suite when `MSSQL_URL` is set (its tests are ignored
//! otherwise). See `docs/sqlserver.md` in the repository for setup and guarantees.
//!
//! ```no_run
//! use outboxkit_core::{NewMessage, OutboxProducer};
//! use outboxkit_sqlserver::{MssqlConfig, MssqlOutbox};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = MssqlConfig::new(
//!     "server=tcp:127.0.0.1,1433;user=sa;password=...;TrustServerCertificate=true",
//! );
//! let outbox = MssqlOutbox::connect(&config).await?;
//! outbox.migrate().await?;
//!
//! // A pooled connection with an open transaction (BEGIN TRAN on your own client works
//! // the same: pass that client to `enqueue`).
//! let mut tx = outbox.begin().await?;
//! tx.execute(
//!     "INSERT INTO dbo.orders (id, total_cents) VALUES (@P1, @P2)",
//!     &[&42_i64, &1999_i64],
//! )
//! .await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! outbox.enqueue(&mut tx, &event).await?;
//! tx.commit().await?; // the order and its event commit together, or neither does
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod connection;
mod error;
mod inbox;
mod migrate;
mod ops;
mod sql;
mod store;

pub use config::{DEFAULT_SCHEMA, MssqlConfig};
pub use connection::{
    MssqlClient, MssqlConnection, MssqlConnectionManager, MssqlPool, MssqlTransaction,
    PooledConnection,
};
pub use error::ConnectError;
pub use inbox::MssqlInbox;
pub use migrate::LATEST_VERSION;
pub use ops::MAX_ROWS_PER_STATEMENT;
pub use outboxkit_core::database::{redact_connection_string, redact_database_url};
pub use store::MssqlOutbox;
