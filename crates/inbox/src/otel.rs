//! W3C Trace Context → OpenTelemetry parent of the handler span (or, for a handler
//! call on a batch, a link per message).

use opentelemetry::Context;
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
};
use outboxkit_core::wire::TraceParent;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

fn remote_context(traceparent: TraceParent, tracestate: Option<&str>) -> SpanContext {
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    SpanContext::new(
        TraceId::from_bytes(traceparent.trace_id.to_be_bytes()),
        SpanId::from_bytes(traceparent.parent_id.to_be_bytes()),
        TraceFlags::new(traceparent.flags),
        true,
        state,
    )
}

/// Links `span` to the remote span described by `traceparent`/`tracestate`: a handler
/// call on a batch has one link per message (OpenTelemetry's model for batch
/// processing). Without an OpenTelemetry layer installed this does nothing.
pub(crate) fn add_remote_link(
    span: &tracing::Span,
    traceparent: TraceParent,
    tracestate: Option<&str>,
) {
    span.add_link(remote_context(traceparent, tracestate));
}

/// Makes the remote span described by `traceparent`/`tracestate` the parent of `span`,
/// so the handler's span joins the producer's trace (W3C Trace Context,
/// <https://www.w3.org/TR/trace-context/>). Without an OpenTelemetry layer installed
/// this does nothing.
pub(crate) fn set_remote_parent(
    span: &tracing::Span,
    traceparent: TraceParent,
    tracestate: Option<&str>,
) {
    let remote = remote_context(traceparent, tracestate);
    // Fails only when the span is disabled or already started a trace: nothing to do.
    let _ = span.set_parent(Context::new().with_remote_span_context(remote));
}
