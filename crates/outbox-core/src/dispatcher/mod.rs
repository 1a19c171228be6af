//! The relay loop: claim a batch, publish it with pipelined confirms, write every outcome
//! back in one round trip, repeat.
//!
//! - `run`: [`Dispatcher::run`], which starts the three stages below and joins them,
//!   and [`Dispatcher::run_batch`]; what the stages hand each other and when they stop;
//! - `claimer`: stage 1, claiming batches; while the circuit is open, the probes and the
//!   half-open trial;
//! - `publisher_stage`: stage 2, publishing a claimed batch and deciding its outcomes,
//!   or releasing it unpublished;
//! - `completer`: stage 3, recording the outcomes, merged and retried;
//! - `waves`: the configured order (per-key mode's waves, [`OnDead::Block`]);
//! - `publish`: one publisher call under the publish timeout and isolated from panics
//!   ([`publish_guarded`], also used by the PostgreSQL WAL relay);
//! - `decide`: each message's outcome turned into its completion;
//! - `circuit`: the circuit breaker (closed, open, half-open with a one-message trial);
//! - `destinations`: one circuit per destination (`EventPublisher::destination`), so that a full queue or
//!   stream holds back only its own messages, held out of the claim path;
//! - `trials`: the task that tries held destinations, releases their rows once a trial
//!   is confirmed, and finds the circuits the table holds (after a restart, beyond
//!   [`MAX_CIRCUITS`]);
//! - `config`: [`DispatcherConfig`];
//! - `stats`: [`DispatcherStats`] and [`BatchReport`].
//!
//! [`OnDead::Block`]: crate::OnDead::Block

mod circuit;
mod claimer;
mod completer;
pub mod config;
mod decide;
mod destinations;
mod publish;
mod publisher_stage;
mod run;
pub mod stats;
mod trials;
mod waves;

use std::sync::Arc;

use tokio::sync::Notify;

pub use config::{DEFAULT_DRAIN_TIMEOUT, DEFAULT_MIN_POLL_INTERVAL, DispatcherConfig};
pub use destinations::{MAX_CIRCUITS, RELEASE_CHUNK, TRIALS_PER_SECOND};
pub use publish::publish_guarded;
pub use stats::{BatchReport, DispatcherStats};

use crate::error::OutboxError;
use crate::message::OutboxMessage;
use crate::publisher::EventPublisher;
use crate::store::OutboxStore;
use circuit::Circuit;
use destinations::Destinations;
use stats::Counters;

/// Wakes a dispatcher that is waiting for its poll interval, e.g. right after a
/// transaction that enqueued messages commits. The store's push wake-up
/// ([`OutboxStore::spawn_wake_source`]) gets one from [`Dispatcher::run`]; in-process
/// producers over a store without one may call it themselves. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WakeHandle(Arc<Notify>);

impl WakeHandle {
    /// Ends the current poll wait of every pipeline of the dispatcher.
    pub fn wake(&self) {
        self.0.notify_waiters();
    }
}

/// The relay: moves committed outbox messages to the broker.
///
/// Three stages run at once so the broker stays busy while the database works: a
/// claimer claims batches (committing each claim before anything is published), up to
/// `concurrency` publishers publish them (the publisher pipelines confirms), and a
/// completer records every outcome, fenced by claim token, merging what is waiting into
/// one statement. A full batch is followed at once by the next claim; otherwise the
/// claimer waits (adaptively: 10 ms after a claim that found messages, doubling while
/// claims find nothing, up to `poll_interval`) or until a [`WakeHandle::wake`], which
/// the store's own push wake-up sends when messages are committed (started by
/// [`run`](Self::run), see [`OutboxStore::spawn_wake_source`]). Several
/// dispatchers, in one process or many, may share a database: claims never overlap.
///
/// What happens to a message, by what went wrong:
/// - **poison row** (the store could not decode it, or its crash-loop guard caught it):
///   `Dead` alone with `last_error` saying why; the rest of the batch is published;
/// - **a verdict about the message** (unroutable, oversized, invalid header or subject,
///   or a publisher panic on this message alone): `Dead` at once, only this message;
/// - **any other transient failure** of one message: `Processing → New` with backoff
///   from the event type's [`RetryPolicy`](crate::RetryPolicy); after `max_attempts`,
///   `Dead`;
/// - **one destination refuses messages** (the broker's own refusal,
///   [`PublishError::Rejected`](crate::PublishError::Rejected): a queue full with
///   `reject-publish`, a JetStream stream full or without a leader): that
///   **destination's circuit opens** (what the publisher names for the routing key,
///   [`EventPublisher::destination`]: the routing key, a NATS stream, a RabbitMQ
///   rule's queue): its messages
///   are held without charging an attempt, out of every claim's path
///   ([`CompletionOutcome::Hold`](crate::CompletionOutcome::Hold)), and one of them is
///   tried alone after 500 ms, 1 s, ... up to the probe cap; when the destination
///   takes it, its held messages are released. Every other destination keeps flowing
///   at full rate, however many messages are held. At most [`MAX_CIRCUITS`] circuits
///   are kept in memory (the table holds the rest, tried in turn) and refused trials
///   are limited to [`TRIALS_PER_SECOND`];
/// - **the broker cannot take messages** (unreachable, no confirmation in time, blocked
///   by a resource alarm, a publisher call longer than its publish timeout): the
///   **circuit opens**: unpublished messages are released without charging an
///   attempt, claiming stops, the publisher is probed with exponential backoff, then
///   one message is published alone as a trial, and claiming resumes when it succeeds.
///   A relay also claims nothing until its publisher is ready. An outage of any length
///   never dead-letters anything;
/// - **database failure**: the pipeline backs off exponentially (up to 30 s) and
///   retries; completion of a published batch is retried until it lands or the lease
///   runs out (the message is then republished after reclaim: at-least-once). A
///   completion that fails permanently (a trigger or constraint that rejects it) stops
///   the dispatcher at once: [`run`](Self::run) returns the error after releasing what
///   it holds, rather than publishing messages whose outcome it cannot record.
///
/// Shutdown ([`run`](Self::run)'s token): the claimer stops claiming, publishes in flight
/// finish, batches not yet started are released, and whatever is still waiting for the
/// broker when the drain timeout ([`DispatcherConfig::with_drain_timeout`]) is up is
/// released too; then `run` returns.
pub struct Dispatcher<S, P> {
    store: Arc<S>,
    publisher: Arc<P>,
    config: Arc<DispatcherConfig>,
    wake: Arc<Notify>,
    counters: Arc<Counters>,
    circuit: Arc<Circuit>,
    destinations: Arc<Destinations>,
}

impl<S, P> Clone for Dispatcher<S, P> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            publisher: Arc::clone(&self.publisher),
            config: Arc::clone(&self.config),
            wake: Arc::clone(&self.wake),
            counters: Arc::clone(&self.counters),
            circuit: Arc::clone(&self.circuit),
            destinations: Arc::clone(&self.destinations),
        }
    }
}

impl<S, P> std::fmt::Debug for Dispatcher<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("config", &self.config)
            .field("stats", &self.counters.snapshot())
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// A dispatcher over `store` and `publisher`. Nothing starts until
    /// [`run`](Self::run) (or [`run_batch`](Self::run_batch)).
    ///
    /// # Errors
    /// [`OutboxError::InvalidConfig`] naming the setting, before any I/O: what
    /// [`DispatcherConfig::validate`] refuses, or a lease shorter than twice the
    /// publisher's [`publish_timeout`](EventPublisher::publish_timeout)
    /// ([`DispatcherConfig::check_lease`]).
    pub fn new(
        store: Arc<S>,
        publisher: Arc<P>,
        config: DispatcherConfig,
    ) -> Result<Self, OutboxError> {
        config.validate()?;
        config.check_lease(publisher.publish_timeout())?;
        let circuit = Circuit::new(config.probe_initial, config.probe_max);
        let destinations =
            Destinations::new(config.probe_initial, config.probe_max, config.batch_size);
        Ok(Self {
            store,
            publisher,
            config: Arc::new(config),
            wake: Arc::new(Notify::new()),
            counters: Arc::new(Counters::default()),
            circuit: Arc::new(circuit),
            destinations: Arc::new(destinations),
        })
    }

    /// A handle that ends the poll wait early.
    pub fn wake_handle(&self) -> WakeHandle {
        WakeHandle(Arc::clone(&self.wake))
    }

    /// Counters since creation.
    pub fn stats(&self) -> DispatcherStats {
        self.counters.snapshot()
    }

    /// Whether the circuit is open (the broker could not take messages and no trial
    /// publish has succeeded since).
    pub fn circuit_open(&self) -> bool {
        self.circuit.is_open()
    }

    /// Whether some destination's circuit is open in memory (it refused messages and no
    /// trial of it has been confirmed since): its messages are held, the others flow.
    pub fn destination_circuit_open(&self) -> bool {
        self.destinations.any_open()
    }

    /// How many destination circuits are open in memory (at most [`MAX_CIRCUITS`]).
    pub fn destination_circuits(&self) -> usize {
        self.destinations.open_count()
    }

    /// The destination (circuit) of `msg`: what the publisher names for its routing key
    /// ([`EventPublisher::destination`]).
    fn destination<'a>(&'a self, msg: &'a OutboxMessage) -> std::borrow::Cow<'a, str> {
        self.publisher.destination(msg.effective_routing_key())
    }
}

#[cfg(test)]
mod tests;
