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
//! | [`PUBLISH_FAILURES_TOTAL`] | counter | messages | `kind`, `event_type` (bounded) | publish attempts that failed, by [`kind`](KIND_TRANSIENT) |
//! | [`RETRIED_TOTAL`] | counter | messages | `event_type` (bounded) | scheduled for another attempt with backoff |
//! | [`DEAD_TOTAL`] | counter | messages | `event_type` (bounded) | moved to `Dead` (permanent failure or attempts exhausted) |
//! | [`RELEASED_TOTAL`] | counter | messages | – | handed back without charge (outage, shutdown) |
//! | [`DEFERRED_TOTAL`] | counter | messages | `event_type` (bounded) | held back without charge because their destination refused messages (a full queue or stream) |
//! | [`FENCED_TOTAL`] | counter | messages | – | completions lost to a newer claim (stale lease) |
//! | [`CLAIM_BATCH_SIZE`] | histogram | messages | – | size of each non-empty claimed batch |
//! | [`PUBLISH_DURATION_SECONDS`] | histogram | seconds | – | publish of one batch, all confirms included |
//! | [`CLAIM_WAIT_SECONDS`] | histogram | seconds | – | a publisher's wait for a claimed batch (beside the publish time: is a busy relay waiting on the database?) |
//! | [`COMMIT_TO_PUBLISH_SECONDS`] | histogram | seconds | – | row `created_at` (database clock) to broker confirm (relay clock), per message |
//! | [`CIRCUIT_OPEN`] | gauge | 0/1 | – | 1 while the broker is considered unreachable |
//! | [`DESTINATIONS_OPEN`] | gauge | destinations | – | destinations (routing keys) whose circuit is open: their messages are held back while the others flow |
//! | [`PENDING_MESSAGES`] | gauge | messages | – | `New` + `Processing` rows (queue depth); the `outbox` relay counts at most 10,000 (then: at least that many) |
//! | [`OLDEST_PENDING_AGE_SECONDS`] | gauge | seconds | – | age of the oldest pending row (queue lag); the `outbox` relay's is exact below 10,000 pending, else the backlog head's |
//! | [`DEAD_MESSAGES`] | gauge | messages | – | rows in `Dead` now; the `outbox` relay counts at most 10,000 |
//! | [`DEAD_ROW_VERSIONS`] | gauge | row versions | – | dead row versions of the outbox table waiting for VACUUM (PostgreSQL's statistics) |
//! | [`OLDEST_TRANSACTION_AGE_SECONDS`] | gauge | seconds | – | age of the oldest transaction of the database holding the xmin horizon back (nothing older can be vacuumed); 0 when none |
//!
//! The dispatcher records the counters and histograms; the three table gauges need a
//! query, so whoever owns the relay process sets them periodically from
//! [`OutboxStore::stats`](crate::OutboxStore::stats) with [`set_table_gauges`]. The
//! `outbox` relay uses a bounded variant (PostgreSQL's `PgOutbox::pending_stats`) that
//! costs the same at any backlog: exact counts cost a visit per row, every few seconds
//! per relay.
//!
//! Commit-to-publish latency mixes two clocks (the row's `created_at` comes from the
//! database); skew between them shifts it, and negative values are recorded as 0.
//!
//! # Bounded `event_type` labels
//!
//! The `event_type` label comes from message content, chosen by producers, and every
//! distinct value is a time series of its own in the recorder and in Prometheus. So the
//! values are bounded (see [`event_type_label`]): the first
//! [`DEFAULT_MAX_EVENT_TYPE_LABELS`] (100) distinct values seen by the process keep their
//! own label, and any further value, or a value longer than
//! [`MAX_EVENT_TYPE_LABEL_BYTES`] (64) bytes or with a character outside
//! `[A-Za-z0-9._:-]`, is reported as [`EVENT_TYPE_OTHER`] (`other`). The bound can be
//! changed once, before the first label is recorded, with [`set_max_event_type_labels`].
//! Poison rows, whose event type may be unreadable, are counted under
//! [`EVENT_TYPE_POISON`] (`(poison)`).

use std::collections::HashSet;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use ::metrics::SharedString;
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
/// Counter: messages held back without charge for their destination; label
/// [`LABEL_EVENT_TYPE`].
pub const DEFERRED_TOTAL: &str = "outbox_deferred_total";
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
/// Gauge (destinations): routing keys whose circuit is open.
pub const DESTINATIONS_OPEN: &str = "outbox_destinations_open";
/// Gauge (messages): `New` + `Processing` rows.
pub const PENDING_MESSAGES: &str = "outbox_pending_messages";
/// Gauge (seconds): age of the oldest `New` or `Processing` row; 0 when none.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_oldest_pending_age_seconds";
/// Gauge (messages): rows in `Dead`.
pub const DEAD_MESSAGES: &str = "outbox_dead_messages";
/// Gauge (row versions): dead row versions of the outbox table waiting for VACUUM
/// ([`VacuumPressure::dead_rows`](crate::VacuumPressure)); PostgreSQL only.
pub const DEAD_ROW_VERSIONS: &str = "outbox_dead_row_versions";
/// Gauge (seconds): age of the oldest transaction holding the xmin horizon back
/// ([`VacuumPressure::oldest_transaction_age`](crate::VacuumPressure)); 0 when none;
/// PostgreSQL only.
pub const OLDEST_TRANSACTION_AGE_SECONDS: &str = "outbox_oldest_transaction_age_seconds";

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

/// `event_type` value of every value beyond the bound (see the [module docs](self)).
pub const EVENT_TYPE_OTHER: &str = "other";
/// `event_type` value of poison rows (undecodable, crash loops): their event type may be
/// unreadable.
pub const EVENT_TYPE_POISON: &str = "(poison)";
/// Default of [`set_max_event_type_labels`]: distinct `event_type` values that keep a
/// label of their own.
pub const DEFAULT_MAX_EVENT_TYPE_LABELS: usize = 100;
/// Longest `event_type` value, in bytes, that keeps a label of its own.
pub const MAX_EVENT_TYPE_LABEL_BYTES: usize = 64;

/// The process's `event_type` values, fixed at the first use.
static EVENT_TYPE_LABELS: OnceLock<LabelSet> = OnceLock::new();

/// Sets how many distinct `event_type` values keep a label of their own (default
/// [`DEFAULT_MAX_EVENT_TYPE_LABELS`]); the rest are reported as [`EVENT_TYPE_OTHER`].
/// Takes effect only once per process and only before the first `event_type` label is
/// recorded: call it at start-up, before the dispatcher runs.
///
/// # Errors
/// `Err` with the bound in force, changing nothing, when the bound is already fixed (set
/// before, or fixed at its default by the first label recorded).
pub fn set_max_event_type_labels(max: usize) -> Result<(), usize> {
    EVENT_TYPE_LABELS
        .set(LabelSet::new(max))
        .map_err(|_| event_type_labels().max)
}

fn event_type_labels() -> &'static LabelSet {
    EVENT_TYPE_LABELS.get_or_init(|| LabelSet::new(DEFAULT_MAX_EVENT_TYPE_LABELS))
}

/// The `event_type` label value recorded for a message of `event_type`: the value
/// itself while it is one of the first distinct values of the process (see
/// [`set_max_event_type_labels`]), at most [`MAX_EVENT_TYPE_LABEL_BYTES`] long and made
/// of `[A-Za-z0-9._:-]`; otherwise [`EVENT_TYPE_OTHER`]. A known value costs a read lock
/// and a reference count, no allocation.
pub fn event_type_label(event_type: &str) -> SharedString {
    event_type_labels().label(event_type)
}

/// Label values admitted first come, first served, up to `max` distinct ones.
#[derive(Debug)]
struct LabelSet {
    max: usize,
    seen: RwLock<HashSet<Arc<str>>>,
}

impl LabelSet {
    fn new(max: usize) -> Self {
        Self {
            max,
            seen: RwLock::new(HashSet::new()),
        }
    }

    fn label(&self, value: &str) -> SharedString {
        let other = || SharedString::const_str(EVENT_TYPE_OTHER);
        if !is_plain_label(value) {
            return other();
        }
        {
            let seen = self.seen.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(known) = seen.get(value) {
                return SharedString::from_shared(Arc::clone(known));
            }
            if seen.len() >= self.max {
                return other();
            }
        }
        let mut seen = self.seen.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = seen.get(value) {
            return SharedString::from_shared(Arc::clone(known));
        }
        if seen.len() >= self.max {
            return other();
        }
        let admitted: Arc<str> = value.into();
        seen.insert(Arc::clone(&admitted));
        SharedString::from_shared(admitted)
    }
}

/// Non-empty, at most [`MAX_EVENT_TYPE_LABEL_BYTES`], only `[A-Za-z0-9._:-]`.
fn is_plain_label(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= MAX_EVENT_TYPE_LABEL_BYTES
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

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
        DEFERRED_TOTAL,
        Unit::Count,
        "Messages held back without charge because their destination refused messages, by event type"
    );
    describe_gauge!(
        DESTINATIONS_OPEN,
        Unit::Count,
        "Destinations (routing keys) whose circuit is open"
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
        "Outbox rows New or Processing (the outbox relay counts at most 10000: that value means at least 10000)"
    );
    describe_gauge!(
        OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest New or Processing row (queue lag); the outbox relay's is exact below 10000 pending rows, else the age of the oldest of the first 10000 in claim order"
    );
    describe_gauge!(
        DEAD_MESSAGES,
        Unit::Count,
        "Outbox rows Dead (the outbox relay counts at most 10000: that value means at least 10000)"
    );
    describe_gauge!(
        DEAD_ROW_VERSIONS,
        Unit::Count,
        "Dead row versions of the outbox table waiting for VACUUM (PostgreSQL statistics)"
    );
    describe_gauge!(
        OLDEST_TRANSACTION_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest transaction of the database holding the xmin horizon back; 0 when none"
    );
}

/// The `kind` label value of an error kind.
pub fn kind_label(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::Unavailable => KIND_UNAVAILABLE,
        ErrorKind::Permanent | ErrorKind::InvalidData => KIND_PERMANENT,
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

/// Records one failed publish attempt of a message of `event_type` (label bounded by
/// [`event_type_label`]).
pub fn publish_failed(kind: ErrorKind, event_type: &str) {
    ::metrics::counter!(PUBLISH_FAILURES_TOTAL, LABEL_KIND => kind_label(kind), LABEL_EVENT_TYPE => event_type_label(event_type)).increment(1);
}

/// Records a message scheduled for a retry (label bounded by [`event_type_label`]).
pub fn retried(event_type: &str) {
    ::metrics::counter!(RETRIED_TOTAL, LABEL_EVENT_TYPE => event_type_label(event_type))
        .increment(1);
}

/// Records a message moved to `Dead` (label bounded by [`event_type_label`]).
pub fn dead(event_type: &str) {
    ::metrics::counter!(DEAD_TOTAL, LABEL_EVENT_TYPE => event_type_label(event_type)).increment(1);
}

/// Records a poison row moved to `Dead`, under [`EVENT_TYPE_POISON`].
pub fn dead_poison() {
    ::metrics::counter!(DEAD_TOTAL, LABEL_EVENT_TYPE => EVENT_TYPE_POISON).increment(1);
}

/// Records the recorded outcomes of a batch: `published` Sent, `released` handed back,
/// `fenced` lost to a newer claim.
pub fn completed(published: usize, released: usize, fenced: usize) {
    ::metrics::counter!(PUBLISHED_TOTAL).increment(published as u64);
    ::metrics::counter!(RELEASED_TOTAL).increment(released as u64);
    ::metrics::counter!(FENCED_TOTAL).increment(fenced as u64);
}

/// Records a message held back for its destination.
pub fn deferred(event_type: &str) {
    ::metrics::counter!(DEFERRED_TOTAL, LABEL_EVENT_TYPE => event_type_label(event_type))
        .increment(1);
}

/// Records how many destinations have an open circuit.
pub fn destinations_open(n: usize) {
    ::metrics::gauge!(DESTINATIONS_OPEN).set(n as f64);
}

/// Records whether the circuit is open.
pub fn circuit(open: bool) {
    ::metrics::gauge!(CIRCUIT_OPEN).set(if open { 1.0 } else { 0.0 });
}

/// Sets the table gauges ([`PENDING_MESSAGES`], [`OLDEST_PENDING_AGE_SECONDS`],
/// [`DEAD_MESSAGES`]) from a stats snapshot, exact or bounded (the help texts describe
/// the `outbox` relay's bounded one).
pub fn set_table_gauges(stats: &OutboxStats) {
    ::metrics::gauge!(PENDING_MESSAGES).set((stats.new + stats.processing) as f64);
    ::metrics::gauge!(OLDEST_PENDING_AGE_SECONDS)
        .set(stats.oldest_pending_age.map_or(0.0, |d| d.as_secs_f64()));
    ::metrics::gauge!(DEAD_MESSAGES).set(stats.dead as f64);
}

/// Sets the vacuum gauges ([`DEAD_ROW_VERSIONS`], [`OLDEST_TRANSACTION_AGE_SECONDS`])
/// from `pressure`.
pub fn set_vacuum_gauges(pressure: &crate::VacuumPressure) {
    ::metrics::gauge!(DEAD_ROW_VERSIONS).set(pressure.dead_rows as f64);
    ::metrics::gauge!(OLDEST_TRANSACTION_AGE_SECONDS).set(
        pressure
            .oldest_transaction_age
            .map_or(0.0, |d| d.as_secs_f64()),
    );
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ::metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, Unit};

    use super::*;

    #[test]
    fn the_first_distinct_values_keep_their_label() {
        let set = LabelSet::new(3);
        assert_eq!(&*set.label("OrderPlaced"), "OrderPlaced");
        assert_eq!(&*set.label("order.shipped:v2"), "order.shipped:v2");
        // Rejected values take no slot.
        for bad in ["", "a b", "x\ny", "é", "{{x}}", "a/b", &"a".repeat(65)] {
            assert_eq!(&*set.label(bad), EVENT_TYPE_OTHER, "{bad:?}");
        }
        assert_eq!(&*set.label(&"a".repeat(64)), "a".repeat(64));
        assert_eq!(
            &*set.label("Another-One"),
            EVENT_TYPE_OTHER,
            "the set is full"
        );
        assert_eq!(
            &*set.label("OrderPlaced"),
            "OrderPlaced",
            "known values stay"
        );
        assert_eq!(set.seen.read().map(|s| s.len()).unwrap_or_default(), 3);
    }

    #[test]
    fn racing_threads_admit_at_most_the_bound() {
        let set = Arc::new(LabelSet::new(10));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let set = Arc::clone(&set);
                std::thread::spawn(move || {
                    (0..50)
                        .map(|i| set.label(&format!("E{}", (i * 7 + t) % 40)).into_owned())
                        .collect::<Vec<String>>()
                })
            })
            .collect();
        let labels: HashSet<String> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap_or_default())
            .collect();
        assert!(labels.contains(EVENT_TYPE_OTHER));
        assert_eq!(
            labels.len(),
            11,
            "10 admitted values and `other`: {labels:?}"
        );
    }

    /// Counts the distinct label sets each counter is registered with.
    #[derive(Default)]
    struct Registrations(Mutex<HashSet<Key>>);

    impl Recorder for Registrations {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            if let Ok(mut keys) = self.0.lock() {
                keys.insert(key.clone());
            }
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    #[test]
    fn producer_chosen_event_types_cannot_grow_the_series_without_bound() {
        let recorder = Registrations::default();
        ::metrics::with_local_recorder(&recorder, || {
            for i in 0..1_000 {
                let event_type = format!("Generated{i}");
                dead(&event_type);
                retried(&event_type);
                publish_failed(ErrorKind::Transient, &event_type);
            }
            dead("has spaces");
            dead(&"x".repeat(200));
            dead_poison();
        });
        let keys = recorder.0.lock().map(|k| k.clone()).unwrap_or_default();
        let values = |name: &str| -> HashSet<String> {
            keys.iter()
                .filter(|k| k.name() == name)
                .flat_map(|k| k.labels().filter(|l| l.key() == LABEL_EVENT_TYPE))
                .map(|l| l.value().to_owned())
                .collect()
        };
        let max = event_type_labels().max;
        for name in [DEAD_TOTAL, RETRIED_TOTAL, PUBLISH_FAILURES_TOTAL] {
            let values = values(name);
            assert!(values.contains(EVENT_TYPE_OTHER), "{name}");
            // Other tests of this binary may have taken some of the process's slots.
            assert!(values.len() <= max + 2, "{name}: {} series", values.len());
        }
        assert!(values(DEAD_TOTAL).contains(EVENT_TYPE_POISON));
        assert!(!values(DEAD_TOTAL).contains("has spaces"));
        // The bound is fixed once labels have been recorded.
        assert_eq!(set_max_event_type_labels(5), Err(max));
    }
}
