//! Capture of the current OpenTelemetry context as W3C Trace Context headers.

use opentelemetry::trace::TraceContextExt as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The current `tracing` span's OpenTelemetry span context as a W3C `traceparent`
/// (version 00) and, when not empty, `tracestate`
/// (<https://www.w3.org/TR/trace-context/>). `None` outside a sampled or recorded
/// OpenTelemetry span (no layer installed, or no span).
pub(crate) fn current_trace_context() -> Option<(String, Option<String>)> {
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let traceparent = format!(
        "00-{:032x}-{:016x}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    let state = sc.trace_state().header();
    Some((traceparent, (!state.is_empty()).then_some(state)))
}
