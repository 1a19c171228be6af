//! [`RabbitPublisher`]: the [`EventPublisher`] for RabbitMQ, with pipelined publisher
//! confirms and mandatory returns.
//!
//! # How a batch is published
//!
//! 1. Each message is checked before anything is sent: a payload over
//!    [`max_payload_bytes`](crate::RabbitConfig::with_max_payload_bytes) gets
//!    [`PublishError::PayloadTooLarge`], a routing key, event type or header name over
//!    the AMQP short-string limit of 255 bytes, or headers too large for one AMQP frame,
//!    get [`PublishError::Invalid`]. These are permanent and nothing is sent for them.
//! 2. The batch takes one of the connection's confirm-mode channels (AMQP 0-9-1
//!    `confirm.select`, RabbitMQ [publisher confirms]) for itself and sends every
//!    message with `basic.publish` (`mandatory`, persistent, see below) without waiting
//!    for anything in between.
//! 3. Then all confirms are awaited together, under one deadline of
//!    [`confirm_timeout`](crate::RabbitConfig::with_confirm_timeout) counted from
//!    when the channel was ready (reconnecting first takes at most the
//!    [`connect_timeout`](crate::RabbitConfig::with_connect_timeout), over
//!    however many nodes of a cluster are tried; the sum is the publisher's
//!    [`EventPublisher::publish_timeout`]).
//!
//! Each message gets exactly one [`PublishOutcome`], in input order:
//!
//! | broker or driver says                           | outcome                                    |
//! |-------------------------------------------------|--------------------------------------------|
//! | `basic.ack`                                     | `Published`                                |
//! | `basic.return` then `basic.ack` (mandatory, no queue bound) | `Permanent(Unroutable)`        |
//! | `basic.nack` (a queue at `x-max-length` with `reject-publish`, a queue failure) | `Transient(Rejected)`: its destination's circuit opens (its routing key, or the name of the `DestinationRule` it matches), the others flow |
//! | no confirm requested (confirm mode off)         | `Permanent(ConfirmsNotEnabled)`            |
//! | connection or channel lost, broker unreachable  | `Transient(Unavailable)`: circuit opens    |
//! | connection blocked by a broker resource alarm   | `Transient(Unavailable)`: circuit opens    |
//! | no confirm within the deadline (slow or frozen broker) | `Transient(Timeout)`: an outage, circuit opens |
//! | channel closed with `406 PRECONDITION_FAILED` (a message over the broker's `max_message_size`) | the unconfirmed messages are published again one at a time: the one closed with 406 alone gets `Permanent(Other)`, the others their own outcome |
//!
//! Only a verdict about one message is permanent; whatever says the broker cannot take
//! messages now is an outage ([`ErrorKind::Unavailable`]), which charges no attempt.
//!
//! # Wire format
//!
//! Properties: `message_id` = outbox id, `content_type` = `application/json`,
//! `delivery_mode` = 2 (persistent), `timestamp` = `occurred_at` (Unix seconds), `type`
//! = event type. Headers: [`outboxkit_core::wire::encode_headers`] with the AMQP binding
//! (`cloudEvents:*` attributes, `traceparent`/`tracestate`, pass-through headers), all
//! as AMQP long strings; when a pass-through header has the name of a CloudEvents
//! attribute, the attribute wins. Routing key: [`OutboxMessage::effective_routing_key`].
//!
//! # Connection handling
//!
//! One connection, [`channels`](crate::RabbitConfig::with_channels) channels. A
//! lost connection is dropped and re-established by the next `publish_batch` or
//! [`check_ready`](EventPublisher::check_ready) call, with
//! [`connect_timeout`](crate::RabbitConfig::with_connect_timeout); while the
//! broker cannot be reached every message gets `Unavailable`, which makes the
//! dispatcher open its circuit, hand the messages back without charging an attempt and
//! probe with `check_ready` until the broker is back.
//!
//! [publisher confirms]: https://www.rabbitmq.com/docs/confirms#publisher-confirms

use std::collections::BTreeMap;
use std::sync::Arc;
use std::task::Poll;

use async_trait::async_trait;
use futures::future::join_all;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation, PublisherConfirm};
use outboxkit_core::wire::{Binding, CONTENT_TYPE_JSON, check_limits, encode_headers};
use outboxkit_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::sync::Mutex;
use tokio::time::{Instant, timeout, timeout_at};
use tracing::{debug, warn};

use crate::config::{RabbitConfig, Resolved};
use crate::connection::Session;
use crate::error::{RabbitError, is_precondition_failed};
use crate::topology::declare_exchange;

/// AMQP 0-9-1 `delivery-mode` of a persistent message.
const PERSISTENT: u8 = 2;
/// Largest AMQP short string (routing key, header name, `type`), in bytes.
const MAX_SHORT_STRING: usize = 255;

/// Publishes outbox messages to a RabbitMQ topic exchange and waits for publisher
/// confirms. See the [module docs](self) for the outcome of each broker answer.
///
/// Cheap to share: wrap it in an [`Arc`] or hand it to the
/// [`Dispatcher`](outboxkit_core::Dispatcher) directly. Concurrent
/// [`publish_batch`](EventPublisher::publish_batch) calls use different channels of the
/// one connection.
#[derive(Debug)]
pub struct RabbitPublisher {
    pub(crate) config: Resolved,
    pub(crate) session: Mutex<Option<Arc<Session>>>,
}

impl RabbitPublisher {
    /// A publisher that connects lazily, on the first
    /// [`publish_batch`](EventPublisher::publish_batch) or
    /// [`check_ready`](EventPublisher::check_ready). Use this when the relay must start
    /// even while the broker is down. The same call as `NatsPublisher::connect_lazy`
    /// (async for that reason; nothing here waits).
    ///
    /// # Errors
    /// [`RabbitError::InvalidUrl`] or [`RabbitError::InvalidConfig`] when `config` is
    /// invalid ([`RabbitConfig::validate`]), before anything else.
    pub async fn connect_lazy(config: RabbitConfig) -> Result<Self, RabbitError> {
        Self::lazy(config)
    }

    fn lazy(config: RabbitConfig) -> Result<Self, RabbitError> {
        Ok(Self {
            config: config.resolve()?,
            session: Mutex::new(None),
        })
    }

    /// Connects at once: opens the connection and its confirm-mode channels and
    /// declares (or, with `declare_exchange = false`, checks) the exchange.
    ///
    /// # Errors
    /// [`RabbitError::Connect`] when the broker refuses or cannot be reached (bad
    /// credentials are [`ErrorKind::Permanent`], an unreachable broker
    /// [`ErrorKind::Unavailable`]), [`RabbitError::ConnectTimeout`] after the connect
    /// timeout, [`RabbitError::Channel`] or [`RabbitError::Declare`] when the channels or
    /// the exchange cannot be set up. [`RabbitError::InvalidUrl`] or
    /// [`RabbitError::InvalidConfig`] when `config` is invalid
    /// ([`RabbitConfig::validate`]), before any connection is tried.
    pub async fn connect(config: RabbitConfig) -> Result<Self, RabbitError> {
        let publisher = Self::lazy(config)?;
        publisher.session().await?;
        Ok(publisher)
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitConfig {
        &self.config
    }

    /// Closes the connection (AMQP `connection.close`, reply code 200) if one is open.
    /// The publisher stays usable: the next call reconnects.
    pub async fn close(&self) {
        let session = self.session.lock().await.take();
        if let Some(session) = session
            && session.connection.status().connected()
        {
            let closing = session.connection.close(200, "publisher closed".into());
            if let Err(e) = timeout(self.config.connect_timeout(), closing)
                .await
                .unwrap_or(Ok(()))
            {
                debug!(error = %e, "closing the RabbitMQ connection failed");
            }
        }
    }

    /// Checks one message and turns it into what `basic.publish` needs, inside a
    /// debug-level `outbox.publish_message` span with the message's id, event type,
    /// tenant, aggregate, version and attempts (never the payload).
    fn prepare(&self, msg: &OutboxMessage) -> Result<Prepared, PublishError> {
        let _span = tracing::debug_span!(
            "outbox.publish_message",
            message.id = %msg.id,
            event_type = %msg.event_type,
            tenant = msg.tenant_id.as_deref().unwrap_or(""),
            aggregate_type = %msg.aggregate_type,
            aggregate_id = %msg.aggregate_id,
            aggregate_version = msg.aggregate_version,
            attempts = msg.attempts,
        )
        .entered();
        let size = msg.payload.get().len();
        let max = self.config.max_payload_bytes();
        if size > max {
            return Err(PublishError::PayloadTooLarge { size, max });
        }
        // What a consumer would refuse to decode is refused here, at the source.
        check_limits(msg).map_err(|e| PublishError::Invalid(e.to_string()))?;
        let routing_key = short_string(msg.effective_routing_key(), "routing key")?;
        let kind = short_string(&msg.event_type, "event type (AMQP `type` property)")?;
        let message_id = ShortString::from(msg.id.to_string());

        let mut headers = BTreeMap::new();
        // Bytes of the encoded field table (AMQP 0-9-1 §4.2.5.5): a 4-byte length, then
        // per field a short string name, a type octet and a long string value.
        let mut table_size = 4;
        for (name, value) in encode_headers(msg, Binding::Amqp, self.config.source()) {
            let name = short_string(&name, "header name")?;
            if headers.contains_key(&name) {
                // encode_headers lists the CloudEvents attributes first: a pass-through
                // header must not overwrite the id, type, ... of the event.
                continue;
            }
            table_size += 1 + name.as_str().len() + 1 + 4 + value.len();
            headers.insert(name, AMQPValue::LongString(LongString::from(value)));
        }
        // A content header frame: frame header (7) and end octet (1), class id,
        // weight, body size and property flags (14), then the properties we set.
        let header_frame_size = 8
            + 14
            + (1 + CONTENT_TYPE_JSON.len())
            + 1
            + (1 + message_id.as_str().len())
            + 8
            + (1 + kind.as_str().len())
            + table_size;

        let timestamp = u64::try_from(msg.occurred_at.timestamp()).unwrap_or(0);
        let properties = BasicProperties::default()
            .with_content_type(ShortString::from(CONTENT_TYPE_JSON))
            .with_delivery_mode(PERSISTENT)
            .with_message_id(message_id)
            .with_timestamp(timestamp)
            .with_type(kind)
            .with_headers(FieldTable::from(headers));
        Ok(Prepared {
            routing_key,
            properties,
            header_frame_size,
        })
    }

    /// Records the outcome of a batch that cannot reach the broker: a message that
    /// could never be published is rejected as such, every other one is an outage.
    fn not_published(
        &self,
        messages: &[OutboxMessage],
        error: &RabbitError,
        results: &mut [Option<Result<(), PublishError>>],
    ) {
        for (i, msg) in messages.iter().enumerate() {
            results[i] = Some(match self.prepare(msg) {
                Ok(_) => Err(outage(error)),
                Err(e) => Err(e),
            });
        }
    }

    /// Publishes the batch on one channel, then awaits its confirms together, before
    /// `deadline` or, without one, the confirm timeout after the channel is ready.
    /// Fills `results` for every message. Returns the deadline used and the indices of
    /// the messages lost with a channel the broker closed with `406
    /// PRECONDITION_FAILED` (one of them caused it; see [`isolate`](Self::isolate)), if
    /// that happened.
    async fn publish_on_channel(
        &self,
        messages: &[OutboxMessage],
        results: &mut [Option<Result<(), PublishError>>],
        deadline: Option<Instant>,
    ) -> (Instant, Vec<usize>) {
        let unreachable = || deadline.unwrap_or_else(Instant::now);
        let session = match self.session().await {
            Ok(session) => session,
            Err(e) => {
                warn!(error = %e, messages = messages.len(), "RabbitMQ unavailable, batch not published");
                self.not_published(messages, &e, results);
                return (unreachable(), Vec::new());
            }
        };
        let mut slot = session.take_slot().await;
        let channel = match self.channel_in(&session, &mut slot).await {
            Ok(channel) => channel,
            Err(e) => {
                warn!(error = %e, "no usable RabbitMQ channel, batch not published");
                self.not_published(messages, &e, results);
                drop(slot);
                self.forget_if_lost(&session).await;
                return (unreachable(), Vec::new());
            }
        };

        let frame_max =
            usize::try_from(session.connection.configuration().frame_max()).unwrap_or(usize::MAX);
        let exchange = ShortString::from(self.config.exchange());
        let deadline = deadline.unwrap_or_else(|| Instant::now() + self.config.confirm_timeout());
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };

        // Phase 1: prepare each message and hand it to lapin at once; then await the
        // sends together. A send's first poll registers its delivery tag and queues its
        // frames, so lapin's I/O thread writes them in a few large writes while the next
        // messages are prepared; awaiting each send before the next cost one write and
        // two thread hand-offs per message (about 40% of the relay process's CPU). Sends
        // complete in any order; the order of messages within a batch does not matter:
        // unordered mode promises none, and an ordered wave holds one message per key.
        let mut sends = Vec::with_capacity(messages.len());
        let mut sent = Vec::with_capacity(messages.len());
        for (i, msg) in messages.iter().enumerate() {
            let message = match self.prepare(msg) {
                Ok(message) => message,
                Err(e) => {
                    warn!(id = %msg.id, event_type = %msg.event_type, error = %e, "message cannot be published");
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            if message.header_frame_size > frame_max {
                results[i] = Some(Err(PublishError::Invalid(format!(
                    "the headers and properties need {} bytes, more than the negotiated AMQP frame size of {frame_max} bytes",
                    message.header_frame_size
                ))));
                continue;
            }
            let mut send = Box::pin(timeout_at(
                deadline,
                channel.basic_publish(
                    exchange.clone(),
                    message.routing_key,
                    options,
                    msg.payload.get().as_bytes(),
                    message.properties,
                ),
            ));
            match futures::poll!(send.as_mut()) {
                Poll::Ready(outcome) => sent.push((i, outcome)),
                Poll::Pending => sends.push(async move { (i, send.await) }),
            }
        }
        sent.extend(join_all(sends).await);
        let mut pending: Vec<(usize, PublisherConfirm)> = Vec::with_capacity(sent.len());
        let mut failure: Option<Failure> = None;
        // Messages lost with the channel while the connection stayed up, and whether the
        // broker closed it with 406 PRECONDITION_FAILED (a message over its
        // max_message_size): then one of them is poison and the rest innocent.
        let mut lost_with_channel: Vec<usize> = Vec::new();
        let mut precondition_failed = false;
        for (i, outcome) in sent {
            match outcome {
                Ok(Ok(confirm)) => pending.push((i, confirm)),
                Ok(Err(e)) => {
                    precondition_failed |= is_precondition_failed(&e);
                    if session.connection.status().connected() {
                        lost_with_channel.push(i);
                    }
                    let f = Failure::Driver(e);
                    results[i] = Some(Err(f.to_error(&self.config, &session)));
                    failure = Some(f);
                }
                Err(_) => {
                    results[i] = Some(Err(Failure::Timeout.to_error(&self.config, &session)));
                    failure = Some(Failure::Timeout);
                }
            }
        }

        // Phase 2: await every confirm together, under the same deadline.
        let confirms = join_all(
            pending
                .into_iter()
                .map(|(i, confirm)| async move { (i, timeout_at(deadline, confirm).await) }),
        )
        .await;
        let (mut acked, mut driver_errors, mut timed_out) = (0usize, 0usize, 0usize);
        for (i, confirm) in confirms {
            let result = match confirm {
                Ok(Ok(confirmation)) => confirmation_result(confirmation, self.config.exchange()),
                Ok(Err(e)) => {
                    driver_errors += 1;
                    precondition_failed |= is_precondition_failed(&e);
                    if session.connection.status().connected() {
                        lost_with_channel.push(i);
                    }
                    Err(Failure::Driver(e).to_error(&self.config, &session))
                }
                Err(_) => {
                    timed_out += 1;
                    Err(Failure::Timeout.to_error(&self.config, &session))
                }
            };
            acked += usize::from(result.is_ok());
            results[i] = Some(result);
        }

        if failure.is_some() || driver_errors > 0 || timed_out > 0 {
            warn!(
                acked,
                driver_errors,
                timed_out,
                connected = session.connection.status().connected(),
                "RabbitMQ batch incomplete; the channel will be reopened"
            );
            // Dropping the channel closes it (and forgets its unconfirmed messages).
            *slot = None;
            drop(slot);
            self.forget_if_lost(&session).await;
        } else {
            debug!(acked, "RabbitMQ batch confirmed");
        }
        if !precondition_failed {
            lost_with_channel.clear();
        }
        (deadline, lost_with_channel)
    }

    /// The broker closed a channel with `406 PRECONDITION_FAILED` (a message over its
    /// `max_message_size`, which may be lower than our
    /// [`max_payload_bytes`](crate::RabbitConfig::with_max_payload_bytes)) and
    /// took the unconfirmed messages of the batch with it. Only one of them is at fault:
    /// each is published again alone, on a channel of its own, before `deadline`; one
    /// whose channel is closed with 406 again is permanently rejected, the others get
    /// their own outcome. (One suspect alone is the culprit without a second try.)
    async fn isolate(
        &self,
        messages: &[OutboxMessage],
        suspects: Vec<usize>,
        results: &mut [Option<Result<(), PublishError>>],
        deadline: Instant,
    ) {
        let poison = |msg: &OutboxMessage| PublishError::Other {
            kind: ErrorKind::Permanent,
            message: format!(
                "the broker closed the channel with 406 PRECONDITION_FAILED for this message alone ({} bytes of payload): is it over the broker's max_message_size?",
                msg.payload.get().len()
            ),
            source: None,
        };
        if let [i] = suspects[..] {
            warn!(id = %messages[i].id, "RabbitMQ closed the channel for one message: it is rejected");
            results[i] = Some(Err(poison(&messages[i])));
            return;
        }
        warn!(
            suspects = suspects.len(),
            "RabbitMQ closed a channel with 406 PRECONDITION_FAILED: publishing its unconfirmed messages one at a time to find the one at fault"
        );
        for i in suspects {
            let mut alone = [None];
            let (_, again) = self
                .publish_on_channel(&messages[i..=i], &mut alone, Some(deadline))
                .await;
            results[i] = if again.is_empty() {
                alone[0].take()
            } else {
                warn!(id = %messages[i].id, "RabbitMQ closes the channel for this message alone: it is rejected");
                Some(Err(poison(&messages[i])))
            };
        }
    }
}

#[async_trait]
impl EventPublisher for RabbitPublisher {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let mut results: Vec<Option<Result<(), PublishError>>> =
            messages.iter().map(|_| None).collect();
        if !messages.is_empty() {
            let (deadline, suspects) = self.publish_on_channel(messages, &mut results, None).await;
            if !suspects.is_empty() {
                self.isolate(messages, suspects, &mut results, deadline)
                    .await;
            }
        }
        results
            .into_iter()
            .map(|result| {
                PublishOutcome::from_result(result.unwrap_or_else(|| {
                    Err(PublishError::Other {
                        kind: ErrorKind::Transient,
                        message: "no outcome was recorded for this message".to_owned(),
                        source: None,
                    })
                }))
            })
            .collect()
    }

    /// The first [`DestinationRule`](crate::DestinationRule) matching `routing_key`
    /// names its destination, else the routing key is its own
    /// ([`RabbitConfig::destination`]): a
    /// `basic.nack` names no queue.
    fn destination<'a>(&'a self, routing_key: &'a str) -> std::borrow::Cow<'a, str> {
        self.config().destination(routing_key)
    }

    /// The connect timeout plus the confirm timeout: a batch's connection and channel
    /// are (re)opened under the connect timeout (over however many nodes of a cluster
    /// are tried), then its messages are sent and their
    /// confirms awaited under one deadline of the confirm timeout (a 406 isolation
    /// included). Give the publisher at
    /// least as many [`channels`](crate::RabbitConfig::with_channels) as the
    /// dispatcher has concurrent publishes, or a batch may first wait for a channel.
    fn publish_timeout(&self) -> Option<std::time::Duration> {
        Some(self.config.connect_timeout() + self.config.confirm_timeout())
    }

    /// Connects if needed and succeeds only with a usable confirm-mode channel and an
    /// exchange to publish to: the exchange is declared again (or, with
    /// `declare_exchange = false`, checked), so an exchange deleted while the
    /// connection stayed up is noticed and, when we own it, recreated.
    async fn check_ready(&self) -> Result<(), PublishError> {
        // A connection that was up and is lost during the check (RabbitMQ closing it
        // with a hard error, e.g. for a frame of a channel dropped moments before after
        // a confirm timeout) is not the broker's state: one new connection is tried.
        match self.check_ready_once().await {
            (Err(_), true) => self.check_ready_once().await.0,
            (ready, _) => ready,
        }
    }
}

impl RabbitPublisher {
    /// One readiness check, and whether its connection, up when it began, was lost.
    async fn check_ready_once(&self) -> (Result<(), PublishError>, bool) {
        let session = match self.session().await {
            Ok(session) => session,
            Err(e) => return (Err(outage(&e)), false),
        };
        let was_connected = session.connection.status().connected();
        let mut slot = session.take_slot().await;
        let ready = match self.channel_in(&session, &mut slot).await {
            Ok(channel) if channel.status().confirm() => self
                .with_connect_timeout(declare_exchange(
                    &session.connection,
                    &self.config,
                    !self.config.declare_exchange(),
                ))
                .await
                .map_err(|e| outage(&e)),
            Ok(_) => Err(PublishError::ConfirmsNotEnabled),
            Err(e) => Err(outage(&e)),
        };
        drop(slot);
        let lost = ready.is_err() && was_connected && !session.connection.status().connected();
        self.forget_if_lost(&session).await;
        (ready, lost)
    }
}

/// What `basic.publish` needs for one message.
struct Prepared {
    routing_key: ShortString,
    properties: BasicProperties,
    /// Size of the content header frame, checked against the negotiated `frame_max`.
    header_frame_size: usize,
}

/// Why messages of a batch got no confirm.
enum Failure {
    Driver(lapin::Error),
    Timeout,
}

impl Failure {
    fn to_error(&self, config: &Resolved, session: &Session) -> PublishError {
        match self {
            Self::Driver(e) if is_precondition_failed(e) => PublishError::Other {
                kind: ErrorKind::Transient,
                message: format!(
                    "the broker closed the channel: {e} (is a message over the broker's max_message_size?)"
                ),
                source: Some(Box::new(e.clone())),
            },
            Self::Driver(e) => PublishError::unavailable(
                if session.connection.status().connected() {
                    format!("channel lost before the confirm arrived: {e}")
                } else {
                    format!(
                        "connection to {} lost before the confirm arrived: {e}",
                        config.url_redacted()
                    )
                },
                Some(Box::new(e.clone())),
            ),
            Self::Timeout if session.connection.status().blocked() => PublishError::unavailable(
                "the broker blocked the connection (resource alarm: memory or disk)",
                None,
            ),
            Self::Timeout => PublishError::Timeout(config.confirm_timeout()),
        }
    }
}

/// The per-message result of a publisher confirm.
fn confirmation_result(confirmation: Confirmation, exchange: &str) -> Result<(), PublishError> {
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(returned)) => Err(PublishError::Unroutable {
            exchange: if returned.delivery.exchange.as_str().is_empty() {
                exchange.to_owned()
            } else {
                returned.delivery.exchange.to_string()
            },
            routing_key: returned.delivery.routing_key.to_string(),
            reply_code: returned.reply_code,
            reply_text: returned.reply_text.to_string(),
        }),
        Confirmation::Nack(returned) => Err(PublishError::Rejected {
            reason: match returned {
                Some(r) => format!(
                    "basic.nack after basic.return {} {}",
                    r.reply_code, r.reply_text
                ),
                None => "basic.nack (the broker could not take responsibility for the message, e.g. a queue with overflow=reject-publish is full)".to_owned(),
            },
        }),
        Confirmation::NotRequested => Err(PublishError::ConfirmsNotEnabled),
    }
}

/// A broker-side failure before anything was sent: never the message's fault.
fn outage(error: &RabbitError) -> PublishError {
    PublishError::unavailable(error.to_string(), None)
}

fn short_string(value: &str, what: &str) -> Result<ShortString, PublishError> {
    if value.len() > MAX_SHORT_STRING {
        let shown: String = value.chars().take(40).collect();
        return Err(PublishError::Invalid(format!(
            "{what} {shown:?}... is {} bytes long, AMQP allows at most {MAX_SHORT_STRING}",
            value.len()
        )));
    }
    ShortString::try_new(value).map_err(|e| PublishError::Invalid(format!("{what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_strings_are_checked() {
        assert!(short_string(&"k".repeat(255), "routing key").is_ok());
        match short_string(&"k".repeat(256), "routing key") {
            Err(PublishError::Invalid(text)) => assert!(text.contains("256 bytes")),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn confirmations_map_to_outcomes() {
        assert!(confirmation_result(Confirmation::Ack(None), "x").is_ok());
        assert!(matches!(
            confirmation_result(Confirmation::Nack(None), "x"),
            Err(PublishError::Rejected { .. })
        ));
        assert!(matches!(
            confirmation_result(Confirmation::NotRequested, "x"),
            Err(PublishError::ConfirmsNotEnabled)
        ));
    }
}

/// Property tests: no panic is reachable from a row's content on the way to a
/// `basic.publish`; what cannot be published gets a typed, permanent error.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::config::DEFAULT_URL;
    use outboxkit_core::proptest_support::{any_time, config, payload, text};
    use outboxkit_core::{MAX_AGGREGATE_ID_LEN, MAX_NAME_LEN, MessageStatus};
    use proptest::prelude::*;
    use uuid::Uuid;

    /// Text of about `MAX_SHORT_STRING` bytes (250 to 260), ASCII or made of 2-, 3- or
    /// 4-byte chars, so that the limit falls on or inside a char.
    fn near_short_string_limit() -> impl Strategy<Value = String> {
        (
            prop::sample::select(vec!["k", "é", "日", "𝄞"]),
            250usize..=260,
        )
            .prop_map(|(c, bytes)| {
                let mut s = c.repeat(bytes / c.len());
                s.push_str(&"k".repeat(bytes % c.len()));
                s
            })
    }

    /// Header names of 0 to about 800 bytes of arbitrary unicode, around the 255-byte
    /// limit, and the names of our own attributes.
    fn header_name() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => text(40),
            2 => "[!-~]{1,20}",
            2 => near_short_string_limit(),
            1 => (0usize..400).prop_map(|n| "h".repeat(n)),
            1 => prop::collection::vec(any::<char>(), 60..200).prop_map(String::from_iter),
            1 => prop::sample::select(vec![
                "", "cloudEvents:id", "cloudEvents:type", "cloudEvents:aggregateversion",
                "cloudEvents:time", "correlationid", "causationid", "traceparent",
                "tracestate", "ce-id", "Nats-Msg-Id",
            ])
            .prop_map(str::to_owned),
        ]
    }

    fn header_value() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => text(60),
            1 => (0usize..3000).prop_map(|n| "v".repeat(n)),
        ]
    }

    /// Routing keys and event types: arbitrary text, around and over 255 bytes,
    /// multi-byte.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[A-Za-z0-9_.-]{1,30}",
            2 => text(30),
            2 => near_short_string_limit(),
            1 => text(300),
        ]
    }

    /// Aggregate types, tenants and partition keys: mostly short, some around and over
    /// the 255-byte limit consumers decode.
    fn name() -> impl Strategy<Value = String> {
        prop_oneof![6 => text(20), 1 => near_short_string_limit()]
    }

    /// Aggregate ids: mostly short, some around the 1,024-byte limit.
    fn aggregate_id() -> impl Strategy<Value = String> {
        prop_oneof![6 => text(20), 1 => (1020usize..1030).prop_map(|n| "a".repeat(n))]
    }

    /// A row with arbitrary content, and a payload limit with a payload a few bytes
    /// under, at or over it (or of any size that fits).
    fn message_and_limit() -> impl Strategy<Value = (OutboxMessage, usize)> {
        (
            (any::<u128>(), name(), aggregate_id(), any::<i64>(), key()),
            (
                prop::collection::btree_map(header_name(), header_value(), 0..8),
                prop::option::of(name()),
                prop::option::of(key()),
                prop::option::of(name()),
                any_time(),
            ),
            (
                1usize..512,
                prop_oneof![3 => (-3isize..=3).prop_map(Some), 1 => Just(None)],
                any::<prop::sample::Index>(),
            ),
        )
            .prop_map(
                |(
                    (id, aggregate_type, aggregate_id, aggregate_version, event_type),
                    (headers, tenant_id, routing_key, partition_key, occurred_at),
                    (max, delta, fitting),
                )| {
                    let size = delta
                        .map_or_else(|| fitting.index(max + 1), |d| max.saturating_add_signed(d));
                    let msg = OutboxMessage {
                        id: Uuid::from_u128(id),
                        seq: 1,
                        aggregate_type,
                        aggregate_id,
                        aggregate_version,
                        event_type,
                        payload: payload(size),
                        headers,
                        tenant_id,
                        routing_key,
                        partition_key,
                        occurred_at,
                        created_at: occurred_at,
                        visible_at: occurred_at,
                        attempts: 1,
                        status: MessageStatus::Processing,
                        last_error: None,
                        claim_token: None,
                        lease_until: None,
                        sent_at: None,
                    };
                    (msg, max)
                },
            )
    }

    fn publisher(max: usize, source: Option<String>) -> RabbitPublisher {
        RabbitPublisher::lazy(
            RabbitConfig::new(DEFAULT_URL)
                .with_max_payload_bytes(max)
                .with_source(source),
        )
        .expect("valid config")
    }

    /// The bytes of the content header frame lapin writes for `properties`: frame
    /// header (7), class id, weight, body size (12), properties, end octet (1).
    fn content_header_frame_len(properties: &BasicProperties) -> usize {
        let serialize = lapin::protocol::basic::gen_properties(properties);
        let written = serialize(From::from(Vec::new())).expect("serializable properties");
        7 + 12 + usize::try_from(written.position).expect("fits") + 1
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against `prepare` panicking on a row's content (lapin's
        /// `ShortString::from` panics over 255 bytes): arbitrary header names of 0 to
        /// 800 bytes and values, routing keys and event types around and over 255
        /// bytes, multi-byte chars, payloads around `max_payload_bytes`, any
        /// `occurred_at`. The verdict is exactly: payload over the limit →
        /// `PayloadTooLarge`, a routing key, event type, aggregate type, tenant,
        /// partition key or header name over 255 bytes or an aggregate id over 1,024 →
        /// `Invalid`, else `Ok`. An `Ok` carries the key and properties the module docs
        /// promise, its `header_frame_size` is the size of the frame lapin writes, and
        /// the consumer decodes it to the same id, type and version.
        #[test]
        fn prepare_never_panics(
            (msg, max) in message_and_limit(),
            source in prop::option::of("/[a-z]{1,10}"),
        ) {
            let publisher = publisher(max, source);
            let size = msg.payload.get().len();
            let too_long = msg.effective_routing_key().len() > MAX_SHORT_STRING
                || msg.event_type.len() > MAX_SHORT_STRING
                || msg.aggregate_type.len() > MAX_NAME_LEN
                || msg.aggregate_id.len() > MAX_AGGREGATE_ID_LEN
                || msg.tenant_id.as_ref().is_some_and(|t| t.len() > MAX_NAME_LEN)
                || msg.partition_key.as_ref().is_some_and(|k| k.len() > MAX_NAME_LEN)
                || msg.headers.keys().any(|name| name.len() > MAX_SHORT_STRING);
            match publisher.prepare(&msg) {
                Err(PublishError::PayloadTooLarge { size: got, max: limit }) => {
                    prop_assert_eq!((got, limit), (size, max));
                    prop_assert!(size > max);
                }
                Err(PublishError::Invalid(reason)) => {
                    prop_assert!(size <= max && too_long, "{}", reason);
                }
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
                Ok(prepared) => {
                    prop_assert!(size <= max && !too_long);
                    prop_assert_eq!(prepared.routing_key.as_str(), msg.effective_routing_key());
                    let properties = &prepared.properties;
                    prop_assert_eq!(
                        properties.kind().as_ref().map(ShortString::as_str),
                        Some(msg.event_type.as_str())
                    );
                    let id = msg.id.to_string();
                    prop_assert_eq!(
                        properties.message_id().as_ref().map(ShortString::as_str),
                        Some(id.as_str())
                    );
                    prop_assert_eq!(*properties.delivery_mode(), Some(PERSISTENT));
                    prop_assert_eq!(
                        prepared.header_frame_size,
                        content_header_frame_len(properties)
                    );
                    let decoded = crate::consumer::decode_delivery(
                        properties,
                        msg.payload.get().as_bytes().to_vec(),
                        false,
                    )
                    .map_err(|e| TestCaseError::fail(format!("prepared but undecodable: {e}")))?;
                    prop_assert_eq!(decoded.id, msg.id);
                    prop_assert_eq!(&decoded.event_type, &msg.event_type);
                    prop_assert_eq!(decoded.aggregate_version, Some(msg.aggregate_version));
                }
            }
        }
    }
}
