//! [`AnyConsumer`]: one [`Consumer`] over the brokers this crate was built with, the
//! consumer side of [`AnyPublisher`](crate::AnyPublisher), for programs that choose
//! the broker at run time.

use async_trait::async_trait;
use outboxkit_core::consumer::{BatchDeliveryHandler, BatchSettings, Consumer, DeliveryHandler};
use outboxkit_core::{ErrorKind, TransportKind};
#[cfg(feature = "nats")]
use outboxkit_nats::{NatsConsumer, NatsConsumerConfig, NatsError, StreamSetup};
#[cfg(feature = "rabbit")]
use outboxkit_rabbit::{RabbitConsumer, RabbitConsumerConfig, RabbitError};
use tokio_util::sync::CancellationToken;

use crate::{AnyPublisherConfig, AnyPublisherError};

/// One consumer over the enabled brokers, a [`Consumer`] by delegation: the same
/// handlers ([`DeliveryHandler`], [`BatchDeliveryHandler`], the `outboxkit-inbox` crate's
/// `IdempotentConsumer` and `DurableReceiver`) run on either.
///
/// Build it with [`new`](Self::new) from an [`AnyConsumerConfig`] (a URL and a name,
/// or the publisher's configuration and a name), or from a transport's consumer (built
/// with its own configuration: queue arguments, prefetch, ack wait…) with `From`.
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
    /// The consumer `config` describes. Nothing connects here: the consumer connects
    /// when it runs (or [`declare`](Consumer::declare)s).
    ///
    /// - RabbitMQ: the durable queue named by the config, declared if missing and bound
    ///   with `#` (every routing key) to the publisher configuration's exchange
    ///   (`outbox.events` by default).
    /// - NATS: the durable pull consumer of that name on the config's stream, both
    ///   created if missing; a missing stream is created as the publisher
    ///   configuration declares it ([`NatsConfig::with_stream`](crate::nats::NatsConfig::with_stream)),
    ///   or else capturing the subjects it publishes to (`outbox.events.>` by default;
    ///   file storage, one replica); an existing stream is left as it is
    ///   ([`NatsConsumerConfig::with_stream_setup`](crate::nats::NatsConsumerConfig::with_stream_setup)).
    ///
    /// # Errors
    /// [`AnyConsumerError::NoStream`] for NATS without a stream name, or the
    /// transport's own error for a name it rejects (both
    /// [`ErrorKind::Permanent`](outboxkit_core::ErrorKind::Permanent)).
    pub fn new(config: AnyConsumerConfig) -> Result<Self, AnyConsumerError> {
        let AnyConsumerConfig {
            publisher,
            name,
            stream,
            batch,
        } = config;
        match publisher {
            #[cfg(feature = "rabbit")]
            AnyPublisherConfig::Rabbit(config) => {
                drop(stream); // RabbitMQ consumes a queue, not a stream
                let mut consumer = RabbitConsumerConfig::new(config, name).with_binding_key("#");
                if let Some(batch) = batch {
                    consumer = consumer.with_batch(batch);
                }
                Ok(Self::Rabbit(RabbitConsumer::new(consumer)?))
            }
            #[cfg(feature = "nats")]
            AnyPublisherConfig::Nats(config) => {
                let setup = match (stream, config.stream()) {
                    (Some(name), Some(declared)) if declared.name() == name => declared,
                    (Some(name), _) => StreamSetup::for_config(name, &config),
                    (None, Some(declared)) => declared,
                    (None, None) => {
                        return Err(AnyConsumerError::NoStream {
                            url_redacted: config.url_redacted(),
                        });
                    }
                };
                let mut consumer = NatsConsumerConfig::new(config, setup.name().to_owned(), name)
                    .with_stream_setup(setup);
                if let Some(batch) = batch {
                    consumer = consumer.with_batch(batch);
                }
                Ok(Self::Nats(NatsConsumer::new(consumer)?))
            }
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

/// The configuration of an [`AnyConsumer`]: what a publisher configured by an
/// [`AnyPublisherConfig`] publishes (its exchange or subject prefix and, for NATS, its
/// stream), consumed under a name (RabbitMQ: the queue; NATS: the durable consumer).
///
/// `AnyConsumerConfig::from_url(url, "billing")?.with_stream("OUTBOX")`; or
/// [`new`](Self::new) from the publisher's own configuration, so both sides agree on the
/// exchange, subject prefix and stream.
#[derive(Debug, Clone)]
#[must_use]
pub struct AnyConsumerConfig {
    publisher: AnyPublisherConfig,
    name: String,
    stream: Option<String>,
    batch: Option<BatchSettings>,
}

impl AnyConsumerConfig {
    /// The consumer `name` of what a publisher configured by `publisher` publishes.
    pub fn new(publisher: impl Into<AnyPublisherConfig>, name: impl Into<String>) -> Self {
        Self {
            publisher: publisher.into(),
            name: name.into(),
            stream: None,
            batch: None,
        }
    }

    /// The consumer `name` of what a relay with default settings publishes to `url`,
    /// the broker picked by the URL's scheme as
    /// [`AnyPublisherConfig::from_url`] picks it (`amqp://`, `amqps://`: RabbitMQ;
    /// `nats://`, `tls://`: NATS).
    ///
    /// # Errors
    /// [`AnyConsumerError::UnsupportedScheme`], [`AnyConsumerError::TransportDisabled`],
    /// or the transport's own error for a URL it rejects
    /// ([`ErrorKind::Permanent`](outboxkit_core::ErrorKind::Permanent)).
    pub fn from_url(url: &str, name: impl Into<String>) -> Result<Self, AnyConsumerError> {
        Ok(Self::new(AnyPublisherConfig::from_url(url)?, name))
    }

    /// NATS: the JetStream stream to consume from (no default: the publisher
    /// configuration's [declared stream](crate::nats::NatsConfig::with_stream)
    /// when it has one, else required). RabbitMQ ignores it.
    pub fn with_stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = Some(stream.into());
        self
    }

    /// How [`run_batched`](Consumer::run_batched) groups deliveries (default: the
    /// transport's, [`BatchSettings`]).
    pub fn with_batch(mut self, batch: BatchSettings) -> Self {
        self.batch = Some(batch);
        self
    }

    /// The transport this configuration is for.
    pub fn kind(&self) -> TransportKind {
        self.publisher.kind()
    }
}

/// Why an [`AnyConsumer`] or its [`AnyConsumerConfig`] could not be made, or why it
/// stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnyConsumerError {
    /// RabbitMQ refused the configuration, or the consumer failed (see
    /// [`RabbitError::kind`]).
    #[cfg(feature = "rabbit")]
    #[error(transparent)]
    Rabbit(#[from] RabbitError),
    /// NATS refused the configuration, or the consumer failed (see
    /// [`NatsError::kind`]).
    #[cfg(feature = "nats")]
    #[error(transparent)]
    Nats(#[from] NatsError),
    /// The URL's scheme names no broker: RabbitMQ is `amqp://` or `amqps://`, NATS
    /// `nats://` or `tls://`.
    #[error(
        "broker URL {url_redacted}: unsupported scheme (RabbitMQ: amqp:// or amqps://; NATS: nats:// or tls://)"
    )]
    UnsupportedScheme {
        /// The URL, password or token hidden.
        url_redacted: String,
    },
    /// The URL names a broker whose transport feature of the `outboxkit` crate is off.
    #[error(
        "broker URL {url_redacted}: the `outboxkit` crate was built without its `{feature}` feature"
    )]
    TransportDisabled {
        /// The URL, password or token hidden.
        url_redacted: String,
        /// The feature to enable: `"rabbit"` or `"nats"`.
        feature: &'static str,
    },
    /// A NATS consumer needs a stream: [`AnyConsumerConfig::with_stream`], or a
    /// publisher configuration that declares one.
    #[error(
        "NATS consumer at {url_redacted}: no stream given (AnyConsumerConfig::with_stream, or NatsConfig::with_stream in the publisher's configuration)"
    )]
    NoStream {
        /// The URL, password or token hidden.
        url_redacted: String,
    },
}

impl AnyConsumerError {
    /// What the caller can do about it: the transport's own kind for
    /// [`Rabbit`](Self::Rabbit) / [`Nats`](Self::Nats) (an unreachable broker is
    /// [`ErrorKind::Unavailable`], bad credentials or settings
    /// [`ErrorKind::Permanent`]); [`ErrorKind::Permanent`] for the others.
    pub fn kind(&self) -> ErrorKind {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(e) => e.kind(),
            #[cfg(feature = "nats")]
            Self::Nats(e) => e.kind(),
            Self::UnsupportedScheme { .. }
            | Self::TransportDisabled { .. }
            | Self::NoStream { .. } => ErrorKind::Permanent,
        }
    }
}

impl From<AnyPublisherError> for AnyConsumerError {
    fn from(e: AnyPublisherError) -> Self {
        match e {
            #[cfg(feature = "rabbit")]
            AnyPublisherError::Rabbit(e) => Self::Rabbit(e),
            #[cfg(feature = "nats")]
            AnyPublisherError::Nats(e) => Self::Nats(e),
            AnyPublisherError::UnsupportedScheme { url_redacted } => {
                Self::UnsupportedScheme { url_redacted }
            }
            AnyPublisherError::TransportDisabled {
                url_redacted,
                feature,
            } => Self::TransportDisabled {
                url_redacted,
                feature,
            },
        }
    }
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

    fn build(url: &str, stream: Option<&str>, name: &str) -> Result<AnyConsumer, AnyConsumerError> {
        let config = AnyConsumerConfig::from_url(url, name)?;
        AnyConsumer::new(match stream {
            Some(stream) => config.with_stream(stream),
            None => config,
        })
    }

    #[cfg(feature = "rabbit")]
    #[test]
    fn an_amqp_url_is_a_rabbit_queue_bound_to_every_key() {
        let consumer = build("amqp://guest:guest@127.0.0.1:5672/%2f", None, "billing")
            .expect("valid: RabbitMQ needs no stream");
        assert_eq!(consumer.kind(), TransportKind::Rabbit);
        assert_eq!(
            consumer.as_rabbit().map(RabbitConsumer::queue),
            Some("billing")
        );
    }

    #[cfg(feature = "nats")]
    #[test]
    fn a_nats_url_is_a_durable_on_the_stream() {
        let consumer = build("nats://127.0.0.1:4222", Some("ORDERS"), "billing").expect("valid");
        assert_eq!(consumer.kind(), TransportKind::Nats);
        let nats = consumer.as_nats().expect("nats");
        assert_eq!((nats.stream(), nats.durable()), ("ORDERS", "billing"));
        // Without a stream name, a NATS consumer is a typed error …
        let err = build("nats://127.0.0.1:4222", None, "billing").expect_err("no stream");
        assert!(matches!(err, AnyConsumerError::NoStream { .. }), "{err}");
        assert_eq!(err.kind(), ErrorKind::Permanent);
        // … unless the publisher's configuration declares one: then it is that stream.
        let publisher = crate::nats::NatsConfig::new("nats://127.0.0.1:4222")
            .with_stream(StreamSetup::new("DECLARED"));
        let consumer =
            AnyConsumer::new(AnyConsumerConfig::new(publisher, "billing")).expect("valid");
        assert_eq!(
            consumer.as_nats().map(NatsConsumer::stream),
            Some("DECLARED")
        );
    }

    #[test]
    fn other_schemes_and_bad_names_are_typed_errors() {
        let err = build("http://x", Some("S"), "c").expect_err("no broker");
        assert!(
            matches!(err, AnyConsumerError::UnsupportedScheme { .. }),
            "{err}"
        );
        assert_eq!(err.kind(), ErrorKind::Permanent);
        #[cfg(feature = "rabbit")]
        assert!(build("amqp://127.0.0.1", None, "").is_err());
        #[cfg(feature = "nats")]
        assert!(build("nats://127.0.0.1", Some("bad.stream"), "c").is_err());
    }
}
