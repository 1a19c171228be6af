//! The relay's health: what `/healthz` reports, and the checker that keeps it (and the
//! table gauges) current.
//!
//! `/healthz` is unhealthy (HTTP 503) when any of these holds, healthy (200) otherwise:
//! - the relay task has stopped (fatal error);
//! - the broker is unreachable: the dispatcher's circuit is open, or the checker's own
//!   readiness probe of the broker failed (this catches a dead broker even when there
//!   is nothing to publish);
//! - the database could not be queried for longer than `stuck_after`;
//! - the relay is stuck: a claimable message (New and visible; in ordered mode also
//!   not held back by an earlier message of its key) has waited longer than
//!   `stuck_after` without being claimed, or (`--source wal`, PostgreSQL) a parked
//!   message has been due that long without being published by the sweeper;
//! - the queue lag (age of the oldest New or Processing message) is over `max_lag`;
//! - `--source wal`: the replication slot retains more WAL than its threshold;
//! - `--source wal`: the relay has failed to read the slot for longer than
//!   `stuck_after` and retries (the server restarting or refusing connections, too
//!   many walsenders), with the last failure. What the operator must fix (the slot
//!   invalidated or gone, the publication incomplete) stops the relay instead: then
//!   the relay-stopped reason above carries the typed error and what to do.
//!
//! Until the first check completes the state is unhealthy with reason `starting`.
//!
//! Warnings (`warnings`, with the status still `ok`) name what will slow the relay and
//! the database down later without stopping anything now (PostgreSQL only,
//! [`OutboxAdmin::vacuum_pressure`]):
//! - a transaction of the database holding the xmin horizon back for longer than
//!   `max_lag`: nothing completed since it began can be vacuumed;
//! - more than [`DEAD_ROWS_WARNING`] dead row versions in the outbox table, and more
//!   than its live rows: autovacuum is off, behind, or held back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outboxkit_core::{EventPublisher, OnDead, OutboxAdmin, RelayHeartbeat, VacuumPressure};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// Dead row versions in the outbox table above which (and above its live rows)
/// `/healthz` warns.
pub(crate) const DEAD_ROWS_WARNING: u64 = 100_000;

/// A point-in-time health report, as served by `/healthz` (JSON).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub struct HealthReport {
    /// `"ok"` or `"unhealthy"`.
    pub status: &'static str,
    /// Why it is unhealthy (empty when ok).
    pub reasons: Vec<String>,
    /// `New` + `Processing` rows at the last check.
    pub pending: Option<u64>,
    /// `Dead` rows at the last check.
    pub dead: Option<u64>,
    /// Queue lag in seconds at the last check.
    pub oldest_pending_age_secs: Option<f64>,
    /// How long the oldest claimable message has waited, in seconds.
    pub oldest_claimable_wait_secs: Option<f64>,
    /// Whether the dispatcher's circuit is open.
    pub circuit_open: bool,
    /// Whether the last broker probe succeeded.
    pub broker_reachable: Option<bool>,
    /// Messages published by this relay since start.
    pub published: u64,
    /// What will slow the relay down later without making it unhealthy now (see the
    /// [module docs](self)); empty when nothing.
    pub warnings: Vec<String>,
    /// Dead row versions of the outbox table at the last check (PostgreSQL only).
    pub dead_row_versions: Option<u64>,
    /// Age in seconds of the oldest transaction holding the xmin horizon back at the
    /// last check (PostgreSQL only; `None`: none).
    pub oldest_transaction_age_secs: Option<f64>,
    /// `--source wal`: WAL retained by the replication slot, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wal_retained_bytes: Option<u64>,
}

impl HealthReport {
    /// Whether every check passed.
    pub fn is_healthy(&self) -> bool {
        self.reasons.is_empty()
    }
}

#[derive(Debug, Default)]
struct State {
    checked: bool,
    relay_stopped: Option<String>,
    broker_error: Option<String>,
    db_error: Option<String>,
    last_db_ok: Option<Instant>,
    pending: Option<u64>,
    dead: Option<u64>,
    lag: Option<Duration>,
    claimable_wait: Option<Duration>,
    circuit_open: bool,
    published: u64,
    heartbeat_failing: bool,
    vacuum: Option<VacuumPressure>,
    /// WAL retained by the slot and the threshold (`--source wal`).
    wal_retained: Option<(u64, u64)>,
    /// Since when reading the slot has failed, and the last failure (`--source wal`).
    wal_session_failing: Option<(Instant, String)>,
}

/// The warnings of [`HealthReport::warnings`] for `v`: a transaction holding the
/// horizon for longer than `max_lag`, dead row versions above [`DEAD_ROWS_WARNING`] and
/// the live rows.
fn vacuum_warnings(v: &VacuumPressure, max_lag: Duration) -> Vec<String> {
    let mut warnings = Vec::new();
    if let Some(age) = v.oldest_transaction_age
        && age > max_lag
    {
        warnings.push(format!(
            "a transaction has held the xmin horizon back for {}s ({}): nothing completed since can be vacuumed; end it, or bound such sessions with idle_in_transaction_session_timeout",
            age.as_secs(),
            v.oldest_transaction.as_deref().unwrap_or("unknown session")
        ));
    }
    if v.dead_rows > DEAD_ROWS_WARNING && v.dead_rows > v.live_rows {
        warnings.push(format!(
            "{} dead row versions in the outbox table ({} live; last vacuum {}): autovacuum is off, behind or held back",
            v.dead_rows,
            v.live_rows,
            v.last_vacuum
                .map_or_else(|| "never".to_owned(), |t| t.to_rfc3339())
        ));
    }
    warnings
}

/// Shared health state: written by the checker and the relay, read by `/healthz`.
#[derive(Debug, Clone)]
pub struct Health {
    state: Arc<Mutex<State>>,
    max_lag: Duration,
    stuck_after: Duration,
    ordered: Option<OnDead>,
    started: Instant,
}

impl Health {
    /// A state with the given thresholds. `ordered` is the relay's per-key policy
    /// (`None` when unordered): messages waiting behind a blocked key do not count as
    /// a stuck relay.
    pub fn new(max_lag: Duration, stuck_after: Duration, ordered: Option<OnDead>) -> Self {
        Self {
            state: Arc::default(),
            max_lag,
            stuck_after,
            ordered,
            started: Instant::now(),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut guard = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut guard)
    }

    /// Records that the relay task ended (with its error, if any).
    pub fn relay_stopped(&self, why: String) {
        self.with(|s| s.relay_stopped = Some(why));
    }

    /// `--source wal`: the WAL the replication slot retains, in bytes, and the most it
    /// may retain before `/healthz` fails.
    pub fn wal_retained(&self, bytes: Option<u64>, max: u64) {
        self.with(|s| s.wal_retained = bytes.map(|b| (b, max)));
    }

    /// `--source wal`: how long the relay has failed to read the replication slot and
    /// retried, with the last failure (`None`: it reads, or stands by).
    pub fn wal_session(&self, failing: Option<(Duration, String)>) {
        // Kept as an instant: a check that takes long (a database down) must not hold
        // the report at the duration sampled before it.
        let failing = failing.map(|(d, e)| {
            (
                Instant::now().checked_sub(d).unwrap_or_else(Instant::now),
                e,
            )
        });
        self.with(|s| s.wal_session_failing = failing);
    }

    /// The current report.
    pub fn report(&self) -> HealthReport {
        self.with(|s| {
            let mut reasons = Vec::new();
            if !s.checked {
                reasons.push("starting: first check not finished".to_owned());
            }
            if let Some(why) = &s.relay_stopped {
                reasons.push(format!("relay stopped: {why}"));
            }
            if s.circuit_open {
                reasons.push("broker unreachable: circuit open".to_owned());
            }
            if let Some(e) = &s.broker_error {
                reasons.push(format!("broker unreachable: {e}"));
            }
            if let Some(e) = &s.db_error {
                let since_ok = s.last_db_ok.unwrap_or(self.started).elapsed();
                if since_ok >= self.stuck_after {
                    reasons.push(format!(
                        "database unreachable for {}s: {e}",
                        since_ok.as_secs()
                    ));
                }
            }
            if let Some(wait) = s.claimable_wait
                && wait >= self.stuck_after
                && !s.circuit_open
            {
                reasons.push(format!(
                    "relay stuck: a claimable (or due parked) message has waited {}s (threshold {}s)",
                    wait.as_secs(),
                    self.stuck_after.as_secs()
                ));
            }
            if let Some(lag) = s.lag
                && lag > self.max_lag
            {
                reasons.push(format!(
                    "queue lag {}s over the threshold of {}s",
                    lag.as_secs(),
                    self.max_lag.as_secs()
                ));
            }
            let warnings = s
                .vacuum
                .as_ref()
                .map(|v| vacuum_warnings(v, self.max_lag))
                .unwrap_or_default();
            if let Some((bytes, max)) = s.wal_retained
                && bytes > max
            {
                reasons.push(format!(
                    "the replication slot retains {bytes} bytes of WAL (threshold {max})"
                ));
            }
            if let Some((since, e)) = &s.wal_session_failing
                && since.elapsed() >= self.stuck_after
            {
                reasons.push(format!(
                    "the replication slot cannot be read for {}s, retrying: {e}",
                    since.elapsed().as_secs()
                ));
            }
            HealthReport {
                status: if reasons.is_empty() {
                    "ok"
                } else {
                    "unhealthy"
                },
                reasons,
                pending: s.pending,
                dead: s.dead,
                oldest_pending_age_secs: s.lag.map(|d| d.as_secs_f64()),
                oldest_claimable_wait_secs: s.claimable_wait.map(|d| d.as_secs_f64()),
                circuit_open: s.circuit_open,
                broker_reachable: s.checked.then_some(s.broker_error.is_none()),
                published: s.published,
                warnings,
                dead_row_versions: s.vacuum.as_ref().map(|v| v.dead_rows),
                oldest_transaction_age_secs: s
                    .vacuum
                    .as_ref()
                    .and_then(|v| v.oldest_transaction_age)
                    .map(|d| d.as_secs_f64()),
                wal_retained_bytes: s.wal_retained.map(|(b, _)| b),
            }
        })
    }

    /// One check: table stats (also exported as gauges), the oldest claimable wait, a
    /// broker probe bounded by `probe_timeout`, and the dispatcher's circuit.
    pub async fn check<S: OutboxAdmin + ?Sized, P: EventPublisher>(
        &self,
        store: &S,
        publisher: &P,
        circuit_open: bool,
        published: u64,
        probe_timeout: Duration,
    ) {
        outboxkit_core::metrics::circuit(circuit_open);
        let stats = store.pending_stats().await;
        let claimable = match &stats {
            Ok(_) => store.oldest_claimable_wait(self.ordered).await.map(Some),
            Err(_) => Ok(None),
        };
        let probe = tokio::time::timeout(probe_timeout, publisher.check_ready()).await;
        let broker_error = match probe {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {probe_timeout:?}")),
        };
        if let Ok(st) = &stats {
            outboxkit_core::metrics::set_table_gauges(st);
        }
        // Statistics views only; a failure here says nothing the stats above do not.
        let vacuum = match &stats {
            Ok(_) => store.vacuum_pressure().await.ok().flatten(),
            Err(_) => None,
        };
        if let Some(v) = &vacuum {
            outboxkit_core::metrics::set_vacuum_gauges(v);
        }
        self.with(|s| {
            s.checked = true;
            s.circuit_open = circuit_open;
            s.published = published;
            s.broker_error = broker_error;
            if vacuum.is_some() {
                s.vacuum = vacuum;
            }
            match (stats, claimable) {
                (Ok(st), Ok(wait)) => {
                    s.db_error = None;
                    s.last_db_ok = Some(Instant::now());
                    s.pending = Some(st.new + st.processing);
                    s.dead = Some(st.dead);
                    s.lag = st.oldest_pending_age;
                    s.claimable_wait = wait.flatten();
                }
                (Err(e), _) | (_, Err(e)) => {
                    s.db_error = Some(e.to_string());
                }
            }
        });
    }

    /// Records the relay's heartbeat (`beat`, updated from the current report) in the
    /// database ([`OutboxAdmin::record_heartbeat`]), for operators. A failure (the
    /// migration that adds the table not applied yet, the database down) is logged once
    /// until a heartbeat succeeds again, and changes nothing of the relay's health.
    pub async fn beat<S: OutboxAdmin + ?Sized>(&self, store: &S, beat: &mut RelayHeartbeat) {
        let report = self.report();
        beat.circuit_open = report.circuit_open;
        beat.healthy = report.is_healthy();
        beat.published = report.published;
        beat.detail = report.reasons.join("; ");
        match store.record_heartbeat(beat).await {
            Ok(()) => self.with(|s| s.heartbeat_failing = false),
            Err(e) => {
                if !self.with(|s| std::mem::replace(&mut s.heartbeat_failing, true)) {
                    tracing::warn!(error = %e, "cannot record the relay's heartbeat (run `outbox migrate`?); the dashboard will not list this relay");
                }
            }
        }
    }

    /// Runs checks every `interval` until `shutdown`; `sample` supplies the
    /// dispatcher's circuit state and published count at each check. After each check,
    /// `heartbeat` (when given) is recorded ([`beat`](Self::beat)).
    pub async fn run_checker<S: OutboxAdmin + ?Sized, P: EventPublisher>(
        &self,
        store: Arc<S>,
        publisher: Arc<P>,
        interval: Duration,
        sample: impl Fn() -> (bool, u64) + Send,
        mut heartbeat: Option<RelayHeartbeat>,
        shutdown: CancellationToken,
    ) {
        loop {
            let (circuit_open, published) = sample();
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.check(&*store, &*publisher, circuit_open, published, interval.max(Duration::from_secs(1))) => {}
            }
            if let Some(beat) = heartbeat.as_mut() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = self.beat(&*store, beat) => {}
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pressure(dead: u64, live: u64, age_secs: Option<u64>) -> VacuumPressure {
        let mut v = VacuumPressure::default();
        v.dead_rows = dead;
        v.live_rows = live;
        v.oldest_transaction_age = age_secs.map(Duration::from_secs);
        v.oldest_transaction = age_secs.map(|_| "pid 4711 (psql), idle in transaction".to_owned());
        v
    }

    #[test]
    fn a_transaction_older_than_max_lag_is_warned_of_with_its_session() {
        let max_lag = Duration::from_secs(300);
        assert!(vacuum_warnings(&pressure(0, 0, Some(300)), max_lag).is_empty());
        let w = vacuum_warnings(&pressure(0, 0, Some(301)), max_lag);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("301s") && w[0].contains("pid 4711"), "{w:?}");
    }

    #[test]
    fn dead_rows_are_warned_of_above_the_threshold_and_the_live_rows() {
        let max_lag = Duration::from_secs(300);
        assert!(vacuum_warnings(&pressure(DEAD_ROWS_WARNING, 0, None), max_lag).is_empty());
        // Mostly live rows (sent rows kept): not a warning.
        assert!(
            vacuum_warnings(
                &pressure(DEAD_ROWS_WARNING + 1, 10 * DEAD_ROWS_WARNING, None),
                max_lag
            )
            .is_empty()
        );
        let w = vacuum_warnings(&pressure(DEAD_ROWS_WARNING + 1, 5, None), max_lag);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("last vacuum never"), "{w:?}");
    }

    #[test]
    fn a_slot_failing_to_be_read_is_a_reason_after_stuck_after() {
        let health = Health::new(Duration::from_secs(300), Duration::from_secs(60), None);
        health.with(|s| s.checked = true);
        let error =
            "replication stream: server error: sorry, too many clients already (SQLSTATE 53300)";
        health.wal_session(Some((Duration::from_secs(59), error.to_owned())));
        assert!(health.report().is_healthy());
        health.wal_session(Some((Duration::from_secs(61), error.to_owned())));
        let report = health.report();
        assert_eq!(
            report.reasons,
            [format!(
                "the replication slot cannot be read for 61s, retrying: {error}"
            )]
        );
        health.wal_session(None);
        assert!(health.report().is_healthy());
    }

    #[test]
    fn warnings_leave_the_status_ok() {
        let health = Health::new(Duration::from_secs(1), Duration::from_secs(60), None);
        health.with(|s| {
            s.checked = true;
            s.vacuum = Some(pressure(0, 0, Some(3600)));
        });
        let report = health.report();
        assert!(report.is_healthy(), "{report:?}");
        assert_eq!(report.status, "ok");
        assert_eq!(report.warnings.len(), 1);
        assert_eq!(report.oldest_transaction_age_secs, Some(3600.0));
    }
}
