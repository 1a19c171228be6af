//! The consumer-side contract shared by every transport: a [`DeliveryHandler`] receives
//! each decoded [`IncomingMessage`] and answers with a [`HandlerDecision`], which the
//! transport turns into its protocol's acknowledgement (AMQP `basic.ack`/`basic.nack`,
//! JetStream `+ACK`/`-NAK`/`+TERM`).

use async_trait::async_trait;

use crate::wire::IncomingMessage;

/// What to tell the broker about a delivery once the handler is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandlerDecision {
    /// Processed (and committed): acknowledge (AMQP `basic.ack`, JetStream `+ACK`).
    Ack,
    /// Not processed, deliver again (AMQP `basic.nack` with `requeue = true`; JetStream
    /// `-NAK`, with the consumer's backoff as delay).
    Requeue,
    /// Never processable: drop or dead-letter (AMQP `basic.nack` with `requeue = false`,
    /// to the queue's dead-letter exchange if any; JetStream `+TERM`).
    Reject,
}

/// Handles one decoded delivery.
///
/// # Contract
/// - It MUST finish its side effects (e.g. commit its database transaction) before
///   returning [`HandlerDecision::Ack`]: the transport acknowledges after the return.
/// - It MUST be idempotent or deduplicate on [`IncomingMessage::id`]: delivery is
///   at-least-once.
/// - It SHOULD NOT panic. Transports catch a panic and log it; the delivery is
///   requeued on its first delivery and rejected once it was redelivered, so a message
///   that always panics is dead-lettered instead of looping.
#[async_trait]
pub trait DeliveryHandler: Send + Sync + 'static {
    /// Handles `msg` and says how to answer the broker.
    async fn handle(&self, msg: IncomingMessage) -> HandlerDecision;
}

#[async_trait]
impl<H: DeliveryHandler + ?Sized> DeliveryHandler for std::sync::Arc<H> {
    async fn handle(&self, msg: IncomingMessage) -> HandlerDecision {
        (**self).handle(msg).await
    }
}
