//! # outboxkit-rabbit
//!
//! The RabbitMQ (AMQP 0-9-1) transport of the outbox toolkit:
//!
//! - [`RabbitPublisher`] implements [`outboxkit_core::EventPublisher`] for the relay: it
//!   publishes a batch to a durable topic exchange as persistent, `mandatory` messages
//!   on a channel in confirm mode, sends the whole batch before awaiting the
//!   [publisher confirms] together, and turns every broker answer into one
//!   [`PublishOutcome`](outboxkit_core::PublishOutcome) per message (a `basic.return` is
//!   a permanent `Unroutable`, a `basic.nack` a transient `Rejected`, a lost connection
//!   `Unavailable`, which opens the dispatcher's circuit). It reconnects by itself.
//! - [`RabbitConsumer`] consumes a queue bound to that exchange with manual acks,
//!   decodes each delivery into an [`IncomingMessage`](outboxkit_core::wire::IncomingMessage)
//!   and acks, requeues or rejects it after a [`DeliveryHandler`] returns; or, with
//!   [`RabbitConsumer::run_batched`], hands a [`BatchDeliveryHandler`] the deliveries
//!   in batches and acknowledges a whole batch with one `basic.ack` when it can.
//! - [`RabbitConfig`]: the broker URL and settings shared by both, and
//!   [`RabbitConsumerConfig`], the consumer's own; [`RabbitError`]: typed errors with an [`ErrorKind`](outboxkit_core::ErrorKind).
//!
//! Messages carry the outbox id as the AMQP `message_id` property and the event's
//! metadata as CloudEvents AMQP-binding headers (`cloudEvents:type`, ...), see
//! [`outboxkit_core::wire`].
//!
//! ```no_run
//! use outboxkit_core::{Dispatcher, EventPublisher};
//! use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};
//!
//! # async fn relay() -> Result<(), Box<dyn std::error::Error>> {
//! // OUTBOX_BROKER_URL, or amqp://guest:guest@127.0.0.1:5672/%2f
//! let config = RabbitConfig::from_env()?
//!     .with_exchange("orders.events")
//!     .with_connection_name("orders-relay");
//! // Fails fast with a typed error if the configuration is invalid, the broker is
//! // unreachable or refuses us.
//! let publisher = RabbitPublisher::connect(config).await?;
//! publisher.check_ready().await?;
//! // Hand it to a `Dispatcher` together with a store, e.g. outboxkit-postgres.
//! # Ok(())
//! # }
//! ```
//!
//! [publisher confirms]: https://www.rabbitmq.com/docs/confirms#publisher-confirms
#![cfg_attr(docsrs, feature(doc_cfg))]

mod batch;
pub mod config;
mod connection;
pub mod consumer;
pub mod destinations;
pub mod error;
pub mod publisher;
mod topology;

pub use config::RabbitConfig;
pub use consumer::{QueueType, RabbitConsumer, RabbitConsumerConfig};
pub use destinations::DestinationRule;
pub use error::{RabbitError, redact_url};
pub use outboxkit_core::consumer::{
    BatchDeliveryHandler, Consumer, DeliveryHandler, HandlerDecision, TransportKind,
};
pub use publisher::RabbitPublisher;

/// The AMQP client this crate is built on, for its types (e.g.
/// [`FieldTable`](lapin::types::FieldTable) for
/// [`RabbitConsumerConfig::with_queue_arguments`]).
pub use lapin;
