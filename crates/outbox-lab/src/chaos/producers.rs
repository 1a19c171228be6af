//! The producers (orders and their events, one transaction each, at a steady rate;
//! every [`SWALLOW_EVERY`]-th order of each producer marked for the consumers' swallowing
//! handler, every [`SIDE_EVERY`]-th with a side event for the second destination) and
//! the poison lane (rows the relay must dead-letter alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use outboxkit_core::{NewMessage, OutboxProducer};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::db::{Arg, Database, Outbox, bound, on_outbox};
use super::schedule::{FaultKind, Planned};
use super::timeline::Timeline;
use super::topology::{EVENT_TYPE, Names, SIDE_EVENT_TYPE, TransportKind};

/// What the producers did.
#[derive(Debug, Default)]
pub(crate) struct ProducerStats {
    /// Transactions committed (the orders table is the truth; this is what the
    /// producers saw).
    pub(crate) committed: AtomicU64,
    /// Transactions that failed (a database fault): the order is skipped (or, when the
    /// commit's answer was lost, it may be in the table: the table is what counts).
    pub(crate) failed: AtomicU64,
}

/// Every this many orders of each producer, one is marked for the swallowing handler
/// (with 4 producers at 200 orders per second, 0.8 per second): the producer writes its
/// audit row with it and sets `"audit": true` in the event, and the consumers' handler
/// then trips over that row and swallows the error (see `consumer`). The marked orders
/// are those with an `audit` row; each must end as a consumer dead letter, with no
/// effect. Every other marked event is unversioned (version 0): then no inbox statement
/// follows the handler and the store's commit alone must notice the aborted
/// transaction; for a versioned one, recording the version after the handler fails
/// first.
pub(crate) const SWALLOW_EVERY: u64 = 250;

/// Every this many orders of each producer, the order's transaction also enqueues a side
/// event ([`SIDE_EVENT_TYPE`], recorded in `side_events`): the second destination, which
/// the destination-full fault holds full while the orders' destination must keep
/// flowing. No consumer reads it; the verdict checks every side event reached the broker
/// and none is dead.
pub(crate) const SIDE_EVERY: u64 = 4;

/// One order and its event, in one transaction (with its audit row when it is marked,
/// see [`SWALLOW_EVERY`], and a side event, see [`SIDE_EVERY`]). The order row is
/// written last with `clock_timestamp()` (MariaDB: `NOW(6)`), the closest the database
/// clock gets to the commit time, from which commit-to-consume latency is measured.
async fn place_order(outbox: &Outbox, names: &Names, n: u64) -> anyhow::Result<()> {
    let order_id = Uuid::now_v7();
    let audit = n.is_multiple_of(SWALLOW_EVERY);
    let unversioned = audit && (n / SWALLOW_EVERY).is_multiple_of(2);
    let event = NewMessage::builder("order", order_id.to_string(), EVENT_TYPE)
        .aggregate_version(if unversioned { 0 } else { 1 })
        .payload(&serde_json::json!({
            "order_id": order_id,
            "customer": format!("customer-{}", n % 97),
            "total_cents": 1_000 + (n * 37) % 50_000,
            "audit": audit,
        }))
        .build()?;
    let side = n
        .is_multiple_of(SIDE_EVERY)
        .then(|| {
            NewMessage::builder("order", order_id.to_string(), SIDE_EVENT_TYPE)
                .payload(&serde_json::json!({ "order_id": order_id }))
                .build()
        })
        .transpose()?;
    let d = outbox.database();
    let (now, a1, a2) = (d.now(), d.arg(1), d.arg(2));
    let mut rows = Vec::new();
    if let Some(side) = &side {
        rows.push((
            format!(
                "INSERT INTO {} (id, created_at) VALUES ({a1}, {now})",
                names.table("side_events")
            ),
            vec![Arg::Uuid(side.id)],
        ));
    }
    if audit {
        rows.push((
            format!(
                "INSERT INTO {} (order_id, event_id) VALUES ({a1}, {a2})",
                names.table("audit")
            ),
            vec![Arg::Uuid(order_id), Arg::Uuid(event.id)],
        ));
    }
    rows.push((
        format!(
            "INSERT INTO {} (id, event_id, created_at) VALUES ({a1}, {a2}, {now})",
            names.table("orders")
        ),
        vec![Arg::Uuid(order_id), Arg::Uuid(event.id)],
    ));
    on_outbox!(outbox, store => {
        let mut tx = store.begin().await?;
        store.enqueue(&mut tx, &event).await?;
        if let Some(side) = &side {
            store.enqueue(&mut tx, side).await?;
        }
        for (sql, args) in rows {
            bound!(query, sql, args).execute(&mut *tx).await?;
        }
        tx.commit().await?;
    });
    Ok(())
}

/// A producer writing `rate` orders per second until `stop`. A failed transaction is
/// counted and the producer goes on at its pace (no burst to catch up).
pub(crate) async fn produce(
    outbox: Outbox,
    names: Names,
    rate: f64,
    stats: Arc<ProducerStats>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0_u64;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        n += 1;
        match place_order(&outbox, &names, n).await {
            Ok(()) => {
                stats.committed.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                if stats
                    .failed
                    .fetch_add(1, Ordering::Relaxed)
                    .is_multiple_of(100)
                {
                    tracing::warn!(error = %e, "a producer transaction failed");
                }
            }
        }
    }
}

/// A kind of poison row: what spoils it, and what the relay must say about it.
#[derive(Debug, Clone)]
pub(crate) struct PoisonKind {
    pub(crate) name: &'static str,
    /// SQL assignments that spoil a row.
    pub(crate) set: String,
    /// Text its `last_error` must contain.
    pub(crate) reason: &'static str,
}

/// The largest payload RabbitMQ takes during a run (its `max_message_size`, lowered by
/// the harness for the run; the relay's own limit stays at 16 MiB, so the broker is
/// the one refusing), and NATS' default `max_payload`.
pub(crate) const BROKER_LIMIT: usize = 1024 * 1024;

/// The poison kinds the relay-fault tests isolate, for `transport`, in `database`'s SQL.
/// `payload_limit`: whether the broker limit is in force (RabbitMQ's needs a
/// `rabbitmqctl` here).
pub(crate) fn poison_kinds(
    transport: TransportKind,
    database: Database,
    payload_limit: bool,
) -> Vec<PoisonKind> {
    let size = BROKER_LIMIT + 200 * 1024;
    let big = match database {
        Database::Postgres => format!("payload = to_json(repeat('x', {size}))"),
        Database::Mysql => format!("payload = JSON_QUOTE(REPEAT('x', {size}))"),
    };
    // A JSON `\n` escape in a string literal: MySQL reads a backslash in a literal as
    // an escape of its own.
    let line_break = match database {
        Database::Postgres => r#"headers = '{"note": "a\nb"}'"#,
        Database::Mysql => r#"headers = '{"note": "a\\nb"}'"#,
    };
    let mut kinds = vec![PoisonKind {
        name: "headers not a JSON object of strings",
        set: r#"headers = '{"retries": 3}'"#.to_owned(),
        reason: "undecodable row",
    }];
    match transport {
        TransportKind::Rabbit => {
            kinds.push(PoisonKind {
                name: "header name over 255 bytes",
                set: format!(r#"headers = '{{"{}": "x"}}'"#, "h".repeat(300)),
                // Refused before the wire by the limits consumers decode
                // (`outboxkit_core::wire::check_limits`).
                reason: "header name is 300 bytes long, the maximum is 255",
            });
            if payload_limit {
                kinds.push(PoisonKind {
                    name: "payload over the broker's max_message_size",
                    set: big,
                    reason: "406 PRECONDITION_FAILED for this message alone",
                });
            }
        }
        TransportKind::Nats => {
            kinds.push(PoisonKind {
                name: "non-ASCII header name",
                set: r#"headers = '{"größe": "x"}'"#.to_owned(),
                reason: "not a NATS header name",
            });
            kinds.push(PoisonKind {
                name: "payload over the server's max_payload",
                set: big,
                reason: "exceeds the broker limit",
            });
            kinds.push(PoisonKind {
                name: "line break in a header value",
                set: line_break.to_owned(),
                reason: "line break",
            });
            kinds.push(PoisonKind {
                name: "header reserved for JetStream",
                set: r#"headers = '{"Nats-Expected-Stream": "other"}'"#.to_owned(),
                reason: "reserved for JetStream",
            });
        }
    }
    kinds
}

/// A poison row written: its id and kind.
#[derive(Debug, Clone)]
pub(crate) struct PoisonRow {
    pub(crate) id: Uuid,
    pub(crate) kind: PoisonKind,
}

/// A valid event, to be spoiled by [`write_poison`].
fn poison_event(kind: &PoisonKind) -> anyhow::Result<NewMessage> {
    Ok(
        NewMessage::builder("poison", Uuid::now_v7().to_string(), EVENT_TYPE)
            .payload(&serde_json::json!({ "poison": kind.name }))
            .build()?,
    )
}

/// Writes `event` spoiled by `kind`: enqueued and spoiled in the same transaction (as a
/// trigger, a migration or another language's producer might), so no relay ever sees
/// it unspoiled. The payload bypasses `enqueue`'s size limit the same way.
async fn write_poison(
    outbox: &Outbox,
    names: &Names,
    event: &NewMessage,
    kind: &PoisonKind,
) -> anyhow::Result<()> {
    let sql = format!(
        "UPDATE {} SET {} WHERE id = {}",
        names.table("outbox_messages"),
        kind.set,
        outbox.database().arg(1)
    );
    on_outbox!(outbox, store => {
        let mut tx = store.begin().await?;
        store.enqueue(&mut tx, event).await?;
        let updated = bound!(query, sql, [Arg::Uuid(event.id)])
            .execute(&mut *tx)
            .await?
            .rows_affected();
        anyhow::ensure!(updated == 1, "the poison row was not updated");
        tx.commit().await?;
    });
    Ok(())
}

/// Whether row `id` is in the outbox (a commit whose answer was lost may have
/// happened).
pub(super) async fn written(outbox: &Outbox, names: &Names, id: Uuid) -> bool {
    outbox
        .pool()
        .fetch_one::<(i64,)>(
            format!(
                "SELECT count(*) FROM {} WHERE id = {}",
                names.table("outbox_messages"),
                outbox.database().arg(1)
            ),
            vec![Arg::Uuid(id)],
        )
        .await
        .is_ok_and(|(n,)| n > 0)
}

/// The poison lane: at each planned time, one row of every kind. A row whose
/// transaction fails (a database fault at that moment) is retried, with the same id,
/// for up to 30 s.
pub(crate) async fn poison_lane(
    outbox: &Outbox,
    names: &Names,
    kinds: &[PoisonKind],
    plan: &[Planned],
    phase_start: Instant,
    timeline: &Timeline,
    stop: &CancellationToken,
) -> Vec<PoisonRow> {
    let mut rows = Vec::new();
    for batch in plan {
        let at = tokio::time::Instant::from_std(phase_start + batch.at);
        tokio::select! {
            () = stop.cancelled() => return rows,
            () = tokio::time::sleep_until(at) => {}
        }
        for kind in kinds {
            let event = match poison_event(kind) {
                Ok(event) => event,
                Err(e) => {
                    timeline.not_injected(FaultKind::Poison, format!("{}: {e}", kind.name));
                    continue;
                }
            };
            let id = event.id;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let result = match write_poison(outbox, names, &event, kind).await {
                    Err(_) if written(outbox, names, id).await => Ok(()),
                    other => other,
                };
                match result {
                    Ok(()) => {
                        let record = timeline.injected(FaultKind::Poison, kind.name);
                        timeline.ended(record);
                        rows.push(PoisonRow {
                            id,
                            kind: kind.clone(),
                        });
                        break;
                    }
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(error = %e, "poison row not written yet");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => {
                        timeline.not_injected(
                            FaultKind::Poison,
                            format!("{}: could not be written: {e}", kind.name),
                        );
                        break;
                    }
                }
            }
        }
        timeline.say(format!("poison rows: {} written", kinds.len()));
    }
    rows
}
