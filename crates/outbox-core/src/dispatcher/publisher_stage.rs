//! Stage 2, the publishers: each publishes a claimed batch (see `publish` and `waves`)
//! and decides every outcome (`decide`), or releases the batch unpublished; the
//! circuit is tripped or, after a trial, closed here.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::{Mutex, mpsc};
use tracing::{Instrument as _, info, info_span, warn};

use super::Dispatcher;
use super::destinations::Admit;
use super::run::{Claimed, Finished, Stop};
use crate::error::PublishError;
use crate::message::OutboxMessage;
use crate::ordering::Ordering;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::{ClaimedBatch, OutboxStore};

/// How [`Dispatcher::publish_and_decide`] treats the circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Release without trying while the circuit is open; an outage opens it.
    Normal,
    /// The half-open trial: publish although the circuit is open, then close it or
    /// keep it open.
    Trial,
    /// [`Dispatcher::run_batch`]: publish whatever the circuit says; an outage opens it.
    Once,
    /// The trials of held destinations (one message each, claimed by
    /// [`claim_held`](crate::OutboxStore::claim_held)): published although their
    /// destinations' circuits are open; a confirmation closes a circuit and releases
    /// its held rows, a refusal holds the message again. Like `Normal` otherwise.
    Held,
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// Stage 2: publishes claimed batches (several at once), decides each outcome. While
    /// stopping, batches not yet started are released instead.
    pub(super) async fn publisher_stage(
        &self,
        claimed_rx: Arc<Mutex<mpsc::Receiver<Claimed>>>,
        done_tx: mpsc::Sender<Finished>,
        stop: Stop,
    ) {
        let micros = |since: std::time::Instant| {
            u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
        };
        loop {
            let waiting = std::time::Instant::now();
            let next = claimed_rx.lock().await.recv().await;
            self.counters
                .claim_wait_micros
                .fetch_add(micros(waiting), Relaxed);
            let Some(claimed) = next else { break };
            crate::metrics::claim_wait(waiting.elapsed());
            let finished = if stop.is_stopping() {
                self.release(claimed, "stopping: released without publishing")
            } else if self
                .publisher
                .publish_timeout()
                .is_some_and(|limit| claimed.claimed_at.elapsed() + limit > self.config.lease)
            {
                self.release(
                    claimed,
                    "the batch waited so long for a publisher that its lease could run out during the publish: released without publishing",
                )
            } else {
                let publishing = std::time::Instant::now();
                let finished = self.publish_and_decide(claimed, Mode::Normal, &stop).await;
                self.counters
                    .publish_micros
                    .fetch_add(micros(publishing), Relaxed);
                finished
            };
            if done_tx.send(finished).await.is_err() {
                break;
            }
        }
    }

    /// Hands a claimed batch back without publishing it (its poison rows are still
    /// recorded).
    fn release(&self, claimed: Claimed, why: &'static str) -> Finished {
        let Claimed {
            batch, claimed_at, ..
        } = claimed;
        if !batch.messages.is_empty() {
            warn!(messages = batch.messages.len(), "{why}");
        }
        let outcomes = batch.messages.iter().map(|_| None).collect();
        let (completions, report) = self.decide(&batch.messages, outcomes, &batch.poison, &[]);
        Finished {
            completions,
            report,
            claimed_at,
        }
    }

    /// Publishes a claimed batch (see [`Mode`] for the circuit) and decides every
    /// outcome. A publish still running when the drain ends is abandoned and its
    /// messages released.
    pub(super) async fn publish_and_decide(
        &self,
        claimed: Claimed,
        mode: Mode,
        stop: &Stop,
    ) -> Finished {
        let Claimed {
            batch,
            claimed_at,
            held,
        } = claimed;
        let ClaimedBatch {
            messages, poison, ..
        } = batch;
        // Each message's destination (its circuit): a trial's is the one it was held
        // for, whatever the publisher names for it now (it may have learned otherwise,
        // or restarted with other rules).
        let mut destinations: Vec<Cow<'_, str>> = if held.len() == messages.len() {
            held.iter().map(|d| Cow::Borrowed(d.as_str())).collect()
        } else {
            messages.iter().map(|m| self.destination(m)).collect()
        };
        let started = std::time::Instant::now();
        let outcomes: Vec<Option<PublishOutcome>> = if messages.is_empty() {
            Vec::new()
        } else if matches!(mode, Mode::Normal | Mode::Held) && self.circuit.is_open() {
            // The broker is known to be unable to take messages: hand the batch back.
            messages
                .iter()
                .map(|_| {
                    Some(PublishOutcome::Transient(PublishError::unavailable(
                        "circuit open",
                        None,
                    )))
                })
                .collect()
        } else {
            // Messages of a destination whose circuit is open are held; the rest go (the
            // trials of held destinations all go).
            let admits = if mode == Mode::Held {
                vec![Admit::Go; messages.len()]
            } else {
                self.destinations.admit(&destinations)
            };
            let go: Vec<usize> = self.admitted(&messages, &admits);
            let span = info_span!(
                "outbox.publish",
                messages = go.len(),
                trial = mode == Mode::Trial
            );
            let publishing = async {
                if go.len() == messages.len() {
                    self.publish(&messages, &poison).await
                } else if go.is_empty() {
                    Vec::new()
                } else {
                    let subset: Vec<OutboxMessage> =
                        go.iter().map(|&i| messages[i].clone()).collect();
                    self.publish(&subset, &poison).await
                }
            };
            let published = tokio::select! {
                outcomes = publishing.instrument(span) => {
                    if !go.is_empty() {
                        crate::metrics::publish_duration(started.elapsed());
                    }
                    Some(outcomes)
                }
                () = stop.drain_expired() => {
                    warn!(
                        messages = go.len(),
                        "drain timeout: a publish still waiting for the broker is abandoned and its messages released"
                    );
                    None
                }
            };
            match published {
                Some(outcomes) => {
                    if held.is_empty()
                        && outcomes.iter().any(|o| {
                            o.as_ref()
                                .is_some_and(PublishOutcome::is_refused_by_destination)
                        })
                    {
                        // A refusal may have taught the publisher where these routing
                        // keys go (a NATS stream): refusals are named as it names them
                        // now.
                        destinations = messages.iter().map(|m| self.destination(m)).collect();
                    }
                    self.note_destinations(&destinations, &go, &outcomes, mode == Mode::Held);
                    let mut all: Vec<Option<PublishOutcome>> =
                        held_outcomes(&destinations, &admits);
                    for (&i, outcome) in go.iter().zip(outcomes) {
                        all[i] = outcome;
                    }
                    all
                }
                None => messages.iter().map(|_| None).collect(),
            }
        };
        crate::metrics::commit_to_publish(messages.iter().zip(&outcomes).map(|(m, o)| {
            (
                &m.created_at,
                o.as_ref().is_some_and(PublishOutcome::is_published),
            )
        }));
        let (completions, report) = self.decide(&messages, outcomes, &poison, &destinations);
        if mode == Mode::Trial {
            if report.outage {
                warn!(
                    "trial publish failed: the broker still cannot take messages, circuit stays open"
                );
            } else {
                self.circuit.close().await;
                info!("trial publish succeeded, circuit closed");
            }
        } else if report.outage && self.circuit.trip() {
            self.counters.circuit_opened.fetch_add(1, Relaxed);
            warn!(
                released = report.released,
                "the broker cannot take messages: circuit opened, messages released without charge"
            );
        }
        Finished {
            completions,
            report,
            claimed_at,
        }
    }
}

/// The outcomes of messages not published because their destination's circuit is
/// open: a refusal, so that they are held back without charge; `None` (released) for
/// the ones published or behind one held back.
fn held_outcomes(destinations: &[Cow<'_, str>], admits: &[Admit]) -> Vec<Option<PublishOutcome>> {
    destinations
        .iter()
        .zip(admits)
        .map(|(dest, admit)| match admit {
            Admit::Hold => Some(PublishOutcome::Transient(PublishError::Rejected {
                reason: format!(
                    "held: destination {dest:?} refused messages and is tried again later"
                ),
            })),
            Admit::Go => None,
        })
        .collect()
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// The indices of `messages` to publish now: those admitted by their destination,
    /// except, in per-key order, a message behind a held-back one of its key (its key
    /// waits for the held one, which is deferred; the message is released).
    fn admitted(&self, messages: &[OutboxMessage], admits: &[Admit]) -> Vec<usize> {
        let ordered = matches!(self.config.ordering, Ordering::PerKey { .. });
        let mut held_keys = std::collections::HashSet::new();
        let mut go = Vec::with_capacity(messages.len());
        for (i, (msg, admit)) in messages.iter().zip(admits).enumerate() {
            if ordered && held_keys.contains(&msg.order_key()) {
                continue;
            }
            match admit {
                Admit::Go => go.push(i),
                Admit::Hold => {
                    if ordered {
                        held_keys.insert(msg.order_key());
                    }
                }
            }
        }
        go
    }

    /// Updates the destination circuits from what the broker said: a destination that
    /// refused a message (a full queue or stream) opens, or keeps open with a longer
    /// delay; one that took every message of the batch closes. `trials`: the batch is
    /// the trials of held destinations (see [`Mode::Held`]).
    fn note_destinations(
        &self,
        destinations: &[Cow<'_, str>],
        published: &[usize],
        outcomes: &[Option<PublishOutcome>],
        trials: bool,
    ) {
        let mut refused = std::collections::BTreeSet::new();
        let mut accepted = std::collections::BTreeSet::new();
        for (&i, outcome) in published.iter().zip(outcomes) {
            let dest = destinations[i].as_ref();
            match outcome {
                Some(o) if o.is_refused_by_destination() => {
                    refused.insert(dest);
                }
                Some(PublishOutcome::Published) => {
                    accepted.insert(dest);
                }
                _ => {}
            }
        }
        for dest in &refused {
            let (delay, opened) = self.destinations.refused(dest);
            if trials {
                self.counters.refused_trials.fetch_add(1, Relaxed);
                self.destinations.rotate(dest);
            }
            if opened {
                self.counters
                    .destination_circuits_opened
                    .fetch_add(1, Relaxed);
                warn!(destination = %dest, retry_ms = delay.as_millis() as u64, "a destination refuses messages (a full queue or stream): its messages are held back without charge, the others flow");
            }
        }
        for dest in accepted.difference(&refused) {
            if trials {
                self.destinations.trial_confirmed();
            }
            if self.destinations.accepted(dest, trials) || trials {
                info!(destination = %dest, "the destination takes messages again: its circuit is closed and its held messages are released");
            }
        }
    }
}
