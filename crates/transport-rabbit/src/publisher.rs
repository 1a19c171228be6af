//! [`RabbitPublisher`]: the [`EventPublisher`] for RabbitMQ, with pipelined publisher
//! confirms and mandatory returns.
//!
//! # How a batch is published
//!
//! 1. Each message is checked before anything is sent: a payload over
//!    [`max_payload_bytes`](crate::RabbitConfigBuilder::with_max_payload_bytes) gets
//!    [`PublishError::PayloadTooLarge`], a routing key, event type or header name over
//!    the AMQP short-string limit of 255 bytes, or headers too large for one AMQP frame,
//!    get [`PublishError::Invalid`]. These are permanent and nothing is sent for them.
//! 2. The batch takes one of the connection's confirm-mode channels (AMQP 0-9-1
//!    `confirm.select`, RabbitMQ [publisher confirms]) for itself and sends every
//!    message with `basic.publish` (`mandatory`, persistent, see below) without waiting
//!    for anything in between.
//! 3. Then all confirms are awaited together, under one deadline of
//!    [`confirm_timeout`](crate::RabbitConfigBuilder::with_confirm_timeout) counted from
//!    the first publish.
//!
//! Each message gets exactly one [`PublishOutcome`], in input order:
//!
//! | broker or driver says                           | outcome                                    |
//! |-------------------------------------------------|--------------------------------------------|
//! | `basic.ack`                                     | `Published`                                |
//! | `basic.return` then `basic.ack` (mandatory, no queue bound) | `Permanent(Unroutable)`        |
//! | `basic.nack`                                    | `Transient(Rejected)`                      |
//! | no confirm requested (confirm mode off)         | `Permanent(ConfirmsNotEnabled)`            |
//! | connection or channel lost, broker unreachable  | `Transient(Unavailable)`: circuit opens    |
//! | connection blocked by a broker resource alarm   | `Transient(Unavailable)`: circuit opens    |
//! | channel closed with `406 PRECONDITION_FAILED` (over the broker's `max_message_size`) | `Transient(Other)` |
//! | no confirm within the deadline                  | `Transient(Timeout)`                       |
//!
//! # Wire format
//!
//! Properties: `message_id` = outbox id, `content_type` = `application/json`,
//! `delivery_mode` = 2 (persistent), `timestamp` = `occurred_at` (Unix seconds), `type`
//! = event type. Headers: [`outbox_core::wire::encode_headers`] with the AMQP binding
//! (`cloudEvents:*` attributes, `traceparent`/`tracestate`, pass-through headers), all
//! as AMQP long strings; when a pass-through header has the name of a CloudEvents
//! attribute, the attribute wins. Routing key: [`OutboxMessage::effective_routing_key`].
//!
//! # Connection handling
//!
//! One connection, [`channels`](crate::RabbitConfigBuilder::with_channels) channels. A
//! lost connection is dropped and re-established by the next `publish_batch` or
//! [`check_ready`](EventPublisher::check_ready) call, with
//! [`connect_timeout`](crate::RabbitConfigBuilder::with_connect_timeout); while the
//! broker cannot be reached every message gets `Unavailable`, which makes the
//! dispatcher open its circuit, hand the messages back without charging an attempt and
//! probe with `check_ready` until the broker is back.
//!
//! [publisher confirms]: https://www.rabbitmq.com/docs/confirms#publisher-confirms

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use async_trait::async_trait;
use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    PublisherConfirm,
};
use outbox_core::wire::{Binding, CONTENT_TYPE_JSON, encode_headers};
use outbox_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::sync::{Mutex, MutexGuard};
use tokio::time::{Instant, timeout, timeout_at};
use tracing::{debug, info, warn};

use crate::config::RabbitConfig;
use crate::error::{RabbitError, is_precondition_failed};

/// AMQP 0-9-1 `delivery-mode` of a persistent message.
const PERSISTENT: u8 = 2;
/// Largest AMQP short string (routing key, header name, `type`), in bytes.
const MAX_SHORT_STRING: usize = 255;

/// Publishes outbox messages to a RabbitMQ topic exchange and waits for publisher
/// confirms. See the [module docs](self) for the outcome of each broker answer.
///
/// Cheap to share: wrap it in an [`Arc`] or hand it to the
/// [`Dispatcher`](outbox_core::Dispatcher) directly. Concurrent
/// [`publish_batch`](EventPublisher::publish_batch) calls use different channels of the
/// one connection.
#[derive(Debug)]
pub struct RabbitPublisher {
    config: RabbitConfig,
    session: Mutex<Option<Arc<Session>>>,
}

/// One connection and its publisher channels.
#[derive(Debug)]
struct Session {
    connection: Connection,
    /// Confirm-mode channels; `None` until (re)opened. A batch holds its slot's lock for
    /// its whole duration, so confirms of one batch never mix with another's.
    slots: Vec<Mutex<Option<Channel>>>,
    next_slot: AtomicUsize,
}

impl RabbitPublisher {
    /// A publisher that connects lazily, on the first
    /// [`publish_batch`](EventPublisher::publish_batch) or
    /// [`check_ready`](EventPublisher::check_ready). Use this when the relay must start
    /// even while the broker is down.
    pub fn new(config: RabbitConfig) -> Self {
        Self {
            config,
            session: Mutex::new(None),
        }
    }

    /// Connects at once: opens the connection and its confirm-mode channels and
    /// declares (or, with `declare_exchange = false`, checks) the exchange.
    ///
    /// # Errors
    /// [`RabbitError::Connect`] when the broker refuses or cannot be reached (bad
    /// credentials are [`ErrorKind::Permanent`], an unreachable broker
    /// [`ErrorKind::Unavailable`]), [`RabbitError::ConnectTimeout`] after the connect
    /// timeout, [`RabbitError::Channel`] or [`RabbitError::Declare`] when the channels or
    /// the exchange cannot be set up.
    pub async fn connect(config: RabbitConfig) -> Result<Self, RabbitError> {
        let publisher = Self::new(config);
        publisher.session().await?;
        Ok(publisher)
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitConfig {
        &self.config
    }

    /// Declares the configured exchange (durable, type `topic`) now, whatever
    /// [`with_declare_exchange`](crate::RabbitConfigBuilder::with_declare_exchange)
    /// says. Idempotent.
    ///
    /// # Errors
    /// A connection error as for [`connect`](Self::connect), or
    /// [`RabbitError::Declare`] (e.g. `406 PRECONDITION_FAILED` when an exchange of that
    /// name exists with another type or durability).
    pub async fn declare_exchange(&self) -> Result<(), RabbitError> {
        let current = self
            .session
            .lock()
            .await
            .as_ref()
            .filter(|s| s.connection.status().connected())
            .map(Arc::clone);
        // Without a session, use a connection of its own: opening a session checks the
        // exchange and would fail for the very exchange we are about to declare.
        let declared = self
            .with_connect_timeout(async {
                match &current {
                    Some(session) => {
                        declare_exchange(&session.connection, &self.config, false).await
                    }
                    None => {
                        let connection = open_connection(&self.config).await?;
                        let declared = declare_exchange(&connection, &self.config, false).await;
                        let _ = connection.close(200, "OK".into()).await;
                        declared
                    }
                }
            })
            .await;
        if let Some(session) = &current {
            self.forget_if_lost(session).await;
        }
        declared
    }

    /// Runs `fut` under the connect timeout.
    async fn with_connect_timeout<T>(
        &self,
        fut: impl Future<Output = Result<T, RabbitError>>,
    ) -> Result<T, RabbitError> {
        timeout(self.config.connect_timeout(), fut)
            .await
            .unwrap_or_else(|_| {
                Err(RabbitError::ConnectTimeout {
                    url_redacted: self.config.url_redacted().to_owned(),
                    timeout: self.config.connect_timeout(),
                })
            })
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

    /// The current session, connecting when there is none or it was lost. Concurrent
    /// callers wait for one connection attempt instead of starting their own.
    async fn session(&self) -> Result<Arc<Session>, RabbitError> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref() {
            if session.connection.status().connected() {
                return Ok(Arc::clone(session));
            }
            warn!(url = %self.config.url_redacted(), "RabbitMQ connection lost, reconnecting");
            *current = None;
        }
        let session = Arc::new(
            self.with_connect_timeout(Session::open(&self.config))
                .await?,
        );
        info!(
            url = %self.config.url_redacted(),
            exchange = %self.config.exchange(),
            channels = self.config.channels(),
            "connected to RabbitMQ"
        );
        *current = Some(Arc::clone(&session));
        Ok(session)
    }

    /// Drops `session` if its connection is gone, so the next call reconnects. A newer
    /// session installed meanwhile by another call is left alone.
    async fn forget_if_lost(&self, session: &Arc<Session>) {
        if session.connection.status().connected() {
            return;
        }
        let mut current = self.session.lock().await;
        if current.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *current = None;
        }
    }

    /// A usable confirm channel in `slot`, (re)opening it when needed.
    async fn channel_in(
        &self,
        session: &Session,
        slot: &mut MutexGuard<'_, Option<Channel>>,
    ) -> Result<Channel, RabbitError> {
        if let Some(channel) = slot.as_ref()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        **slot = None;
        let channel = self
            .with_connect_timeout(open_confirm_channel(&session.connection))
            .await?;
        **slot = Some(channel.clone());
        Ok(channel)
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

    /// Publishes the batch on one channel, then awaits its confirms together. Fills
    /// `results` for every message.
    async fn publish_on_channel(
        &self,
        messages: &[OutboxMessage],
        results: &mut [Option<Result<(), PublishError>>],
    ) {
        let session = match self.session().await {
            Ok(session) => session,
            Err(e) => {
                warn!(error = %e, messages = messages.len(), "RabbitMQ unavailable, batch not published");
                self.not_published(messages, &e, results);
                return;
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
                return;
            }
        };

        let frame_max =
            usize::try_from(session.connection.configuration().frame_max()).unwrap_or(usize::MAX);
        let exchange = ShortString::from(self.config.exchange());
        let deadline = Instant::now() + self.config.confirm_timeout();
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
        for (i, outcome) in sent {
            match outcome {
                Ok(Ok(confirm)) => pending.push((i, confirm)),
                Ok(Err(e)) => {
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
    }
}

#[async_trait]
impl EventPublisher for RabbitPublisher {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let mut results: Vec<Option<Result<(), PublishError>>> =
            messages.iter().map(|_| None).collect();
        if !messages.is_empty() {
            self.publish_on_channel(messages, &mut results).await;
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

    /// Connects if needed and succeeds only with a usable confirm-mode channel and an
    /// exchange to publish to: the exchange is declared again (or, with
    /// `declare_exchange = false`, checked), so an exchange deleted while the
    /// connection stayed up is noticed and, when we own it, recreated.
    async fn check_ready(&self) -> Result<(), PublishError> {
        let session = self.session().await.map_err(|e| outage(&e))?;
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
        self.forget_if_lost(&session).await;
        ready
    }
}

impl Session {
    async fn open(config: &RabbitConfig) -> Result<Self, RabbitError> {
        let connection = open_connection(config).await?;
        declare_exchange(&connection, config, !config.declare_exchange()).await?;
        let mut slots = Vec::with_capacity(config.channels());
        for _ in 0..config.channels() {
            slots.push(Mutex::new(Some(open_confirm_channel(&connection).await?)));
        }
        Ok(Self {
            connection,
            slots,
            next_slot: AtomicUsize::new(0),
        })
    }

    /// A free slot if there is one, else the next one in turn (waiting for it).
    async fn take_slot(&self) -> MutexGuard<'_, Option<Channel>> {
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let n = self.slots.len();
        for k in 0..n {
            if let Ok(guard) = self.slots[(start + k) % n].try_lock() {
                return guard;
            }
        }
        self.slots[start % n].lock().await
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
    fn to_error(&self, config: &RabbitConfig, session: &Session) -> PublishError {
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

/// Opens a connection named after the configuration, without a timeout of its own.
pub(crate) async fn open_connection(config: &RabbitConfig) -> Result<Connection, RabbitError> {
    let mut uri = config.uri().clone();
    if uri.query.connection_timeout.is_none() {
        // Bounds the TCP connect inside the driver too (milliseconds).
        uri.query.connection_timeout =
            Some(u64::try_from(config.connect_timeout().as_millis()).unwrap_or(u64::MAX));
    }
    let properties = ConnectionProperties::default()
        .with_connection_name(LongString::from(config.connection_name()));
    Connection::connect_uri(uri, properties)
        .await
        .map_err(|source| RabbitError::Connect {
            url_redacted: config.url_redacted().to_owned(),
            source: Box::new(source),
        })
}

/// Opens a channel in confirm mode.
async fn open_confirm_channel(connection: &Connection) -> Result<Channel, RabbitError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "channel.open",
            source: Box::new(source),
        })?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "confirm.select",
            source: Box::new(source),
        })?;
    Ok(channel)
}

/// Declares the exchange (durable topic) or, when `passive`, checks that it exists, on
/// a short-lived channel (a failed declare closes its channel).
pub(crate) async fn declare_exchange(
    connection: &Connection,
    config: &RabbitConfig,
    passive: bool,
) -> Result<(), RabbitError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "channel.open",
            source: Box::new(source),
        })?;
    let declared = channel
        .exchange_declare(
            ShortString::from(config.exchange()),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive,
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|source| RabbitError::Declare {
            operation: "exchange.declare",
            name: config.exchange().to_owned(),
            source: Box::new(source),
        });
    if declared.is_ok() {
        // Best effort: the channel is closed on drop anyway.
        let _ = channel.close(200, "OK".into()).await;
    }
    declared
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
