//! # outbox
//!
//! The transactional outbox and inbox toolkit in one dependency. Write events in the
//! same database transaction as your business rows, relay them to a broker with
//! confirmation (at-least-once), and consume them with exactly-once effects.
//!
//! The core (`outboxkit-core`: message model, [`Dispatcher`], [`OutboxProducer`] /
//! [`OutboxStore`] / [`InboxStore`] / [`EventPublisher`] traits, retry policy, wire
//! format) is always
//! present and re-exported at the root, so `outboxkit::NewMessage` is
//! `outboxkit_core::NewMessage`. Each database and broker is a cargo feature that adds
//! one module with the backend crate's items (`outboxkit::postgres::PgOutbox` is
//! `outboxkit_postgres::PgOutbox`); these docs show each item under one path:
//!
//! | feature | default | module | what it adds |
//! |---|---|---|---|
//! | `postgres` | yes | [`outboxkit::postgres`](crate::postgres) (`outboxkit-postgres`) | PostgreSQL store and inbox (sqlx): `FOR UPDATE SKIP LOCKED` claims with fenced leases |
//! | `sqlserver` | | [`outboxkit::sqlserver`](crate::sqlserver) (`outboxkit-sqlserver`) | SQL Server store and inbox (tiberius): `READPAST/UPDLOCK/ROWLOCK` claims, an inbox claim that locks only its own key |
//! | `mysql` | | [`outboxkit::mysql`](crate::mysql) (`outboxkit-mysql`) | MySQL 8.0+ / MariaDB 10.6+ store and inbox (sqlx): `FOR UPDATE SKIP LOCKED` claims under `READ COMMITTED`, polling (no push wake-up) |
//! | `rabbit` | yes | [`outboxkit::rabbit`](crate::rabbit) (`outboxkit-rabbit`) | RabbitMQ publisher (AMQP 0-9-1 publisher confirms, mandatory returns) and consumer |
//! | `nats` | | [`outboxkit::nats`](crate::nats) (`outboxkit-nats`) | NATS JetStream publisher (awaits each PubAck; `Nats-Msg-Id` deduplication) and consumer |
//! | `inbox` | | [`outboxkit::inbox`](crate::inbox) (`outboxkit-inbox`) | idempotent consumer, durable inbox processor, handler pipeline |
//! | `opentelemetry` | yes | — | W3C trace context captured at enqueue and made the consumer span's parent (`tracing-opentelemetry`) |
//!
//! With `rabbit` or `nats`, [`AnyPublisher`] and [`AnyConsumer`] are one publisher and
//! one consumer type over the enabled brokers, for programs that choose theirs at run
//! time (from a URL or a setting). With `postgres`, `mysql` or `sqlserver`, [`AnyStore`]
//! is one outbox store ([`OutboxStore`] and [`OutboxAdmin`], with `migrate`) over the
//! enabled databases, picked by the database URL ([`AnyStoreConfig::from_url`] /
//! [`AnyStoreConfig::from_env`]); writing messages and the inbox stay with the concrete
//! store, whose transaction and connection types differ per database.
//!
//! **The environment.** Every store's and transport's `from_env` reads the variables the
//! `outbox` binary reads, with the binary's syntax: `DATABASE_URL` (required; each
//! store refuses another database's URL), `OUTBOX_SCHEMA`, `OUTBOX_SENT_RETENTION`,
//! `OUTBOX_CRASH_LOOP_LIMIT`, `OUTBOX_MAX_PAYLOAD_BYTES` for the stores;
//! `OUTBOX_BROKER_URL` (default: the local broker), `OUTBOX_CONNECT_TIMEOUT`,
//! `OUTBOX_CONFIRM_TIMEOUT`, `OUTBOX_EXCHANGE`, `OUTBOX_DESTINATION_RULES` (RabbitMQ),
//! `OUTBOX_SUBJECT_PREFIX` (NATS) for the transports. A bad value is an
//! [`EnvError`] naming the variable (the table: [`env`](mod@env)).
//!
//! ```toml
//! [dependencies]
//! outboxkit = { version = "0.1", features = ["nats", "inbox"] }            # PostgreSQL (default) + RabbitMQ (default) + NATS + inbox
//! outboxkit = { version = "0.1", default-features = false, features = ["sqlserver", "nats"] }
//! ```
//!
//! Features only add: enabling one never changes what another does. `outboxkit::inbox`
//! always holds the core's inbox traits ([`InboxStore`], [`DurableInbox`], …, also at
//! the root); the `inbox` feature adds the `outboxkit-inbox` crate's consumer, handler pipeline
//! and durable processor to the same module. With `opentelemetry` off no trace context
//! is captured or restored: the backends and transports depend on the core without
//! that feature, so only the facade's feature (or your own dependency on `outboxkit-core`
//! or `inbox` with default features) turns it on.
//!
//! **TLS with `sqlserver`:** tiberius brings rustls's aws-lc-rs provider while sqlx,
//! lapin and async-nats use ring; with both linked, rustls will not choose and the
//! first TLS connection panics. A program enabling `sqlserver` with another backend
//! installs one provider at start, as the `outbox` binary does:
//! `rustls::crypto::ring::default_provider().install_default()`.
//!
//! **Writing events** is the same on every store: [`OutboxProducer`]'s
//! [`enqueue`](OutboxProducer::enqueue) and [`enqueue_batch`](OutboxProducer::enqueue_batch)
//! take the caller's transaction (`&mut tx`), and the messages reach the relay when it
//! commits, or never if it rolls back. **Waking the relay** is the dispatcher's own
//! business: over PostgreSQL it `LISTEN`s for the commits while it runs
//! ([`OutboxStore::spawn_wake_source`], off with
//! [`DispatcherConfig::with_push_wake`]); MySQL and SQL Server have no push, so it polls.
//!
//! ## PostgreSQL and RabbitMQ
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "rabbit"))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::postgres::{PgConfig, PgOutbox};
//! use outboxkit::rabbit::{RabbitConfig, RabbitPublisher};
//! use outboxkit::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
//!
//! let store = PgOutbox::connect(&PgConfig::from_env()?).await?; // DATABASE_URL
//! store.migrate().await?;
//!
//! // Producer: the business rows and their event commit together, or neither does.
//! let mut tx = store.begin().await?;
//! // ... INSERT the order on &mut *tx ...
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! store.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! // Relay: a durable topic exchange, routing key = event type. It LISTENs by itself,
//! // so a commit wakes it at once.
//! let rabbit = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .with_exchange("orders.events");
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## PostgreSQL and NATS JetStream
//!
//! A stream must capture the subjects first: a publish no stream captures is
//! dead-lettered as unroutable.
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "nats"))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::nats::{NatsConfig, NatsPublisher, StreamSetup};
//! use outboxkit::postgres::{PgConfig, PgOutbox};
//! use outboxkit::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
//!
//! let store = PgOutbox::connect(&PgConfig::from_env()?).await?;
//! store.migrate().await?;
//!
//! let mut tx = store.begin().await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! store.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! // Relay: subject = prefix.{routing key or event type}.
//! let nats = NatsConfig::new("nats://127.0.0.1:4222")
//!     .with_subject_prefix("orders.events");
//! let publisher = NatsPublisher::connect(nats.clone()).await?;
//! publisher.ensure_stream(&StreamSetup::for_config("ORDERS", &nats)).await?; // orders.events.>
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## SQL Server and RabbitMQ
//!
//! ```no_run
//! # #[cfg(all(feature = "sqlserver", feature = "rabbit"))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::rabbit::{RabbitConfig, RabbitPublisher};
//! use outboxkit::sqlserver::{MssqlConfig, MssqlOutbox};
//! use outboxkit::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
//!
//! let store = MssqlOutbox::connect(&MssqlConfig::from_env()?).await?; // DATABASE_URL
//! store.migrate().await?;
//!
//! // A pooled connection with an open transaction; it dereferences to the client.
//! let mut tx = store.begin().await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! store.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! let rabbit = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f");
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## MySQL / MariaDB and RabbitMQ
//!
//! ```no_run
//! # #[cfg(all(feature = "mysql", feature = "rabbit"))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::mysql::{MySqlConfig, MySqlOutbox};
//! use outboxkit::rabbit::{RabbitConfig, RabbitPublisher};
//! use outboxkit::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
//!
//! let store = MySqlOutbox::connect(&MySqlConfig::from_env()?).await?; // DATABASE_URL
//! store.migrate().await?;
//!
//! let mut tx = store.begin().await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! store.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! let rabbit = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f");
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! // No push wake-up on MySQL: the dispatcher polls (every `poll_interval`).
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## SQL Server and NATS JetStream
//!
//! ```no_run
//! # #[cfg(all(feature = "sqlserver", feature = "nats"))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::nats::{NatsConfig, NatsPublisher, StreamSetup};
//! use outboxkit::sqlserver::{MssqlConfig, MssqlOutbox};
//! use outboxkit::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
//!
//! let store = MssqlOutbox::connect(&MssqlConfig::from_env()?).await?;
//! store.migrate().await?;
//!
//! let mut tx = store.begin().await?;
//! let event = NewMessage::builder("order", "42", "OrderPlaced")
//!     .payload(&serde_json::json!({ "order_id": 42 }))
//!     .build()?;
//! store.enqueue(&mut tx, &event).await?;
//! tx.commit().await?;
//!
//! let nats = NatsConfig::new("nats://127.0.0.1:4222")
//!     .with_subject_prefix("orders.events");
//! let publisher = NatsPublisher::connect(nats.clone()).await?;
//! publisher.ensure_stream(&StreamSetup::for_config("ORDERS", &nats)).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## The database and the broker chosen at run time
//!
//! ```no_run
//! # #[cfg(all(any(feature = "postgres", feature = "mysql", feature = "sqlserver"), any(feature = "rabbit", feature = "nats")))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::{AnyPublisher, AnyPublisherConfig, AnyStore, AnyStoreConfig};
//! use outboxkit::{Dispatcher, DispatcherConfig, OutboxAdmin as _};
//!
//! // DATABASE_URL: postgres://, mysql:// / mariadb://, mssql:// or an ADO.NET string.
//! let store = AnyStore::connect(AnyStoreConfig::from_env()?).await?;
//! store.migrate().await?;
//! // amqp:// or amqps:// is RabbitMQ, nats:// or tls:// is NATS (default settings).
//! let config = AnyPublisherConfig::from_url("nats://127.0.0.1:4222")?;
//! // Lazy: the relay starts while the broker is down and reports it unready.
//! let publisher = Arc::new(AnyPublisher::connect_lazy(config).await?);
//! Dispatcher::new(Arc::new(store), Arc::clone(&publisher), DispatcherConfig::new())?
//!     .run(shutdown)
//!     .await?;
//! publisher.close().await;
//! # Ok(()) }
//! ```
//!
//! ## Consuming with exactly-once effects
//!
//! With `inbox`: the handler's effect and the inbox record of `(message, handler)`
//! commit in one transaction, then the delivery is acknowledged; a redelivery finds
//! the record and is acknowledged without running the handler again. [`AnyConsumer`]
//! picks the broker from the URL as [`AnyPublisherConfig::from_url`] does
//! ([`AnyConsumerConfig`]: the name, the NATS stream, [`BatchSettings`] for
//! [`Consumer::run_batched`]); a transport's own consumer configuration
//! (`outboxkit::rabbit::RabbitConsumerConfig`, `outboxkit::nats::NatsConsumerConfig`)
//! sets the rest (prefetch, quorum queues, ack wait, …) and converts with `From`.
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "inbox", any(feature = "rabbit", feature = "nats")))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::inbox::{ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline};
//! use outboxkit::postgres::sqlx::{self, PgConnection};
//! use outboxkit::postgres::{PgConfig, PgInbox, PgOutbox};
//! use outboxkit::{AnyConsumer, AnyConsumerConfig, Consumer as _, IncomingMessage};
//!
//! struct Project;
//!
//! #[async_trait::async_trait]
//! impl Handler<PgInbox> for Project {
//!     async fn handle(&self, conn: &mut PgConnection, msg: &IncomingMessage, _: &HandlerContext)
//!         -> Result<(), HandlerError> {
//!         // On the inbox's transaction: the effect commits with the record, or neither.
//!         sqlx::query("INSERT INTO projected (id) VALUES ($1)").bind(msg.id).execute(conn).await?;
//!         Ok(())
//!     }
//! }
//!
//! let inbox = PgOutbox::connect(&PgConfig::from_env()?).await?.inbox();
//! // RabbitMQ: the queue `projection` on the exchange `outbox.events`; NATS: the durable
//! // consumer `projection` on the stream `OUTBOX`. Each created when missing.
//! let config = AnyConsumerConfig::from_url("amqp://guest:guest@127.0.0.1:5672/%2f", "projection")?;
//! let consumer = AnyConsumer::new(config.with_stream("OUTBOX"))?;
//! let pipeline = Pipeline::new().on("OrderPlaced", "projection", Project);
//! consumer.run(IdempotentConsumer::new(Arc::new(inbox), pipeline, ConsumerConfig::new())?, shutdown).await?;
//! # Ok(()) }
//! ```
//!
//! More, each a program to run: `crates/outbox/examples` (publish in a transaction, a
//! relay, exactly-once and batched consumers, per-key ordering, SQL Server).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(
    not(all(
        feature = "postgres",
        feature = "sqlserver",
        feature = "mysql",
        feature = "rabbit",
        feature = "nats",
        feature = "inbox"
    )),
    allow(
        rustdoc::broken_intra_doc_links,
        reason = "the docs link every feature's items; they are built with all features (docs.rs)"
    )
)]

// Every item once in the documentation (issue 47; `cargo xtask release-check` fails
// when `all.html` lists an item under two paths). The core's root items are at the
// root, through this glob. The glob would also bring the core's modules, most of which
// hold root items too (`outboxkit::admin::GroupStats` is `outboxkit::GroupStats`): each
// such module is shadowed below by a module of the same name that re-exports the whole
// core module hidden from the docs (every path keeps compiling) and shows only the
// items that are not at the root. The backends and transports are modules built the
// same way: their own root items, their driver crate as a plain re-export (inlined,
// sqlx would be documented twice, under `postgres::sqlx` and `mysql::sqlx`), without
// the core items they re-export. A name listed in one of these lists and removed from
// its crate fails to compile here; an item added to a crate and to none of these lists
// is usable but missing from the docs: `cargo xtask release-check` reports both kinds.
pub use outboxkit_core::*;

/// The operator queries behind the `outbox` binary: [`OutboxAdmin`] and its types
/// (at the root), and the bounds of its counting queries.
pub mod admin {
    #[doc(hidden)]
    pub use outboxkit_core::admin::*;
    #[doc(inline)]
    pub use outboxkit_core::admin::{DEFAULT_SCAN_BOUND, PENDING_STATS_BOUND};
}

/// The consumer-side contract shared by every transport: [`DeliveryHandler`],
/// [`BatchDeliveryHandler`], [`HandlerDecision`], [`Consumer`] (at the root), and the
/// helpers the transports' consumers drive them with.
pub mod consumer {
    #[doc(hidden)]
    pub use outboxkit_core::consumer::*;
    #[doc(inline)]
    pub use outboxkit_core::consumer::{
        MAX_DEFER_DELAY, defer_delay, drop_undecodable, handle_batch_until_decided,
        handle_until_decided, until_decided,
    };
}

/// Database URLs: [`DatabaseKind`] (at the root) and the redaction of passwords in URLs
/// and connection strings.
pub mod database {
    #[doc(hidden)]
    pub use outboxkit_core::database::*;
    #[doc(inline)]
    pub use outboxkit_core::database::{redact_connection_string, redact_database_url};
}

/// The relay loop: [`Dispatcher`], [`DispatcherConfig`] and their reports (at the root),
/// and the relay's defaults and bounds.
pub mod dispatcher {
    #[doc(hidden)]
    pub use outboxkit_core::dispatcher::*;
    #[doc(inline)]
    pub use outboxkit_core::dispatcher::{
        DEFAULT_DRAIN_TIMEOUT, DEFAULT_MIN_POLL_INTERVAL, MAX_CIRCUITS, RELEASE_CHUNK,
        TRIALS_PER_SECOND, publish_guarded,
    };
}

/// [`DomainEvents`] and [`EventSource`], at the root.
#[doc(hidden)]
pub mod domain {
    pub use outboxkit_core::domain::*;
}

/// The environment variables of the `outbox` binary, read the same way by every store's
/// and transport's `from_env` ([`EnvError`] is at the root).
pub mod env {
    #[doc(hidden)]
    pub use outboxkit_core::env::*;
    #[doc(inline)]
    pub use outboxkit_core::env::{
        DATABASE_URL, DurationError, Env, OUTBOX_BROKER_URL, OUTBOX_CONFIRM_TIMEOUT,
        OUTBOX_CONNECT_TIMEOUT, OUTBOX_CRASH_LOOP_LIMIT, OUTBOX_DESTINATION_RULES, OUTBOX_EXCHANGE,
        OUTBOX_MAX_PAYLOAD_BYTES, OUTBOX_SCHEMA, OUTBOX_SENT_RETENTION, OUTBOX_STREAM,
        OUTBOX_SUBJECT_PREFIX, PairsLookup, ProcessLookup, parse_duration,
    };
}

/// Typed errors ([`OutboxError`], [`ErrorKind`], … at the root) and the redaction of
/// passwords in broker URLs.
pub mod error {
    #[doc(hidden)]
    pub use outboxkit_core::error::*;
    #[doc(inline)]
    pub use outboxkit_core::error::{LoneUserInfo, redact_url};
}

/// [`NewMessage`], [`OutboxMessage`], [`MessageStatus`] and their limits, at the root.
#[doc(hidden)]
pub mod message {
    pub use outboxkit_core::message::*;
}

/// [`OrderKey`], [`Ordering`], [`OnDead`] and [`BlockedKey`], at the root.
#[doc(hidden)]
pub mod ordering {
    pub use outboxkit_core::ordering::*;
}

/// [`OutboxProducer`], at the root.
#[doc(hidden)]
pub mod producer {
    pub use outboxkit_core::producer::*;
}

/// [`EventPublisher`] and [`PublishOutcome`], at the root.
#[doc(hidden)]
pub mod publisher {
    pub use outboxkit_core::publisher::*;
}

/// Retry policies ([`RetryPolicy`], [`RetryPolicies`] at the root) and the backoff of
/// an outage.
pub mod retry {
    #[doc(inline)]
    pub use outboxkit_core::retry::outage_backoff;
    #[doc(hidden)]
    pub use outboxkit_core::retry::*;
}

/// The store traits ([`OutboxStore`], [`InboxStore`] and their types, at the root) and
/// the limits of stored errors and schema names.
pub mod store {
    #[doc(hidden)]
    pub use outboxkit_core::store::*;
    #[doc(inline)]
    pub use outboxkit_core::store::{MAX_ERROR_BYTES, validate_schema};
}

/// The wire format shared by every transport: CloudEvents attributes in binary content
/// mode and W3C Trace Context ([`IncomingMessage`] is at the root).
pub mod wire {
    #[doc(hidden)]
    pub use outboxkit_core::wire::*;
    #[doc(inline)]
    pub use outboxkit_core::wire::{
        Binding, CAUSATION_ID, CONTENT_TYPE_JSON, CORRELATION_ID, DecodeError, MAX_QUOTED_BYTES,
        SPEC_VERSION, TRACEPARENT, TRACESTATE, TraceParent, UndecodableMessage, check_limits,
        encode_headers, format_time, headers_from_pairs,
    };
}

// The core's test suites, their macros and test strategies, for backend and transport
// authors, are `outboxkit_core`'s only: with its `conformance` or `proptest` feature on
// (by another crate of the build), these keep them out of the facade (a local item
// shadows the glob's, in paths and in the docs).
#[doc(hidden)]
pub mod conformance {}
#[doc(hidden)]
pub mod inbox_conformance {}
#[doc(hidden)]
pub mod transport_conformance {}
#[doc(hidden)]
pub mod proptest_support {}

/// Not the facade's: `outboxkit_core::store_conformance_tests!` (this shadows it).
#[doc(hidden)]
#[macro_export]
macro_rules! store_conformance_tests {
    ($($any:tt)*) => {
        compile_error!("the store conformance suite is outboxkit_core's: outboxkit_core::store_conformance_tests!")
    };
}

/// Not the facade's: `outboxkit_core::inbox_conformance_tests!` (this shadows it).
#[doc(hidden)]
#[macro_export]
macro_rules! inbox_conformance_tests {
    ($($any:tt)*) => {
        compile_error!("the inbox conformance suite is outboxkit_core's: outboxkit_core::inbox_conformance_tests!")
    };
}

/// Not the facade's: `outboxkit_core::transport_conformance_tests!` (this shadows it).
#[doc(hidden)]
#[macro_export]
macro_rules! transport_conformance_tests {
    ($($any:tt)*) => {
        compile_error!("the transport conformance suite is outboxkit_core's: outboxkit_core::transport_conformance_tests!")
    };
}

/// The PostgreSQL backend (`outboxkit-postgres`, sqlx): [`PgOutbox`](postgres::PgOutbox)
/// (connect or wrap your pool, [`migrate`](postgres::PgOutbox::migrate),
/// [`enqueue`](OutboxProducer::enqueue) in your transaction, the relay's store with its
/// `LISTEN` wake-up, [`inbox`](postgres::PgOutbox::inbox)), [`PgConfig`](postgres::PgConfig)
/// and [`PgInbox`](postgres::PgInbox). The crate's documentation has the details
/// (claims, migrations, round trips).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres {
    /// The sqlx this backend is built on, for its types (`sqlx::Transaction` from
    /// [`PgOutbox::begin`], `sqlx::PgPool` for [`PgOutbox::new`]).
    #[doc(no_inline)]
    pub use outboxkit_postgres::sqlx;
    // Everything else the crate has: its `wal` module when a crate of the build enables
    // that feature, and whatever a later version adds (none of it in the docs).
    #[doc(hidden)]
    #[allow(
        unused_imports,
        unreachable_pub,
        reason = "the explicit list below may name every item of this build"
    )]
    pub use outboxkit_postgres::*;
    #[doc(inline)]
    pub use outboxkit_postgres::{
        DEFAULT_SCHEMA, KEEPALIVE_INTERVAL, LATEST_VERSION, NOTIFY_CHANNEL, OUTAGE_WAKE_INTERVAL,
        PgConfig, PgInbox, PgOutbox, parse_url,
    };
}

/// The SQL Server backend (`outboxkit-sqlserver`, tiberius and bb8):
/// [`MssqlOutbox`](sqlserver::MssqlOutbox) (connect or wrap your pool,
/// [`migrate`](sqlserver::MssqlOutbox::migrate), [`enqueue`](OutboxProducer::enqueue) in
/// your transaction, the relay's store, [`inbox`](sqlserver::MssqlOutbox::inbox)),
/// [`MssqlConfig`](sqlserver::MssqlConfig), [`MssqlInbox`](sqlserver::MssqlInbox) and the
/// pool and transaction types (the redaction of connection strings is
/// [`database::redact_connection_string`]).
#[cfg(feature = "sqlserver")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlserver")))]
pub mod sqlserver {
    #[doc(hidden)]
    pub use outboxkit_sqlserver::*;
    #[doc(inline)]
    pub use outboxkit_sqlserver::{
        ConnectError, DEFAULT_SCHEMA, LATEST_VERSION, MAX_ROWS_PER_STATEMENT, MssqlClient,
        MssqlConfig, MssqlConnection, MssqlConnectionManager, MssqlInbox, MssqlOutbox, MssqlPool,
        MssqlTransaction, PooledConnection,
    };
}

/// The MySQL 8.0+ / MariaDB 10.6+ backend (`outboxkit-mysql`, sqlx):
/// [`MySqlOutbox`](mysql::MySqlOutbox) (connect or wrap your pool,
/// [`migrate`](mysql::MySqlOutbox::migrate), [`enqueue`](OutboxProducer::enqueue) in your
/// transaction, the relay's store, polled, [`inbox`](mysql::MySqlOutbox::inbox)),
/// [`MySqlConfig`](mysql::MySqlConfig) and [`MySqlInbox`](mysql::MySqlInbox).
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql {
    /// The sqlx this backend is built on, for its types (`sqlx::Transaction` from
    /// [`MySqlOutbox::begin`], `sqlx::MySqlPool` for [`MySqlOutbox::new`]).
    #[doc(no_inline)]
    pub use outboxkit_mysql::sqlx;
    #[doc(hidden)]
    #[allow(
        unused_imports,
        unreachable_pub,
        reason = "the explicit list below may name every item of this build"
    )]
    pub use outboxkit_mysql::*;
    #[doc(inline)]
    pub use outboxkit_mysql::{
        DEFAULT_SCHEMA, LATEST_VERSION, MySqlConfig, MySqlInbox, MySqlInboxTransaction,
        MySqlOutbox, parse_url,
    };
}

/// The RabbitMQ transport (`outboxkit-rabbit`, lapin): [`RabbitPublisher`](rabbit::RabbitPublisher)
/// (publisher confirms, mandatory returns), [`RabbitConsumer`](rabbit::RabbitConsumer)
/// and their configuration (the consumer traits are at the root: [`DeliveryHandler`],
/// [`Consumer`]).
#[cfg(feature = "rabbit")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbit")))]
pub mod rabbit {
    /// The lapin this transport is built on, for its types (e.g. `lapin::types::FieldTable`
    /// for [`RabbitConsumerConfig::with_queue_arguments`]).
    #[doc(no_inline)]
    pub use outboxkit_rabbit::lapin;
    #[doc(hidden)]
    pub use outboxkit_rabbit::*;
    #[doc(inline)]
    pub use outboxkit_rabbit::{
        DestinationRule, QueueType, RabbitConfig, RabbitConsumer, RabbitConsumerConfig,
        RabbitError, RabbitPublisher, redact_url,
    };

    /// The defaults and bounds of [`RabbitConfig`].
    pub mod config {
        #[doc(hidden)]
        pub use outboxkit_rabbit::config::*;
        #[doc(inline)]
        pub use outboxkit_rabbit::config::{
            DEFAULT_CHANNELS, DEFAULT_CONFIRM_TIMEOUT, DEFAULT_CONNECT_TIMEOUT,
            DEFAULT_CONNECTION_NAME, DEFAULT_EXCHANGE, DEFAULT_HEARTBEAT_SECS,
            DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_URL, MAX_CHANNELS,
        };
    }

    /// The defaults of [`RabbitConsumer`] and the decoding of AMQP headers.
    pub mod consumer {
        #[doc(hidden)]
        pub use outboxkit_rabbit::consumer::*;
        #[doc(inline)]
        pub use outboxkit_rabbit::consumer::{
            DEFAULT_PREFETCH, DEFAULT_RECONNECT_INITIAL, DEFAULT_RECONNECT_MAX,
            DEFAULT_REQUEUE_DELAY, headers_to_strings,
        };
    }

    #[doc(hidden)]
    pub mod destinations {
        pub use outboxkit_rabbit::destinations::*;
    }

    #[doc(hidden)]
    pub mod error {
        pub use outboxkit_rabbit::error::*;
    }

    #[doc(hidden)]
    pub mod publisher {
        pub use outboxkit_rabbit::publisher::*;
    }
}

/// The NATS JetStream transport (`outboxkit-nats`, async-nats):
/// [`NatsPublisher`](nats::NatsPublisher) (awaits each PubAck, `Nats-Msg-Id`
/// deduplication), [`NatsConsumer`](nats::NatsConsumer), the stream
/// ([`StreamSetup`](nats::StreamSetup)) and their configuration (the consumer traits are
/// at the root: [`DeliveryHandler`], [`Consumer`]).
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats {
    /// The async-nats this transport is built on, for its types (e.g.
    /// `async_nats::jetstream::Context` from [`NatsPublisher::jetstream`]).
    #[doc(no_inline)]
    pub use outboxkit_nats::async_nats;
    #[doc(hidden)]
    pub use outboxkit_nats::*;
    #[doc(inline)]
    pub use outboxkit_nats::{
        NatsConfig, NatsConsumer, NatsConsumerConfig, NatsError, NatsPublisher, Storage,
        StreamInfo, StreamRetention, StreamSetup, redact_url,
    };

    /// The defaults and bounds of [`NatsConfig`].
    pub mod config {
        #[doc(hidden)]
        pub use outboxkit_nats::config::*;
        #[doc(inline)]
        pub use outboxkit_nats::config::{
            DEFAULT_CONFIRM_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_CONNECTION_NAME,
            DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_SUBJECT_PREFIX, DEFAULT_URL,
            MAX_IN_FLIGHT, MAX_SUBJECT_BYTES,
        };
    }

    /// The defaults and bounds of [`NatsConsumer`] and the decoding of NATS headers.
    pub mod consumer {
        #[doc(hidden)]
        pub use outboxkit_nats::consumer::*;
        #[doc(inline)]
        pub use outboxkit_nats::consumer::{
            DEFAULT_ACK_WAIT, DEFAULT_CONCURRENCY, DEFAULT_MAX_DELIVER, DEFAULT_NAK_DELAYS,
            DEFAULT_RECONNECT_INITIAL, DEFAULT_RECONNECT_MAX, MAX_CONCURRENCY, headers_to_strings,
        };
    }

    #[doc(hidden)]
    pub mod error {
        pub use outboxkit_nats::error::*;
    }

    /// The headers [`NatsPublisher`] sets.
    pub mod publisher {
        #[doc(hidden)]
        pub use outboxkit_nats::publisher::*;
        #[doc(inline)]
        pub use outboxkit_nats::publisher::{CONTENT_TYPE_HEADER, MSG_ID_HEADER};
    }

    /// The defaults of [`StreamSetup`].
    pub mod topology {
        #[doc(inline)]
        pub use outboxkit_nats::topology::DEFAULT_DUPLICATE_WINDOW;
        #[doc(hidden)]
        pub use outboxkit_nats::topology::*;
    }
}

/// The consumer side. Always: the core's inbox traits and types
/// ([`InboxStore`] and its capabilities [`DurableInbox`],
/// [`VersionTracking`], [`ConsumerDeadLetters`], …, at the root) and
/// [`lock_order`](inbox::lock_order). With the `inbox` feature, also the
/// `outboxkit-inbox` crate: [`IdempotentConsumer`](inbox::IdempotentConsumer),
/// [`Handler`](inbox::Handler), [`Pipeline`](inbox::Pipeline), the durable
/// [`InboxProcessor`](inbox::InboxProcessor) and their metrics. A feature only adds
/// names here; none changes meaning.
pub mod inbox {
    #[doc(inline)]
    pub use outboxkit_core::inbox::lock_order;
    #[doc(hidden)]
    pub use outboxkit_core::inbox::*;

    #[cfg(feature = "inbox")]
    #[doc(hidden)]
    pub use ::outboxkit_inbox::*;
    #[cfg(feature = "inbox")]
    #[cfg_attr(docsrs, doc(cfg(feature = "inbox")))]
    #[doc(inline)]
    pub use ::outboxkit_inbox::{
        BatchHandlerError, ConsumerConfig, DEFAULT_MAX_DELIVERIES, DEFAULT_MAX_VERSION_JUMP,
        DurableReceiver, GapPolicy, Handler, HandlerContext, HandlerError, IdempotentConsumer,
        InboxProcessor, InboxRetention, Pipeline, ProcessReport, ProcessorConfig, PurgeReport,
        StalePolicy, UNDECODABLE_CONSUMER, UNHANDLED_CONSUMER, UnhandledPolicy, metrics,
    };
}

/// A message as received from a broker, decoded from its wire form (both transports
/// hand these to a [`DeliveryHandler`]).
pub use outboxkit_core::wire::IncomingMessage;

#[cfg(any(feature = "rabbit", feature = "nats"))]
mod any_publisher;

#[cfg(any(feature = "rabbit", feature = "nats"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "rabbit", feature = "nats"))))]
pub use any_publisher::{AnyPublisher, AnyPublisherConfig, AnyPublisherError};

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlserver"))]
mod any_store;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlserver"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "mysql", feature = "sqlserver")))
)]
pub use any_store::{AnyStore, AnyStoreConfig, AnyStoreError};

#[cfg(any(feature = "rabbit", feature = "nats"))]
mod any_consumer;

#[cfg(any(feature = "rabbit", feature = "nats"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "rabbit", feature = "nats"))))]
pub use any_consumer::{AnyConsumer, AnyConsumerConfig, AnyConsumerError};
