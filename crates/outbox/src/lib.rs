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
//! one module, the backend crate re-exported as is:
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
//! let rabbit = RabbitConfig::builder("amqp://guest:guest@127.0.0.1:5672/%2f")
//!     .with_exchange("orders.events")
//!     .build()?;
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())
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
//! let nats = NatsConfig::builder("nats://127.0.0.1:4222")
//!     .with_subject_prefix("orders.events")
//!     .build()?;
//! let publisher = NatsPublisher::connect(nats.clone()).await?;
//! publisher.ensure_stream(&StreamSetup::for_config("ORDERS", &nats)).await?; // orders.events.>
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())
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
//! let rabbit = RabbitConfig::builder("amqp://guest:guest@127.0.0.1:5672/%2f").build()?;
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())
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
//! let rabbit = RabbitConfig::builder("amqp://guest:guest@127.0.0.1:5672/%2f").build()?;
//! let publisher = RabbitPublisher::connect(rabbit).await?;
//! // No push wake-up on MySQL: the dispatcher polls (every `poll_interval`).
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())
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
//! let nats = NatsConfig::builder("nats://127.0.0.1:4222")
//!     .with_subject_prefix("orders.events")
//!     .build()?;
//! let publisher = NatsPublisher::connect(nats.clone()).await?;
//! publisher.ensure_stream(&StreamSetup::for_config("ORDERS", &nats)).await?;
//! Dispatcher::new(Arc::new(store), Arc::new(publisher), DispatcherConfig::new())
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
//! let publisher = Arc::new(AnyPublisher::connect_lazy(config).await);
//! Dispatcher::new(Arc::new(store), Arc::clone(&publisher), DispatcherConfig::new())
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
//! [`Consumer::run_batched`]); a transport's own builder
//! (`outboxkit::rabbit::RabbitConsumer::builder`, `outboxkit::nats::NatsConsumer::builder`)
//! sets the rest (prefetch, quorum queues, ack wait, …) and converts with `From`.
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "inbox", any(feature = "rabbit", feature = "nats")))]
//! # async fn demo(shutdown: tokio_util::sync::CancellationToken) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use outboxkit::inbox::{Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline};
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
//! consumer.run(IdempotentConsumer::new(Arc::new(inbox), pipeline), shutdown).await?;
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

pub use outboxkit_core::*;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[doc(inline)]
pub use outboxkit_postgres as postgres;

#[cfg(feature = "sqlserver")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlserver")))]
#[doc(inline)]
pub use outboxkit_sqlserver as sqlserver;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
#[doc(inline)]
pub use outboxkit_mysql as mysql;

#[cfg(feature = "rabbit")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbit")))]
#[doc(inline)]
pub use outboxkit_rabbit as rabbit;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[doc(inline)]
pub use outboxkit_nats as nats;

/// The consumer side. Always: the core's inbox traits and types
/// ([`InboxStore`] and its capabilities [`DurableInbox`],
/// [`VersionTracking`], [`ConsumerDeadLetters`], …, also at the root). With the `inbox`
/// feature, also the `outboxkit-inbox` crate: [`IdempotentConsumer`](inbox::IdempotentConsumer),
/// [`Handler`](inbox::Handler), [`Pipeline`](inbox::Pipeline), the durable
/// [`InboxProcessor`](inbox::InboxProcessor) and their metrics. A feature only adds
/// names here; none changes meaning.
pub mod inbox {
    #[doc(inline)]
    pub use outboxkit_core::inbox::*;

    #[cfg(feature = "inbox")]
    #[cfg_attr(docsrs, doc(cfg(feature = "inbox")))]
    #[doc(inline)]
    pub use ::outboxkit_inbox::*;
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
