//! # outboxkit-nats
//!
//! The NATS JetStream transport of the outbox toolkit:
//!
//! - [`NatsPublisher`] implements [`outboxkit_core::EventPublisher`] for the relay: it
//!   publishes a batch to JetStream with `Nats-Msg-Id` = outbox id (so the stream's
//!   duplicate window drops a re-publish), keeps a bounded window of publishes in
//!   flight, awaits their PubAcks together, and turns every answer into one
//!   [`PublishOutcome`](outboxkit_core::PublishOutcome) per message (an invalid subject or
//!   oversized message is permanent, no stream for the subject is a permanent
//!   `Unroutable`, a lost connection `Unavailable`, which opens the dispatcher's
//!   circuit). The client reconnects by itself.
//! - [`NatsConsumer`] consumes a stream through a durable pull consumer with explicit
//!   acks, decodes each message into an
//!   [`IncomingMessage`](outboxkit_core::wire::IncomingMessage) and acks, naks (with a
//!   delay) or terminates it after a [`DeliveryHandler`] returns; the outboxkit-inbox crate's
//!   idempotent consumer plugs in as that handler. With [`NatsConsumer::run_batched`]
//!   it hands a [`BatchDeliveryHandler`] the messages in batches instead.
//! - [`StreamSetup`] creates or updates the stream the publisher writes to (subjects,
//!   storage, duplicate window, retention, max age) and documents what a PubAck
//!   promises about durability.
//! - [`NatsConfig`] (and [`NatsConsumerConfig`]): the server URL and settings shared by
//!   all of them; [`NatsError`]: typed errors with an [`ErrorKind`](outboxkit_core::ErrorKind).
//!
//! Messages carry the outbox id as `Nats-Msg-Id` and the event's metadata as
//! CloudEvents headers of the NATS binding (`ce-id`, `ce-type`, ...), see
//! [`outboxkit_core::wire`].
//!
//! ```no_run
//! use outboxkit_core::EventPublisher;
//! use outboxkit_nats::{NatsConfig, NatsPublisher, StreamSetup};
//!
//! # async fn relay() -> Result<(), Box<dyn std::error::Error>> {
//! // OUTBOX_BROKER_URL, or nats://127.0.0.1:4222
//! let config = NatsConfig::from_env()?
//!     .with_subject_prefix("orders.events")
//!     .with_connection_name("orders-relay");
//! // Fails fast with a typed error if the server is unreachable or refuses us.
//! let publisher = NatsPublisher::connect(config.clone()).await?;
//! // A stream must capture the subjects before anything is published.
//! publisher
//!     .ensure_stream(&StreamSetup::for_config("ORDERS", &config))
//!     .await?;
//! publisher.check_ready().await?;
//! // Hand it to a `Dispatcher` together with a store, e.g. outboxkit-postgres.
//! # Ok(())
//! # }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
pub mod config;
mod connection;
pub mod consumer;
mod destinations;
pub mod error;
pub mod publisher;
pub mod topology;

pub use config::NatsConfig;
pub use consumer::{NatsConsumer, NatsConsumerConfig};
pub use error::{NatsError, redact_url};
pub use outboxkit_core::consumer::{
    BatchDeliveryHandler, Consumer, DeliveryHandler, HandlerDecision, TransportKind,
};
pub use publisher::NatsPublisher;
pub use topology::{Storage, StreamInfo, StreamRetention, StreamSetup};

/// The NATS client this crate is built on, for its types (e.g.
/// [`jetstream::Context`](async_nats::jetstream::Context) from
/// [`NatsPublisher::jetstream`]).
pub use async_nats;
