//! The message's W3C trace context becomes the OpenTelemetry parent of the handler span.

use std::sync::Arc;

use async_trait::async_trait;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outboxkit_core::consumer::HandlerDecision;
use outboxkit_core::wire::{IncomingMessage, TraceParent};
use outboxkit_inbox::{
    ConsumerConfig, Handler, HandlerContext, HandlerError, IdempotentConsumer, Pipeline,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::PgConnection;
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

#[tokio::test(flavor = "current_thread")]
async fn handler_span_joins_the_producers_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let schema = format!("t_{}", Uuid::new_v4().simple());
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let _schema = outboxkit_testkit::pg::DropSchema::new(&url, &schema);
    let outbox = PgOutbox::connect(&PgConfig::new(url).with_schema(&schema))
        .await
        .expect("PostgreSQL");
    outbox.migrate().await.expect("migrate");
    let store = Arc::new(
        PgOutbox::new(
            outbox.pool().clone(),
            &PgConfig::default().with_schema(&schema),
        )
        .expect("outbox")
        .inbox(),
    );
    let consumer = IdempotentConsumer::new(
        store,
        Pipeline::new().on("OrderPlaced", "projector", Noop),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");

    let producer = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .expect("valid");
    let mut msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    msg.traceparent = Some(producer);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);

    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().expect("spans");
    let handle = spans
        .iter()
        .find(|s| s.name == "inbox.handle")
        .expect("an inbox.handle span was exported");
    assert_eq!(
        format!(
            "{:032x}",
            u128::from_be_bytes(handle.span_context.trace_id().to_bytes())
        ),
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "same trace id as the producer"
    );
    assert_eq!(
        format!(
            "{:016x}",
            u64::from_be_bytes(handle.parent_span_id.to_bytes())
        ),
        "00f067aa0ba902b7",
        "the producer's span is the parent"
    );
}
