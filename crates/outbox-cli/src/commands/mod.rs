//! The admin commands, one module each holding the command's arguments (clap), their
//! validation, its library function returning a serializable report, and the rendering
//! of that report as a table or JSON:
//!
//! - `migrate`: `outbox migrate`;
//! - `stats`: `outbox stats` ([`stats()`], [`StatsReport`]);
//! - `reconcile`: `outbox reconcile` ([`reconcile()`]);
//! - `dead`: `outbox dead list|replay` ([`dead_list`], [`dead_replay`]);
//! - `inbox_dead`: `outbox inbox dead list|replay` ([`inbox_dead_list`],
//!   [`inbox_dead_replay`]);
//! - `purge`: `outbox purge` ([`purge()`]);
//! - `wal`: `outbox wal setup|status|drop` (the slot of `outbox relay --source wal`);
//! - `dashboard`: `outbox dashboard`, the pages in the browser (also mounted by
//!   `outbox relay --dashboard`).
//!
//! Each module's `validate` checks the arguments and returns a `Validated` value;
//! [`crate::run`] connects to the database only once that succeeded, then runs it.

use std::io::Write;

use outboxkit_core::OutboxAdmin;

use crate::error::CliError;

pub(crate) mod dashboard;
pub(crate) mod dead;
pub(crate) mod inbox_dead;
pub(crate) mod migrate;
pub(crate) mod purge;
pub(crate) mod reconcile;
pub(crate) mod stats;
pub(crate) mod wal;

pub(crate) use purge::purge;
pub(crate) use reconcile::reconcile;
pub(crate) use stats::stats;

/// A command whose arguments were validated: all that is left is to run it against
/// the database.
pub(crate) trait Validated {
    /// Runs the command against `outbox` and writes its output (a table, a line or
    /// JSON) to `out`.
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError>;
}
