//! The consumer side of the verdict: what the swallowing handler's orders and the
//! foreign producer's messages became, and whether every consumer dead letter is one
//! of those expected.
//!
//! - A **swallowing** order (one with an `audit` row, see `producers::SWALLOW_EVERY`),
//!   on PostgreSQL, must have no effect and exactly one consumer dead letter whose `last_error` names
//!   the aborted transaction: the idempotent consumer's under the handler's consumer
//!   name in `inbox_failures`, the durable inbox's as its `inbox_messages` row `Dead`.
//!   No effect and no dead letter means the delivery was acked as if applied: the bug
//!   the inbox's abort check fixes. On MariaDB the swallowed unique violation aborts
//!   nothing (InnoDB undoes the failed statement alone, the transaction goes on and
//!   commits the effect): such an order must be applied exactly once, and is judged
//!   with the other orders.
//! - A **foreign** message with a usable id must be applied exactly once (the one with
//!   NUL characters) or be exactly one consumer dead letter under `undecodable` (the
//!   others), never both, never neither. One the broker never confirmed may be missing
//!   if it is not among the broker's copies either (it never arrived); if it arrived,
//!   the same holds.
//! - Every other consumer dead letter is unexpected.

use std::collections::HashSet;

use outboxkit_inbox::UNDECODABLE_CONSUMER;
use uuid::Uuid;

use super::super::audit::Copies;
use super::super::db::{Arg, Database, Db};
use super::super::foreign::Expect;
use super::super::topology::{CONSUMER, ConsumerMode, Names};

/// What the `last_error` of a swallowing order's dead letter must contain (the inbox
/// says "the handler returned Ok, but its transaction was aborted").
const ABORTED: &str = "aborted";

/// The `consumer` shown for a durable-inbox message that is `Dead`.
const DURABLE: &str = "(durable inbox)";

/// What the consumer side of the verdict found.
#[derive(Debug, Default)]
pub(crate) struct ConsumerSide {
    /// Event ids of the swallowing orders (on PostgreSQL; on MariaDB they are judged
    /// with the other orders: see [`judge`]).
    pub(crate) swallowing: HashSet<Uuid>,
    /// On MariaDB, the swallowing orders: InnoDB undoes a failed statement alone and
    /// the transaction goes on, so the swallowed unique violation leaves the effect to
    /// commit, and each must be applied exactly once like any other order.
    pub(crate) swallowed_kept: usize,
    /// Swallowing orders that ended as they must.
    pub(crate) swallowed_dead: usize,
    /// Swallowing orders with no effect and no dead letter: acked as if applied.
    pub(crate) acked_without_record: Vec<Uuid>,
    /// Swallowing orders with an effect.
    pub(crate) swallowed_applied: Vec<Uuid>,
    /// Swallowing orders dead for another reason than the aborted transaction.
    pub(crate) swallowed_other: Vec<(Uuid, String)>,
    /// Ids of the foreign messages with a usable id (any outcome).
    pub(crate) foreign_ids: HashSet<Uuid>,
    /// Foreign messages that must be applied, whose one effect is expected.
    pub(crate) foreign_applied_ids: HashSet<Uuid>,
    /// Foreign messages with a usable id, and how many the broker confirmed.
    pub(crate) foreign_sent: usize,
    pub(crate) foreign_confirmed: usize,
    /// Foreign messages that ended as they must: applied once, dead-lettered once.
    pub(crate) foreign_applied: usize,
    pub(crate) foreign_dead: usize,
    /// Foreign messages that reached the broker (confirmed, or among its copies) but
    /// are neither applied nor dead letters.
    pub(crate) foreign_lost: Vec<(Uuid, String)>,
    /// Unconfirmed foreign messages that are neither among the broker's copies nor
    /// applied nor dead letters: they never arrived (allowed).
    pub(crate) foreign_never_arrived: usize,
    /// Foreign messages that ended otherwise: applied twice, applied and dead, dead
    /// when they should be applied, applied when they should be dead.
    pub(crate) foreign_wrong: Vec<(Uuid, String)>,
    /// Foreign dead letters whose `last_error` does not say what the kind expects.
    pub(crate) foreign_other_reason: Vec<(Uuid, String, String)>,
    /// Consumer dead letters: all of them, and the unexpected ones.
    pub(crate) dead_letters: usize,
    pub(crate) unexpected_dead: Vec<(Uuid, String, String)>,
}

/// A foreign message as recorded, and what became of it: id, kind, expected outcome,
/// what its dead letter must say, whether the broker confirmed it, its effects, the
/// `last_error` of its dead letter under `undecodable`, its consumer dead letters under
/// any consumer.
type ForeignRow = (Uuid, String, String, String, bool, i64, Option<String>, i64);

/// Reads what the consumers did with the swallowing orders, the foreign messages and
/// every consumer dead letter; `copies` are the broker's, if it could be read.
pub(crate) async fn judge(
    admin: &Db,
    names: &Names,
    mode: ConsumerMode,
    copies: Option<&Copies>,
) -> anyhow::Result<ConsumerSide> {
    let t = |table: &str| names.table(table);
    let mut side = ConsumerSide::default();
    let d = admin.database();

    // The swallowing orders: effects, the handler's dead letter, the durable inbox's.
    let swallowing: Vec<(Uuid, i64, Option<String>, Option<String>)> = admin
        .fetch_all(
            format!(
                "SELECT a.event_id,
                        (SELECT count(*) FROM {e} e WHERE e.event_id = a.event_id),
                        (SELECT d.last_error FROM {f} d
                          WHERE d.message_id = a.event_id AND d.consumer = {p} AND d.dead_at IS NOT NULL),
                        (SELECT coalesce(m.last_error, '') FROM {i} m
                          WHERE m.id = a.event_id AND m.status = 3)
                   FROM {a} a JOIN {o} o ON o.event_id = a.event_id",
                e = t("effects"),
                f = t("inbox_failures"),
                i = t("inbox_messages"),
                a = t("audit"),
                o = t("orders"),
                p = d.arg(1),
            ),
            vec![Arg::Text(CONSUMER.to_owned())],
        )
        .await?;
    for (id, effects, handler_dead, durable_dead) in swallowing {
        if d == Database::Mysql {
            side.swallowed_kept += 1;
            continue;
        }
        side.swallowing.insert(id);
        let dead = match mode {
            ConsumerMode::Durable => durable_dead,
            ConsumerMode::Idempotent | ConsumerMode::Direct => handler_dead,
        };
        match (effects, dead) {
            (0, None) => side.acked_without_record.push(id),
            (0, Some(e)) if e.contains(ABORTED) => side.swallowed_dead += 1,
            (0, Some(e)) => side.swallowed_other.push((id, e)),
            _ => side.swallowed_applied.push(id),
        }
    }

    // The foreign messages with a usable id.
    let foreign: Vec<ForeignRow> = admin
        .fetch_all(
            format!(
                "SELECT x.id, x.kind, x.expect, x.reason, x.confirmed,
                        (SELECT count(*) FROM {e} e WHERE e.event_id = x.id) AS effects,
                        (SELECT d.last_error FROM {f} d
                          WHERE d.message_id = x.id AND d.consumer = {p} AND d.dead_at IS NOT NULL)
                          AS undecodable,
                        (SELECT count(*) FROM {f} d WHERE d.message_id = x.id AND d.dead_at IS NOT NULL)
                      + (SELECT count(*) FROM {i} m WHERE m.id = x.id AND m.status = 3) AS dead
                   FROM {x} x",
                e = t("effects"),
                f = t("inbox_failures"),
                i = t("inbox_messages"),
                x = t("foreign_messages"),
                p = d.arg(1),
            ),
            vec![Arg::Text(UNDECODABLE_CONSUMER.to_owned())],
        )
        .await?;
    side.foreign_sent = foreign.len();
    let mut foreign_dead_ids = HashSet::new();
    for (id, kind, expect, reason, confirmed, effects, undecodable, dead) in foreign {
        side.foreign_ids.insert(id);
        side.foreign_confirmed += usize::from(confirmed);
        let applied = expect == Expect::Applied.as_str();
        if applied {
            side.foreign_applied_ids.insert(id);
        } else {
            foreign_dead_ids.insert(id);
        }
        let arrived = confirmed || copies.is_none_or(|c| c.contains_key(&id));
        match (applied, effects, dead) {
            (_, 0, 0) if arrived => side.foreign_lost.push((id, kind)),
            (_, 0, 0) => side.foreign_never_arrived += 1,
            (true, 1, 0) => side.foreign_applied += 1,
            (false, 0, 1) if undecodable.is_some() => {
                side.foreign_dead += 1;
                if let Some(error) = undecodable.filter(|e| !e.contains(&reason)) {
                    side.foreign_other_reason.push((id, kind, error));
                }
            }
            (_, effects, dead) => side.foreign_wrong.push((
                id,
                format!(
                    "{kind}: must be {expect}, has {effects} effects and {dead} consumer dead letters"
                ),
            )),
        }
    }

    // Every consumer dead letter, against those expected.
    let dead: Vec<(Uuid, String, String)> = admin
        .fetch_all(
            format!(
                "SELECT message_id, consumer, last_error FROM {f} WHERE dead_at IS NOT NULL
                 UNION ALL
                 SELECT id, '{DURABLE}', coalesce(last_error, '') FROM {i} WHERE status = 3",
                f = t("inbox_failures"),
                i = t("inbox_messages"),
            ),
            Vec::new(),
        )
        .await?;
    side.dead_letters = dead.len();
    side.unexpected_dead = dead
        .into_iter()
        .filter(|(id, consumer, _)| {
            let swallowed = side.swallowing.contains(id)
                && match mode {
                    ConsumerMode::Durable => consumer == DURABLE,
                    ConsumerMode::Idempotent | ConsumerMode::Direct => consumer == CONSUMER,
                };
            let undecodable = foreign_dead_ids.contains(id) && consumer == UNDECODABLE_CONSUMER;
            !(swallowed || undecodable)
        })
        .collect();
    Ok(side)
}

impl ConsumerSide {
    /// The reasons the consumer side fails the run.
    pub(crate) fn failures(&self) -> Vec<String> {
        let mut failures = Vec::new();
        if !self.acked_without_record.is_empty() {
            failures.push(format!(
                "{} of the swallowing handler's messages were acked without effect and without \
                 a dead letter: their aborted transactions passed for commits (e.g. {})",
                self.acked_without_record.len(),
                sample(self.acked_without_record.iter().copied())
            ));
        }
        if !self.swallowed_applied.is_empty() {
            failures.push(format!(
                "{} of the swallowing handler's messages have an effect (e.g. {})",
                self.swallowed_applied.len(),
                sample(self.swallowed_applied.iter().copied())
            ));
        }
        if let Some((id, error)) = self.swallowed_other.first() {
            failures.push(format!(
                "{} of the swallowing handler's messages are dead letters that do not name the \
                 aborted transaction (e.g. {id}: {error})",
                self.swallowed_other.len()
            ));
        }
        if let Some((id, kind)) = self.foreign_lost.first() {
            failures.push(format!(
                "{} foreign messages that reached the broker were neither applied nor dead \
                 letters (e.g. {id}, {kind})",
                self.foreign_lost.len()
            ));
        }
        if let Some((id, what)) = self.foreign_wrong.first() {
            failures.push(format!(
                "{} foreign messages ended otherwise than their kind must (e.g. {id}: {what})",
                self.foreign_wrong.len()
            ));
        }
        if let Some((id, consumer, error)) = self.unexpected_dead.first() {
            failures.push(format!(
                "{} unexpected consumer dead letters (e.g. {id} of {consumer}: {error})",
                self.unexpected_dead.len()
            ));
        }
        failures
    }
}

pub(crate) fn sample(ids: impl Iterator<Item = Uuid>) -> String {
    ids.take(3)
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
