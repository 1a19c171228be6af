//! [`AnyConsumer`]: one [`Consumer`] over the brokers this crate was built with, the
//! consumer side of [`AnyPublisher`](crate::AnyPublisher), for programs that choose
//! the broker at run time.

use async_trait::async_trait;
use outboxkit_core::TransportKind;
use outboxkit_core::consumer::{BatchDeliveryHandler, Consumer, DeliveryHandler};
#[cfg(feature = "nats")]
use outboxkit_nats::{NatsConfig, NatsConsumer, NatsError, StreamSetup};
#[cfg(feature = "rabbit")]
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitError};
use tokio_util::sync::CancellationToken;

use crate::AnyPublisherError;
#[cfg(not(all(feature = "rabbit", feature = "nats")))]
use crate::any_publisher::transport_disabled;
use crate::any_publisher::{NATS_SCHEMES, RABBIT_SCHEMES, redact_unknown};

/// One consumer over the enabled brokers, a [`Consumer`] by delegation: the same
/// handlers ([`DeliveryHandler`], [`BatchDeliveryHandler`], the `outboxkit-inbox` crate's
/// `IdempotentConsumer` and `DurableReceiver`) run on either.
///
/// Build it with [`from_url`](Self::from_url) when a URL and a name are all there is,
/// or from a transport's consumer (built with its own builder: queue arguments,
/// prefetch, ack wait, batch settings…) with `From`.
///
/// `#[non_exhaustive]`: match with a wildcard arm, or use
/// [`as_rabbit`](Self::as_rabbit) / [`as_nats`](Self::as_nats).
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyConsumer {
    /// A RabbitMQ queue's consumer.
    #[cfg(feature = "rabbit")]
    Rabbit(RabbitConsumer),
    /// A JetStream durable pull consumer.
    #[cfg(feature = "nats")]
    Nats(NatsConsumer),
}

impl AnyConsumer {
    /// The consumer `name` of what a relay with default settings publishes to `url`,
    /// picked by the URL's scheme as [`AnyPublisherConfig::from_url`](crate::AnyPublisherConfig::from_url)
    /// does:
    ///
    /// - `amqp://`, `amqps://`: the durable queue `name`, declared if missing and bound
    ///   with `#` (every routing key) to the exchange `outbox.events` (the
    ///   [`RabbitConfig`] default the publisher declares). `stream` is not used.
    /// - `nats://`, `tls://`: the durable pull consumer `name` on the JetStream stream
    ///   `stream`, both created if missing; a missing stream is created as
    ///   `StreamSetup::for_config(stream, …)` describes it (capturing `outbox.events.>`,
    ///   the subjects the publisher's default configuration uses; file storage, one
    ///   replica), an existing one is left as it is
    ///   ([`NatsConsumerBuilder::with_stream_setup`](crate::nats::NatsConsumerBuilder::with_stream_setup)).
    ///
    /// # Errors
    /// [`AnyPublisherError::UnsupportedScheme`],
    /// [`AnyPublisherError::TransportDisabled`], or the transport's own error for a URL
    /// or name it rejects ([`ErrorKind::Permanent`](outboxkit_core::ErrorKind::Permanent)). Nothing connects here: the
    /// consumer connects when it runs.
    pub fn from_url(url: &str, stream: &str, name: &str) -> Result<Self, AnyConsumerError> {
        match url.split_once("://").map(|(scheme, _)| scheme) {
            Some(s) if RABBIT_SCHEMES.contains(&s) => rabbit(url, name),
            Some(s) if NATS_SCHEMES.contains(&s) => nats(url, stream, name),
            _ => Err(AnyPublisherError::UnsupportedScheme {
                url_redacted: redact_unknown(url),
            }),
        }
    }

    /// The RabbitMQ consumer, if this is one.
    #[cfg(feature = "rabbit")]
    pub fn as_rabbit(&self) -> Option<&RabbitConsumer> {
        #[allow(irrefutable_let_patterns, reason = "refutable with `nats` enabled")]
        if let Self::Rabbit(c) = self {
            Some(c)
        } else {
            None
        }
    }

    /// The NATS consumer, if this is one.
    #[cfg(feature = "nats")]
    pub fn as_nats(&self) -> Option<&NatsConsumer> {
        #[allow(irrefutable_let_patterns, reason = "refutable with `rabbit` enabled")]
        if let Self::Nats(c) = self {
            Some(c)
        } else {
            None
        }
    }
}

/// Why an [`AnyConsumer`] could not be made or stopped: the same cases as for a
/// publisher (a transport's error, an unknown scheme, a disabled transport).
pub type AnyConsumerError = AnyPublisherError;

#[cfg(feature = "rabbit")]
fn rabbit(url: &str, name: &str) -> Result<AnyConsumer, AnyConsumerError> {
    let config = RabbitConfig::builder(url).build()?;
    Ok(AnyConsumer::Rabbit(
        RabbitConsumer::builder(config, name)
            .with_binding_key("#")
            .build()?,
    ))
}

#[cfg(not(feature = "rabbit"))]
fn rabbit(url: &str, _name: &str) -> Result<AnyConsumer, AnyConsumerError> {
    Err(transport_disabled(url, "rabbit"))
}

#[cfg(feature = "nats")]
fn nats(url: &str, stream: &str, name: &str) -> Result<AnyConsumer, AnyConsumerError> {
    let config = NatsConfig::builder(url).build()?;
    let setup = StreamSetup::for_config(stream, &config);
    Ok(AnyConsumer::Nats(
        NatsConsumer::builder(config, stream, name)
            .with_stream_setup(setup)
            .build()?,
    ))
}

#[cfg(not(feature = "nats"))]
fn nats(url: &str, _stream: &str, _name: &str) -> Result<AnyConsumer, AnyConsumerError> {
    Err(transport_disabled(url, "nats"))
}

#[cfg(feature = "rabbit")]
impl From<RabbitConsumer> for AnyConsumer {
    fn from(consumer: RabbitConsumer) -> Self {
        Self::Rabbit(consumer)
    }
}

#[cfg(feature = "nats")]
impl From<NatsConsumer> for AnyConsumer {
    fn from(consumer: NatsConsumer) -> Self {
        Self::Nats(consumer)
    }
}

#[async_trait]
impl Consumer for AnyConsumer {
    type Error = AnyConsumerError;

    fn kind(&self) -> TransportKind {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(c) => c.kind(),
            #[cfg(feature = "nats")]
            Self::Nats(c) => c.kind(),
        }
    }

    async fn declare(&self) -> Result<(), AnyConsumerError> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(c) => Consumer::declare(c).await.map_err(RabbitError::into),
            #[cfg(feature = "nats")]
            Self::Nats(c) => Consumer::declare(c).await.map_err(NatsError::into),
        }
    }

    async fn run<H: DeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), AnyConsumerError> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(c) => c.run(handler, shutdown).await.map_err(RabbitError::into),
            #[cfg(feature = "nats")]
            Self::Nats(c) => c.run(handler, shutdown).await.map_err(NatsError::into),
        }
    }

    async fn run_batched<H: BatchDeliveryHandler>(
        &self,
        handler: H,
        shutdown: CancellationToken,
    ) -> Result<(), AnyConsumerError> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(c) => c
                .run_batched(handler, shutdown)
                .await
                .map_err(RabbitError::into),
            #[cfg(feature = "nats")]
            Self::Nats(c) => c
                .run_batched(handler, shutdown)
                .await
                .map_err(NatsError::into),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outboxkit_core::ErrorKind;

    #[cfg(feature = "rabbit")]
    #[test]
    fn an_amqp_url_is_a_rabbit_queue_bound_to_every_key() {
        let consumer =
            AnyConsumer::from_url("amqp://guest:guest@127.0.0.1:5672/%2f", "S", "billing")
                .expect("valid");
        assert_eq!(consumer.kind(), TransportKind::Rabbit);
        assert_eq!(
            consumer.as_rabbit().map(RabbitConsumer::queue),
            Some("billing")
        );
    }

    #[cfg(feature = "nats")]
    #[test]
    fn a_nats_url_is_a_durable_on_the_stream() {
        let consumer =
            AnyConsumer::from_url("nats://127.0.0.1:4222", "ORDERS", "billing").expect("valid");
        assert_eq!(consumer.kind(), TransportKind::Nats);
        let nats = consumer.as_nats().expect("nats");
        assert_eq!((nats.stream(), nats.durable()), ("ORDERS", "billing"));
    }

    #[test]
    fn other_schemes_and_bad_names_are_typed_errors() {
        let err = AnyConsumer::from_url("http://x", "S", "c").expect_err("no broker");
        assert!(matches!(err, AnyPublisherError::UnsupportedScheme { .. }));
        assert_eq!(err.kind(), ErrorKind::Permanent);
        #[cfg(feature = "rabbit")]
        assert!(AnyConsumer::from_url("amqp://127.0.0.1", "S", "").is_err());
        #[cfg(feature = "nats")]
        assert!(AnyConsumer::from_url("nats://127.0.0.1", "bad.stream", "c").is_err());
    }
}
