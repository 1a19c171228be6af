//! What the copies of the quick start in this project share (`cargo xtask outside`,
//! xtask/src/outside.rs): the publisher's configuration from the environment, so that
//! each run has an exchange (RabbitMQ) or subject prefix (NATS) of its own.

use outboxkit::AnyPublisherConfig;

/// The configuration `AnyPublisherConfig::from_url(OUTBOX_BROKER_URL)` gives, read
/// with the transport's `from_env` instead: `OUTBOX_EXCHANGE` (RabbitMQ) and
/// `OUTBOX_SUBJECT_PREFIX` (NATS) name where the run publishes.
///
/// # Errors
/// `OUTBOX_BROKER_URL` unset or neither `amqp://` nor `nats://`, or a setting the
/// transport refuses.
pub fn publisher_config() -> Result<AnyPublisherConfig, Box<dyn std::error::Error>> {
    let url = std::env::var("OUTBOX_BROKER_URL")?;
    if url.starts_with("amqp://") {
        Ok(outboxkit::rabbit::RabbitConfig::from_env()?.into())
    } else if url.starts_with("nats://") {
        Ok(outboxkit::nats::NatsConfig::from_env()?.into())
    } else {
        Err(format!("OUTBOX_BROKER_URL={url}: neither amqp:// nor nats://").into())
    }
}
