//! The demo's OpenTelemetry tracer, so that every event carries its producer's trace
//! to the consumer (W3C Trace Context, `traceparent`).
//!
//! With `OTEL_EXPORTER_OTLP_ENDPOINT` set (e.g. `http://127.0.0.1:4318`), spans go to
//! that OTLP collector over HTTP/protobuf (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
//! `OTEL_SERVICE_NAME` and the other standard variables apply); otherwise they are kept
//! in process by the SDK's in-memory exporter and only counted. Either way the spans of
//! the demo and of the outbox crates (`orders.place`, `outbox.publish`,
//! `inbox.handle`, …) are recorded at `INFO`, whatever `RUST_LOG` says about the log
//! output.

use std::collections::HashSet;

use anyhow::Context as _;
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, InMemorySpanExporter, SdkTracerProvider};
use tracing::level_filters::LevelFilter;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Where the spans go.
enum Sink {
    /// An OTLP/HTTP collector at this endpoint.
    Otlp(String),
    /// Kept in process.
    InProcess(InMemorySpanExporter),
}

/// The installed tracer; [`Telemetry::finish`] flushes it.
pub(crate) struct Telemetry {
    provider: SdkTracerProvider,
    sink: Sink,
}

/// Installs the global `tracing` subscriber: log output filtered by `RUST_LOG`
/// (default `warn`), and an OpenTelemetry layer recording the workspace's spans.
pub(crate) fn install() -> anyhow::Result<Telemetry> {
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .ok()
        .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
        .filter(|e| !e.trim().is_empty());
    let mut resource = Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("orders-demo");
    }
    let builder = SdkTracerProvider::builder().with_resource(resource.build());
    let (provider, sink) = match endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .build()
                .with_context(|| format!("OTLP span exporter for {endpoint}"))?;
            // The default queue (2,048 spans) overflows within a second of the demo:
            // a larger one unless OTEL_BSP_MAX_QUEUE_SIZE says otherwise.
            let mut batch = BatchConfigBuilder::default();
            if std::env::var_os("OTEL_BSP_MAX_QUEUE_SIZE").is_none() {
                batch = batch.with_max_queue_size(65_536);
            }
            // The exporter's hyper client runs on Tokio: export on Tokio tasks.
            let processor =
                opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                    exporter,
                    opentelemetry_sdk::runtime::Tokio,
                )
                .with_batch_config(batch.build())
                .build();
            (
                builder.with_span_processor(processor).build(),
                Sink::Otlp(endpoint),
            )
        }
        None => {
            let exporter = InMemorySpanExporter::default();
            (
                builder.with_simple_exporter(exporter.clone()).build(),
                Sink::InProcess(exporter),
            )
        }
    };
    let spans = Targets::new().with_targets(
        [
            "orders_example",
            "outboxkit_core",
            "outboxkit_postgres",
            "outboxkit_inbox",
            "outboxkit_rabbit",
            "outboxkit_nats",
        ]
        .map(|target| (target, LevelFilter::INFO)),
    );
    let log = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_filter(log))
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("orders-example"))
                .with_filter(spans),
        )
        .try_init()
        .context("install the tracing subscriber")?;
    Ok(Telemetry { provider, sink })
}

impl Telemetry {
    /// One line saying where the spans go.
    pub(crate) fn describe(&self) -> String {
        match &self.sink {
            Sink::Otlp(endpoint) => format!("tracing: spans exported to {endpoint} (OTLP/HTTP)"),
            Sink::InProcess(_) => "tracing: spans kept in process \
                 (set OTEL_EXPORTER_OTLP_ENDPOINT to send them to a collector)"
                .to_owned(),
        }
    }

    /// Flushes and shuts the tracer down; returns what became of the spans.
    pub(crate) async fn finish(self) -> anyhow::Result<String> {
        let Self { provider, sink } = self;
        // The in-memory exporter forgets its spans on shutdown: count them first.
        let summary = match &sink {
            Sink::Otlp(endpoint) => format!("exported to {endpoint} (OTLP/HTTP)"),
            Sink::InProcess(exporter) => {
                let spans = exporter.get_finished_spans()?;
                let traces: HashSet<_> = spans.iter().map(|s| s.span_context.trace_id()).collect();
                format!(
                    "{} in {} traces, kept in process",
                    spans.len(),
                    traces.len()
                )
            }
        };
        // Shutting down blocks until the processor has exported what it holds. A
        // collector that is down loses the spans but not the demo's verdict.
        match tokio::task::spawn_blocking(move || provider.shutdown()).await? {
            Ok(()) => {}
            Err(e) => return Ok(format!("{summary}; flush failed: {e}")),
        }
        Ok(summary)
    }
}

/// The OpenTelemetry trace id of `span` as 32 lowercase hex digits, or `None` when it
/// is not recorded by an OpenTelemetry layer.
pub(crate) fn trace_id(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let otel = cx.span();
    let sc = otel.span_context();
    sc.is_valid().then(|| format!("{:032x}", sc.trace_id()))
}
