//! Consumer-side metrics, recorded through the [`metrics`] facade (no-ops until the
//! application installs a recorder, e.g. `metrics-exporter-prometheus`).
//!
//! | name | type | unit | labels | meaning |
//! |---|---|---|---|---|
//! | [`PROCESSED_TOTAL`] | counter | messages | `consumer`, `event_type` | handler ran and its transaction committed |
//! | [`DUPLICATES_TOTAL`] | counter | messages | `consumer` | already handled by this consumer (inbox record present): no effect |
//! | [`STALE_TOTAL`] | counter | messages | `consumer` | skipped: aggregate version not newer than the last applied |
//! | [`FAILURES_TOTAL`] | counter | messages | `consumer` | handler failed; its transaction rolled back |
//! | [`DEAD_TOTAL`] | counter | messages | `consumer` | given up: consumer dead letter (idempotent consumer) or durable inbox `Dead` |
//! | [`HANDLER_DURATION_SECONDS`] | histogram | seconds | `consumer` | one handler run, its transaction included (successful runs) |
//! | [`END_TO_END_SECONDS`] | histogram | seconds | `consumer` | from the event's `occurred_at` (producer clock) to the handler's commit (consumer clock) |
//! | [`UNHANDLED_TOTAL`] | counter | messages | `policy` | messages whose event type no handler subscribes to, by what the consumer's `UnhandledPolicy` did (`ack`, `dead_letter`, `requeue`) |
//! | [`DEFERRED_TOTAL`] | counter | messages | `kind` | deliveries (or durable inbox messages) deferred, uncharged, because the inbox database failed: `unavailable` (an outage), `transient` (a deadlock, a timeout), `permanent` (a misconfiguration: a missing table, a refused permission) |
//! | [`UNDECODABLE_TOTAL`] | counter | messages | `outcome` | deliveries the transport could not decode: `dead_letter` (recorded under [`UNDECODABLE_CONSUMER`](crate::UNDECODABLE_CONSUMER)), `dropped` (no usable id) |
//!
//! `consumer` is the handler's consumer name (bounded by the pipeline); `event_type`
//! is bounded by the event types the pipeline subscribes to.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// Counter: messages a handler applied and committed.
pub const PROCESSED_TOTAL: &str = "inbox_processed_total";
/// Counter: duplicate deliveries absorbed by the inbox record.
pub const DUPLICATES_TOTAL: &str = "inbox_duplicates_total";
/// Counter: stale versions skipped.
pub const STALE_TOTAL: &str = "inbox_stale_total";
/// Counter: handler failures (rolled back).
pub const FAILURES_TOTAL: &str = "inbox_handler_failures_total";
/// Counter: messages given up on (consumer dead letters, durable inbox `Dead`).
pub const DEAD_TOTAL: &str = "inbox_dead_total";
/// Histogram (seconds): one successful handler run with its transaction.
pub const HANDLER_DURATION_SECONDS: &str = "inbox_handler_duration_seconds";
/// Histogram (seconds): `occurred_at` to commit of the handler's effects.
pub const END_TO_END_SECONDS: &str = "inbox_end_to_end_seconds";
/// Counter: messages no handler subscribes to, by policy.
pub const UNHANDLED_TOTAL: &str = "inbox_unhandled_total";

/// Counter: messages deferred because the inbox database failed, by error kind.
pub const DEFERRED_TOTAL: &str = "inbox_deferred_total";
/// Counter: undecodable deliveries, by outcome.
pub const UNDECODABLE_TOTAL: &str = "inbox_undecodable_total";

/// Label: what the `UnhandledPolicy` did.
pub const LABEL_POLICY: &str = "policy";
/// Label: an error kind (`unavailable`, `transient`, `permanent`).
pub const LABEL_KIND: &str = "kind";
/// Label: what became of an undecodable delivery (`dead_letter`, `dropped`).
pub const LABEL_OUTCOME: &str = "outcome";

/// Label: the handler's consumer name.
pub const LABEL_CONSUMER: &str = "consumer";
/// Label: the message's event type.
pub const LABEL_EVENT_TYPE: &str = "event_type";

/// Registers descriptions and units with the installed recorder (optional).
pub fn describe() {
    use ::metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        PROCESSED_TOTAL,
        Unit::Count,
        "Messages a handler applied and committed, by consumer and event type"
    );
    describe_counter!(
        DUPLICATES_TOTAL,
        Unit::Count,
        "Duplicate deliveries absorbed by the inbox, by consumer"
    );
    describe_counter!(
        STALE_TOTAL,
        Unit::Count,
        "Stale aggregate versions skipped, by consumer"
    );
    describe_counter!(
        FAILURES_TOTAL,
        Unit::Count,
        "Handler failures (rolled back), by consumer"
    );
    describe_counter!(
        DEAD_TOTAL,
        Unit::Count,
        "Messages given up on (consumer dead letters, durable inbox Dead), by consumer"
    );
    describe_histogram!(
        HANDLER_DURATION_SECONDS,
        Unit::Seconds,
        "One successful handler run with its transaction"
    );
    describe_counter!(
        UNHANDLED_TOTAL,
        Unit::Count,
        "Messages whose event type no handler subscribes to, by policy (ack, dead_letter, requeue)"
    );
    describe_counter!(
        DEFERRED_TOTAL,
        Unit::Count,
        "Messages deferred, uncharged, because the inbox database failed, by error kind"
    );
    describe_counter!(
        UNDECODABLE_TOTAL,
        Unit::Count,
        "Undecodable deliveries, by outcome (dead_letter, dropped)"
    );
    describe_histogram!(
        END_TO_END_SECONDS,
        Unit::Seconds,
        "From the event's occurred_at to the commit of the handler's effects"
    );
}

/// Records a committed handler run: processed count, handler duration and, when the
/// message carries `occurred_at`, end-to-end latency (negative skew recorded as 0).
pub(crate) fn processed(
    consumer: &str,
    event_type: &str,
    took: Duration,
    occurred_at: Option<DateTime<Utc>>,
) {
    ::metrics::counter!(PROCESSED_TOTAL, LABEL_CONSUMER => consumer.to_owned(), LABEL_EVENT_TYPE => event_type.to_owned()).increment(1);
    ::metrics::histogram!(HANDLER_DURATION_SECONDS, LABEL_CONSUMER => consumer.to_owned())
        .record(took.as_secs_f64());
    if let Some(at) = occurred_at {
        let secs = (Utc::now() - at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        ::metrics::histogram!(END_TO_END_SECONDS, LABEL_CONSUMER => consumer.to_owned())
            .record(secs.max(0.0));
    }
}

/// Records a duplicate absorbed by the inbox.
pub(crate) fn duplicate(consumer: &str) {
    ::metrics::counter!(DUPLICATES_TOTAL, LABEL_CONSUMER => consumer.to_owned()).increment(1);
}

/// Records a stale version skipped.
pub(crate) fn stale(consumer: &str) {
    ::metrics::counter!(STALE_TOTAL, LABEL_CONSUMER => consumer.to_owned()).increment(1);
}

/// Records a handler failure.
pub(crate) fn failed(consumer: &str) {
    ::metrics::counter!(FAILURES_TOTAL, LABEL_CONSUMER => consumer.to_owned()).increment(1);
}

/// Records a message given up on by `consumer`.
pub(crate) fn dead(consumer: &str) {
    ::metrics::counter!(DEAD_TOTAL, LABEL_CONSUMER => consumer.to_owned()).increment(1);
}

/// Records a message no handler subscribes to, handled by `policy`.
pub(crate) fn unhandled(policy: &'static str) {
    ::metrics::counter!(UNHANDLED_TOTAL, LABEL_POLICY => policy).increment(1);
}

/// Records `messages` deferred because of a store error of `kind`.
pub(crate) fn deferred(kind: outboxkit_core::ErrorKind, messages: usize) {
    let kind = match kind {
        outboxkit_core::ErrorKind::Unavailable => "unavailable",
        outboxkit_core::ErrorKind::Transient => "transient",
        _ => "permanent",
    };
    ::metrics::counter!(DEFERRED_TOTAL, LABEL_KIND => kind)
        .increment(u64::try_from(messages).unwrap_or(u64::MAX));
}

/// Records an undecodable delivery and what became of it.
pub(crate) fn undecodable(outcome: &'static str) {
    ::metrics::counter!(UNDECODABLE_TOTAL, LABEL_OUTCOME => outcome).increment(1);
}
