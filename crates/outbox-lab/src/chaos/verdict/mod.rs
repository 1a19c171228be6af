//! The verdict: every order counted against the effects table and the consumer dead
//! letters (`consumer_side`: the swallowing handler's orders, the foreign producer's
//! messages), the outbox's dead letters against the injected poison rows, the broker's
//! copies (read without the outbox tables) against all of them, every process exit
//! against the faults that explain it (`supervisor::explained_by`), latency outside the
//! fault windows and while only the side events' destination was full (the orders'
//! destination must not notice), the delayed lane's messages against when they came due
//! (`delayed`), and the table that says it all.

mod consumer_side;
mod delayed;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::Drained;
use super::audit::Copies;
use super::db::Db;
use super::foreign::{self, Expect};
use super::producers::{PoisonRow, SIDE_EVERY, SWALLOW_EVERY};
use super::schedule::{FaultKind, Schedule};
use super::supervisor::{ProcessReport, Role, explained_by};
use super::timeline::Record;
use super::topology::{
    ConsumerMode, DELIVERY_LIMIT, EVENT_TYPE, Names, SIDE_EVENT_TYPE, TransportKind,
};
use crate::common;
use consumer_side::sample;

/// Everything the verdict is drawn from besides the database.
pub(crate) struct Inputs {
    pub(crate) transport: TransportKind,
    /// The run was on the clusters.
    pub(crate) cluster: bool,
    pub(crate) mode: ConsumerMode,
    /// The consumers ran in batches (`--batched`).
    pub(crate) batched: bool,
    pub(crate) seed: u64,
    pub(crate) duration: Duration,
    /// How the drain ended, or why it did not finish.
    pub(crate) drain: Result<Drained, String>,
    pub(crate) schedule: Schedule,
    pub(crate) records: Vec<Record>,
    pub(crate) processes: ProcessReport,
    /// Producer transactions that failed (database faults).
    pub(crate) producer_failures: u64,
    /// What the delayed lane wrote.
    pub(crate) delayed: Arc<super::delayed::DelayedStats>,
    pub(crate) poison: Vec<PoisonRow>,
    /// The foreign producer's messages, and whether they could be recorded in the
    /// run's `foreign_messages` table.
    pub(crate) foreign: Vec<foreign::Sent>,
    pub(crate) foreign_recorded: Result<(), String>,
    /// The broker's copies by id and the copies without an id, or why they could not
    /// be read.
    pub(crate) broker: Result<(Copies, u64), String>,
    /// The fault phase.
    pub(crate) phase: (DateTime<Utc>, DateTime<Utc>),
    pub(crate) relays: usize,
    pub(crate) consumers: usize,
    pub(crate) crash_loop_limit: usize,
    /// Poison rows per poison batch (one per kind).
    pub(crate) poison_kinds: usize,
    /// The relays' `--lease` (see `supervisor::explained_by`).
    pub(crate) lease: Duration,
    /// The consumers' NATS `ack_wait` (`None` over RabbitMQ).
    pub(crate) outage_ack_wait: Option<Duration>,
}

/// One order as the database has it: its event, when it was committed, how many
/// effects it has and when the first was applied (seconds since the epoch).
struct Order {
    event_id: Uuid,
    created: f64,
    effects: i64,
    applied: Option<f64>,
}

fn epoch(t: DateTime<Utc>) -> f64 {
    t.timestamp_micros() as f64 / 1e6
}

fn secs(s: f64) -> String {
    format!("{s:.1} s")
}

/// A line of the table: label padded, then the value.
fn line(label: &str, value: impl std::fmt::Display) {
    println!("  {label:<40} {value}");
}

/// Prints the verdict table; returns the reasons the run fails (empty: it passes).
pub(crate) async fn judge(
    admin: &Db,
    names: &Names,
    inputs: &Inputs,
) -> anyhow::Result<Vec<String>> {
    let t = |table: &str| names.table(table);
    let mut failures = Vec::new();
    let copies = inputs.broker.as_ref().ok().map(|(copies, _)| copies);
    let side = consumer_side::judge(admin, names, inputs.mode, copies).await?;

    let epoch_of = |expr: &str| admin.database().epoch(expr);
    let orders: Vec<Order> = admin
        .fetch_all::<(Uuid, f64, i64, Option<f64>)>(
            format!(
                "SELECT o.event_id, {}, count(e.event_id), {}
                   FROM {} o LEFT JOIN {} e ON e.event_id = o.event_id
                  GROUP BY o.event_id, o.created_at",
                epoch_of("o.created_at"),
                epoch_of("min(e.applied_at)"),
                t("orders"),
                t("effects")
            ),
            Vec::new(),
        )
        .await?
        .into_iter()
        .map(|(event_id, created, effects, applied)| Order {
            event_id,
            created,
            effects,
            applied,
        })
        .collect();
    let written = orders.len();
    // The side events (the second destination): every one must reach the broker.
    let side_events: HashSet<Uuid> = admin
        .column::<Uuid>(format!("SELECT id FROM {}", t("side_events")))
        .await?
        .into_iter()
        .collect();
    // When the orders' events were published (the relays' completion time).
    let orders_sent_at: Vec<f64> = admin
        .column(format!(
            "SELECT {} FROM {}
              WHERE event_type = '{EVENT_TYPE}' AND sent_at IS NOT NULL",
            epoch_of("sent_at"),
            t("outbox_messages")
        ))
        .await?;
    // When the side events the relays were refused at least once were committed: their
    // rows keep the refusal as `last_error` (a deferral charges nothing but records why).
    let side_refused_at: Vec<f64> = admin
        .column(format!(
            "SELECT {} FROM {} s JOIN {} m ON m.id = s.id WHERE m.last_error IS NOT NULL",
            epoch_of("s.created_at"),
            t("side_events"),
            t("outbox_messages")
        ))
        .await?;
    // Side events published without a refusal: when committed, when published.
    let side_unrefused: Vec<(f64, f64)> = admin
        .fetch_all::<(f64, f64)>(
            format!(
                "SELECT {}, {} FROM {} s JOIN {} m ON m.id = s.id
                  WHERE m.last_error IS NULL AND m.sent_at IS NOT NULL",
                epoch_of("s.created_at"),
                epoch_of("m.sent_at"),
                t("side_events"),
                t("outbox_messages")
            ),
            Vec::new(),
        )
        .await?;
    // The delayed lane's messages (judged by `delayed`).
    let delayed_ids: HashSet<Uuid> = admin
        .column::<Uuid>(format!("SELECT id FROM {}", t("delayed_events")))
        .await?
        .into_iter()
        .collect();
    let order_ids: HashSet<Uuid> = orders.iter().map(|o| o.event_id).collect();
    // The swallowing handler's orders are judged by `consumer_side`; the rest here.
    let plain: Vec<&Order> = orders
        .iter()
        .filter(|o| !side.swallowing.contains(&o.event_id))
        .collect();
    let dead_ids: HashSet<Uuid> = side.unexpected_dead.iter().map(|d| d.0).collect();
    let lost: Vec<&&Order> = plain
        .iter()
        .filter(|o| o.effects == 0 && !dead_ids.contains(&o.event_id))
        .collect();
    let doubled: Vec<&&Order> = plain.iter().filter(|o| o.effects > 1).collect();
    let extra_effects: i64 = doubled.iter().map(|o| o.effects - 1).sum();
    let exactly_once = plain.iter().filter(|o| o.effects == 1).count();

    let unknown_effects = admin
        .count(format!(
            "SELECT count(*) FROM {} e
              WHERE NOT EXISTS (SELECT 1 FROM {} o WHERE o.event_id = e.event_id)
                AND NOT EXISTS (SELECT 1 FROM {} x WHERE x.id = e.event_id AND x.expect = '{}')",
            t("effects"),
            t("orders"),
            t("foreign_messages"),
            Expect::Applied.as_str()
        ))
        .await?;
    let dead: HashMap<Uuid, String> = admin
        .fetch_all::<(Uuid, Option<String>)>(
            format!(
                "SELECT id, last_error FROM {} WHERE status = 3",
                t("outbox_messages")
            ),
            Vec::new(),
        )
        .await?
        .into_iter()
        .map(|(id, e)| (id, e.unwrap_or_default()))
        .collect();
    // The delayed lane's far messages aside: they are due after the run.
    let pending = admin
        .count(format!(
            "SELECT count(*) FROM {o} m WHERE status IN (0, 9)
                AND NOT EXISTS (SELECT 1 FROM {d} d WHERE d.id = m.id AND d.far)",
            o = t("outbox_messages"),
            d = t("delayed_events"),
        ))
        .await?;
    let (deliveries, delivered_ids, swallowing_deliveries, swallowing_delivered): (
        i64,
        i64,
        i64,
        i64,
    ) = admin
        .fetch_one(
            format!(
                "SELECT count(*), count(DISTINCT d.event_id),
                        count(a.event_id), count(DISTINCT a.event_id)
                   FROM {} d LEFT JOIN {} a ON a.event_id = d.event_id",
                t("deliveries"),
                t("audit")
            ),
            Vec::new(),
        )
        .await?;
    // The swallowing handler's messages come back on purpose until they are dead.
    let swallowing_redeliveries = swallowing_deliveries - swallowing_delivered;

    // Poison rows: exactly the dead letters, never at the broker.
    let poison_ids: HashSet<Uuid> = inputs.poison.iter().map(|p| p.id).collect();
    let unexpected_dead: Vec<(&Uuid, &String)> = dead
        .iter()
        .filter(|(id, _)| !poison_ids.contains(id))
        .collect();
    let poison_alive: Vec<&PoisonRow> = inputs
        .poison
        .iter()
        .filter(|p| !dead.contains_key(&p.id))
        .collect();
    let poison_other_reason: Vec<(&PoisonRow, &String)> = inputs
        .poison
        .iter()
        .filter_map(|p| dead.get(&p.id).map(|e| (p, e)))
        .filter(|(p, e)| !e.contains(p.kind.reason))
        .collect();

    // The foreign messages without any id: between the confirmed ones and every attempt
    // may have reached the broker.
    let anonymous: Vec<&foreign::Sent> = inputs.foreign.iter().filter(|s| s.id.is_none()).collect();
    let anonymous_confirmed = anonymous.iter().filter(|s| s.confirmed).count() as u64;
    let anonymous_attempts: u64 = anonymous.iter().map(|s| u64::from(s.attempts)).sum();
    let confirmed_foreign: Vec<Uuid> = inputs
        .foreign
        .iter()
        .filter(|s| s.confirmed)
        .filter_map(|s| s.id)
        .collect();

    // The broker's side.
    let mut anonymous_copies = None;
    let (broker_line, dup_line) = match &inputs.broker {
        Ok((copies, without_id)) => {
            anonymous_copies = Some(*without_id);
            let total: u64 = copies.values().map(|n| u64::from(*n)).sum::<u64>() + without_id;
            let missing = orders
                .iter()
                .filter(|o| !copies.contains_key(&o.event_id))
                .count();
            let side_missing = side_events
                .iter()
                .filter(|id| !copies.contains_key(id))
                .count();
            let foreign_missing = confirmed_foreign
                .iter()
                .filter(|id| !copies.contains_key(id))
                .count();
            let poison_published = poison_ids
                .iter()
                .filter(|id| copies.contains_key(id))
                .count();
            let unknown_without_id =
                if (anonymous_confirmed..=anonymous_attempts).contains(without_id) {
                    0
                } else {
                    usize::try_from(*without_id).unwrap_or(usize::MAX)
                };
            let unknown = copies
                .keys()
                .filter(|id| {
                    !order_ids.contains(id)
                        && !side_events.contains(id)
                        && !delayed_ids.contains(id)
                        && !poison_ids.contains(id)
                        && !side.foreign_ids.contains(id)
                })
                .count()
                + unknown_without_id;
            if foreign_missing > 0 {
                failures.push(format!(
                    "{foreign_missing} foreign messages the broker confirmed are not at the broker"
                ));
            }
            // The relays' duplicates (the foreign producer's retries are its own).
            let duplicates: u64 = copies
                .iter()
                .filter(|(id, _)| !side.foreign_ids.contains(id))
                .map(|(_, n)| u64::from(n.saturating_sub(1)))
                .sum();
            if missing > 0 {
                failures.push(format!("{missing} events never reached the broker"));
            }
            if side_missing > 0 {
                failures.push(format!(
                    "{side_missing} side events never reached the broker"
                ));
            }
            if poison_published > 0 {
                failures.push(format!("{poison_published} poison rows reached the broker"));
            }
            if unknown > 0 {
                failures.push(format!("{unknown} messages at the broker match no order"));
            }
            let what = match inputs.transport {
                TransportKind::Rabbit => "audit queue",
                TransportKind::Nats => "streams",
            };
            (
                format!(
                    "{} distinct ids in the {what} ({total} copies; {} side events, {} foreign, {without_id} without an id); missing {missing} orders' and {side_missing} side events, poison {poison_published}, unknown {unknown}",
                    copies.len(),
                    side_events
                        .iter()
                        .filter(|id| copies.contains_key(id))
                        .count(),
                    side.foreign_ids
                        .iter()
                        .filter(|id| copies.contains_key(id))
                        .count()
                ),
                match inputs.transport {
                    TransportKind::Rabbit => format!(
                        "{duplicates} (copies beyond the first, all routed to the consumers' queue)"
                    ),
                    TransportKind::Nats => format!(
                        "{duplicates} stored (republishes inside the 2-minute window are dropped by the stream's Nats-Msg-Id deduplication and not counted)"
                    ),
                },
            )
        }
        Err(e) => {
            failures.push(format!("the broker could not be audited: {e}"));
            (format!("NOT AUDITED: {e}"), "unknown".to_owned())
        }
    };

    // Fault windows, each extended until the pipeline caught up with what was
    // committed before the fault was undone.
    let mut by_created: Vec<&Order> = plain.clone();
    by_created.sort_by(|a, b| a.created.total_cmp(&b.created));
    let mut caught_up = Vec::with_capacity(by_created.len());
    let mut latest = f64::MIN;
    for o in &by_created {
        latest = latest.max(o.applied.unwrap_or(f64::MAX));
        caught_up.push(latest);
    }
    let catch_up = |t: f64| -> f64 {
        let i = by_created.partition_point(|o| o.created <= t);
        if i == 0 { t } else { caught_up[i - 1].max(t) }
    };
    let windows: Vec<(FaultKind, f64, f64, f64)> = inputs
        .records
        .iter()
        .filter(|r| r.injected)
        .map(|r| {
            let start = epoch(r.start);
            let end = r.end.map_or(start, epoch);
            (r.kind, start, end, catch_up(end))
        })
        .collect();
    let delayed = delayed::judge(
        admin,
        names,
        &inputs.delayed,
        &windows,
        inputs.lease,
        epoch(Utc::now()),
        copies,
    )
    .await?;
    failures.extend(delayed.failures.iter().cloned());

    // A full side destination is no fault for the orders: their latency outside the
    // other faults' windows includes the time it was full, and is also shown alone.
    let in_order_fault = |c: f64, a: f64| {
        windows.iter().any(|(kind, start, _, caught)| {
            *kind != FaultKind::DestinationFull && c <= *caught && a >= *start
        })
    };
    let outside: Vec<f64> = plain
        .iter()
        .filter_map(|o| o.applied.map(|a| (o.created, a)))
        .filter(|(c, a)| !in_order_fault(*c, *a))
        .map(|(c, a)| (a - c) * 1000.0)
        .collect();
    // The orders committed while the side destination was full, those aside that were
    // on their way while a broker-wide or database fault was in force (their latency is
    // shown; the check is on the rate below, since orders committed right after another
    // fault wait behind its backlog).
    let side_full: Vec<(f64, f64)> = windows
        .iter()
        .filter(|(kind, ..)| *kind == FaultKind::DestinationFull)
        .map(|(_, start, end, _)| (*start, *end))
        .collect();
    // Refused side events committed while the fault was in force (the queue-full fault
    // refuses them too, but at other times).
    let side_refused = side_refused_at
        .iter()
        .filter(|c| {
            side_full
                .iter()
                .any(|(start, end)| *c >= start && *c <= end)
        })
        .count();
    // Side events the full destination took although they were committed after its
    // injection had completed and published before its undo began: any means the
    // injection did not hold (0.2 s aside for the clocks).
    let side_in_force: Vec<(f64, f64)> = inputs
        .records
        .iter()
        .filter(|r| r.injected && r.kind == FaultKind::DestinationFull)
        .filter_map(|r| r.in_force)
        .map(|(from, until)| (epoch(from) + 0.2, epoch(until) - 0.2))
        .collect();
    let side_taken_while_full = side_unrefused
        .iter()
        .filter(|(created, sent)| {
            side_in_force
                .iter()
                .any(|(from, until)| created >= from && sent <= until)
        })
        .count();
    let holds_every_order = |kind: FaultKind| {
        matches!(
            kind,
            FaultKind::BrokerFreeze
                | FaultKind::BrokerRestart
                | FaultKind::MemoryAlarm
                | FaultKind::QueueFull
                | FaultKind::DbRestart
                | FaultKind::DbTerminate
                | FaultKind::ConsumerLockout
        )
    };
    let while_side_full: Vec<f64> = plain
        .iter()
        .filter_map(|o| o.applied.map(|a| (o.created, a)))
        .filter(|(c, a)| {
            side_full.iter().any(|(start, end)| c >= start && c <= end)
                && !windows.iter().any(|(kind, start, end, _)| {
                    holds_every_order(*kind) && *c <= *end && *a >= *start
                })
        })
        .map(|(c, a)| (a - c) * 1000.0)
        .collect();
    let mut applied: Vec<f64> = orders.iter().filter_map(|o| o.applied).collect();
    applied.sort_by(f64::total_cmp);
    let phase_start = epoch(inputs.phase.0);
    let phase_end = epoch(inputs.phase.1);
    let mut stall = (0.0_f64, phase_start);
    let mut previous = phase_start;
    for a in applied
        .iter()
        .copied()
        .filter(|a| *a >= phase_start && *a <= phase_end)
    {
        if a - previous > stall.0 {
            stall = (a - previous, previous);
        }
        previous = a;
    }
    let stall_causes: Vec<&str> = {
        let (len, from) = stall;
        let mut kinds: Vec<FaultKind> = windows
            .iter()
            .filter(|(_, start, _, caught)| *start <= from + len && *caught >= from)
            .map(|(k, ..)| *k)
            .collect();
        kinds.sort();
        kinds.dedup();
        kinds.iter().map(|k| k.label(inputs.transport)).collect()
    };

    // The table.
    println!();
    println!(
        "chaos verdict: {}, {}, {}{}, seed {}, fault phase {}, {} relays, {} consumers, crash-loop limit {}",
        admin.database().server(),
        inputs.transport.name(),
        inputs.mode.name(),
        if inputs.batched { " (batched)" } else { "" },
        inputs.seed,
        humantime::format_duration(inputs.duration),
        inputs.relays,
        inputs.consumers,
        inputs.crash_loop_limit
    );
    println!();
    println!(
        "  {:<30} {:>7} {:>8}  notes",
        "fault", "planned", "injected"
    );
    let mut by_kind: BTreeMap<FaultKind, (usize, Vec<String>)> = BTreeMap::new();
    for r in &inputs.records {
        let entry = by_kind.entry(r.kind).or_default();
        if r.injected {
            entry.0 += 1;
        } else {
            entry.1.push(format!("not injected: {}", r.note));
        }
    }
    for kind in FaultKind::all(inputs.transport, inputs.cluster) {
        let planned = match kind {
            FaultKind::Poison => inputs.schedule.planned(kind) * inputs.poison_kinds,
            FaultKind::Foreign => inputs.schedule.planned(kind) * foreign::kinds().len(),
            // Not scheduled: a share of the orders, each one injected as it is written.
            FaultKind::Swallow => side.swallowing.len() + side.swallowed_kept,
            _ => inputs.schedule.planned(kind),
        };
        let (mut injected, mut notes) = by_kind.remove(&kind).unwrap_or_default();
        if kind == FaultKind::Swallow {
            injected = side.swallowing.len() + side.swallowed_kept;
        }
        if let Some((_, why)) = inputs.schedule.unscheduled.iter().find(|(k, _)| *k == kind) {
            notes.push(why.clone());
        }
        notes.sort();
        notes.dedup();
        let held: Vec<f64> = inputs
            .records
            .iter()
            .filter(|r| r.kind == kind && r.injected)
            .filter_map(|r| r.end.map(|end| (end - r.start).as_seconds_f64()))
            .collect();
        if let (Some(least), Some(most)) = (
            held.iter().copied().reduce(f64::min),
            held.iter().copied().reduce(f64::max),
        ) && most > 0.05
        {
            let what = match kind {
                FaultKind::RelayKill | FaultKind::RelayClockSkew | FaultKind::ConsumerKill => {
                    "down"
                }
                FaultKind::BrokerRestart | FaultKind::DbRestart | FaultKind::NodeKill => "down",
                _ => "held",
            };
            notes.insert(0, format!("{what} {least:.1}-{most:.1} s"));
        }
        if matches!(kind, FaultKind::DbTerminate | FaultKind::ConsumerLockout) {
            let connections: u64 = inputs
                .records
                .iter()
                .filter(|r| r.kind == kind && r.injected)
                .filter_map(|r| r.note.split_whitespace().next()?.parse::<u64>().ok())
                .sum();
            notes.push(format!("{connections} connections terminated in all"));
        }
        if kind == FaultKind::ConsumerLockout {
            notes.push(match inputs.outage_ack_wait {
                Some(ack_wait) => format!(
                    "consumers' role refused; ack_wait {} s, max_deliver {DELIVERY_LIMIT}",
                    ack_wait.as_secs()
                ),
                None => format!("consumers' role refused; x-delivery-limit {DELIVERY_LIMIT}"),
            });
        }
        if kind == FaultKind::Foreign {
            notes.push(format!(
                "{} kinds per batch, published straight to the broker",
                foreign::kinds().len()
            ));
        }
        if kind == FaultKind::Swallow {
            notes.push(format!(
                "every {SWALLOW_EVERY}th order of each producer: a unique violation caught and ignored"
            ));
        }
        if kind == FaultKind::DestinationFull {
            notes.push(format!(
                "{} side events in all ({SIDE_EVENT_TYPE}, every {SIDE_EVERY}th order), {side_refused} of those committed while it was held refused at least once, {side_taken_while_full} taken while it was held{}; the orders must keep flowing",
                side_events.len(),
                if side_refused == 0 && side_taken_while_full == 0 {
                    " (none tried while it was in force: the relays reached them after it was undone, held by another fault; not judged)"
                } else {
                    ""
                }
            ));
        }
        if kind == FaultKind::Poison {
            let mut kinds: Vec<&str> = inputs.poison.iter().map(|p| p.kind.name).collect();
            kinds.sort_unstable();
            kinds.dedup();
            notes.push(format!("kinds: {}", kinds.join("; ")));
        }
        println!(
            "  {:<30} {:>7} {:>8}  {}",
            kind.label(inputs.transport),
            planned,
            injected,
            notes.join("; ")
        );
    }
    println!();
    line("orders written (committed)", written);
    line("producer transactions failed", inputs.producer_failures);
    line("events at the broker", &broker_line);
    line("duplicates published", &dup_line);
    line(
        "events consumed (deliveries recorded)",
        format!(
            "{delivered_ids} distinct ids, {deliveries} deliveries ({} redeliveries or duplicates)",
            deliveries - delivered_ids
        ),
    );
    line(
        "duplicates suppressed by the inbox",
        match inputs.mode {
            ConsumerMode::Direct => "none: no inbox".to_owned(),
            _ => format!(
                "{} (besides {swallowing_redeliveries} redeliveries of the swallowing handler's messages)",
                (deliveries - delivered_ids - extra_effects - swallowing_redeliveries).max(0)
            ),
        },
    );
    line(
        "applied exactly once",
        format!(
            "{exactly_once} of {} orders (the swallowing handler's {})",
            plain.len(),
            if side.swallowed_kept > 0 {
                "included"
            } else {
                "aside"
            }
        ),
    );
    if side.swallowed_kept > 0 {
        line(
            "swallowing handler's orders",
            format!(
                "{}: among the orders above (InnoDB undid the failed insert alone; each must be applied exactly once)",
                side.swallowed_kept
            ),
        );
    } else {
        line(
            "swallowing handler's orders",
            format!(
                "{}: {} consumer dead letters naming the aborted transaction, {} acked without effect or record, {} applied, {} dead for another reason",
                side.swallowing.len(),
                side.swallowed_dead,
                side.acked_without_record.len(),
                side.swallowed_applied.len(),
                side.swallowed_other.len()
            ),
        );
    }
    line(
        "foreign messages with a usable id",
        format!(
            "{} ({} confirmed): {} applied once, {} undecodable dead letters, {} neither, {} otherwise, {} unconfirmed and never arrived",
            side.foreign_sent,
            side.foreign_confirmed,
            side.foreign_applied,
            side.foreign_dead,
            side.foreign_lost.len(),
            side.foreign_wrong.len(),
            side.foreign_never_arrived
        ),
    );
    line(
        "foreign messages without any id",
        format!(
            "{} ({anonymous_confirmed} confirmed, {} at the broker): dropped by the consumers, counted in their metric only; none left on the broker",
            anonymous.len(),
            anonymous_copies.map_or_else(|| "unknown".to_owned(), |n| n.to_string())
        ),
    );
    line(
        "dead letters (outbox)",
        format!(
            "{} ({} injected poison rows, {} unexpected, {} poison rows not dead)",
            dead.len(),
            inputs.poison.len(),
            unexpected_dead.len(),
            poison_alive.len()
        ),
    );
    line(
        "consumer dead letters",
        format!(
            "{} ({} swallowed errors, {} undecodable foreign messages, {} unexpected)",
            side.dead_letters,
            side.swallowed_dead + side.swallowed_other.len(),
            side.foreign_dead,
            side.unexpected_dead.len()
        ),
    );
    line("lost", lost.len());
    line(
        "double effects",
        format!(
            "{} events ({extra_effects} extra effect rows)",
            doubled.len()
        ),
    );
    line("effects of unknown events", unknown_effects);
    line("still pending in the outbox", pending);
    for (label, value) in &delayed.lines {
        line(label, value);
    }
    match common::percentiles(&outside) {
        Some((p50, p99)) => {
            let max = outside.iter().copied().fold(0.0, f64::max);
            line(
                "commit-to-consume outside fault windows",
                format!(
                    "p50 {}  p99 {}  max {}  ({} of {} events)",
                    common::ms(p50),
                    common::ms(p99),
                    common::ms(Duration::from_secs_f64(max / 1000.0)),
                    outside.len(),
                    written
                ),
            );
        }
        None => line(
            "commit-to-consume outside fault windows",
            "no event outside",
        ),
    }
    // The orders' destination while only the side destination was full: the relays must
    // publish the orders' events at least at half the rate the producers commit them
    // (a backlog of earlier faults makes it more; a relay that took the refusal for a
    // broker outage publishes next to none). Counted second by second, the seconds aside
    // in which another fault held the orders back (see `held_back`).
    let held_back = held_back(
        &windows
            .iter()
            .map(|(kind, start, end, _)| (*kind, *start, *end))
            .collect::<Vec<_>>(),
        &orders_sent_at,
    );
    let (mut committed_in, mut sent_in, mut seconds) = (0_usize, 0_usize, 0.0_f64);
    for (start, end) in &side_full {
        let mut t = *start;
        while t < *end {
            let u = (t + 1.0).min(*end);
            if !held_back.iter().any(|(a, b)| t < *b && u > *a) {
                committed_in += orders
                    .iter()
                    .filter(|o| o.created >= t && o.created < u)
                    .count();
                sent_in += orders_sent_at
                    .iter()
                    .filter(|s| **s >= t && **s < u)
                    .count();
                seconds += u - t;
            }
            t = u;
        }
    }
    let latency = common::percentiles(&while_side_full).map_or_else(
        || "no latency sample".to_owned(),
        |(p50, p99)| {
            format!(
                "commit-to-consume p50 {} p99 {} (with any catch-up after earlier faults)",
                common::ms(p50),
                common::ms(p99)
            )
        },
    );
    if side_full.is_empty() {
        line(
            "orders while one destination was full",
            "the fault was not injected",
        );
    } else if seconds < 3.0 || committed_in == 0 {
        line(
            "orders while one destination was full",
            format!("not judged: {seconds:.1} s not held back by another fault; {latency}"),
        );
    } else {
        let ratio = sent_in as f64 / committed_in as f64;
        line(
            "orders while one destination was full",
            format!(
                "{sent_in} published for {committed_in} committed in {seconds:.1} s (ratio {ratio:.2}, at least 0.5); {latency}"
            ),
        );
        if ratio < 0.5 {
            failures.push(format!(
                "the orders' destination stalled while only the side destination was full: {sent_in} of the orders' events published for {committed_in} committed in {seconds:.1} s"
            ));
        }
    }
    line(
        "longest stall (no effect applied)",
        format!(
            "{} from {} into the run{}",
            secs(stall.0),
            secs(stall.1 - phase_start),
            if stall_causes.is_empty() {
                String::new()
            } else {
                format!(" (during {})", stall_causes.join(", "))
            }
        ),
    );
    let p = &inputs.processes;
    let mut explained = Vec::new();
    let mut unexplained = Vec::new();
    for exit in &p.exits {
        match explained_by(exit, &inputs.records, inputs.lease, inputs.phase.0) {
            Some(fault) => explained.push(format!("{} ({fault})", exit.label)),
            None => unexplained.push(exit),
        }
    }
    let relay_exits = p
        .exits
        .iter()
        .filter(|e| e.role == Role::Relay && !e.at_shutdown)
        .count();
    line(
        "relay restarts",
        format!(
            "{} (after kills and {relay_exits} exits of their own{})",
            p.relay_restarts,
            if explained.is_empty() {
                String::new()
            } else {
                format!(", explained by database faults: {}", explained.join(", "))
            }
        ),
    );
    line("consumer restarts", p.consumer_restarts);
    if !unexplained.is_empty() {
        line(
            "exits not caused by the harness",
            unexplained
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        );
    }
    line(
        "drain",
        match &inputs.drain {
            Ok(Drained {
                took,
                unsettled: None,
            }) => format!("finished in {}", secs(took.as_secs_f64())),
            Ok(Drained {
                took,
                unsettled: Some(what),
            }) => format!(
                "settled in {} with nothing left to deliver, but: {what}",
                secs(took.as_secs_f64())
            ),
            Err(e) => format!("DID NOT FINISH: {e}"),
        },
    );
    for (id, kind, error) in &side.foreign_other_reason {
        println!(
            "  note: foreign message {id} ({kind}) is a dead letter for another reason than expected: {error}"
        );
    }
    for (p, e) in &poison_other_reason {
        println!(
            "  note: poison row {} ({}) is dead for another reason than expected: {e}",
            p.id, p.kind.name
        );
    }

    if let Err(e) = &inputs.drain {
        failures.push(format!("the drain did not finish: {e}"));
    }
    if written == 0 {
        failures.push("no order was written".to_owned());
    }
    if !lost.is_empty() {
        failures.push(format!(
            "{} events lost (e.g. {})",
            lost.len(),
            sample(lost.iter().map(|o| o.event_id))
        ));
    }
    if !doubled.is_empty() {
        failures.push(format!(
            "{} double effects (e.g. {})",
            doubled.len(),
            sample(doubled.iter().map(|o| o.event_id))
        ));
    }
    if !unexpected_dead.is_empty() {
        failures.push(format!(
            "{} unexpected dead letters (e.g. {}: {})",
            unexpected_dead.len(),
            unexpected_dead[0].0,
            unexpected_dead[0].1
        ));
    }
    if side_taken_while_full > 0 {
        failures.push(format!(
            "{side_taken_while_full} side events published while their destination was held full: the injection did not bite"
        ));
    }
    // With no side event refused and none taken, none committed while it was full was
    // tried before it was undone: the relays were held by another fault (a PostgreSQL
    // restart beside it, or the backlog after one). Not judged; said in its notes.
    if !poison_alive.is_empty() {
        failures.push(format!("{} poison rows are not dead", poison_alive.len()));
    }
    failures.extend(side.failures());
    if let Err(e) = &inputs.foreign_recorded {
        failures.push(format!("the foreign messages could not be recorded: {e}"));
    }
    if unknown_effects > 0 {
        failures.push(format!(
            "{unknown_effects} effects of events no order or foreign message has"
        ));
    }
    if !unexplained.is_empty() {
        failures.push(format!(
            "processes ended in ways the harness did not cause: {}",
            unexplained
                .iter()
                .map(|e| format!("{}: {}", e.label, e.how))
                .collect::<Vec<_>>()
                .join("; ")
        ));
    }
    Ok(failures)
}

/// The relays' longest wait between two tries of a refused destination or an
/// unreachable broker: the polling relay's circuit probes and the WAL relay's trials of
/// parked destinations double from 0.1-0.5 s up to 30 s (`probe_max`, `probe_cap`).
const RELAY_PROBE_CAP: f64 = 30.0;

/// When another fault held the orders' events back, so that the seconds of the side
/// destination's fault that overlap them say nothing about it: `windows` are the
/// injected faults (kind, start, end, seconds since the epoch), `orders_sent_at` when
/// the orders' events were published.
///
/// - The database down, or its connections terminated, and the 3 s after (the relays
///   complete nothing then, whatever the broker does).
/// - A fault that refused or cut off the orders' destination too (the broker frozen,
///   restarted or alarmed, the queue bound to `#` full, a node's fault), and after its
///   end until the orders flow again, at most for as long as the relays' backoff can
///   still wait before its next try: about the fault's duration (it doubles from a
///   fraction of a second), at most [`RELAY_PROBE_CAP`], plus 3 s. Without this a side
///   destination filled right after a 22 s queue-full fault failed a run (seed
///   16137438389868368370): the WAL relay's trial of the orders' destination, parked by
///   that fault, was due 11 s after it ended, while the side destination was full.
fn held_back(windows: &[(FaultKind, f64, f64)], orders_sent_at: &[f64]) -> Vec<(f64, f64)> {
    windows
        .iter()
        .filter_map(|&(kind, start, end)| match kind {
            FaultKind::DbRestart | FaultKind::DbTerminate => Some((start, end + 3.0)),
            FaultKind::BrokerFreeze
            | FaultKind::BrokerRestart
            | FaultKind::MemoryAlarm
            | FaultKind::QueueFull
            | FaultKind::NodeKill
            | FaultKind::NodeFreeze
            | FaultKind::NodePartition => {
                let backoff_until = end + (end - start).min(RELAY_PROBE_CAP) + 3.0;
                let flowing_again = orders_sent_at
                    .iter()
                    .copied()
                    .filter(|&sent| sent >= end)
                    .fold(f64::INFINITY, f64::min);
                Some((start, backoff_until.min(flowing_again)))
            }
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{FaultKind, held_back};

    #[test]
    fn the_orders_are_held_back_after_a_broker_fault_until_they_flow_or_the_backoff_ends() {
        // A 20 s queue-full fault from 100 to 120: held back until the first order is
        // published after it, at most until 120 + 20 + 3.
        let queue_full = [(FaultKind::QueueFull, 100.0, 120.0)];
        assert_eq!(held_back(&queue_full, &[90.0, 130.5]), [(100.0, 130.5)]);
        assert_eq!(held_back(&queue_full, &[90.0, 150.0]), [(100.0, 143.0)]);
        assert_eq!(held_back(&queue_full, &[]), [(100.0, 143.0)]);
        // A longer outage: at most the relays' 30 s probe cap after it.
        assert_eq!(
            held_back(&[(FaultKind::BrokerFreeze, 0.0, 100.0)], &[]),
            [(0.0, 133.0)]
        );
        // The database: 3 s after it, whatever the orders do.
        assert_eq!(
            held_back(&[(FaultKind::DbRestart, 10.0, 15.0)], &[15.5]),
            [(10.0, 18.0)]
        );
        // The side destination's own fault and the consumers' faults hold nothing back.
        assert!(
            held_back(
                &[
                    (FaultKind::DestinationFull, 0.0, 10.0),
                    (FaultKind::ConsumerLockout, 0.0, 10.0),
                    (FaultKind::RelayKill, 5.0, 6.0),
                ],
                &[]
            )
            .is_empty()
        );
    }
}
