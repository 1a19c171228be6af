//! One publisher call, bounded by the publisher's publish timeout and isolated from
//! panics.
//!
//! Every function here returns one `Option<PublishOutcome>` per message, in the
//! messages' order (`None`: not attempted, released without charge), so an outcome can
//! only ever be paired with its own message.

use std::panic::AssertUnwindSafe;

use futures::FutureExt as _;
use tokio::time::Instant;
use tracing::{error, warn};

use super::Dispatcher;
use crate::error::{ErrorKind, PublishError};
use crate::message::OutboxMessage;
use crate::publisher::{EventPublisher, PublishOutcome};
use crate::store::OutboxStore;

/// What one call of the publisher came to.
enum Call {
    Done(Vec<Option<PublishOutcome>>),
    TimedOut,
    Panicked(String),
}

impl<S: OutboxStore, P: EventPublisher> Dispatcher<S, P> {
    /// [`publish_guarded`] with this dispatcher's publisher.
    pub(super) async fn publish_guarded(
        &self,
        messages: &[OutboxMessage],
        deadline: Option<Instant>,
    ) -> Vec<Option<PublishOutcome>> {
        publish_guarded(&*self.publisher, messages, deadline).await
    }
}

/// One `publish_batch` call, padded or cut to one outcome per message.
async fn call<P: EventPublisher + ?Sized>(
    publisher: &P,
    messages: &[OutboxMessage],
    deadline: Option<Instant>,
) -> Call {
    let publish = AssertUnwindSafe(publisher.publish_batch(messages)).catch_unwind();
    let result = match deadline {
        Some(deadline) => match tokio::time::timeout_at(deadline, publish).await {
            Ok(result) => result,
            Err(_) => return Call::TimedOut,
        },
        None => publish.await,
    };
    match result {
        Ok(outcomes) => {
            if outcomes.len() != messages.len() {
                warn!(
                    expected = messages.len(),
                    got = outcomes.len(),
                    "publisher broke its contract: outcome count differs; unmatched messages are released"
                );
            }
            let mut outcomes: Vec<Option<PublishOutcome>> =
                outcomes.into_iter().map(Some).collect();
            outcomes.resize_with(messages.len(), || None);
            Call::Done(outcomes)
        }
        Err(panic) => Call::Panicked(
            panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned()),
        ),
    }
}

/// Publishes `messages` with `publisher` in one call, one outcome per message in their
/// order (`None`: not attempted). A call that outlives `deadline` is an outage of the
/// whole batch. A call that panics is repeated one message at a time, so that only a
/// message whose publish panics alone is judged for it (a permanent failure), never
/// the rest of its batch. The [`Dispatcher`] publishes through it, and so does any
/// other relay loop (the PostgreSQL WAL relay).
pub async fn publish_guarded<P: EventPublisher + ?Sized>(
    publisher: &P,
    messages: &[OutboxMessage],
    deadline: Option<Instant>,
) -> Vec<Option<PublishOutcome>> {
    let timed_out = || {
        let limit = publisher.publish_timeout().unwrap_or_default();
        Some(PublishOutcome::Transient(PublishError::unavailable(
            format!("the publisher gave no outcome within its publish timeout ({limit:?})"),
            None,
        )))
    };
    let panicked = |text: &str| {
        Some(PublishOutcome::Permanent(PublishError::Other {
            kind: ErrorKind::Permanent,
            message: format!("the publisher panicked on this message alone: {text}"),
            source: None,
        }))
    };
    match call(publisher, messages, deadline).await {
        Call::Done(outcomes) => outcomes,
        Call::TimedOut => messages.iter().map(|_| timed_out()).collect(),
        Call::Panicked(text) if messages.len() == 1 => vec![panicked(&text)],
        Call::Panicked(text) => {
            error!(
                messages = messages.len(),
                panic = %text,
                "the publisher panicked on a batch: publishing its messages one at a time to find the poison message"
            );
            let mut outcomes = Vec::with_capacity(messages.len());
            for msg in messages {
                outcomes.push(match call(publisher, std::slice::from_ref(msg), deadline).await {
                        Call::Done(mut one) => one.pop().flatten(),
                        Call::TimedOut => timed_out(),
                        Call::Panicked(text) => {
                            error!(id = %msg.id, panic = %text, "the publisher panics on this message alone: it is dead");
                            panicked(&text)
                        }
                    });
            }
            outcomes
        }
    }
}
