//! Batched consuming: [`RabbitConsumer::run_batched`] (see the consumer's module docs,
//! "Batched mode").

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::ShortString;
use outboxkit_core::consumer::{
    BatchDeliveryHandler, HandlerDecision, handle_batch_until_decided, until_decided,
};
use outboxkit_core::wire::{IncomingMessage, UndecodableMessage};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::consumer::{RabbitConsumer, answer as answer_delivery, decode_delivery};
use crate::error::RabbitError;

/// How a delivery is answered: the requeue delay, and how long an answer may take.
#[derive(Debug, Clone, Copy)]
struct Timing {
    requeue_delay: Duration,
    answer_timeout: Duration,
}

/// A decoded delivery waiting in a batch.
struct Held {
    tag: u64,
    acker: Acker,
    msg: IncomingMessage,
}

/// The delivery tags of the channel that a `multiple` ack must not cover: those received
/// and not answered yet, and those whose answer is in flight (handed to lapin, not yet
/// written to the socket). lapin runs each answer as its own internal future, so two
/// answers may reach the socket in either order: a `multiple` ack sent while a lower
/// tag's answer is in flight could overtake it and acknowledge that tag first, and the
/// broker then closes the channel on the late answer (`406 PRECONDITION_FAILED - unknown
/// delivery tag`). So a `multiple` ack is sent only when every tag up to its own is one
/// of its batch's, unanswered, and no lower answer is in flight. Everything that
/// touches it runs in the consuming task.
#[derive(Debug, Default)]
struct Outstanding(Mutex<Tags>);

#[derive(Debug, Default)]
struct Tags {
    unanswered: BTreeSet<u64>,
    in_flight: BTreeSet<u64>,
}

impl Outstanding {
    fn tags(&self) -> std::sync::MutexGuard<'_, Tags> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(&self, tag: u64) {
        self.tags().unanswered.insert(tag);
    }

    /// `tag` is being answered: in flight until [`answered`](Self::answered).
    fn answering(&self, tag: u64) {
        let mut tags = self.tags();
        tags.unanswered.remove(&tag);
        tags.in_flight.insert(tag);
    }

    /// The answer of `tag` was written (or failed with the channel).
    fn answered(&self, tag: u64) {
        self.tags().in_flight.remove(&tag);
    }

    /// When every unanswered tag up to the highest of `tags` is one of `tags`, every tag
    /// of `tags` is unanswered, and no answer of a tag below the highest is in flight
    /// (so a `multiple` ack on it acknowledges exactly them, whatever the order in which
    /// lapin writes the answers), marks them in flight and returns the index of the
    /// highest; otherwise changes nothing.
    fn take_if_alone(&self, tags: &[u64]) -> Option<usize> {
        let (top, &highest) = tags.iter().enumerate().max_by_key(|(_, t)| **t)?;
        let mut set = self.tags();
        let ours: BTreeSet<u64> = tags.iter().copied().collect();
        if set.unanswered.range(..=highest).any(|t| !ours.contains(t))
            || !ours.iter().all(|t| set.unanswered.contains(t))
            || set.in_flight.range(..=highest).next().is_some()
        {
            return None;
        }
        for tag in &ours {
            set.unanswered.remove(tag);
            set.in_flight.insert(*tag);
        }
        Some(top)
    }
}

/// One connection's worth of batched consuming. `Ok(())` means shutdown; the `bool`
/// whether consuming started.
pub(crate) async fn consume_batched_once<H: BatchDeliveryHandler>(
    consumer: &RabbitConsumer,
    handler: &H,
    shutdown: &CancellationToken,
) -> (bool, Result<(), RabbitError>) {
    let mut session = match consumer.open().await {
        Ok(session) => session,
        Err(e) => return (false, Err(e)),
    };
    let outstanding = Outstanding::default();
    let timing = Timing {
        requeue_delay: consumer.requeue_delay,
        answer_timeout: consumer.config.connect_timeout(),
    };
    let batch_size = consumer.batch_size;
    let mut collecting: Vec<Held> = Vec::with_capacity(batch_size);
    let mut linger_until: Option<Instant> = None;
    let mut batches = FuturesUnordered::new();
    let mut undecodables = FuturesUnordered::new();
    let ended = loop {
        let launchable = !collecting.is_empty() && batches.len() < consumer.batch.in_flight();
        if launchable && collecting.len() >= batch_size {
            let batch = std::mem::take(&mut collecting);
            batches.push(process_batch(
                handler,
                batch,
                &outstanding,
                timing,
                shutdown,
            ));
            linger_until = None;
            continue;
        }
        let deadline = linger_until.unwrap_or_else(Instant::now);
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break Ok(()),
            Some(()) = batches.next(), if !batches.is_empty() => {}
            Some(()) = undecodables.next(), if !undecodables.is_empty() => {}
            // Deliveries already received go into the batch before the linger counts.
            next = session.consumer.next(), if collecting.len() < batch_size => match next {
                Some(Ok(delivery)) => {
                    let Delivery { delivery_tag, redelivered, properties, data, acker, .. } = delivery;
                    outstanding.insert(delivery_tag);
                    match decode_delivery(&properties, data, redelivered) {
                        Ok(msg) => {
                            if collecting.is_empty() {
                                linger_until = Some(Instant::now() + consumer.batch.linger());
                            }
                            collecting.push(Held { tag: delivery_tag, acker, msg });
                        }
                        // Alone, at once: the handler may record it (or drop it).
                        Err(undecodable) => {
                            let message_id = properties.message_id().as_ref().map(ShortString::as_str);
                            debug!(
                                delivery_tag,
                                message_id = message_id.unwrap_or(""),
                                error = %undecodable.error,
                                "undecodable delivery handed to the handler alone"
                            );
                            undecodables.push(undecodable_alone(
                                handler,
                                *undecodable,
                                acker,
                                delivery_tag,
                                &outstanding,
                                timing,
                                shutdown,
                            ));
                        }
                    }
                }
                Some(Err(source)) => break Err(consumer.stream_error(Some(source))),
                None => break Err(consumer.stream_error(None)),
            },
            () = tokio::time::sleep_until(deadline), if launchable => {
                let batch = std::mem::take(&mut collecting);
                batches.push(process_batch(handler, batch, &outstanding, timing, shutdown));
                linger_until = None;
            }
        }
    };
    if ended.is_ok() {
        consumer.cancel(&session).await;
    }
    if !collecting.is_empty() {
        debug!(
            deliveries = collecting.len(),
            "deliveries collected for a batch not started are returned to the queue"
        );
    }
    drop(collecting);
    let draining = batches.len();
    if draining > 0 {
        debug!(batches = draining, "waiting for in-flight batches");
    }
    while batches.next().await.is_some() {}
    while undecodables.next().await.is_some() {}
    consumer.close(session, ended.is_ok()).await;
    (true, ended)
}

/// Hands an undecodable delivery to the handler's
/// [`handle_undecodable`](BatchDeliveryHandler::handle_undecodable) until decided, and
/// answers it (a requeue after the requeue delay, cut short by shutdown).
async fn undecodable_alone<H: BatchDeliveryHandler>(
    handler: &H,
    msg: UndecodableMessage,
    acker: Acker,
    tag: u64,
    outstanding: &Outstanding,
    timing: Timing,
    shutdown: &CancellationToken,
) {
    // An unacknowledged delivery stays ours: nothing to do to keep it while deferred.
    let decision = until_decided(
        msg.id,
        || handler.handle_undecodable(&msg),
        shutdown,
        || async {},
    )
    .await;
    if decision == HandlerDecision::Requeue && !timing.requeue_delay.is_zero() {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(timing.requeue_delay) => {}
        }
    }
    outstanding.answering(tag);
    answer_one(tag, &acker, decision, outstanding, timing.answer_timeout).await;
}

/// Hands a batch to the handler until every delivery is decided, answering each as
/// soon as it is.
async fn process_batch<H: BatchDeliveryHandler>(
    handler: &H,
    batch: Vec<Held>,
    outstanding: &Outstanding,
    timing: Timing,
    shutdown: &CancellationToken,
) {
    let mut ackers = Vec::with_capacity(batch.len());
    let mut msgs = Vec::with_capacity(batch.len());
    for Held { tag, acker, msg } in batch {
        ackers.push((tag, acker));
        msgs.push(msg);
    }
    let ackers = &ackers;
    // An unacknowledged delivery stays ours: nothing to do to keep it while deferred.
    handle_batch_until_decided(
        handler,
        msgs,
        shutdown,
        |_| async {},
        move |decided| answer(ackers, decided, outstanding, timing, shutdown),
    )
    .await;
}

/// Answers the decided deliveries of a batch: all of it acknowledged with one
/// `multiple` ack when that is safe, otherwise one answer each (requeues after the
/// requeue delay, cut short by shutdown).
async fn answer(
    ackers: &[(u64, Acker)],
    decided: Vec<(usize, HandlerDecision)>,
    outstanding: &Outstanding,
    timing: Timing,
    shutdown: &CancellationToken,
) {
    if decided.len() == ackers.len() && decided.iter().all(|(_, d)| *d == HandlerDecision::Ack) {
        let tags: Vec<u64> = ackers.iter().map(|(tag, _)| *tag).collect();
        if let Some(top) = outstanding.take_if_alone(&tags) {
            let (tag, acker) = &ackers[top];
            let acked = match tokio::time::timeout(
                timing.answer_timeout,
                acker.ack(BasicAckOptions { multiple: true }),
            )
            .await
            {
                Ok(acked) => acked.map_err(|e| e.to_string()),
                Err(_) => Err(format!(
                    "no answer from the channel within {:?}",
                    timing.answer_timeout
                )),
            };
            for tag in &tags {
                outstanding.answered(*tag);
            }
            if let Err(e) = acked {
                warn!(delivery_tag = tag, deliveries = tags.len(), error = %e, "could not acknowledge the batch; the broker will redeliver it");
            }
            return;
        }
    }
    let (later, now): (Vec<_>, Vec<_>) = decided
        .into_iter()
        .partition(|(_, d)| *d == HandlerDecision::Requeue);
    // Each answer is marked in flight before it is handed to lapin, and done once
    // lapin has written it: no `multiple` ack covers it meanwhile.
    join_all(now.into_iter().map(|(i, d)| {
        let (tag, acker) = &ackers[i];
        outstanding.answering(*tag);
        answer_one(*tag, acker, d, outstanding, timing.answer_timeout)
    }))
    .await;
    if later.is_empty() {
        return;
    }
    if !timing.requeue_delay.is_zero() {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(timing.requeue_delay) => {}
        }
    }
    join_all(later.into_iter().map(|(i, d)| {
        let (tag, acker) = &ackers[i];
        outstanding.answering(*tag);
        answer_one(*tag, acker, d, outstanding, timing.answer_timeout)
    }))
    .await;
}

/// Answers one delivery (marked in flight by the caller) and marks it answered, giving
/// up after `limit` (see [`answer_delivery`]).
async fn answer_one(
    tag: u64,
    acker: &Acker,
    decision: HandlerDecision,
    outstanding: &Outstanding,
    limit: Duration,
) {
    let answered = answer_delivery(acker, decision, limit).await;
    outstanding.answered(tag);
    if let Err(e) = answered {
        warn!(delivery_tag = tag, ?decision, error = %e, "could not answer the broker; it will redeliver");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outstanding(tags: &[u64]) -> Outstanding {
        let o = Outstanding::default();
        for &t in tags {
            o.insert(t);
        }
        o
    }

    #[test]
    fn a_multiple_ack_is_used_only_when_it_acknowledges_nothing_else() {
        let unanswered = |o: &Outstanding| o.tags().unanswered.iter().copied().collect::<Vec<_>>();
        // Alone on the channel: taken, the highest tag named, ours in flight.
        let o = outstanding(&[3, 4, 5]);
        assert_eq!(o.take_if_alone(&[4, 5, 3]), Some(1));
        assert!(o.tags().unanswered.is_empty());
        assert_eq!(o.tags().in_flight.len(), 3);
        // Another batch's delivery below the highest tag: refused, nothing changed.
        let o = outstanding(&[1, 2, 3, 4]);
        assert_eq!(o.take_if_alone(&[1, 2, 4]), None);
        assert_eq!(unanswered(&o), [1, 2, 3, 4]);
        // Only later deliveries besides ours: fine, they stay.
        let o = outstanding(&[1, 2, 7, 8]);
        assert_eq!(o.take_if_alone(&[1, 2]), Some(1));
        assert_eq!(unanswered(&o), [7, 8]);
        // One of ours already answered: refused.
        let o = outstanding(&[2]);
        assert_eq!(o.take_if_alone(&[1, 2]), None);
        assert_eq!(o.take_if_alone(&[]), None);
    }

    #[test]
    fn a_multiple_ack_never_overtakes_a_lower_answer_in_flight() {
        // Batch A (1, 2) is acknowledged with `multiple` on 2 and still in flight when
        // batch B (3, 4) is done: a `multiple` ack on 4 could reach the broker first and
        // acknowledge 1 and 2 before A's ack does. Refused until A's ack is written.
        let o = outstanding(&[1, 2, 3, 4]);
        assert_eq!(o.take_if_alone(&[1, 2]), Some(1));
        assert_eq!(o.take_if_alone(&[3, 4]), None);
        o.answered(1);
        assert_eq!(o.take_if_alone(&[3, 4]), None, "2 is still in flight");
        o.answered(2);
        assert_eq!(o.take_if_alone(&[3, 4]), Some(1));
        // An individual answer in flight below counts too; one above does not.
        let o = outstanding(&[1, 2, 3, 9]);
        o.answering(1);
        o.answering(9);
        assert_eq!(o.take_if_alone(&[2, 3]), None);
        o.answered(1);
        assert_eq!(o.take_if_alone(&[2, 3]), Some(1));
    }
}
