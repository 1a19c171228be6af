//! Each claimed row's outcome turned into its completion.

use std::borrow::Cow;

use tracing::{debug, error, warn};

use super::{BatchReport, Dispatcher};
use crate::error::PublishError;
use crate::message::OutboxMessage;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{Completion, CompletionOutcome, OutboxStore, Poison, PoisonRow};

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// The completions of a batch: `outcomes[i]` is the outcome of `claimed[i]` (`None`:
    /// not attempted, released without charge), and every poison row is `Dead`.
    ///
    /// Each message is paired with its own outcome before anything else is looked at,
    /// so a message that cannot be completed (no claim token) never hands its outcome
    /// to the next one. `destinations[i]` is the destination (circuit) `claimed[i]` is
    /// held for when refused; where it is missing, the publisher names it.
    pub(super) fn decide(
        &self,
        claimed: &[OutboxMessage],
        outcomes: Vec<Option<PublishOutcome>>,
        poison: &[PoisonRow],
        destinations: &[Cow<'_, str>],
    ) -> (Vec<Completion>, BatchReport) {
        let mut report = BatchReport {
            claimed: claimed.len() + poison.len(),
            ..BatchReport::default()
        };
        let mut completions = Vec::with_capacity(claimed.len() + poison.len());
        let mut outcomes = outcomes.into_iter();
        for (i, msg) in claimed.iter().enumerate() {
            let outcome = outcomes.next().flatten();
            let Some(token) = msg.claim_token else {
                error!(id = %msg.id, "a claimed message has no claim token: its outcome cannot be recorded; it is reclaimed after its lease");
                continue;
            };
            let destination = destinations.get(i).map(AsRef::as_ref);
            let outcome = self.outcome_of(msg, destination, outcome, &mut report);
            completions.push(Completion {
                id: msg.id,
                claim_token: token,
                outcome,
            });
        }
        for row in poison {
            report.dead += 1;
            report.poison += 1;
            crate::metrics::dead_poison();
            match &row.poison {
                Poison::Undecodable {
                    claim_token,
                    reason,
                } => {
                    warn!(id = %row.id, reason = %reason, "poison row: it cannot be decoded, it is dead");
                    completions.push(Completion {
                        id: row.id,
                        claim_token: *claim_token,
                        outcome: CompletionOutcome::Dead {
                            error: row.poison.to_string(),
                        },
                    });
                }
                Poison::CrashLoop { claims_alone } => {
                    warn!(id = %row.id, claims_alone, "poison row: claimed alone again and again without an outcome (suspected crash loop); the store moved it to dead");
                }
            }
        }
        (completions, report)
    }

    fn outcome_of(
        &self,
        msg: &OutboxMessage,
        destination: Option<&str>,
        outcome: Option<PublishOutcome>,
        report: &mut BatchReport,
    ) -> CompletionOutcome {
        match outcome {
            None => {
                report.released += 1;
                CompletionOutcome::Release
            }
            Some(PublishOutcome::Published) => {
                report.published += 1;
                CompletionOutcome::Sent
            }
            Some(PublishOutcome::Transient(e @ PublishError::Rejected { .. })) => {
                crate::metrics::publish_failed(crate::ErrorKind::Unavailable, &msg.event_type);
                crate::metrics::deferred(&msg.event_type);
                report.deferred += 1;
                let destination =
                    destination.map_or_else(|| self.destination(msg).into_owned(), str::to_owned);
                debug!(id = %msg.id, event_type = %msg.event_type, destination = %destination, error = %e, "its destination refused it: held without charge until the destination's trial succeeds");
                CompletionOutcome::Hold {
                    destination,
                    error: e.to_string(),
                }
            }
            Some(o @ PublishOutcome::Transient(_)) if o.is_outage() => {
                crate::metrics::publish_failed(crate::ErrorKind::Unavailable, &msg.event_type);
                report.outage = true;
                report.released += 1;
                CompletionOutcome::Release
            }
            Some(PublishOutcome::Transient(e)) => {
                crate::metrics::publish_failed(e.kind(), &msg.event_type);
                let policy = self.config.retry.for_event_type(&msg.event_type);
                let attempts = u32::try_from(msg.attempts).unwrap_or(0);
                if policy.should_retry(attempts) {
                    report.retried += 1;
                    crate::metrics::retried(&msg.event_type);
                    let delay = policy.delay(attempts);
                    debug!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts, delay_ms = delay.as_millis() as u64, error = %e, "publish failed, will retry");
                    CompletionOutcome::Retry {
                        delay,
                        error: e.to_string(),
                    }
                } else {
                    report.dead += 1;
                    crate::metrics::dead(&msg.event_type);
                    warn!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts, error = %e, "attempts exhausted, message is dead");
                    CompletionOutcome::Dead {
                        error: format!(
                            "attempts exhausted ({attempts}/{}): {e}",
                            policy.max_attempts()
                        ),
                    }
                }
            }
            Some(PublishOutcome::Permanent(e)) => {
                report.dead += 1;
                crate::metrics::publish_failed(e.kind(), &msg.event_type);
                crate::metrics::dead(&msg.event_type);
                warn!(id = %msg.id, event_type = %msg.event_type, tenant = msg.tenant_id.as_deref().unwrap_or(""), aggregate_type = %msg.aggregate_type, aggregate_id = %msg.aggregate_id, version = msg.aggregate_version, attempts = msg.attempts, error = %e, "permanent publish failure, message is dead");
                CompletionOutcome::Dead {
                    error: e.to_string(),
                }
            }
        }
    }
}
