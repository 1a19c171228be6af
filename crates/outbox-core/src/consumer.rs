//! The consumer-side contract shared by every transport: a [`DeliveryHandler`] receives
//! each decoded [`IncomingMessage`] and answers with a [`HandlerDecision`], which the
//! transport turns into its protocol's acknowledgement (AMQP `basic.ack`/`basic.nack`,
//! JetStream `+ACK`/`-NAK`/`+TERM`/`+WPI`). A [`BatchDeliveryHandler`] receives several
//! deliveries at once (a transport's batched run mode) and answers one decision per
//! message. [`handle_until_decided`] and [`handle_batch_until_decided`] are how every
//! transport runs them (panics caught, [`HandlerDecision::Defer`] retried with backoff).
//!
//! A delivery the transport cannot decode (no usable id, no event type, a malformed or
//! over-long attribute) goes to [`DeliveryHandler::handle_undecodable`] (or the batch
//! handler's) as an [`UndecodableMessage`], through [`until_decided`], so a handler with
//! a store can record it before the broker forgets it.

use async_trait::async_trait;

use crate::wire::{IncomingMessage, UndecodableMessage};

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
    /// delivery that cannot even be identified: a handler that gave up on a message, or
    /// on an undecodable delivery with a usable id, records it (a consumer dead letter)
    /// and answers [`Ack`](Self::Ack).
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
///   dropped). The `outboxkit-inbox` crate's handlers catch their own panics and count them as
///   handler failures, so a message that always panics ends as a consumer dead letter.
#[async_trait]
pub trait DeliveryHandler: Send + Sync + 'static {
    /// Handles `msg` and says how to answer the broker.
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision;

    /// Handles a delivery the transport could not decode, and says how to answer the
    /// broker; see [`drop_undecodable`] for the default (it drops the delivery).
    ///
    /// A handler with a store SHOULD record a delivery that has a usable
    /// [`id`](UndecodableMessage::id) before answering [`HandlerDecision::Ack`] (the
    /// `outboxkit-inbox` crate's consumers record a consumer dead letter holding its raw headers
    /// and body), answer [`HandlerDecision::Defer`] while its store cannot take it, and
    /// answer [`HandlerDecision::Reject`] only for a delivery without a usable id.
    /// Transports run it like [`handle`](Self::handle) (a panic requeues, `Defer` is
    /// kept and retried, see [`until_decided`]).
    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        drop_undecodable(msg)
    }
}

/// The default answer to an undecodable delivery: logged at warn and
/// [`HandlerDecision::Reject`]ed (AMQP `basic.nack` without requeue, to the queue's
/// dead-letter exchange if any; JetStream `+TERM`), recorded nowhere.
pub fn drop_undecodable(msg: &UndecodableMessage) -> HandlerDecision {
    tracing::warn!(
        id = msg.id.map(|id| id.to_string()).unwrap_or_default(),
        error = %msg.error,
        "undecodable delivery dropped: the handler records nothing of it"
    );
    HandlerDecision::Reject
}

#[async_trait]
impl<H: DeliveryHandler + ?Sized> DeliveryHandler for std::sync::Arc<H> {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        (**self).handle(msg).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        (**self).handle_undecodable(msg).await
    }
}

/// Hands `msg` to `handler` until it decides something other than
/// [`HandlerDecision::Defer`], the way every transport runs a delivery: [`until_decided`]
/// with [`DeliveryHandler::handle`].
pub async fn handle_until_decided<H, K, F>(
    handler: &H,
    msg: &IncomingMessage,
    shutdown: &tokio_util::sync::CancellationToken,
    keep: K,
) -> HandlerDecision
where
    H: DeliveryHandler + ?Sized,
    K: FnMut() -> F + Send,
    F: Future<Output = ()> + Send,
{
    until_decided(Some(msg.id), || handler.handle(msg), shutdown, keep).await
}

/// Asks `decide` (one handler call on one delivery, e.g. `|| handler.handle(&msg)` or
/// `|| handler.handle_undecodable(&msg)`) until it answers something other than
/// [`HandlerDecision::Defer`]:
///
/// - a panic of the handler is caught, logged, and answered
///   [`HandlerDecision::Requeue`] (never `Reject`: nothing has recorded the message);
/// - while the handler answers `Defer`, `keep` is awaited (the transport's way of
///   keeping the delivery, e.g. JetStream `+WPI`), then the next attempt waits
///   [`defer_delay`] (1 s, doubling, at most 15 s); the handler reports its store's
///   trouble itself, so this logs at debug level only;
/// - when `shutdown` is cancelled during such a wait, the answer is `Defer` and the
///   transport hands the delivery back to the broker.
///
/// `id` (the delivery's id, if it has one) only labels the log lines.
pub async fn until_decided<D, DF, K, F>(
    id: Option<uuid::Uuid>,
    mut decide: D,
    shutdown: &tokio_util::sync::CancellationToken,
    mut keep: K,
) -> HandlerDecision
where
    D: FnMut() -> DF + Send,
    DF: Future<Output = HandlerDecision> + Send,
    K: FnMut() -> F + Send,
    F: Future<Output = ()> + Send,
{
    use futures::FutureExt as _;
    let id = id.map(|id| id.to_string()).unwrap_or_default();
    let mut deferred = 0u32;
    loop {
        let decision = match std::panic::AssertUnwindSafe(decide()).catch_unwind().await {
            Ok(decision) => decision,
            Err(panic) => {
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(id, panic = %text, "delivery handler panicked; the delivery is requeued");
                return HandlerDecision::Requeue;
            }
        };
        if decision != HandlerDecision::Defer {
            if deferred > 0 {
                tracing::debug!(
                    id,
                    deferred,
                    "the handler's store is back; delivery handled"
                );
            }
            return decision;
        }
        deferred += 1;
        if deferred == 1 {
            tracing::debug!(
                id,
                "the handler's store is unavailable: holding the delivery and trying again"
            );
        }
        keep().await;
        tokio::select! {
            () = shutdown.cancelled() => return HandlerDecision::Defer,
            () = tokio::time::sleep(defer_delay(deferred)) => {}
        }
    }
}

/// Handles a batch of decoded deliveries at once (a transport's batched run mode, e.g.
/// `RabbitConsumer::run_batched`), so that a handler can do the work of many deliveries
/// in one database transaction.
///
/// # Contract
/// - It MUST return exactly one [`HandlerDecision`] per message of `msgs`, in the same
///   order. A transport answers a missing decision with [`HandlerDecision::Requeue`] and
///   ignores extra ones (both logged as errors: a handler bug).
/// - It MUST finish the side effects of a message (commit) before returning `Ack` for
///   it: the transport acknowledges after the return.
/// - It MUST be idempotent or deduplicate on [`IncomingMessage::id`]: delivery is
///   at-least-once, and one batch may even hold two deliveries of the same message.
/// - It SHOULD answer [`HandlerDecision::Defer`] for each message its store cannot take
///   now. The transport answers the other messages at once, keeps the deferred ones
///   without spending a delivery (JetStream `+WPI`; AMQP: they stay unacknowledged) and
///   hands just those to `handle_batch` again, as a smaller batch, after 1 s, 2 s, ... up
///   to 15 s, as [`handle_until_decided`] does for one delivery.
/// - It SHOULD NOT panic. Transports catch a panic, log it and requeue every message of
///   that call (never reject them: nothing has recorded them).
/// - `msgs` holds 1 to the transport's batch size messages, in delivery order.
#[async_trait]
pub trait BatchDeliveryHandler: Send + Sync + 'static {
    /// Handles `msgs` and says, for each in order, how to answer the broker.
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision>;

    /// Handles one delivery the transport could not decode, alone (never in a batch),
    /// as [`DeliveryHandler::handle_undecodable`] does; the default drops it
    /// ([`drop_undecodable`]).
    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        drop_undecodable(msg)
    }
}

#[async_trait]
impl<H: BatchDeliveryHandler + ?Sized> BatchDeliveryHandler for std::sync::Arc<H> {
    async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
        (**self).handle_batch(msgs).await
    }

    async fn handle_undecodable(&self, msg: &UndecodableMessage) -> HandlerDecision {
        (**self).handle_undecodable(msg).await
    }
}

/// Hands `msgs` to `handler` until every message is decided, the way every transport
/// runs a batch; [`handle_until_decided`] for a [`BatchDeliveryHandler`]:
///
/// - the decisions other than [`HandlerDecision::Defer`] are passed to `answer` as soon
///   as they are known, as `(index into msgs, decision)` pairs in `msgs` order;
/// - a panic of the handler is caught and logged, and every message of that call is
///   answered [`HandlerDecision::Requeue`] (never `Reject`); a handler that returns too
///   few decisions gets `Requeue` for the missing ones, too many are ignored;
/// - while some messages are deferred, `keep` is awaited with their indices (e.g.
///   JetStream `+WPI` for each), then, after [`defer_delay`], only those messages are
///   handed to the handler again, as a smaller batch;
/// - when `shutdown` is cancelled during such a wait, the still deferred messages are
///   answered `Defer` (the transport hands them back to the broker).
///
/// Returns once `answer` has been awaited for every message. An empty `msgs` returns at
/// once without calling the handler.
pub async fn handle_batch_until_decided<H, K, KF, A, AF>(
    handler: &H,
    msgs: Vec<IncomingMessage>,
    shutdown: &tokio_util::sync::CancellationToken,
    mut keep: K,
    mut answer: A,
) where
    H: BatchDeliveryHandler + ?Sized,
    K: FnMut(Vec<usize>) -> KF + Send,
    KF: Future<Output = ()> + Send,
    A: FnMut(Vec<(usize, HandlerDecision)>) -> AF + Send,
    AF: Future<Output = ()> + Send,
{
    let mut index: Vec<usize> = (0..msgs.len()).collect();
    let mut pending = msgs;
    let mut deferred = 0u32;
    while !pending.is_empty() {
        let decisions = decide_batch(handler, &pending).await;
        let mut decided = Vec::with_capacity(pending.len());
        let mut held = Vec::with_capacity(pending.len());
        for (k, decision) in decisions.into_iter().enumerate() {
            if decision == HandlerDecision::Defer {
                held.push(k);
            } else {
                decided.push((index[k], decision));
            }
        }
        if !decided.is_empty() {
            answer(decided).await;
        }
        if held.is_empty() {
            if deferred > 0 {
                tracing::debug!(deferred, "the handler's store is back; batch handled");
            }
            return;
        }
        if held.len() < pending.len() {
            let mut keep_it = vec![false; pending.len()];
            for &k in &held {
                keep_it[k] = true;
            }
            let mut flags = keep_it.iter();
            pending.retain(|_| flags.next().copied().unwrap_or(false));
            let mut flags = keep_it.iter();
            index.retain(|_| flags.next().copied().unwrap_or(false));
        }
        deferred += 1;
        if deferred == 1 {
            tracing::debug!(
                messages = pending.len(),
                "the handler's store is unavailable: holding the deliveries and trying again"
            );
        }
        keep(index.clone()).await;
        tokio::select! {
            () = shutdown.cancelled() => {
                answer(index.iter().map(|&i| (i, HandlerDecision::Defer)).collect()).await;
                return;
            }
            () = tokio::time::sleep(defer_delay(deferred)) => {}
        }
    }
}

/// One call of `handler` on `msgs`: a panic requeues them all, a wrong number of
/// decisions is fixed up (missing ones requeued, extra ones dropped).
async fn decide_batch<H: BatchDeliveryHandler + ?Sized>(
    handler: &H,
    msgs: &[IncomingMessage],
) -> Vec<HandlerDecision> {
    use futures::FutureExt as _;
    match std::panic::AssertUnwindSafe(handler.handle_batch(msgs))
        .catch_unwind()
        .await
    {
        Ok(mut decisions) => {
            if decisions.len() != msgs.len() {
                tracing::error!(
                    messages = msgs.len(),
                    decisions = decisions.len(),
                    "batch handler bug: not one decision per message; the missing ones are requeued"
                );
                decisions.resize(msgs.len(), HandlerDecision::Requeue);
            }
            decisions
        }
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(messages = msgs.len(), panic = %text, "batch handler panicked; its deliveries are requeued");
            vec![HandlerDecision::Requeue; msgs.len()]
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

    #[test]
    fn a_broker_url_names_its_transport_by_scheme() {
        use super::TransportKind;
        for (url, kind) in [
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                Some(TransportKind::Rabbit),
            ),
            (" amqps://mq.example/vhost", Some(TransportKind::Rabbit)),
            ("nats://127.0.0.1:4222", Some(TransportKind::Nats)),
            ("tls://a:4222,tls://b:4222", Some(TransportKind::Nats)),
            ("AMQP://upper.case", None),
            ("http://x", None),
            ("127.0.0.1:4222", None),
            ("", None),
        ] {
            assert_eq!(TransportKind::of_url(url), kind, "{url:?}");
        }
    }
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

    /// Defers the messages whose payload is `b"defer"` for their first `defers` calls;
    /// panics when `panics`; returns one decision too few when `short`.
    struct FlakyBatch {
        defers: u32,
        calls: std::sync::Mutex<Vec<Vec<uuid::Uuid>>>,
        panics: bool,
        short: bool,
    }

    impl FlakyBatch {
        fn new(defers: u32) -> Self {
            Self {
                defers,
                calls: std::sync::Mutex::new(Vec::new()),
                panics: false,
                short: false,
            }
        }
    }

    #[async_trait]
    impl BatchDeliveryHandler for FlakyBatch {
        async fn handle_batch(&self, msgs: &[IncomingMessage]) -> Vec<HandlerDecision> {
            let round = {
                let mut calls = self.calls.lock().expect("lock");
                calls.push(msgs.iter().map(|m| m.id).collect());
                u32::try_from(calls.len()).expect("few calls")
            };
            assert!(!self.panics, "batch handler bug (expected by the test)");
            let mut decisions: Vec<HandlerDecision> = msgs
                .iter()
                .map(|m| {
                    if m.payload == b"defer" && round <= self.defers {
                        HandlerDecision::Defer
                    } else if m.payload == b"reject" {
                        HandlerDecision::Reject
                    } else {
                        HandlerDecision::Ack
                    }
                })
                .collect();
            if self.short {
                decisions.pop();
            }
            decisions
        }
    }

    fn msg_with(payload: &[u8]) -> IncomingMessage {
        IncomingMessage::new(uuid::Uuid::now_v7(), "OrderPlaced", payload.to_vec())
    }

    type Answers = std::sync::Mutex<Vec<Vec<(usize, HandlerDecision)>>>;

    #[tokio::test(start_paused = true)]
    async fn a_batch_answers_the_decided_at_once_and_hands_only_the_deferred_again() {
        let handler = FlakyBatch::new(2);
        let msgs = vec![
            msg_with(b"ok"),
            msg_with(b"defer"),
            msg_with(b"reject"),
            msg_with(b"defer"),
        ];
        let ids: Vec<uuid::Uuid> = msgs.iter().map(|m| m.id).collect();
        let answers = Answers::default();
        let kept = std::sync::Mutex::new(Vec::new());
        let started = tokio::time::Instant::now();
        handle_batch_until_decided(
            &handler,
            msgs,
            &tokio_util::sync::CancellationToken::new(),
            |held| {
                kept.lock().expect("lock").push(held);
                async {}
            },
            |decided| {
                answers.lock().expect("lock").push(decided);
                async {}
            },
        )
        .await;
        assert_eq!(
            *answers.lock().expect("lock"),
            [
                vec![(0, HandlerDecision::Ack), (2, HandlerDecision::Reject)],
                vec![(1, HandlerDecision::Ack), (3, HandlerDecision::Ack)],
            ],
            "decided ones answered at once, by their index in the batch"
        );
        assert_eq!(*kept.lock().expect("lock"), [vec![1, 3], vec![1, 3]]);
        assert_eq!(
            *handler.calls.lock().expect("lock"),
            [ids.clone(), vec![ids[1], ids[3]], vec![ids[1], ids[3]]],
            "only the deferred messages are handed again"
        );
        assert_eq!(started.elapsed().as_secs(), 1 + 2, "backoff 1 s, 2 s");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_panic_requeues_all_a_short_answer_requeues_the_rest_and_shutdown_hands_back() {
        let run = async |handler: &FlakyBatch, token: &tokio_util::sync::CancellationToken| {
            let answers = Answers::default();
            handle_batch_until_decided(
                handler,
                vec![msg_with(b"ok"), msg_with(b"defer"), msg_with(b"ok")],
                token,
                |_| async {},
                |decided| {
                    answers.lock().expect("lock").push(decided);
                    async {}
                },
            )
            .await;
            answers.into_inner().expect("lock").concat()
        };
        let token = tokio_util::sync::CancellationToken::new();
        let mut panics = FlakyBatch::new(0);
        panics.panics = true;
        assert_eq!(
            run(&panics, &token).await,
            [
                (0, HandlerDecision::Requeue),
                (1, HandlerDecision::Requeue),
                (2, HandlerDecision::Requeue)
            ]
        );
        let mut short = FlakyBatch::new(0);
        short.short = true;
        assert_eq!(
            run(&short, &token).await,
            [
                (0, HandlerDecision::Ack),
                (1, HandlerDecision::Ack),
                (2, HandlerDecision::Requeue)
            ]
        );
        let forever = FlakyBatch::new(u32::MAX);
        let cancel = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(100)).await;
            cancel.cancel();
        });
        assert_eq!(
            run(&forever, &token).await,
            [
                (0, HandlerDecision::Ack),
                (2, HandlerDecision::Ack),
                (1, HandlerDecision::Defer)
            ],
            "still deferred at shutdown: handed back"
        );
        assert!(forever.calls.lock().expect("lock").len() > 5);
    }

    #[test]
    fn batch_settings_are_checked_against_the_window() {
        use std::time::Duration;
        let field = |b: BatchSettings| b.check(10).expect_err("invalid").field;
        assert_eq!(
            BatchSettings::new().check(10),
            Ok(10),
            "default: the window"
        );
        assert_eq!(BatchSettings::new().with_size(10).check(10), Ok(10));
        assert_eq!(field(BatchSettings::new().with_size(0)), "batch_size");
        assert_eq!(field(BatchSettings::new().with_size(11)), "batch_size");
        let at_most = BatchSettings::new().with_linger(BatchSettings::MAX_LINGER);
        assert_eq!(at_most.check(10), Ok(10));
        let above = BatchSettings::new().with_linger(Duration::from_millis(1001));
        assert_eq!(field(above), "batch_linger");
        assert_eq!(
            field(BatchSettings::new().with_in_flight(0)),
            "batches_in_flight"
        );
        assert_eq!(
            field(BatchSettings::new().with_in_flight(65)),
            "batches_in_flight"
        );
        assert_eq!(BatchSettings::new().with_in_flight(64).check(10), Ok(10));
    }

    #[test]
    fn defer_delays_double_up_to_the_cap() {
        let secs: Vec<u64> = (1..=7).map(|n| defer_delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 15, 15, 15]);
        assert_eq!(defer_delay(0).as_secs(), 1);
        assert_eq!(defer_delay(200), MAX_DEFER_DELAY);
    }
}

/// A broker: the transport a publisher or [`Consumer`] talks to.
///
/// One type for programs, command lines and configuration files alike: it parses from
/// and prints as its lower-case name (`"rabbit"`, `"nats"`; serde and [`FromStr`](std::str::FromStr)),
/// and with the `clap` feature it is a `clap::ValueEnum` (`--transport rabbit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// RabbitMQ: AMQP 0-9-1 with publisher confirms (the `outboxkit-rabbit` crate).
    Rabbit,
    /// NATS JetStream: PubAck and `Nats-Msg-Id` deduplication (the `outboxkit-nats`
    /// crate).
    Nats,
}

impl TransportKind {
    /// Every kind, in declaration order.
    pub const ALL: [Self; 2] = [Self::Rabbit, Self::Nats];

    /// The lower-case name used in settings, logs and metrics labels: `"rabbit"` or
    /// `"nats"`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Rabbit => "rabbit",
            Self::Nats => "nats",
        }
    }

    /// The broker `url` names by its scheme: `amqp://` or `amqps://` is RabbitMQ,
    /// `nats://` or `tls://` is NATS (a comma-separated list of servers is read by its
    /// first URL); `None` for any other scheme or none. Schemes are lower case, as the
    /// transports' URL parsers require. The rest of the URL is not checked here.
    pub fn of_url(url: &str) -> Option<Self> {
        match url.trim().split_once("://")?.0 {
            "amqp" | "amqps" => Some(Self::Rabbit),
            "nats" | "tls" => Some(Self::Nats),
            _ => None,
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A transport name that is neither `rabbit` nor `nats`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport {0:?}: expected \"rabbit\" or \"nats\"")]
pub struct UnknownTransport(pub String);

impl std::str::FromStr for TransportKind {
    type Err = UnknownTransport;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|kind| kind.name() == s)
            .ok_or_else(|| UnknownTransport(s.to_owned()))
    }
}

/// A broker consumer: hands each delivery to a [`DeliveryHandler`] (or batches to a
/// [`BatchDeliveryHandler`]) and settles it with the broker as the handler decides,
/// until a shutdown. Implemented by `RabbitConsumer` (a queue) and `NatsConsumer` (a
/// JetStream durable pull consumer), and by the facade's `AnyConsumer` over both, so a
/// program can pick its broker at run time as it does with `AnyPublisher`.
///
/// Both methods reconnect with backoff after a lost connection and return `Ok(())`
/// once `shutdown` is cancelled and the deliveries in hand are settled (a drain); they
/// return an error only for what retrying cannot fix (bad credentials, a queue or
/// consumer the broker refuses).
#[async_trait]
pub trait Consumer: Send + Sync {
    /// What stops the consumer.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The broker.
    fn kind(&self) -> TransportKind;

    /// Creates what the consumer reads from, if missing, and returns: RabbitMQ declares
    /// the exchange and the queue and binds them; NATS creates the durable consumer on
    /// its stream (which must exist). Call it before the first publish when no message
    /// may be published before the consumer exists (a RabbitMQ exchange without a bound
    /// queue refuses a `mandatory` publish; the relay dead-letters it as unroutable).
    /// Idempotent; [`run`](Self::run) does the same at each (re)connection.
    ///
    /// # Errors
    /// A connection or declaration error; see the transport.
    async fn declare(&self) -> Result<(), Self::Error>;

    /// Consumes until `shutdown` is cancelled, one delivery at a time per handler call
    /// (the transport may run several calls at once: RabbitMQ's prefetch, NATS'
    /// concurrency).
    ///
    /// # Errors
    /// Only errors retrying cannot fix; see the transport.
    async fn run<H: DeliveryHandler>(
        &self,
        handler: H,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<(), Self::Error>;

    /// Consumes until `shutdown` is cancelled, handing deliveries to `handler` in
    /// batches (the [`BatchSettings`] the consumer was built with).
    ///
    /// # Errors
    /// As [`run`](Self::run).
    async fn run_batched<H: BatchDeliveryHandler>(
        &self,
        handler: H,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<(), Self::Error>;
}

/// How a consumer's batched mode ([`Consumer::run_batched`]) groups deliveries: the
/// same type and limits for every transport, given to `RabbitConsumerConfig::with_batch`
/// and `NatsConsumerConfig::with_batch`.
///
/// A batch is handed over when it holds [`size`](Self::with_size) deliveries, or when
/// [`linger`](Self::with_linger) has passed since its first one (deliveries already
/// received are always taken first); up to [`in_flight`](Self::with_in_flight) batches
/// are handled at once, so that the broker and the database overlap. The consumer's
/// window (RabbitMQ's prefetch, JetStream's `max_ack_pending`, i.e. the NATS consumer's
/// concurrency) bounds every delivery held, batches in flight included: with a batch
/// size equal to the window the next batch can only fill as the one in flight is
/// acknowledged; half the window with 2 batches in flight lets the broker deliver the
/// next batch while the database works on the current one.
///
/// ```
/// use std::time::Duration;
/// use outboxkit_core::BatchSettings;
///
/// let batch = BatchSettings::new().with_size(50).with_linger(Duration::from_millis(5));
/// assert_eq!(batch.check(100), Ok(50));
/// assert!(batch.check(10).is_err(), "50 is above a window of 10");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub struct BatchSettings {
    size: Option<usize>,
    linger: std::time::Duration,
    in_flight: usize,
}

impl BatchSettings {
    /// Default [linger](Self::with_linger): 3 ms.
    pub const DEFAULT_LINGER: std::time::Duration = std::time::Duration::from_millis(3);
    /// Longest accepted linger: 1 s.
    pub const MAX_LINGER: std::time::Duration = std::time::Duration::from_secs(1);
    /// Default number of [batches in flight](Self::with_in_flight): 2.
    pub const DEFAULT_IN_FLIGHT: usize = 2;
    /// Largest accepted number of batches in flight: 64.
    pub const MAX_IN_FLIGHT: usize = 64;

    /// The defaults: batches as large as the consumer's window, a 3 ms linger, 2
    /// batches in flight.
    pub const fn new() -> Self {
        Self {
            size: None,
            linger: Self::DEFAULT_LINGER,
            in_flight: Self::DEFAULT_IN_FLIGHT,
        }
    }

    /// The largest number of deliveries handed to the handler at once (one transaction
    /// with the `outboxkit-inbox` crate's consumers), 1 to the consumer's window. Default: the
    /// window (RabbitMQ's prefetch, the NATS consumer's concurrency; 100 by default).
    pub const fn with_size(mut self, messages: usize) -> Self {
        self.size = Some(messages);
        self
    }

    /// How long a batch that is not full waits for more deliveries after its first one;
    /// zero hands over whatever has arrived. At most [`MAX_LINGER`](Self::MAX_LINGER).
    /// Default 3 ms.
    pub const fn with_linger(mut self, linger: std::time::Duration) -> Self {
        self.linger = linger;
        self
    }

    /// How many batches are handled at once, 1 to [`MAX_IN_FLIGHT`](Self::MAX_IN_FLIGHT).
    /// Default 2.
    pub const fn with_in_flight(mut self, batches: usize) -> Self {
        self.in_flight = batches;
        self
    }

    /// The batch size asked for; `None` means the consumer's window.
    pub const fn size(&self) -> Option<usize> {
        self.size
    }

    /// The linger.
    pub const fn linger(&self) -> std::time::Duration {
        self.linger
    }

    /// The number of batches handled at once.
    pub const fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Checks the settings against a consumer's `window` (its prefetch or concurrency)
    /// and returns the batch size to use (the size asked for, or the window).
    ///
    /// # Errors
    /// [`InvalidBatchSettings`] naming the field (`batch_size`, `batch_linger`,
    /// `batches_in_flight`) when the size is 0 or above the window, the linger above
    /// [`MAX_LINGER`](Self::MAX_LINGER), or the batches in flight outside
    /// `1..=`[`MAX_IN_FLIGHT`](Self::MAX_IN_FLIGHT).
    pub fn check(&self, window: usize) -> Result<usize, InvalidBatchSettings> {
        let size = self.size.unwrap_or(window);
        if size == 0 || size > window {
            return Err(InvalidBatchSettings {
                field: "batch_size",
                reason: format!(
                    "must be between 1 and the consumer's window ({window}), got {size}"
                ),
            });
        }
        if self.linger > Self::MAX_LINGER {
            return Err(InvalidBatchSettings {
                field: "batch_linger",
                reason: format!(
                    "must be at most {:?}, got {:?}",
                    Self::MAX_LINGER,
                    self.linger
                ),
            });
        }
        if !(1..=Self::MAX_IN_FLIGHT).contains(&self.in_flight) {
            return Err(InvalidBatchSettings {
                field: "batches_in_flight",
                reason: format!(
                    "must be between 1 and {}, got {}",
                    Self::MAX_IN_FLIGHT,
                    self.in_flight
                ),
            });
        }
        Ok(size)
    }
}

impl Default for BatchSettings {
    fn default() -> Self {
        Self::new()
    }
}

/// [`BatchSettings`] a consumer cannot use; the transports report it as their own
/// `InvalidConfig` error with the same field and reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
#[non_exhaustive]
pub struct InvalidBatchSettings {
    /// `batch_size`, `batch_linger` or `batches_in_flight`.
    pub field: &'static str,
    /// What is wrong, with the limit and the value given.
    pub reason: String,
}
