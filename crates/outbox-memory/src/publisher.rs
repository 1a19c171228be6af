//! [`MemoryPublisher`]: an [`EventPublisher`] that records what it is given and
//! answers as scripted.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::sync::Notify;
use uuid::Uuid;

/// What the [`MemoryPublisher`] answers for one message. Each turns into the
/// [`PublishOutcome`] a real transport gives in that situation, so the dispatcher
/// classifies it as it would in production ([`PublishError::kind`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scripted {
    /// The broker confirmed it: [`PublishOutcome::Published`] (the message is recorded).
    Confirm,
    /// No connection to the broker: `Transient(PublishError::Unavailable)`, an outage
    /// ([`ErrorKind::Unavailable`]: the dispatcher opens its circuit, charges nothing).
    Unavailable,
    /// The broker refused it for a reason of its own (a full queue or stream):
    /// `Transient(PublishError::Rejected)`. The dispatcher holds back the messages of its
    /// destination (its routing key), uncharged, while the others flow.
    Rejected,
    /// No confirmation in time: `Transient(PublishError::Timeout)`, an outage.
    Timeout,
    /// A failure of this message that may pass (a nack):
    /// `Transient(PublishError::Other { kind: Transient })`; charges an attempt.
    Nack,
    /// No queue is bound for its routing key: `Permanent(PublishError::Unroutable)`
    /// (312 NO_ROUTE); the message goes `Dead` at once.
    Unroutable,
    /// Its payload is over the broker's limit of `max` bytes:
    /// `Permanent(PublishError::PayloadTooLarge)`.
    TooLarge {
        /// The broker's limit in bytes.
        max: usize,
    },
    /// Its routing key or a header cannot be sent: `Permanent(PublishError::Invalid)`.
    Invalid,
    /// The publisher panics on this message (the dispatcher isolates the panic; the
    /// message alone goes `Dead`).
    Panic,
}

impl Scripted {
    fn outcome(&self, msg: &OutboxMessage) -> PublishOutcome {
        use PublishOutcome::{Permanent, Published, Transient};
        match self {
            Self::Confirm => Published,
            Self::Unavailable => Transient(PublishError::unavailable(
                "memory broker is down (scripted)",
                None,
            )),
            Self::Rejected => Transient(PublishError::Rejected {
                reason: "memory broker rejected the message (scripted)".to_owned(),
            }),
            Self::Timeout => Transient(PublishError::Timeout(Duration::from_secs(5))),
            Self::Nack => Transient(PublishError::Other {
                kind: ErrorKind::Transient,
                message: "memory broker nacked the message (scripted)".to_owned(),
                source: None,
            }),
            Self::Unroutable => Permanent(PublishError::Unroutable {
                exchange: "memory".to_owned(),
                routing_key: msg.effective_routing_key().to_owned(),
                reply_code: 312,
                reply_text: "NO_ROUTE".to_owned(),
            }),
            Self::TooLarge { max } => Permanent(PublishError::PayloadTooLarge {
                size: msg.payload.get().len(),
                max: *max,
            }),
            Self::Invalid => Permanent(PublishError::Invalid(format!(
                "routing key {:?} (scripted)",
                msg.effective_routing_key()
            ))),
            // The caller panics before asking for an outcome.
            Self::Panic => Published,
        }
    }
}

/// A rule consulted for every message before the scripts: `Some` decides its outcome.
type Rule = Arc<dyn Fn(&OutboxMessage) -> Option<Scripted> + Send + Sync>;

#[derive(Default)]
struct State {
    /// Broker down: `check_ready` fails and every message is `Unavailable`.
    down: bool,
    /// Outcomes for the next messages, one each, in order.
    per_message: VecDeque<Scripted>,
    /// Outcomes for the next calls, one for every message of the call.
    per_call: VecDeque<Scripted>,
    rules: Vec<Rule>,
    delay: Duration,
    publish_timeout: Option<Duration>,
    record: bool,
    published: Vec<OutboxMessage>,
    published_count: usize,
    offered: Vec<Uuid>,
    calls: usize,
    call_sizes: Vec<usize>,
    ready_checks: usize,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("down", &self.down)
            .field("per_message", &self.per_message)
            .field("per_call", &self.per_call)
            .field("rules", &self.rules.len())
            .field("delay", &self.delay)
            .field("publish_timeout", &self.publish_timeout)
            .field("published", &self.published_count)
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

/// An in-memory broker: confirms everything by default, records every confirmed
/// message, and fails on demand.
///
/// What each message gets, first match wins:
/// 1. while the broker is [down](Self::set_down): [`Scripted::Unavailable`];
/// 2. a [rule](Self::with_rule) that returns `Some`;
/// 3. the next per-call script ([`script_calls`](Self::script_calls)), for every
///    message of the call (one entry per call);
/// 4. the next per-message script ([`script`](Self::script)), one entry per message;
/// 5. [`Scripted::Confirm`].
///
/// Each `publish_batch` call first sleeps the [delay](Self::set_delay) (tokio time, so
/// `tokio::time::pause()` makes it free), then answers. Cheap to clone: clones share
/// the broker.
#[derive(Debug, Clone)]
pub struct MemoryPublisher {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
}

impl Default for MemoryPublisher {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryPublisher {
    /// A broker that is up, confirms everything at once, records what it confirms and
    /// states no publish timeout.
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                record: true,
                ..State::default()
            })),
            changed: Arc::new(Notify::new()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; recover anyway rather than cascade.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether messages are recorded for [`published`](Self::published) and
    /// [`offered`](Self::offered) and [`call_sizes`](Self::call_sizes) (default `true`). Without, only
    /// [`published_count`](Self::published_count) and [`calls`](Self::calls) are kept,
    /// so a benchmark pays no clone per message.
    #[must_use]
    pub fn with_recording(self, record: bool) -> Self {
        self.state().record = record;
        self
    }

    /// The longest a `publish_batch` call takes, as the publisher states it to the
    /// dispatcher ([`EventPublisher::publish_timeout`]; default `None`). The dispatcher
    /// abandons a longer call as an outage and requires a lease of twice this.
    #[must_use]
    pub fn with_publish_timeout(self, timeout: Option<Duration>) -> Self {
        self.state().publish_timeout = timeout;
        self
    }

    /// Adds a rule consulted for every message (see the type's docs): e.g. every
    /// message of one event type is unroutable.
    #[must_use]
    pub fn with_rule(
        self,
        rule: impl Fn(&OutboxMessage) -> Option<Scripted> + Send + Sync + 'static,
    ) -> Self {
        self.state().rules.push(Arc::new(rule));
        self
    }

    /// Takes the broker down (`true`: [`check_ready`](EventPublisher::check_ready)
    /// fails and every message is [`Scripted::Unavailable`]) or brings it back.
    pub fn set_down(&self, down: bool) {
        self.state().down = down;
    }

    /// Sleeps this long in every `publish_batch` call before answering (default 0): a
    /// slow or frozen broker, for timeouts and shutdown drains.
    pub fn set_delay(&self, delay: Duration) {
        self.state().delay = delay;
    }

    /// Appends outcomes for the next messages published, one per message.
    pub fn script(&self, outcomes: impl IntoIterator<Item = Scripted>) {
        self.state().per_message.extend(outcomes);
    }

    /// Appends outcomes for the next `publish_batch` calls, each applying to every
    /// message of its call.
    pub fn script_calls(&self, outcomes: impl IntoIterator<Item = Scripted>) {
        self.state().per_call.extend(outcomes);
    }

    /// The confirmed messages, in the order they were confirmed (empty without
    /// [recording](Self::with_recording)).
    pub fn published(&self) -> Vec<OutboxMessage> {
        self.state().published.clone()
    }

    /// Ids of the confirmed messages, in order (empty without recording).
    pub fn published_ids(&self) -> Vec<Uuid> {
        self.state().published.iter().map(|m| m.id).collect()
    }

    /// Messages confirmed so far (counted with or without recording).
    pub fn published_count(&self) -> usize {
        self.state().published_count
    }

    /// Ids of every message handed to `publish_batch`, whatever its outcome, in order
    /// (empty without recording).
    pub fn offered(&self) -> Vec<Uuid> {
        self.state().offered.clone()
    }

    /// `publish_batch` calls so far.
    pub fn calls(&self) -> usize {
        self.state().calls
    }

    /// The number of messages of every `publish_batch` call so far, in order (empty
    /// without recording): a half-open trial is a call of one message.
    pub fn call_sizes(&self) -> Vec<usize> {
        self.state().call_sizes.clone()
    }

    /// [`check_ready`](EventPublisher::check_ready) calls so far (the circuit's probes).
    pub fn ready_checks(&self) -> usize {
        self.state().ready_checks
    }

    /// Waits until at least `n` messages have been confirmed, or `timeout` (tokio time)
    /// passes; returns whether they were.
    pub async fn wait_published(&self, n: usize, timeout: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.published_count() >= n {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

#[async_trait]
impl EventPublisher for MemoryPublisher {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let delay = {
            let mut state = self.state();
            state.calls += 1;
            if state.record {
                state.call_sizes.push(messages.len());
            }
            state.delay
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let outcomes = {
            let mut state = self.state();
            let call = state.per_call.pop_front();
            let mut scripted = Vec::with_capacity(messages.len());
            for msg in messages {
                scripted.push(if state.down {
                    Scripted::Unavailable
                } else if let Some(s) = state.rules.iter().find_map(|rule| rule(msg)) {
                    s
                } else if let Some(s) = &call {
                    s.clone()
                } else {
                    state.per_message.pop_front().unwrap_or(Scripted::Confirm)
                });
                if state.record {
                    state.offered.push(msg.id);
                }
            }
            if let Some(i) = scripted.iter().position(|s| *s == Scripted::Panic) {
                // The whole call fails: nothing of it is confirmed. Outside the lock, so
                // the broker's state is not poisoned.
                let id = messages[i].id;
                drop(state);
                panic!("memory publisher: scripted panic on message {id}");
            }
            let mut outcomes = Vec::with_capacity(messages.len());
            for (msg, scripted) in messages.iter().zip(&scripted) {
                let outcome = scripted.outcome(msg);
                if outcome.is_published() {
                    state.published_count += 1;
                    if state.record {
                        state.published.push(msg.clone());
                    }
                }
                outcomes.push(outcome);
            }
            outcomes
        };
        self.changed.notify_waiters();
        outcomes
    }

    fn publish_timeout(&self) -> Option<Duration> {
        self.state().publish_timeout
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        let mut state = self.state();
        state.ready_checks += 1;
        if state.down {
            return Err(PublishError::unavailable(
                "memory broker is down (scripted)",
                None,
            ));
        }
        Ok(())
    }
}
