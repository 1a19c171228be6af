//! The consumer-side contract shared by every transport: a [`DeliveryHandler`] receives
//! each decoded [`IncomingMessage`] and answers with a [`HandlerDecision`], which the
//! transport turns into its protocol's acknowledgement (AMQP `basic.ack`/`basic.nack`,
//! JetStream `+ACK`/`-NAK`/`+TERM`/`+WPI`).

use async_trait::async_trait;

use crate::wire::IncomingMessage;

/// What to tell the broker about a delivery once the handler is done.
///
/// Exhaustive on purpose: every transport must answer every decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandlerDecision {
    /// Processed (and committed): acknowledge (AMQP `basic.ack`, JetStream `+ACK`).
    Ack,
    /// Not processed, deliver again (AMQP `basic.nack` with `requeue = true`; JetStream
    /// `-NAK`, with the consumer's backoff as delay).
    Requeue,
    /// Never processable: drop or dead-letter (AMQP `basic.nack` with `requeue = false`,
    /// to the queue's dead-letter exchange if any; JetStream `+TERM`). Only for a
    /// delivery that cannot even be identified or decoded: a handler that gave up on a
    /// message records it (a consumer dead letter) and answers [`Ack`](Self::Ack).
    Reject,
    /// The handler's own store cannot take the message now (its database is down, or
    /// no connection came free in time): the message is not at fault, and no delivery
    /// attempt may be spent on it. The transport keeps the delivery without answering
    /// (JetStream: `+WPI`, "work in progress", so the server neither redelivers it nor
    /// counts a delivery; AMQP: it simply stays unacknowledged) and hands the same
    /// message to the handler again after a backoff (1 s, doubling, at most 15 s), as
    /// long as it answers `Defer`. Since every delivery in hand waits, and the prefetch
    /// (AMQP) or `max_ack_pending` (JetStream) bounds what the broker hands out, the
    /// consumer takes no new deliveries meanwhile and resumes by itself. At shutdown the
    /// delivery is handed back (`-NAK` / `basic.nack` with requeue).
    Defer,
}

/// Handles one decoded delivery.
///
/// # Contract
/// - It MUST finish its side effects (e.g. commit its database transaction) before
///   returning [`HandlerDecision::Ack`]: the transport acknowledges after the return.
/// - It MUST be idempotent or deduplicate on [`IncomingMessage::id`]: delivery is
///   at-least-once.
/// - It SHOULD answer [`HandlerDecision::Defer`], not `Requeue`, when what failed is its
///   own store rather than the message, so an outage of any length spends no delivery
///   attempt and nothing reaches a broker-side delivery limit.
/// - It SHOULD NOT panic. Transports catch a panic, log it and requeue the delivery
///   (never reject it: a message whose effect is not recorded anywhere must not be
///   dropped). The `inbox` crate's handlers catch their own panics and count them as
///   handler failures, so a message that always panics ends as a consumer dead letter.
#[async_trait]
pub trait DeliveryHandler: Send + Sync + 'static {
    /// Handles `msg` and says how to answer the broker.
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision;
}

#[async_trait]
impl<H: DeliveryHandler + ?Sized> DeliveryHandler for std::sync::Arc<H> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        (**self).handle(msg).await
    }
}

/// Hands `msg` to `handler` until it decides something other than
/// [`HandlerDecision::Defer`], the way every transport runs a delivery:
///
/// - a panic of the handler is caught, logged, and answered
///   [`HandlerDecision::Requeue`] (never `Reject`: nothing has recorded the message);
/// - while the handler answers `Defer`, `keep` is awaited (the transport's way of
///   keeping the delivery, e.g. JetStream `+WPI`), then the next attempt waits
///   [`defer_delay`] (1 s, doubling, at most 15 s);
/// - when `shutdown` is cancelled during such a wait, the answer is `Defer` and the
///   transport hands the delivery back to the broker.
pub async fn handle_until_decided<H, K, F>(
    handler: &H,
    msg: &IncomingMessage,
    shutdown: &tokio_util::sync::CancellationToken,
    mut keep: K,
) -> HandlerDecision
where
    H: DeliveryHandler + ?Sized,
    K: FnMut() -> F + Send,
    F: Future<Output = ()> + Send,
{
    use futures::FutureExt as _;
    let mut deferred = 0u32;
    loop {
        let decision = match std::panic::AssertUnwindSafe(handler.handle(msg))
            .catch_unwind()
            .await
        {
            Ok(decision) => decision,
            Err(panic) => {
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(id = %msg.id, panic = %text, "delivery handler panicked; the delivery is requeued");
                return HandlerDecision::Requeue;
            }
        };
        if decision != HandlerDecision::Defer {
            if deferred > 0 {
                tracing::info!(id = %msg.id, deferred, "the handler's store is back; delivery handled");
            }
            return decision;
        }
        deferred += 1;
        if deferred == 1 {
            tracing::warn!(id = %msg.id, "the handler's store is unavailable: holding the delivery and trying again");
        }
        keep().await;
        tokio::select! {
            () = shutdown.cancelled() => return HandlerDecision::Defer,
            () = tokio::time::sleep(defer_delay(deferred)) => {}
        }
    }
}

/// How long a transport waits before handing a deferred delivery
/// ([`HandlerDecision::Defer`]) to the handler again, after its `n`-th `Defer` in a row
/// (1-based): 1 s, doubling, capped at [`MAX_DEFER_DELAY`].
pub fn defer_delay(n: u32) -> std::time::Duration {
    let secs = 1u64.checked_shl(n.saturating_sub(1)).unwrap_or(u64::MAX);
    std::time::Duration::from_secs(secs).min(MAX_DEFER_DELAY)
}

/// The longest wait between two attempts at a deferred delivery: 15 s, half of
/// JetStream's default `ack_wait`, so that a `+WPI` sent before each wait keeps the
/// delivery.
pub const MAX_DEFER_DELAY: std::time::Duration = std::time::Duration::from_secs(15);

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

    /// Answers `Defer` `defers` times, then `Ack`; panics instead when `panics`.
    struct Flaky {
        defers: u32,
        calls: AtomicU32,
        panics: bool,
    }

    #[async_trait]
    impl DeliveryHandler for Flaky {
        async fn handle(&self, _: &IncomingMessage) -> HandlerDecision {
            let call = self.calls.fetch_add(1, SeqCst);
            assert!(!self.panics, "handler bug (expected by the test)");
            if call < self.defers {
                HandlerDecision::Defer
            } else {
                HandlerDecision::Ack
            }
        }
    }

    fn msg() -> IncomingMessage {
        IncomingMessage::new(uuid::Uuid::now_v7(), "OrderPlaced", b"{}".to_vec())
    }

    #[tokio::test(start_paused = true)]
    async fn a_deferred_delivery_is_kept_and_handed_again_until_decided() {
        let handler = Flaky {
            defers: 3,
            calls: AtomicU32::new(0),
            panics: false,
        };
        let kept = AtomicU32::new(0);
        let started = tokio::time::Instant::now();
        let decision = handle_until_decided(
            &handler,
            &msg(),
            &tokio_util::sync::CancellationToken::new(),
            || async {
                kept.fetch_add(1, SeqCst);
            },
        )
        .await;
        assert_eq!(decision, HandlerDecision::Ack);
        assert_eq!(handler.calls.load(SeqCst), 4);
        assert_eq!(kept.load(SeqCst), 3, "kept before each wait");
        assert_eq!(
            started.elapsed().as_secs(),
            1 + 2 + 4,
            "backoff 1 s, 2 s, 4 s"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_panic_requeues_and_a_shutdown_hands_a_deferred_delivery_back() {
        let panics = Flaky {
            defers: 0,
            calls: AtomicU32::new(0),
            panics: true,
        };
        let token = tokio_util::sync::CancellationToken::new();
        assert_eq!(
            handle_until_decided(&panics, &msg(), &token, || async {}).await,
            HandlerDecision::Requeue
        );
        let forever = Flaky {
            defers: u32::MAX,
            calls: AtomicU32::new(0),
            panics: false,
        };
        let cancel = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(100)).await;
            cancel.cancel();
        });
        assert_eq!(
            handle_until_decided(&forever, &msg(), &token, || async {}).await,
            HandlerDecision::Defer
        );
        assert!(forever.calls.load(SeqCst) > 5);
    }

    #[test]
    fn defer_delays_double_up_to_the_cap() {
        let secs: Vec<u64> = (1..=7).map(|n| defer_delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 15, 15, 15]);
        assert_eq!(defer_delay(0).as_secs(), 1);
        assert_eq!(defer_delay(200), MAX_DEFER_DELAY);
    }
}
