//! The delayed lane's verdict (see `chaos::delayed`): every message that came due was
//! published, not before it was due by the database's clock, and within
//! [`DEADLINE`](super::super::delayed::DEADLINE) of it unless a fault that holds every
//! message back overlapped its wait; no message due after the run reached the broker.

use std::sync::atomic::Ordering;

use uuid::Uuid;

use super::super::audit::Copies;
use super::super::db::Db;
use super::super::delayed::{DEADLINE, DelayedStats, FAR};
use super::super::schedule::FaultKind;
use super::super::topology::Names;
use crate::common;

/// One delayed message as the database has it (seconds since the epoch).
struct Delayed {
    id: Uuid,
    far: bool,
    /// When it came (or comes) due: its commit's `now()` plus its delay, as the store
    /// computed its `visible_at`.
    due: f64,
    sent: Option<f64>,
}

/// What the lane's verdict found.
pub(super) struct Judged {
    /// Lines for the table.
    pub(super) lines: Vec<(&'static str, String)>,
    pub(super) failures: Vec<String>,
}

/// Whether a fault of `kind` may hold a delayed message back: all of them but the side
/// destination's (a destination the delayed messages do not go to) and the faults
/// that add messages. A relay's clock skew holds one back only by its kill (the
/// skewed relay that follows must publish on time: the relays decide "due" by the
/// database's clock).
fn holds_delayed(kind: FaultKind) -> bool {
    !matches!(
        kind,
        FaultKind::DestinationFull | FaultKind::Poison | FaultKind::Foreign | FaultKind::Swallow
    )
}

/// Judges the lane. `windows`: the fault windows (kind, start, end, caught up), in
/// seconds since the epoch; a relay's kill holds what it had claimed for up to `lease`
/// (the relays' `--lease`); `until`: when the drain ended (a message due after it is
/// not judged late); `copies`: the broker's copies, when it could be audited.
pub(super) async fn judge(
    admin: &Db,
    names: &Names,
    stats: &DelayedStats,
    windows: &[(FaultKind, f64, f64, f64)],
    lease: std::time::Duration,
    until: f64,
    copies: Option<&Copies>,
) -> anyhow::Result<Judged> {
    let epoch = |expr: &str| admin.database().epoch(expr);
    let rows: Vec<(Uuid, bool, f64, Option<f64>)> = admin
        .fetch_all(
            format!(
                "SELECT d.id, d.far, {} + d.delay_ms / 1000.0, {}
                   FROM {} d JOIN {} m ON m.id = d.id",
                epoch("m.created_at"),
                epoch("m.sent_at"),
                names.table("delayed_events"),
                names.table("outbox_messages")
            ),
            Vec::new(),
        )
        .await?;
    let rows: Vec<Delayed> = rows
        .into_iter()
        .map(|(id, far, due, sent)| Delayed { id, far, due, sent })
        .collect();
    let mut failures = Vec::new();
    let deadline = DEADLINE.as_secs_f64();
    let (far, near): (Vec<&Delayed>, Vec<&Delayed>) = rows.iter().partition(|d| d.far);

    let far_published = far.iter().filter(|d| d.sent.is_some()).count();
    let far_at_broker = copies.map(|c| far.iter().filter(|d| c.contains_key(&d.id)).count());
    if far_published > 0 || far_at_broker.is_some_and(|n| n > 0) {
        failures.push(format!(
            "{} messages due after the run were published ({} at the broker)",
            far_published,
            far_at_broker.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
        ));
    }
    if far.len() < FAR {
        failures.push(format!(
            "the delayed lane wrote {} of its {FAR} far messages",
            far.len()
        ));
    }

    let due: Vec<&&Delayed> = near.iter().filter(|d| d.due <= until).collect();
    let unpublished = due.iter().filter(|d| d.sent.is_none()).count();
    let missing_at_broker = copies.map(|c| {
        due.iter()
            .filter(|d| d.sent.is_some() && !c.contains_key(&d.id))
            .count()
    });
    let doubled = copies.map(|c| {
        near.iter()
            .filter(|d| c.get(&d.id).is_some_and(|n| *n > 1))
            .count()
    });
    // Published before due: `sent_at` is written after the broker confirmed, so a
    // message published early by less than that shows as on time.
    let early: Vec<f64> = due
        .iter()
        .filter_map(|d| d.sent.map(|s| d.due - s))
        .filter(|early| *early > 0.0)
        .collect();
    let excused = |d: &Delayed, sent: f64| {
        windows.iter().any(|(kind, start, _, caught)| {
            let held_until = match kind {
                FaultKind::RelayKill | FaultKind::RelayClockSkew => {
                    caught.max(start + lease.as_secs_f64())
                }
                _ => *caught,
            };
            holds_delayed(*kind) && *start <= sent && held_until + deadline >= d.due
        })
    };
    let lateness: Vec<f64> = due
        .iter()
        .filter_map(|d| d.sent.map(|s| (s - d.due).max(0.0) * 1000.0))
        .collect();
    let late: Vec<(&&&Delayed, f64)> = due
        .iter()
        .filter_map(|d| d.sent.map(|s| (d, s)))
        .filter(|(d, s)| s - d.due > deadline && !excused(d, *s))
        .collect();
    let worst_late = late.iter().map(|(d, s)| s - d.due).fold(0.0_f64, f64::max);
    if unpublished > 0 {
        failures.push(format!(
            "{unpublished} delayed messages that came due during the run were never published"
        ));
    }
    if missing_at_broker.is_some_and(|n| n > 0) {
        failures.push(format!(
            "{} delayed messages recorded sent are not at the broker",
            missing_at_broker.unwrap_or(0)
        ));
    }
    if !early.is_empty() {
        failures.push(format!(
            "{} delayed messages were published before they were due (up to {:.3} s early by the database's clock)",
            early.len(),
            early.iter().copied().fold(0.0_f64, f64::max)
        ));
    }
    if !late.is_empty() {
        failures.push(format!(
            "{} delayed messages were published more than {} s after they were due outside the fault windows (up to {worst_late:.1} s)",
            late.len(),
            DEADLINE.as_secs()
        ));
    }

    let lateness_line = common::percentiles(&lateness).map_or_else(
        || "no sample".to_owned(),
        |(p50, p99)| {
            format!(
                "due-to-sent p50 {} p99 {} max {}",
                common::ms(p50),
                common::ms(p99),
                common::ms(std::time::Duration::from_secs_f64(
                    lateness.iter().copied().fold(0.0, f64::max) / 1000.0
                ))
            )
        },
    );
    let lines = vec![
        (
            "delayed messages due in seconds",
            format!(
                "{} written ({} not: database faults), {} came due: {} published ({} late outside the fault windows, {} early, {} never), {} doubled at the broker; {lateness_line}",
                near.len(),
                stats.failed.load(Ordering::Relaxed),
                due.len(),
                due.len() - unpublished,
                late.len(),
                early.len(),
                unpublished,
                doubled.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
            ),
        ),
        (
            "delayed messages due after the run",
            format!(
                "{} written, {far_published} published, {} at the broker (must both be 0)",
                far.len(),
                far_at_broker.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
            ),
        ),
    ];
    Ok(Judged { lines, failures })
}
