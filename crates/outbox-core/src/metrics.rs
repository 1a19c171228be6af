//! Relay metrics, recorded through the [`metrics`] facade.
//!
//! The library only records; an application installs a recorder (the `outbox` binary
//! installs `metrics-exporter-prometheus` and serves `/metrics`). Without a recorder
//! every call is a no-op. Names follow the Prometheus conventions: base units
//! (seconds, messages), `_total` for counters.
//!
//! | name | type | unit | labels | meaning |
//! |---|---|---|---|---|
//! | [`PUBLISHED_TOTAL`] | counter | messages | – | confirmed by the broker and recorded `Sent` |
//! | [`PUBLISH_FAILURES_TOTAL`] | counter | messages | `kind`, `event_type` | publish attempts that failed, by [`kind`](KIND_TRANSIENT) |
//! | [`RETRIED_TOTAL`] | counter | messages | `event_type` | scheduled for another attempt with backoff |
//! | [`DEAD_TOTAL`] | counter | messages | `event_type` | moved to `Dead` (permanent failure or attempts exhausted) |
//! | [`RELEASED_TOTAL`] | counter | messages | – | handed back without charge (outage, shutdown) |
//! | [`FENCED_TOTAL`] | counter | messages | – | completions lost to a newer claim (stale lease) |
//! | [`CLAIM_BATCH_SIZE`] | histogram | messages | – | size of each non-empty claimed batch |
//! | [`PUBLISH_DURATION_SECONDS`] | histogram | seconds | – | publish of one batch, all confirms included |
//! | [`CLAIM_WAIT_SECONDS`] | histogram | seconds | – | a publisher's wait for a claimed batch (beside the publish time: is a busy relay waiting on the database?) |
//! | [`COMMIT_TO_PUBLISH_SECONDS`] | histogram | seconds | – | row `created_at` (database clock) to broker confirm (relay clock), per message |
//! | [`CIRCUIT_OPEN`] | gauge | 0/1 | – | 1 while the broker is considered unreachable |
//! | [`PENDING_MESSAGES`] | gauge | messages | – | `New` + `Processing` rows (queue depth) |
//! | [`OLDEST_PENDING_AGE_SECONDS`] | gauge | seconds | – | age of the oldest pending row (queue lag) |
//! | [`DEAD_MESSAGES`] | gauge | messages | – | rows in `Dead` now |
//!
//! The dispatcher records the counters and histograms; the three table gauges need a
//! query, so whoever owns the relay process sets them periodically from
//! [`OutboxStore::stats`](crate::OutboxStore::stats) with [`set_table_gauges`].
//!
//! Commit-to-publish latency mixes two clocks (the row's `created_at` comes from the
//! database); skew between them shifts it, and negative values are recorded as 0.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::error::ErrorKind;
use crate::store::OutboxStats;

/// Counter: messages confirmed by the broker and recorded `Sent`.
pub const PUBLISHED_TOTAL: &str = "outbox_published_total";
/// Counter: failed publish attempts; labels [`LABEL_KIND`] and [`LABEL_EVENT_TYPE`].
pub const PUBLISH_FAILURES_TOTAL: &str = "outbox_publish_failures_total";
/// Counter: messages scheduled for a retry; label [`LABEL_EVENT_TYPE`].
pub const RETRIED_TOTAL: &str = "outbox_retried_total";
/// Counter: messages moved to `Dead`; label [`LABEL_EVENT_TYPE`].
pub const DEAD_TOTAL: &str = "outbox_dead_total";
/// Counter: messages released without charging an attempt.
pub const RELEASED_TOTAL: &str = "outbox_released_total";
/// Counter: completions fenced out by a newer claim.
pub const FENCED_TOTAL: &str = "outbox_fenced_total";
/// Histogram (messages): size of each non-empty claimed batch.
pub const CLAIM_BATCH_SIZE: &str = "outbox_claim_batch_size";
/// Histogram (seconds): publishing one batch, confirms included.
pub const PUBLISH_DURATION_SECONDS: &str = "outbox_publish_duration_seconds";
/// Histogram (seconds): how long a publisher waited for a claimed batch before it could
/// publish again. With a backlog, time spent waiting on the store; without one, idle
/// time. Its `_sum` rate beside [`PUBLISH_DURATION_SECONDS`]'s says whether a busy relay
/// is bound by the broker (publishers rarely wait) or by the database.
pub const CLAIM_WAIT_SECONDS: &str = "outbox_claim_wait_seconds";
/// Histogram (seconds): from the row's commit (`created_at`) to its broker confirm.
pub const COMMIT_TO_PUBLISH_SECONDS: &str = "outbox_commit_to_publish_seconds";
/// Gauge (0 or 1): whether the dispatcher's circuit is open.
pub const CIRCUIT_OPEN: &str = "outbox_circuit_open";
/// Gauge (messages): `New` + `Processing` rows.
pub const PENDING_MESSAGES: &str = "outbox_pending_messages";
/// Gauge (seconds): age of the oldest `New` or `Processing` row; 0 when none.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_oldest_pending_age_seconds";
/// Gauge (messages): rows in `Dead`.
pub const DEAD_MESSAGES: &str = "outbox_dead_messages";

/// Label: the message's event type.
pub const LABEL_EVENT_TYPE: &str = "event_type";
/// Label: failure kind, one of [`KIND_TRANSIENT`], [`KIND_UNAVAILABLE`],
/// [`KIND_PERMANENT`].
pub const LABEL_KIND: &str = "kind";
/// `kind` value: the broker refused or timed out; retried with backoff.
pub const KIND_TRANSIENT: &str = "transient";
/// `kind` value: the broker was unreachable; released, circuit opened.
pub const KIND_UNAVAILABLE: &str = "unavailable";
/// `kind` value: cannot succeed (unroutable, too large, invalid); dead at once.
pub const KIND_PERMANENT: &str = "permanent";

/// Registers descriptions and units of every relay metric with the installed
/// recorder (optional: recording works without it, the exposition just lacks `# HELP`).
pub fn describe() {
    use ::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        PUBLISHED_TOTAL,
        Unit::Count,
        "Messages confirmed by the broker and recorded Sent"
    );
    describe_counter!(
        PUBLISH_FAILURES_TOTAL,
        Unit::Count,
        "Failed publish attempts by kind (transient, unavailable, permanent) and event type"
    );
    describe_counter!(
        RETRIED_TOTAL,
        Unit::Count,
        "Messages scheduled for another attempt, by event type"
    );
    describe_counter!(
        DEAD_TOTAL,
        Unit::Count,
        "Messages moved to Dead, by event type"
    );
    describe_counter!(
        RELEASED_TOTAL,
        Unit::Count,
        "Messages handed back without charging an attempt (outage, shutdown)"
    );
    describe_counter!(
        FENCED_TOTAL,
        Unit::Count,
        "Completions that changed nothing because a newer claim took over"
    );
    describe_histogram!(
        CLAIM_BATCH_SIZE,
        Unit::Count,
        "Messages per non-empty claimed batch"
    );
    describe_histogram!(
        PUBLISH_DURATION_SECONDS,
        Unit::Seconds,
        "Publishing one batch, broker confirms included"
    );
    describe_histogram!(
        CLAIM_WAIT_SECONDS,
        Unit::Seconds,
        "A publisher's wait for a claimed batch (with a backlog: time waiting on the store)"
    );
    describe_histogram!(
        COMMIT_TO_PUBLISH_SECONDS,
        Unit::Seconds,
        "From the outbox row's commit (created_at) to its broker confirm"
    );
    describe_gauge!(
        CIRCUIT_OPEN,
        "1 while the broker is considered unreachable (circuit open)"
    );
    describe_gauge!(
        PENDING_MESSAGES,
        Unit::Count,
        "Outbox rows New or Processing"
    );
    describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest New or Processing row (queue lag)"
    );
    describe_gauge!(DEAD_MESSAGES, Unit::Count, "Outbox rows Dead");
}

/// The `kind` label value of an error kind.
pub fn kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => KIND_UNAVAILABLE,
        ErrorKind::Permanent => KIND_PERMANENT,
        _ => KIND_TRANSIENT,
    }
}

/// Records a claimed batch of `n` messages (ignored when empty).
pub fn claimed(n: usize) {
    if n > 0 {
        ::metrics::histogram!(CLAIM_BATCH_SIZE).record(n as f64);
    }
}

/// Records how long publishing one batch took.
pub fn publish_duration(elapsed: Duration) {
    ::metrics::histogram!(PUBLISH_DURATION_SECONDS).record(elapsed.as_secs_f64());
}

/// Records how long a publisher waited for the claimed batch it now publishes.
pub fn claim_wait(elapsed: Duration) {
    ::metrics::histogram!(CLAIM_WAIT_SECONDS).record(elapsed.as_secs_f64());
}

/// Records commit-to-publish latency for each message whose `published` flag is set,
/// measured against the relay's clock now. `created_at` pairs with `published`.
pub fn commit_to_publish<'a>(
    created_at_and_published: impl IntoIterator<Item = (&'a DateTime<Utc>, bool)>,
) {
    let now = Utc::now();
    let histogram = ::metrics::histogram!(COMMIT_TO_PUBLISH_SECONDS);
    for (created_at, published) in created_at_and_published {
        if published {
            let secs = (now - *created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
            histogram.record(secs.max(0.0));
        }
    }
}

/// Records one failed publish attempt of a message of `event_type`.
pub fn publish_failed(kind: ErrorKind, event_type: &str) {
    ::metrics::counter!(PUBLISH_FAILURES_TOTAL, LABEL_KIND => kind_label(kind), LABEL_EVENT_TYPE => event_type.to_owned()).increment(1);
}

/// Records a message scheduled for a retry.
pub fn retried(event_type: &str) {
    ::metrics::counter!(RETRIED_TOTAL, LABEL_EVENT_TYPE => event_type.to_owned()).increment(1);
}

/// Records a message moved to `Dead`.
pub fn dead(event_type: &str) {
    ::metrics::counter!(DEAD_TOTAL, LABEL_EVENT_TYPE => event_type.to_owned()).increment(1);
}

/// Records the recorded outcomes of a batch: `published` Sent, `released` handed back,
/// `fenced` lost to a newer claim.
pub fn completed(published: usize, released: usize, fenced: usize) {
    ::metrics::counter!(PUBLISHED_TOTAL).increment(published as u64);
    ::metrics::counter!(RELEASED_TOTAL).increment(released as u64);
    ::metrics::counter!(FENCED_TOTAL).increment(fenced as u64);
}

/// Records whether the circuit is open.
pub fn circuit(open: bool) {
    ::metrics::gauge!(CIRCUIT_OPEN).set(if open { 1.0 } else { 0.0 });
}

/// Sets the table gauges ([`PENDING_MESSAGES`], [`OLDEST_PENDING_AGE_SECONDS`],
/// [`DEAD_MESSAGES`]) from a stats snapshot.
pub fn set_table_gauges(stats: &OutboxStats) {
    ::metrics::gauge!(PENDING_MESSAGES).set((stats.new + stats.processing) as f64);
    ::metrics::gauge!(OLDEST_PENDING_AGE_SECONDS)
        .set(stats.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()));
    ::metrics::gauge!(DEAD_MESSAGES).set(stats.dead as f64);
}
