//! One trace from producer to consumer: the producer's span context is captured at
//! enqueue, travels in the outbox row, is published by the relay as a W3C `traceparent`
//! header over the real RabbitMQ, and becomes the parent of the consumer's handler span.

use outboxkit_core::Consumer as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{Dispatcher, DispatcherConfig, NewMessage, OutboxProducer};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use outboxkit_rabbit::{RabbitConfig, RabbitConsumer, RabbitConsumerConfig, RabbitPublisher};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use uuid::Uuid;

struct Noop;

#[async_trait]
impl Handler<PgInbox> for Noop {
    async fn handle(
        &self,
        _: &mut PgConnection,
        _: &IncomingMessage,
        _: &HandlerContext,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.into())
}

// A current-thread runtime keeps every task on the thread that holds the subscriber.
#[tokio::test(flavor = "current_thread")]
async fn the_consumer_span_joins_the_producers_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("e2e")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let schema = format!("t_{}", Uuid::new_v4().simple());
    let url = env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let _schema = outboxkit_testkit::pg::DropSchema::new(&url, &schema);
    let outbox = PgOutbox::connect(&PgConfig::new(url).with_schema(&schema))
        .await
        .expect("PostgreSQL");
    outbox.migrate().await.expect("migrate");
    let exchange = format!("t.{}", Uuid::new_v4().simple());
    let amqp = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let _exchange = outboxkit_testkit::rabbit::DropExchange::new(&amqp, &exchange);
    let rabbit = RabbitConfig::new(amqp).with_exchange(&exchange);
    let consumer = RabbitConsumer::new(
        RabbitConsumerConfig::new(rabbit.clone(), format!("{exchange}.q"))
            .with_binding_key("#")
            .with_queue_arguments(expires_when_unused()),
    )
    .expect("consumer");
    consumer.declare().await.expect("declare");

    // Producer: enqueue inside a span; the builder captures its context.
    let producer_span = tracing::info_span!("place_order");
    let producer_trace = producer_span.context().span().span_context().trace_id();
    let producer_span_id = producer_span.context().span().span_context().span_id();
    async {
        let msg = NewMessage::builder("order", "1", "OrderPlaced")
            .payload(&1)
            .build()
            .expect("valid");
        let mut tx = outbox.begin().await.expect("begin");
        outbox.enqueue(&mut tx, &msg).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }
    .instrument(producer_span)
    .await;

    // Relay and consumer.
    let publisher = Arc::new(RabbitPublisher::connect(rabbit).await.expect("publisher"));
    let dispatcher = Dispatcher::new(Arc::new(outbox.clone()), publisher, DispatcherConfig::new())
        .expect("valid dispatcher config");
    assert_eq!(dispatcher.run_batch().await.expect("relay").published, 1);
    let store = Arc::new(
        PgOutbox::new(
            outbox.pool().clone(),
            &PgConfig::default().with_schema(&schema),
        )
        .expect("outbox")
        .inbox(),
    );
    let token = CancellationToken::new();
    let handler = IdempotentConsumer::new(
        store,
        Pipeline::new().on("OrderPlaced", "projector", Noop),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let run = consumer.run(handler, token.clone());
    let wait = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let _ = provider.force_flush();
            let spans = exporter.get_finished_spans().expect("spans");
            if let Some(span) = spans.into_iter().find(|s| s.name == "inbox.handle") {
                token.cancel();
                return Some(span);
            }
            if tokio::time::Instant::now() > deadline {
                token.cancel();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (ran, handled) = tokio::join!(run, wait);
    ran.expect("consumer");
    let handled = handled.expect("the consumer handled the message in an inbox.handle span");
    assert_eq!(
        handled.span_context.trace_id(),
        producer_trace,
        "one trace from producer to consumer"
    );
    assert_eq!(
        handled.parent_span_id, producer_span_id,
        "the producer's span is the handler's parent"
    );
}

/// Queue arguments that let RabbitMQ delete the test queue a minute after its last
/// consumer left, even when the test fails half-way.
fn expires_when_unused() -> lapin::types::FieldTable {
    let mut args = lapin::types::FieldTable::default();
    args.insert("x-expires".into(), lapin::types::AMQPValue::LongInt(60_000));
    args
}
