//! [`AnyPublisher`]: one [`EventPublisher`] over the brokers this crate was built with,
//! for programs that choose the broker at run time (the `outbox` relay binary, the
//! orders example).

use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::{
    ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome, TransportKind,
};
#[cfg(feature = "nats")]
use outboxkit_nats::{NatsConfig, NatsError, NatsPublisher};
#[cfg(feature = "rabbit")]
use outboxkit_rabbit::{RabbitConfig, RabbitError, RabbitPublisher};

/// The configuration of an [`AnyPublisher`]: one transport's own configuration.
///
/// Build it from the transport's configuration and `.into()` when the program has
/// settings of its own (exchange, subject prefix, timeouts), or with
/// [`from_url`](Self::from_url) when a URL is all there is.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyPublisherConfig {
    /// RabbitMQ: durable topic exchange, persistent messages, publisher confirms.
    #[cfg(feature = "rabbit")]
    Rabbit(RabbitConfig),
    /// NATS JetStream: subject prefix, PubAck timeout, in-flight window.
    #[cfg(feature = "nats")]
    Nats(NatsConfig),
}

impl AnyPublisherConfig {
    /// The transport's default configuration for `url`, picked by its scheme:
    /// `amqp://` or `amqps://` is RabbitMQ ([`RabbitConfig::new`] defaults: exchange
    /// `outbox.events`), `nats://` or `tls://` is NATS ([`NatsConfig::new`]
    /// defaults: subject prefix `outbox.events`), validated here
    /// ([`RabbitConfig::validate`], [`NatsConfig::validate`]). A comma-separated NATS server list
    /// is read by its first URL's scheme. Schemes are lower case, as the transports'
    /// URL parsers require.
    ///
    /// # Errors
    /// [`AnyPublisherError::UnsupportedScheme`] for any other scheme or a URL without
    /// one, [`AnyPublisherError::TransportDisabled`] when the scheme's transport feature
    /// is not enabled, and the transport's own error
    /// ([`AnyPublisherError::Rabbit`] / [`AnyPublisherError::Nats`], both
    /// [`ErrorKind::Permanent`]) when it rejects the URL.
    pub fn from_url(url: &str) -> Result<Self, AnyPublisherError> {
        // NATS: async-nats is built without WebSocket support, so `nats://` and
        // `tls://` only.
        match TransportKind::of_url(url) {
            Some(TransportKind::Rabbit) => rabbit_from_url(url),
            Some(TransportKind::Nats) => nats_from_url(url),
            None => Err(AnyPublisherError::UnsupportedScheme {
                url_redacted: redact_unknown(url),
            }),
        }
    }

    /// The transport this configuration is for.
    pub fn kind(&self) -> TransportKind {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(_) => TransportKind::Rabbit,
            #[cfg(feature = "nats")]
            Self::Nats(_) => TransportKind::Nats,
        }
    }

    /// The broker URL with its password (NATS: token) replaced by `***`, for logs.
    pub fn url_redacted(&self) -> String {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(c) => c.url_redacted(),
            #[cfg(feature = "nats")]
            Self::Nats(c) => c.url_redacted(),
        }
    }
}

#[cfg(feature = "rabbit")]
fn rabbit_from_url(url: &str) -> Result<AnyPublisherConfig, AnyPublisherError> {
    let config = RabbitConfig::new(url);
    config.validate()?;
    Ok(AnyPublisherConfig::Rabbit(config))
}

#[cfg(not(feature = "rabbit"))]
fn rabbit_from_url(url: &str) -> Result<AnyPublisherConfig, AnyPublisherError> {
    Err(transport_disabled(url, "rabbit"))
}

#[cfg(feature = "nats")]
fn nats_from_url(url: &str) -> Result<AnyPublisherConfig, AnyPublisherError> {
    let config = NatsConfig::new(url);
    config.validate()?;
    Ok(AnyPublisherConfig::Nats(config))
}

#[cfg(not(feature = "nats"))]
fn nats_from_url(url: &str) -> Result<AnyPublisherConfig, AnyPublisherError> {
    Err(transport_disabled(url, "nats"))
}

/// The error for a URL whose transport `feature` is compiled out.
#[cfg(not(all(feature = "rabbit", feature = "nats")))]
pub(crate) fn transport_disabled(url: &str, feature: &'static str) -> AnyPublisherError {
    AnyPublisherError::TransportDisabled {
        url_redacted: redact_unknown(url),
        feature,
    }
}

/// A URL of no known transport, redacted the strictest way (a lone user info is taken
/// for a token and hidden).
pub(crate) fn redact_unknown(url: &str) -> String {
    outboxkit_core::error::redact_url(url, outboxkit_core::error::LoneUserInfo::Token)
}

#[cfg(feature = "rabbit")]
impl From<RabbitConfig> for AnyPublisherConfig {
    fn from(config: RabbitConfig) -> Self {
        Self::Rabbit(config)
    }
}

#[cfg(feature = "nats")]
impl From<NatsConfig> for AnyPublisherConfig {
    fn from(config: NatsConfig) -> Self {
        Self::Nats(config)
    }
}

/// Why an [`AnyPublisher`] or its [`AnyPublisherConfig`] could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnyPublisherError {
    /// RabbitMQ refused the configuration or, for [`AnyPublisher::connect`], the
    /// connection (see [`RabbitError::kind`]).
    #[cfg(feature = "rabbit")]
    #[error(transparent)]
    Rabbit(#[from] RabbitError),
    /// NATS refused the configuration or, for [`AnyPublisher::connect`], the
    /// connection (see [`NatsError::kind`]).
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
}

impl AnyPublisherError {
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
            Self::UnsupportedScheme { .. } | Self::TransportDisabled { .. } => ErrorKind::Permanent,
        }
    }
}

/// One publisher over the enabled brokers; an [`EventPublisher`] by delegation, so
/// the [`Dispatcher`](outboxkit_core::Dispatcher) takes it like any other.
///
/// Each variant keeps its transport's guarantees: RabbitMQ publishes persistent
/// messages with `mandatory` to a durable topic exchange and waits for the AMQP 0-9-1
/// publisher confirms (a `basic.return` or `basic.nack` is a failure); NATS publishes
/// to JetStream with `Nats-Msg-Id` = outbox id and waits for each PubAck. Either way a
/// message is `Published` only once the broker has taken responsibility for it.
///
/// Build it with [`connect`](Self::connect) / [`connect_lazy`](Self::connect_lazy)
/// from an [`AnyPublisherConfig`] (or a transport's config, through `Into`), or from
/// an already built transport publisher with `From` (e.g. after declaring a stream
/// with it).
///
/// `#[non_exhaustive]`: match with a wildcard arm, or use
/// [`as_rabbit`](Self::as_rabbit) / [`as_nats`](Self::as_nats).
#[derive(Debug)]
#[non_exhaustive]
#[allow(
    clippy::large_enum_variant,
    reason = "one value per process, shared behind an Arc, never moved in a loop"
)]
pub enum AnyPublisher {
    /// RabbitMQ (feature `rabbit`).
    #[cfg(feature = "rabbit")]
    Rabbit(RabbitPublisher),
    /// NATS JetStream (feature `nats`).
    #[cfg(feature = "nats")]
    Nats(NatsPublisher),
}

impl AnyPublisher {
    /// Connects at once (RabbitMQ: the connection, its confirm-mode channels and the
    /// exchange declaration; NATS: the client connection).
    ///
    /// # Errors
    /// The transport's connection error: [`AnyPublisherError::Rabbit`]
    /// ([`RabbitPublisher::connect`]) or [`AnyPublisherError::Nats`]
    /// ([`NatsPublisher::connect`]); [`AnyPublisherError::kind`] tells an unreachable
    /// broker ([`ErrorKind::Unavailable`]) from bad credentials or settings
    /// ([`ErrorKind::Permanent`]). An invalid configuration is the transport's
    /// `InvalidUrl` or `InvalidConfig` error, returned before anything connects.
    pub async fn connect(config: impl Into<AnyPublisherConfig>) -> Result<Self, AnyPublisherError> {
        Ok(match config.into() {
            #[cfg(feature = "rabbit")]
            AnyPublisherConfig::Rabbit(c) => Self::Rabbit(RabbitPublisher::connect(c).await?),
            #[cfg(feature = "nats")]
            AnyPublisherConfig::Nats(c) => Self::Nats(NatsPublisher::connect(c).await?),
        })
    }

    /// A publisher that connects on first use (RabbitMQ:
    /// [`RabbitPublisher::connect_lazy`]) or in the background (NATS:
    /// [`NatsPublisher::connect_lazy`]), so a relay starts while the broker is down:
    /// until connected, batches come back [`PublishOutcome::Transient`] with an
    /// `Unavailable` error and [`check_ready`](EventPublisher::check_ready) fails.
    ///
    /// # Errors
    /// [`AnyPublisherError::Rabbit`] or [`AnyPublisherError::Nats`] with the
    /// transport's `InvalidUrl` or `InvalidConfig` error when the configuration is
    /// invalid, before anything starts.
    pub async fn connect_lazy(
        config: impl Into<AnyPublisherConfig>,
    ) -> Result<Self, AnyPublisherError> {
        Ok(match config.into() {
            #[cfg(feature = "rabbit")]
            AnyPublisherConfig::Rabbit(c) => Self::Rabbit(RabbitPublisher::connect_lazy(c).await?),
            #[cfg(feature = "nats")]
            AnyPublisherConfig::Nats(c) => Self::Nats(NatsPublisher::connect_lazy(c).await?),
        })
    }

    /// The broker this publisher talks to.
    pub fn kind(&self) -> TransportKind {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(_) => TransportKind::Rabbit,
            #[cfg(feature = "nats")]
            Self::Nats(_) => TransportKind::Nats,
        }
    }

    /// The broker's name: `"rabbit"` or `"nats"` ([`TransportKind::name`]).
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// The broker URL with its password (NATS: token) replaced by `***`, for logs.
    pub fn url_redacted(&self) -> String {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.config().url_redacted(),
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.config().url_redacted(),
        }
    }

    /// The RabbitMQ publisher, if this is one (e.g. to declare the exchange).
    #[cfg(feature = "rabbit")]
    #[cfg_attr(docsrs, doc(cfg(feature = "rabbit")))]
    pub fn as_rabbit(&self) -> Option<&RabbitPublisher> {
        match self {
            Self::Rabbit(p) => Some(p),
            #[allow(unreachable_patterns, reason = "reachable when `nats` is enabled too")]
            _ => None,
        }
    }

    /// The NATS publisher, if this is one (e.g. for its JetStream context or
    /// [`NatsPublisher::ensure_stream`]).
    #[cfg(feature = "nats")]
    #[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
    pub fn as_nats(&self) -> Option<&NatsPublisher> {
        match self {
            Self::Nats(p) => Some(p),
            #[allow(
                unreachable_patterns,
                reason = "reachable when `rabbit` is enabled too"
            )]
            _ => None,
        }
    }

    /// Closes the broker connection, best effort and bounded by the transport's connect
    /// timeout: RabbitMQ sends `connection.close` (reply code 200) and stays usable
    /// (the next call reconnects); NATS flushes and drains the client, after which
    /// publishing reports `Unavailable`. Call it at exit, once the dispatcher has
    /// stopped.
    pub async fn close(&self) {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.close().await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.close().await,
        }
    }
}

#[cfg(feature = "rabbit")]
impl From<RabbitPublisher> for AnyPublisher {
    fn from(publisher: RabbitPublisher) -> Self {
        Self::Rabbit(publisher)
    }
}

#[cfg(feature = "nats")]
impl From<NatsPublisher> for AnyPublisher {
    fn from(publisher: NatsPublisher) -> Self {
        Self::Nats(publisher)
    }
}

#[async_trait]
impl EventPublisher for AnyPublisher {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.publish_batch(messages).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish_batch(messages).await,
        }
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.check_ready().await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.check_ready().await,
        }
    }

    fn publish_timeout(&self) -> Option<Duration> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.publish_timeout(),
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish_timeout(),
        }
    }

    fn destination<'a>(&'a self, routing_key: &'a str) -> std::borrow::Cow<'a, str> {
        match self {
            #[cfg(feature = "rabbit")]
            Self::Rabbit(p) => p.destination(routing_key),
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.destination(routing_key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "rabbit")]
    #[test]
    fn amqp_urls_are_rabbit() {
        for url in [
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqps://host/vhost",
        ] {
            let config = AnyPublisherConfig::from_url(url).expect("valid");
            assert_eq!(config.kind(), TransportKind::Rabbit);
        }
        let config =
            AnyPublisherConfig::from_url("amqp://guest:s3cret@127.0.0.1:5672/%2f").expect("valid");
        assert!(!config.url_redacted().contains("s3cret"));
    }

    #[cfg(feature = "nats")]
    #[test]
    fn nats_urls_are_nats() {
        for url in ["nats://127.0.0.1:4222", "tls://host:4222"] {
            let config = AnyPublisherConfig::from_url(url).expect("valid");
            assert_eq!(config.kind(), TransportKind::Nats);
            assert_eq!(config.kind().name(), "nats");
        }
    }

    #[test]
    fn unknown_schemes_are_rejected_and_redacted() {
        for url in [
            "http://user:s3cret@host",
            "AMQP://user:s3cret@host",
            "127.0.0.1:4222",
            "",
        ] {
            let err = AnyPublisherConfig::from_url(url).expect_err("no broker");
            assert!(
                matches!(err, AnyPublisherError::UnsupportedScheme { .. }),
                "{err:?}"
            );
            assert_eq!(err.kind(), ErrorKind::Permanent);
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[cfg(not(all(feature = "rabbit", feature = "nats")))]
    #[test]
    fn a_disabled_transport_names_its_feature() {
        let (url, feature) = if cfg!(feature = "rabbit") {
            ("nats://tok3n@127.0.0.1:4222", "nats")
        } else {
            ("amqp://guest:tok3n@127.0.0.1:5672/%2f", "rabbit")
        };
        let err = AnyPublisherConfig::from_url(url).expect_err("disabled");
        assert!(
            matches!(err, AnyPublisherError::TransportDisabled { feature: f, .. } if f == feature),
            "{err:?}"
        );
        assert!(!err.to_string().contains("tok3n"), "{err}");
    }

    /// An invalid transport configuration is refused by `connect` and `connect_lazy`
    /// (and `AnyConsumer::new`) with the transport's typed error, before anything
    /// connects or starts.
    #[tokio::test]
    async fn invalid_configurations_are_refused_before_connecting() {
        #[cfg(feature = "rabbit")]
        {
            let zero = RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
                .with_connect_timeout(Duration::ZERO);
            for err in [
                AnyPublisher::connect(zero.clone()).await.err(),
                AnyPublisher::connect_lazy(zero.clone()).await.err(),
            ] {
                assert!(
                    matches!(
                        err,
                        Some(AnyPublisherError::Rabbit(RabbitError::InvalidConfig {
                            field: "connect_timeout",
                            ..
                        }))
                    ),
                    "{err:?}"
                );
            }
            let err = crate::AnyConsumer::new(crate::AnyConsumerConfig::new(zero, "billing"))
                .expect_err("invalid");
            assert!(
                matches!(
                    err,
                    crate::AnyConsumerError::Rabbit(RabbitError::InvalidConfig {
                        field: "connect_timeout",
                        ..
                    })
                ),
                "{err:?}"
            );
        }
        #[cfg(feature = "nats")]
        {
            let bad = NatsConfig::new("nats://app:s3cret@127.0.0.1:notaport");
            for err in [
                AnyPublisher::connect(bad.clone()).await.err(),
                AnyPublisher::connect_lazy(bad).await.err(),
            ] {
                match err {
                    Some(AnyPublisherError::Nats(e @ NatsError::InvalidUrl { .. })) => {
                        assert!(!e.to_string().contains("s3cret"), "{e}");
                    }
                    other => panic!("expected InvalidUrl, got {other:?}"),
                }
            }
        }
    }

    #[cfg(feature = "rabbit")]
    #[tokio::test]
    async fn a_lazy_rabbit_publisher_delegates_without_a_broker() {
        let config = RabbitConfig::new("amqp://guest:guest@127.0.0.1:1/%2f");
        let timeout = RabbitPublisher::connect_lazy(config.clone())
            .await
            .expect("valid")
            .publish_timeout();
        let publisher = AnyPublisher::connect_lazy(config).await.expect("valid");
        assert_eq!(publisher.kind(), TransportKind::Rabbit);
        assert_eq!(publisher.name(), "rabbit");
        assert!(publisher.as_rabbit().is_some());
        assert_eq!(publisher.publish_timeout(), timeout);
        assert!(publisher.publish_batch(&[]).await.is_empty());
    }
}
