//! `outbox migrate`: creates the schema and applies pending migrations.

use std::io::Write;

use outboxkit_core::OutboxAdmin;

use super::Validated;
use crate::error::CliError;

/// `outbox migrate` (it takes no arguments).
pub(crate) struct Migrate;

/// Validates the arguments of `outbox migrate` (there are none).
pub(crate) fn validate() -> Result<Migrate, CliError> {
    Ok(Migrate)
}

impl Validated for Migrate {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let applied = outbox.migrate().await?;
        if applied.is_empty() {
            writeln!(out, "schema {} is up to date", outbox.schema())?;
        } else {
            writeln!(
                out,
                "schema {}: applied migrations {applied:?}",
                outbox.schema()
            )?;
        }
        Ok(())
    }
}
