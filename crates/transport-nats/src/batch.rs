//! Batched consuming: [`NatsConsumer::run_batched`] (see the consumer's module docs,
//! "Batched mode").

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use outboxkit_core::consumer::{
    BatchDeliveryHandler, HandlerDecision, handle_batch_until_decided, until_decided,
};
use outboxkit_core::wire::{IncomingMessage, UndecodableMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::consumer::{NatsConsumer, decode_message, nak_delay};
use crate::error::NatsError;

/// A decoded message held by the consumer, waiting for a batch or in one.
struct Held {
    message: jetstream::Message,
    stream_sequence: u64,
    delivered: u64,
    /// When it arrived: the batch linger counts from the oldest waiting message.
    received: Instant,
    /// When its `ack_wait` last (re)started: its arrival or its last `+WPI`.
    kept: Instant,
    msg: IncomingMessage,
}

/// One pull subscription's worth of batched consuming. `Ok(())` means shutdown; the
/// `bool` whether consuming started.
///
/// Every delivery the server hands out is taken off the subscription at once (the
/// consumer's `max_ack_pending` bounds them), so none sits unseen in the client's
/// buffer; those waiting for a batch slot get a `+WPI` every
/// [`keep_alive_period`](NatsConsumer::keep_alive_period), as do the unanswered
/// messages of each batch in flight, so none is redelivered however long the batches
/// take (a handler deferring through a database outage).
pub(crate) async fn consume_batched_once<H: BatchDeliveryHandler>(
    consumer: &NatsConsumer,
    js: jetstream::Context,
    handler: &H,
    shutdown: &CancellationToken,
) -> (bool, Result<(), NatsError>) {
    let mut messages = match consumer.subscribe(&js).await {
        Ok(messages) => messages,
        Err(e) => return (false, Err(e)),
    };
    let batch_size = consumer.batch_size();
    let period = consumer.keep_alive_period();
    // When the waiting messages get their next `+WPI`: `period` after the first of
    // them arrived or after their last `+WPI`.
    let keep_waiting = tokio::time::sleep(period);
    tokio::pin!(keep_waiting);
    let mut waiting: VecDeque<Held> = VecDeque::with_capacity(batch_size);
    let mut batches = FuturesUnordered::new();
    let mut undecodables = FuturesUnordered::new();
    let mut errors_in_a_row = 0u32;
    let ended = loop {
        let launchable = !waiting.is_empty() && batches.len() < consumer.batch.in_flight();
        if launchable && waiting.len() >= batch_size {
            let batch = waiting.drain(..batch_size).collect();
            batches.push(process_batch(consumer, handler, batch, shutdown));
            continue;
        }
        let linger_until = waiting.front().map_or_else(Instant::now, |first| {
            first.received + consumer.batch.linger()
        });
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(()),
            Some(()) = batches.next(), if !batches.is_empty() => {}
            Some(()) = undecodables.next(), if !undecodables.is_empty() => {}
            () = &mut keep_waiting, if !waiting.is_empty() => {
                keep_alive(waiting.iter().map(|h| (&h.message, h.stream_sequence))).await;
                let now = Instant::now();
                for held in &mut waiting {
                    held.kept = now;
                }
                keep_waiting.as_mut().reset(now + period);
            }
            // Messages already pulled go into the batch before the linger counts.
            next = messages.next() => match next {
                Some(Ok(message)) => {
                    errors_in_a_row = 0;
                    let received = Instant::now();
                    let (delivered, stream_sequence) = match message.info() {
                        Ok(info) => (
                            u64::try_from(info.delivered).unwrap_or(1).max(1),
                            info.stream_sequence,
                        ),
                        Err(e) => {
                            warn!(subject = %message.subject, error = %e, "not a JetStream message; ignored");
                            continue;
                        }
                    };
                    let (message_id, decoded) =
                        decode_message(message.headers.as_ref(), &message.payload, delivered);
                    match decoded {
                        Ok(msg) => {
                            if waiting.is_empty() {
                                keep_waiting.as_mut().reset(received + period);
                            }
                            waiting.push_back(Held {
                                message,
                                stream_sequence,
                                delivered,
                                received,
                                kept: received,
                                msg,
                            });
                        }
                        // Alone, at once: the handler may record it (or drop it).
                        Err(undecodable) => {
                            debug!(
                                stream_sequence,
                                message_id = message_id.as_deref().unwrap_or(""),
                                error = %undecodable.error,
                                "undecodable message handed to the handler alone"
                            );
                            undecodables.push(undecodable_alone(
                                handler,
                                *undecodable,
                                message,
                                stream_sequence,
                                delivered,
                                consumer,
                                shutdown,
                            ));
                        }
                    }
                }
                Some(Err(e)) => {
                    if let Some(e) = consumer.pull_error(e, &mut errors_in_a_row) {
                        break Err(e);
                    }
                }
                None => break Err(consumer.ended_error()),
            },
            () = tokio::time::sleep_until(linger_until), if launchable => {
                let batch = waiting.drain(..waiting.len().min(batch_size)).collect();
                batches.push(process_batch(consumer, handler, batch, shutdown));
            }
        }
    };
    // No more pulls; let the running batches finish and answer.
    drop(messages);
    if !waiting.is_empty() {
        debug!(
            messages = waiting.len(),
            "messages waiting for a batch are redelivered after ack_wait"
        );
    }
    drop(waiting);
    let draining = batches.len();
    if draining > 0 {
        debug!(batches = draining, "waiting for in-flight batches");
    }
    while batches.next().await.is_some() {}
    while undecodables.next().await.is_some() {}
    (true, ended)
}

/// Hands an undecodable message to the handler's
/// [`handle_undecodable`](BatchDeliveryHandler::handle_undecodable) until decided
/// (`+WPI` before each wait while it defers), and answers it.
async fn undecodable_alone<H: BatchDeliveryHandler>(
    handler: &H,
    msg: UndecodableMessage,
    message: jetstream::Message,
    stream_sequence: u64,
    delivered: u64,
    consumer: &NatsConsumer,
    shutdown: &CancellationToken,
) {
    let decision = until_decided(
        msg.id,
        || handler.handle_undecodable(&msg),
        shutdown,
        || async {
            if let Err(e) = message.ack_with(AckKind::Progress).await {
                debug!(stream_sequence, error = %e, "could not send +WPI");
            }
        },
    )
    .await;
    let kind = match decision {
        HandlerDecision::Ack => AckKind::Ack,
        HandlerDecision::Requeue => AckKind::Nak(nak_delay(consumer.nak_delays(), delivered)),
        // Still deferred at shutdown: let the server redeliver it at once.
        HandlerDecision::Defer => AckKind::Nak(None),
        HandlerDecision::Reject => AckKind::Term,
    };
    if let Err(e) = message.ack_with(kind).await {
        warn!(stream_sequence, ?decision, error = %e, "could not answer the server; it will redeliver after ack_wait");
    }
}

/// Sends `+WPI` (work in progress) for each of `held`: the server restarts its
/// `ack_wait` and counts no delivery.
async fn keep_alive<'a>(held: impl Iterator<Item = (&'a jetstream::Message, u64)>) {
    join_all(held.map(|(message, stream_sequence)| async move {
        if let Err(e) = message.ack_with(AckKind::Progress).await {
            debug!(stream_sequence, error = %e, "could not send +WPI");
        }
    }))
    .await;
}

/// Hands a batch to the handler until every message is decided, answering each as
/// soon as it is, and keeping the unanswered ones with `+WPI` every
/// [`keep_alive_period`](NatsConsumer::keep_alive_period) meanwhile.
async fn process_batch<H: BatchDeliveryHandler>(
    consumer: &NatsConsumer,
    handler: &H,
    batch: Vec<Held>,
    shutdown: &CancellationToken,
) {
    let period = consumer.keep_alive_period();
    let mut keep_at = batch
        .iter()
        .map(|held| held.kept)
        .min()
        .unwrap_or_else(Instant::now)
        + period;
    let mut held = Vec::with_capacity(batch.len());
    let mut msgs = Vec::with_capacity(batch.len());
    for Held {
        message,
        stream_sequence,
        delivered,
        msg,
        ..
    } in batch
    {
        held.push((message, stream_sequence, delivered));
        msgs.push(msg);
    }
    let held = &held;
    let answered: &Vec<AtomicBool> = &held.iter().map(|_| AtomicBool::new(false)).collect();
    let nak_delays = consumer.nak_delays();
    let handling = handle_batch_until_decided(
        handler,
        msgs,
        shutdown,
        // Deferred messages are kept by the keep-alive below, like every unanswered one.
        |_| std::future::ready(()),
        move |decided| async move {
            join_all(decided.into_iter().map(|(i, decision)| async move {
                let (message, stream_sequence, delivered) = &held[i];
                // Marked before the answer is written: no `+WPI` may follow it.
                answered[i].store(true, Relaxed);
                let kind = match decision {
                    HandlerDecision::Ack => AckKind::Ack,
                    HandlerDecision::Requeue => AckKind::Nak(nak_delay(nak_delays, *delivered)),
                    // Still deferred at shutdown: let the server redeliver it at once.
                    HandlerDecision::Defer => AckKind::Nak(None),
                    HandlerDecision::Reject => AckKind::Term,
                };
                if let Err(e) = message.ack_with(kind).await {
                    warn!(stream_sequence, ?decision, error = %e, "could not answer the server; it will redeliver after ack_wait");
                }
            }))
            .await;
        },
    );
    let unanswered = || {
        held.iter()
            .zip(answered)
            .filter(|(_, answered)| !answered.load(Relaxed))
            .map(|((message, stream_sequence, _), _)| (message, *stream_sequence))
    };
    // The handling is not polled while the `+WPI`s are written, so none of them can
    // follow an answer to the same message.
    tokio::pin!(handling);
    loop {
        tokio::select! {
            biased;
            () = &mut handling => break,
            () = tokio::time::sleep_until(keep_at) => {
                keep_alive(unanswered()).await;
                keep_at = Instant::now() + period;
            }
        }
    }
}
