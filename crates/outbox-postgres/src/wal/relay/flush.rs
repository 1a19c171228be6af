//! Publishing a batch in order: outages, retries, dead letters, the crash-loop guard.

use std::sync::atomic::Ordering;
use std::time::Duration;

use outbox_core::{EventPublisher, MessageStatus, OutboxStore as _, PublishOutcome};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::WalRelay;
use super::session::{Item, SessionStart};
use crate::wal::WalError;

/// How a publishing round ended short of the batch's end.
enum Pause {
    Outage(String),
    Retry(Duration),
}

impl<P: EventPublisher> WalRelay<P> {
    /// Publishes `batch` in order and records the outcomes. `Ok(false)`: shutdown
    /// came during an outage or a backoff, and not everything was confirmed.
    pub(super) async fn flush(
        &self,
        batch: &mut Vec<Item>,
        state: &mut SessionStart,
        shutdown: &CancellationToken,
    ) -> Result<bool, WalError> {
        let items = std::mem::take(batch);
        let mut messages = Vec::with_capacity(items.len());
        let mut dead = Vec::new();
        for item in items {
            match item {
                Item::Message(m) => messages.push(*m),
                Item::Poison { id, reason } => {
                    warn!(%id, %reason, "poison row: it cannot be decoded, it is dead");
                    outbox_core::metrics::dead_poison();
                    dead.push((id, format!("undecodable row: {reason}")));
                }
                Item::Replay(id) => match self.outbox.get(id).await {
                    Ok(Some(m)) if m.status == MessageStatus::New => messages.push(m),
                    Ok(_) => {}
                    Err(e) if e.kind().is_retryable() => return Err(e.into()),
                    // The row as it is now does not decode: it dies alone.
                    Err(e) => {
                        warn!(%id, error = %e, "poison row: it cannot be decoded, it is dead");
                        outbox_core::metrics::dead_poison();
                        dead.push((id, format!("undecodable row: {e}")));
                    }
                },
            }
        }
        if !self.record(&[], &dead, shutdown).await? {
            return Ok(false);
        }
        if state.catching_up && !messages.is_empty() {
            let pending = self.still_pending(&messages).await?;
            let before = messages.len();
            messages.retain(|m| pending.contains(&m.id));
            if messages.len() == before {
                state.catching_up = false;
            } else {
                info!(
                    skipped = before - messages.len(),
                    "skipped rows the previous session published and recorded already"
                );
            }
        }
        outbox_core::metrics::claimed(messages.len());
        // The crash-loop guard: the session's first pending message is the one a
        // relay that died publishing alone left behind (see `SessionStart`).
        let mut guarded = None;
        if !state.guarded && !messages.is_empty() {
            state.guarded = true;
            let first = &messages[0];
            let alone = self.bump_alone(first.id).await?;
            if alone > i64::from(self.config.crash_loop_limit) {
                let times = alone - 1;
                warn!(id = %first.id, event_type = %first.event_type, times, "suspected crash loop: the relay ended every time it published this message alone; it is dead");
                outbox_core::metrics::dead(&first.event_type);
                let error = format!(
                    "suspected crash loop: published alone {times} times without an outcome (the relay ended each time)"
                );
                if !self.record(&[], &[(first.id, error)], shutdown).await? {
                    return Ok(false);
                }
                messages.remove(0);
            } else {
                guarded = Some(first.id);
            }
        }
        let mut attempts: Vec<u32> = messages
            .iter()
            .map(|m| u32::try_from(m.attempts).unwrap_or(0))
            .collect();
        let mut start = 0;
        let mut outage_delay = Duration::from_millis(500);
        while start < messages.len() {
            // While careful, small rounds each recorded before the next (see
            // `SessionStart`).
            let end = if state.careful_left > 0 {
                messages.len().min(start + state.careful_chunk)
            } else {
                messages.len()
            };
            let slice = &messages[start..end];
            let began = Instant::now();
            // The dispatcher's guard: bounded by the publish timeout, a panic narrowed
            // down to the message that panics alone.
            let deadline = self.publisher.publish_timeout().map(|t| Instant::now() + t);
            let outcomes =
                outbox_core::dispatcher::publish_guarded(&*self.publisher, slice, deadline).await;
            outbox_core::metrics::publish_duration(began.elapsed());
            let mut sent = Vec::new();
            let mut dead = Vec::new();
            let mut pause = None;
            let mut done = 0;
            for (m, outcome) in slice.iter().zip(outcomes) {
                match outcome {
                    Some(PublishOutcome::Published) => sent.push(m.id),
                    Some(PublishOutcome::Permanent(e)) => {
                        outbox_core::metrics::publish_failed(e.kind(), &m.event_type);
                        outbox_core::metrics::dead(&m.event_type);
                        warn!(id = %m.id, event_type = %m.event_type, error = %e, "permanent publish failure, message is dead");
                        dead.push((m.id, e.to_string()));
                    }
                    Some(o @ PublishOutcome::Transient(_))
                        if o.is_outage() || o.is_refused_by_destination() =>
                    {
                        pause = Some(Pause::Outage(match o {
                            PublishOutcome::Transient(e) => e.to_string(),
                            _ => String::new(),
                        }));
                        break;
                    }
                    Some(PublishOutcome::Transient(e)) => {
                        outbox_core::metrics::publish_failed(e.kind(), &m.event_type);
                        let a = &mut attempts[start + done];
                        *a += 1;
                        let policy = self.config.retry.for_event_type(&m.event_type);
                        if policy.should_retry(*a) {
                            outbox_core::metrics::retried(&m.event_type);
                            debug!(id = %m.id, attempts = *a, error = %e, "publish failed, will retry");
                            pause = Some(Pause::Retry(policy.delay(*a)));
                            break;
                        }
                        outbox_core::metrics::dead(&m.event_type);
                        warn!(id = %m.id, event_type = %m.event_type, attempts = *a, error = %e, "attempts exhausted, message is dead");
                        dead.push((
                            m.id,
                            format!("attempts exhausted ({a}/{}): {e}", policy.max_attempts()),
                        ));
                    }
                    None => {
                        pause = Some(Pause::Outage("the publisher gave no outcome".into()));
                        break;
                    }
                    Some(other) => {
                        pause = Some(Pause::Outage(format!("unknown outcome {other:?}")));
                        break;
                    }
                }
                done += 1;
            }
            outbox_core::metrics::commit_to_publish(
                slice.iter().map(|m| (&m.created_at, sent.contains(&m.id))),
            );
            if !self.record(&sent, &dead, shutdown).await? {
                return Ok(false);
            }
            start += done;
            if state.careful_left > 0 && done > 0 {
                state.careful_left = state.careful_left.saturating_sub(done);
                // 1, 1, 2, 4, ...: the first message alone, then doubling rounds.
                if !std::mem::replace(&mut state.careful_first_done, true) {
                    state.careful_chunk = 1;
                } else {
                    state.careful_chunk = (state.careful_chunk * 2).min(self.config.batch_size);
                }
            }
            if let Some(id) = guarded.take() {
                // The publish of the guarded message came back: whatever it was (an
                // outage too), the relay did not die of it.
                self.reset_alone(id).await?;
            }
            let delay = match pause {
                None => {
                    if self.counters.circuit_open.swap(false, Ordering::Relaxed) {
                        info!("the broker takes messages again; reading resumes");
                        metrics::gauge!(outbox_core::metrics::CIRCUIT_OPEN).set(0.0);
                    }
                    continue;
                }
                Some(Pause::Retry(delay)) => delay,
                Some(Pause::Outage(reason)) => {
                    if !self.counters.circuit_open.swap(true, Ordering::Relaxed) {
                        warn!(error = %reason, unconfirmed = messages.len() - start, "the broker cannot take messages: reading pauses, nothing is charged");
                        metrics::gauge!(outbox_core::metrics::CIRCUIT_OPEN).set(1.0);
                    }
                    let d = outage_delay;
                    outage_delay = outbox_core::retry::outage_backoff(d, self.config.probe_cap);
                    d
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return Ok(false),
                () = tokio::time::sleep(delay) => {}
            }
            // During an outage: probe until the broker is ready, then publish the rest
            // of the batch again. The session stays open meanwhile, and a PostgreSQL
            // shutting down waits for this session to confirm what it was sent: so
            // each probe first checks the database, and an unreachable one ends the
            // session (see `record`).
            while self.counters.circuit_open.load(Ordering::Relaxed) {
                sqlx::query("SELECT 1")
                    .execute(self.outbox.pool())
                    .await
                    .map_err(crate::error::db("wal database check"))?;
                let ready = tokio::time::timeout(
                    self.publisher
                        .publish_timeout()
                        .unwrap_or(Duration::from_secs(15)),
                    self.publisher.check_ready(),
                )
                .await;
                if matches!(ready, Ok(Ok(()))) {
                    break;
                }
                let d = outage_delay;
                outage_delay = outbox_core::retry::outage_backoff(d, self.config.probe_cap);
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(false),
                    () = tokio::time::sleep(d) => {}
                }
            }
        }
        Ok(true)
    }
}
