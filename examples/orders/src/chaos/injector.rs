//! The broker and database lanes: each planned fault injected with a guard of
//! `outbox_testkit::faults`, held for its window and undone by dropping the guard, so it
//! is undone also when the run fails, panics or is interrupted (the lane's future is
//! dropped, and with it the guard). A fault that cannot be injected here is recorded as
//! such, with why, and the run goes on.

use std::time::{Duration, Instant};

use outbox_testkit::faults::{
    FaultUnavailable, NatsFrozen, NatsStopped, PgStopped, RabbitFrozen, RabbitMemoryAlarm,
    RabbitQueueFull, RabbitStopped,
};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::schedule::{FaultKind, Planned};
use super::timeline::Timeline;
use super::topology::{CONSUMER_APP, Names, RELAY_APP, Transport};

/// A fault in force; dropping it undoes the fault.
type Guard = Box<dyn Send>;

/// Runs blocking fault commands (`rabbitmqctl`, `pg_ctlcluster`, `kill`) without
/// stalling the other lanes.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn boxed<G: Send + 'static>(guard: G) -> Guard {
    Box::new(guard)
}

fn inject(kind: FaultKind, transport: Transport, names: &Names) -> Result<Guard, FaultUnavailable> {
    match (kind, transport) {
        (FaultKind::BrokerFreeze, Transport::Rabbit) => RabbitFrozen::try_freeze().map(boxed),
        (FaultKind::BrokerFreeze, Transport::Nats) => NatsFrozen::try_freeze().map(boxed),
        (FaultKind::BrokerRestart, Transport::Rabbit) => RabbitStopped::try_stop().map(boxed),
        (FaultKind::BrokerRestart, Transport::Nats) => NatsStopped::try_stop().map(boxed),
        (FaultKind::MemoryAlarm, _) => RabbitMemoryAlarm::try_raise().map(boxed),
        (FaultKind::QueueFull, _) => RabbitQueueFull::try_set(&names.overflow_queue).map(boxed),
        (FaultKind::PgRestart, _) => PgStopped::try_stop().map(boxed),
        (kind, _) => Err(FaultUnavailable {
            fault: "lane",
            reason: format!("{kind:?} is not a server fault"),
        }),
    }
}

/// Everything a lane needs.
pub(crate) struct Lane<'a> {
    pub(crate) transport: Transport,
    pub(crate) names: &'a Names,
    /// The harness's pool (for `pg_terminate_backend`).
    pub(crate) admin: &'a PgPool,
    pub(crate) timeline: &'a Timeline,
    pub(crate) phase_start: Instant,
    pub(crate) stop: &'a CancellationToken,
}

impl Lane<'_> {
    /// Injects `plan`'s faults one after the other at their times; returns early when
    /// stopped (the fault in force, if any, is undone).
    pub(crate) async fn run(&self, plan: &[Planned]) {
        for fault in plan {
            let at = tokio::time::Instant::from_std(self.phase_start + fault.at);
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep_until(at) => {}
            }
            match fault.kind {
                FaultKind::PgTerminate => self.terminate().await,
                kind => self.hold(kind, fault.hold).await,
            }
        }
    }

    async fn hold(&self, kind: FaultKind, hold: Duration) {
        let label = kind.label(self.transport);
        let guard = blocking(|| inject(kind, self.transport, self.names));
        let guard = match guard {
            Ok(guard) => guard,
            Err(e) => {
                self.timeline.not_injected(kind, e.reason);
                return;
            }
        };
        let record = self.timeline.injected(kind, "");
        self.timeline
            .say(format!("{label}: injected for {:.1}s", hold.as_secs_f64()));
        tokio::select! {
            () = self.stop.cancelled() => {}
            () = tokio::time::sleep(hold) => {}
        }
        blocking(move || drop(guard));
        self.timeline.ended(record);
        self.timeline.say(format!("{label}: undone"));
    }

    /// Terminates the relays' and consumers' database connections.
    async fn terminate(&self) {
        let kind = FaultKind::PgTerminate;
        let sql = format!(
            "SELECT count(*) FROM (
                SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE application_name IN ('{RELAY_APP}', '{CONSUMER_APP}')
                   AND pid <> pg_backend_pid()) t"
        );
        match sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
            .fetch_one(self.admin)
            .await
        {
            Ok(0) => self.timeline.not_injected(
                kind,
                "no relay or consumer connection was open at that moment",
            ),
            Ok(n) => {
                let record = self.timeline.injected(kind, format!("{n} connections"));
                self.timeline.ended(record);
                self.timeline.say(format!(
                    "pg_terminate_backend: {n} relay and consumer connections terminated"
                ));
            }
            Err(e) => self
                .timeline
                .not_injected(kind, format!("the statement failed: {e}")),
        }
    }
}
