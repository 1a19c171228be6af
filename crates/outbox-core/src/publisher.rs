//! The [`EventPublisher`] trait implemented by transports, and per-message outcomes.

use std::borrow::Cow;

use async_trait::async_trait;

use crate::error::{ErrorKind, PublishError};
use crate::message::OutboxMessage;

/// What happened to one message of a published batch.
#[derive(Debug)]
#[non_exhaustive]
pub enum PublishOutcome {
    /// The broker confirmed it (AMQP publisher confirm `ack`, JetStream `PubAck`).
    Published,
    /// It may succeed later. When the error's kind is [`ErrorKind::Unavailable`] the
    /// broker cannot take messages now (unreachable, slow, blocked, full): the
    /// dispatcher releases the message without charging an attempt and opens its
    /// circuit. Any other transient error charges an attempt of this message.
    Transient(PublishError),
    /// It can never succeed as it is (unroutable, too large, invalid subject or header):
    /// the dispatcher dead-letters this message, and only this one, at once.
    Permanent(PublishError),
}

impl PublishOutcome {
    /// Classifies a per-message result by [`PublishError::kind`].
    pub fn from_result(result: Result<(), PublishError>) -> Self {
        match result {
            Ok(()) => Self::Published,
            Err(e) if e.kind() == ErrorKind::Permanent => Self::Permanent(e),
            Err(e) => Self::Transient(e),
        }
    }

    /// Whether the broker confirmed the message.
    pub fn is_published(&self) -> bool {
        matches!(self, Self::Published)
    }

    /// Whether this outcome says the broker cannot take messages at all (unreachable,
    /// no confirmation in time, blocked): the dispatcher's circuit opens. A refusal by
    /// one destination ([`is_refused_by_destination`](Self::is_refused_by_destination))
    /// is not one.
    pub fn is_outage(&self) -> bool {
        matches!(self, Self::Transient(e) if e.kind() == ErrorKind::Unavailable)
            && !self.is_refused_by_destination()
    }

    /// Whether the broker refused this message for a reason of its own
    /// ([`PublishError::Rejected`]: a queue full with `reject-publish`, a JetStream
    /// stream full or without a leader): only its destination cannot take messages now.
    /// The dispatcher holds back that destination's messages, without charge, while
    /// the others flow.
    pub fn is_refused_by_destination(&self) -> bool {
        matches!(self, Self::Transient(PublishError::Rejected { .. }))
    }
}

/// A broker-side publisher used by the [`Dispatcher`](crate::Dispatcher).
///
/// # Contract
/// - [`publish_batch`](Self::publish_batch) MUST return exactly one outcome per input
///   message, in input order.
/// - It MUST report [`PublishOutcome::Published`] only after the broker confirmed the
///   message durably as far as the broker's protocol allows (publisher confirms,
///   JetStream acks); a fire-and-forget send is not a publish.
/// - It SHOULD keep many messages in flight and await their confirmations together,
///   never one round trip per message.
/// - It MUST use [`OutboxMessage::id`] as the broker message id, so consumers can
///   deduplicate a re-publish after a relay crash.
/// - It SHOULD reconnect by itself after the broker comes back, and report
///   [`PublishError::Unavailable`] while it cannot reach the broker.
/// - It MUST judge a message [`Permanent`](PublishOutcome::Permanent) only for what is
///   wrong with that message itself, and report everything that is the broker's state
///   (slow, blocked, full, unreachable) with an [`ErrorKind::Unavailable`] error, so a
///   degraded broker never costs a healthy message an attempt. No content of a message
///   may make it panic.
/// - It SHOULD return within [`publish_timeout`](Self::publish_timeout).
#[async_trait]
pub trait EventPublisher: Send + Sync + 'static {
    /// Publishes `messages` and waits for every broker confirmation.
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome>;

    /// The longest one [`publish_batch`](Self::publish_batch) call takes, reconnecting
    /// and awaiting confirmations included (for the transports: their connect timeout
    /// plus their confirm or ack timeout), or `None` when the publisher does not bound
    /// it. The dispatcher refuses to start with a lease shorter than twice this (a
    /// publish must end, and be recorded, before another relay may reclaim its
    /// messages), and treats a call that runs longer as an outage of the whole batch.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// Checks that the broker can be reached (reconnecting if needed). The dispatcher
    /// calls it before its first claim and, with backoff, while its circuit is open: it
    /// claims nothing while the answer is an error. Implementations SHOULD bound it by
    /// their connect timeout; the dispatcher also gives up after the
    /// [`publish_timeout`](Self::publish_timeout) (a broker that accepts connections
    /// but never answers, e.g. a frozen one) and counts that as not ready. The default
    /// says yes.
    ///
    /// # Errors
    /// A [`PublishError`] (usually `Unavailable`) while the broker cannot be used.
    async fn check_ready(&self) -> Result<(), PublishError> {
        Ok(())
    }

    /// The destination of messages whose
    /// [effective routing key](OutboxMessage::effective_routing_key) is `routing_key`:
    /// the name of the circuit a refusal by the broker
    /// ([`PublishOutcome::is_refused_by_destination`]) opens, and of the circuit that
    /// decides whether such a message is published now or held (see
    /// [`Dispatcher`](crate::Dispatcher)). Messages with one destination share one
    /// circuit, one trial at a time and one release.
    ///
    /// The default, each routing key its own destination, never holds back a message
    /// whose queue or stream takes messages, but gives one refusing queue bound
    /// behind many routing keys as many circuits (bounded, see
    /// [`MAX_CIRCUITS`](crate::dispatcher::MAX_CIRCUITS)). A transport that knows
    /// where a routing key goes says so: NATS names the JetStream stream that refused
    /// (`stream NAME`), RabbitMQ applies the operator's routing-key patterns (an AMQP
    /// `basic.nack` names no queue). The name is stored with each held row: it MUST
    /// be at most [`MAX_NAME_LEN`](crate::message::MAX_NAME_LEN) bytes, and depend on
    /// nothing but `routing_key`, the publisher's configuration and what the publisher
    /// learned from the broker.
    fn destination<'a>(&'a self, routing_key: &'a str) -> Cow<'a, str> {
        Cow::Borrowed(routing_key)
    }
}

#[async_trait]
impl<P: EventPublisher + ?Sized> EventPublisher for std::sync::Arc<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        (**self).publish_batch(messages).await
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        (**self).check_ready().await
    }

    fn publish_timeout(&self) -> Option<std::time::Duration> {
        (**self).publish_timeout()
    }

    fn destination<'a>(&'a self, routing_key: &'a str) -> Cow<'a, str> {
        (**self).destination(routing_key)
    }
}
