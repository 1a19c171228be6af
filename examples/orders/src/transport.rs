//! TransportKind selection for the demo: RabbitMQ (default) or NATS JetStream. Everything
//! transport-specific lives here (connection, topology, publisher and consumer
//! construction); the producers, the relay, the projection handler and the
//! reconciliation are the same for both.

pub(crate) use outboxkit_core::TransportKind;
use std::time::Duration;

use anyhow::Context as _;
use outboxkit::AnyConsumer;
use outboxkit::AnyPublisher;
use outboxkit_nats::{
    NatsConfig, NatsConsumer, NatsConsumerConfig, NatsPublisher, StreamSetup, async_nats,
};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};

/// Publisher, consumer, and what the reconciliation needs to know about the broker.
pub(crate) struct Wiring {
    pub(crate) publisher: AnyPublisher,
    pub(crate) consumer: AnyConsumer,
    pub(crate) broker: Broker,
}

/// What the reconciliation asks the broker.
pub(crate) struct Broker {
    /// The NATS stream, to count what it stored (`None` with RabbitMQ).
    stream: Option<(async_nats::jetstream::Context, String)>,
}

impl Broker {
    /// Duplicates the broker delivers when a relay that crashed after publishing `n`
    /// messages republishes them: RabbitMQ delivers them again (the inbox absorbs
    /// them); JetStream drops them server-side (same `Nats-Msg-Id` inside the stream's
    /// duplicate window), so none reach the consumer.
    pub(crate) fn relay_duplicates_delivered(&self, republished: usize) -> u64 {
        if self.stream.is_some() {
            0
        } else {
            republished as u64
        }
    }

    /// Messages the NATS stream holds (`None` with RabbitMQ).
    pub(crate) async fn stored_messages(&self) -> anyhow::Result<Option<u64>> {
        let Some((js, name)) = &self.stream else {
            return Ok(None);
        };
        let mut stream = js.get_stream(name).await?;
        Ok(Some(stream.info().await?.state.messages))
    }
}

/// Connects to the broker of `transport`, resets the demo's topology (named after
/// `schema`) and builds the publisher and the projection's consumer. The consumer's
/// queue or durable consumer exists when this returns, so nothing published afterwards
/// is missed.
pub(crate) async fn wire(
    transport: TransportKind,
    broker_url: &str,
    schema: &str,
) -> anyhow::Result<Wiring> {
    match transport {
        TransportKind::Rabbit => wire_rabbit(broker_url, schema).await,
        TransportKind::Nats => wire_nats(broker_url, schema).await,
    }
}

/// A durable topic exchange and the projection's queue bound to `OrderPlaced`.
async fn wire_rabbit(amqp_url: &str, schema: &str) -> anyhow::Result<Wiring> {
    let exchange = format!("{schema}.events");
    let queue = format!("{schema}.projection");
    let rabbit = RabbitConfig::new(amqp_url).with_exchange(&exchange);
    let publisher = RabbitPublisher::connect(rabbit.clone())
        .await
        .context("connect to RabbitMQ (is it running? `cargo xtask services`)")?;
    // Start from an empty queue: delete what an earlier run may have left behind.
    {
        let conn =
            lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await?;
        let ch = conn.create_channel().await?;
        ch.queue_delete(
            queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await?;
        conn.close(200, "reset".into()).await?;
    }
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit, &queue)
            .with_binding_keys(["OrderPlaced"])
            .with_prefetch(200),
    )?;
    // Declare and bind the queue before anything is published, so nothing is missed.
    consumer.declare().await?;
    Ok(Wiring {
        publisher: publisher.into(),
        consumer: consumer.into(),
        broker: Broker { stream: None },
    })
}

/// A file-storage stream `{schema}_events` capturing `{schema}.events.>` with a
/// 2-minute duplicate window, and a durable pull consumer `projection` of
/// `OrderPlaced`.
async fn wire_nats(nats_url: &str, schema: &str) -> anyhow::Result<Wiring> {
    let config: NatsConfig = outboxkit_nats::NatsConfig::new(nats_url)
        .with_subject_prefix(format!("{schema}.events"))
        .with_connection_name(format!("{schema}-demo"));
    let publisher = NatsPublisher::connect(config.clone())
        .await
        .context("connect to NATS (is it running with JetStream? `cargo xtask services`)")?;
    let stream = format!("{schema}_events");
    // Start from an empty stream (and no consumer position): delete an earlier run's.
    let js = publisher.jetstream().clone();
    match js.delete_stream(&stream).await {
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                async_nats::jetstream::context::DeleteStreamErrorKind::JetStream(ref js)
                    if js.error_code() == async_nats::jetstream::ErrorCode::STREAM_NOT_FOUND
            ) => {}
        Err(e) => return Err(e).context("delete the demo stream of an earlier run"),
    }
    publisher
        .ensure_stream(
            &StreamSetup::for_config(&stream, &config)
                .with_duplicate_window(Duration::from_secs(120)),
        )
        .await?;
    let consumer = NatsConsumer::new(
        NatsConsumerConfig::new(config.clone(), &stream, "projection")
            .with_filter_subject(config.subject_for("OrderPlaced"))
            .with_concurrency(200)
            // The demo's "crash between commit and ack" answers Requeue: come back soon.
            .with_nak_delays(vec![Duration::from_millis(200)]),
    )?;
    consumer.declare().await?;
    Ok(Wiring {
        publisher: publisher.into(),
        consumer: consumer.into(),
        broker: Broker {
            stream: Some((js, stream)),
        },
    })
}
