//! W3C Trace Context → OpenTelemetry parent of the handler span.

use opentelemetry::Context;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use outbox_core::wire::TraceParent;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// Makes the remote span described by `traceparent`/`tracestate` the parent of `span`,
/// so the handler's span joins the producer's trace (W3C Trace Context,
/// <https://www.w3.org/TR/trace-context/>). Without an OpenTelemetry layer installed
/// this does nothing.
pub(crate) fn set_remote_parent(
    span: &tracing::Span,
    traceparent: TraceParent,
    tracestate: Option<&str>,
) {
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let remote = SpanContext::new(
        TraceId::from_bytes(traceparent.trace_id.to_be_bytes()),
        SpanId::from_bytes(traceparent.parent_id.to_be_bytes()),
        TraceFlags::new(traceparent.flags),
        true,
        state,
    );
    // Fails only when the span is disabled or already started a trace: nothing to do.
    let _ = span.set_parent(Context::new().with_remote_span_context(remote));
}
