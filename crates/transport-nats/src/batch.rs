//! Batched consuming: [`NatsConsumer::run_batched`] (see the consumer's module docs,
//! "Batched mode").

use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use outbox_core::consumer::{BatchDeliveryHandler, HandlerDecision, handle_batch_until_decided};
use outbox_core::wire::IncomingMessage;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::consumer::{NatsConsumer, decode_message, nak_delay};
use crate::error::NatsError;

/// A decoded message waiting in a batch.
struct Held {
    message: jetstream::Message,
    stream_sequence: u64,
    delivered: u64,
    msg: IncomingMessage,
}

/// One pull subscription's worth of batched consuming. `Ok(())` means shutdown; the
/// `bool` whether consuming started.
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
    let mut collecting: Vec<Held> = Vec::with_capacity(batch_size);
    let mut linger_until: Option<Instant> = None;
    let mut batches = FuturesUnordered::new();
    let mut terminations = FuturesUnordered::new();
    let mut errors_in_a_row = 0u32;
    let ended = loop {
        let launchable = !collecting.is_empty() && batches.len() < consumer.batches_in_flight;
        if launchable && collecting.len() >= batch_size {
            let batch = std::mem::take(&mut collecting);
            batches.push(process_batch(consumer, handler, batch, shutdown));
            linger_until = None;
            continue;
        }
        let deadline = linger_until.unwrap_or_else(Instant::now);
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(()),
            Some(()) = batches.next(), if !batches.is_empty() => {}
            Some(()) = terminations.next(), if !terminations.is_empty() => {}
            // Messages already pulled go into the batch before the linger counts.
            next = messages.next(), if collecting.len() < batch_size => match next {
                Some(Ok(message)) => {
                    errors_in_a_row = 0;
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
                            if collecting.is_empty() {
                                linger_until = Some(Instant::now() + consumer.batch_linger);
                            }
                            collecting.push(Held { message, stream_sequence, delivered, msg });
                        }
                        Err(e) => {
                            warn!(
                                stream_sequence,
                                message_id = message_id.as_deref().unwrap_or(""),
                                error = %e,
                                "undecodable message terminated"
                            );
                            terminations.push(async move {
                                if let Err(e) = message.ack_with(AckKind::Term).await {
                                    warn!(stream_sequence, error = %e, "could not answer the server; it will redeliver after ack_wait");
                                }
                            });
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
            () = tokio::time::sleep_until(deadline), if launchable => {
                let batch = std::mem::take(&mut collecting);
                batches.push(process_batch(consumer, handler, batch, shutdown));
                linger_until = None;
            }
        }
    };
    // No more pulls; let the running batches finish and answer.
    drop(messages);
    if !collecting.is_empty() {
        debug!(
            messages = collecting.len(),
            "messages collected for a batch not started are redelivered after ack_wait"
        );
    }
    drop(collecting);
    let draining = batches.len();
    if draining > 0 {
        debug!(batches = draining, "waiting for in-flight batches");
    }
    while batches.next().await.is_some() {}
    while terminations.next().await.is_some() {}
    (true, ended)
}

/// Hands a batch to the handler until every message is decided, answering each as
/// soon as it is, and keeping the deferred ones with `+WPI`.
async fn process_batch<H: BatchDeliveryHandler>(
    consumer: &NatsConsumer,
    handler: &H,
    batch: Vec<Held>,
    shutdown: &CancellationToken,
) {
    let mut held = Vec::with_capacity(batch.len());
    let mut msgs = Vec::with_capacity(batch.len());
    for Held {
        message,
        stream_sequence,
        delivered,
        msg,
    } in batch
    {
        held.push((message, stream_sequence, delivered));
        msgs.push(msg);
    }
    let held = &held;
    let nak_delays = consumer.nak_delays();
    handle_batch_until_decided(
        handler,
        msgs,
        shutdown,
        // "+WPI" (work in progress) before each wait restarts the server's ack_wait, so
        // a deferred message is neither redelivered nor counted again.
        move |deferred| async move {
            join_all(deferred.into_iter().map(|i| async move {
                let (message, stream_sequence, _) = &held[i];
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    debug!(stream_sequence, error = %e, "could not send +WPI");
                }
            }))
            .await;
        },
        move |decided| async move {
            join_all(decided.into_iter().map(|(i, decision)| async move {
                let (message, stream_sequence, delivered) = &held[i];
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
    )
    .await;
}
