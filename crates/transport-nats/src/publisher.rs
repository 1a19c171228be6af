//! [`NatsPublisher`]: the [`EventPublisher`] for NATS JetStream, with pipelined PubAcks and
//! server-side deduplication by `Nats-Msg-Id`.
//!
//! # How a batch is published
//!
//! 1. Each message is checked before anything is sent: its subject
//!    (`{prefix}.{routing key or event type}`) must be a valid NATS publish subject
//!    (non-empty tokens separated by `.`, no whitespace, no `*` or `>`, not starting
//!    with `$`), its headers must be expressible as NATS headers, and payload plus
//!    headers must fit the server's `max_payload` (from its `INFO`; 1 MiB by default) or
//!    the configured lower limit. A message that fails gets [`PublishError::Invalid`] or
//!    [`PublishError::PayloadTooLarge`] (both permanent: the dispatcher dead-letters it
//!    at once) and is not sent.
//! 2. When the client is not connected (it reconnects by itself in the background),
//!    every message gets [`PublishError::Unavailable`] without being sent: the
//!    dispatcher opens its circuit and probes with [`check_ready`](EventPublisher::check_ready).
//! 3. The messages are published one after another without waiting ([JetStream
//!    publish]: a request whose reply is the PubAck), up to
//!    [`max_in_flight`](crate::NatsConfig::with_max_in_flight) awaiting their
//!    PubAck at once across all batches of the publisher; when the window is full the
//!    next message goes out as soon as an earlier one is acknowledged.
//! 4. All PubAcks are awaited under one deadline of
//!    [`confirm_timeout`](crate::NatsConfig::with_confirm_timeout) counted from the
//!    start of the batch.
//!
//! Each message gets exactly one [`PublishOutcome`], in input order:
//!
//! | server or client says                                   | outcome                                  |
//! |---------------------------------------------------------|------------------------------------------|
//! | PubAck                                                  | `Published`                              |
//! | PubAck with `duplicate: true` (same `Nats-Msg-Id` inside the stream's duplicate window) | `Published` (stored once, earlier) |
//! | no responders, and no stream captures the subject       | `Permanent(Unroutable)`                  |
//! | no responders, but a stream captures the subject now    | `Transient(Rejected)`: its destination's circuit opens |
//! | JetStream API does not answer, not connected, connection lost | `Transient(Unavailable)`: circuit opens |
//! | JetStream error `10054` (over the stream's `max_msg_size`), or over the server's `max_payload` | `Permanent(Other)` |
//! | JetStream error `10077` (store failed: stream full with `discard: new`), `10047`, `10023` (out of storage) | `Transient(Rejected)`: its destination's circuit opens, the other subjects flow |
//! | other JetStream error (e.g. no leader) | `Transient(Rejected)`: its destination's circuit opens |
//! | no PubAck within the deadline (a slow or frozen server, or the window stayed full) | `Transient(Timeout)`: an outage, circuit opens |
//! | no PubAck within the deadline, connection lost meanwhile | `Transient(Unavailable)`: circuit opens |
//!
//! A refusal's destination is the stream that refused
//! ([`EventPublisher::destination`]:
//! `stream NAME`): after a refusal the publisher looks up the stream that captures the
//! subject and its subject filters, so every subject of one full stream shares one
//! circuit of the relay.
//!
//! Only a verdict about one message (its subject, headers or size, or no stream for its
//! subject) is permanent; whatever says the server cannot take messages now is an
//! outage ([`ErrorKind::Unavailable`]), which charges no attempt.
//!
//! "No responders" (status `503`) is the server's answer to a publish on a subject that
//! no stream captures. It is a configuration error, like RabbitMQ's unroutable
//! `mandatory` return, so it dead-letters the message, but only after the publisher
//! asked JetStream which stream captures the subject (`$JS.API.STREAM.NAMES` with a
//! subject filter): when JetStream does not answer it is an outage, and when a stream
//! appeared meanwhile it is retried. Create the stream before the relay publishes
//! ([`StreamSetup`]).
//!
//! # Deduplication and durability
//!
//! `Nats-Msg-Id` is the outbox id, so a message published again inside the stream's
//! [duplicate window] (a relay that crashed after publishing and before recording the
//! result republishes after its lease, 30 s by default; or a publish whose PubAck was
//! lost) is acknowledged with `duplicate: true` and stored once. Outside the window the
//! consumer's inbox absorbs the duplicate. A PubAck means the stream stored the message
//! (on a cluster: a quorum of replicas); see [`StreamSetup`] for
//! when that is on disk.
//!
//! A publish that was handed to the client while the connection was down is sent when
//! it comes back, even though this batch reported it `Unavailable`; the republish that
//! follows is then dropped by the duplicate window.
//!
//! # Wire format
//!
//! Binary content mode of the CloudEvents NATS protocol binding (NATS headers, since
//! server 2.2): [`outboxkit_core::wire::encode_headers`] with [`Binding::Nats`] (`ce-id`,
//! `ce-type`, `ce-source`, `ce-subject`, `ce-time`, the extensions, `traceparent` /
//! `tracestate` unprefixed, pass-through headers), `Content-Type: application/json`,
//! and `Nats-Msg-Id` = outbox id. When a pass-through header has the name of a
//! CloudEvents attribute or `Content-Type`, ours wins; a pass-through header named
//! `Nats-*` (JetStream's control headers, e.g. `Nats-Expected-Stream`) makes the message
//! [`PublishError::Invalid`].
//!
//! [JetStream publish]: https://docs.nats.io/nats-concepts/jetstream/js_walkthrough
//! [duplicate window]: https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::future::IntoFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outboxkit_core::wire::{Binding, CONTENT_TYPE_JSON, check_limits, encode_headers};
use outboxkit_core::{ErrorKind, EventPublisher, OutboxMessage, PublishError, PublishOutcome};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until, timeout, timeout_at};
use tracing::{debug, info, warn};

use crate::config::{NatsConfig, subject_problem};
use crate::connection::{connect_with, jetstream_ready};
use crate::destinations::{LOOKUPS_PER_BATCH, Refusers};
use crate::error::{NatsError, jetstream_error};
use crate::topology::{StreamInfo, StreamSetup};

/// The NATS header carrying the message id JetStream deduplicates on.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// The header carrying the payload's media type.
pub const CONTENT_TYPE_HEADER: &str = "Content-Type";

/// Publishes outbox messages to NATS JetStream and waits for their PubAcks. See the
/// [module docs](self) for the outcome of each server answer.
///
/// Cheap to share: wrap it in an [`Arc`] or hand it to the
/// [`Dispatcher`](outboxkit_core::Dispatcher) directly; concurrent
/// [`publish_batch`](EventPublisher::publish_batch) calls share one connection and one
/// in-flight window. The client reconnects by itself (unlimited attempts, backoff up to
/// 4 s); while it is disconnected batches report `Unavailable`.
#[derive(Debug)]
pub struct NatsPublisher {
    config: NatsConfig,
    client: async_nats::Client,
    jetstream: jetstream::Context,
    in_flight: Arc<Semaphore>,
    /// Incremented on every `Disconnected` event of the client.
    disconnects: Arc<AtomicU64>,
    /// The streams that refused publishes: the destinations of their subjects.
    refusers: Refusers,
}

impl NatsPublisher {
    /// Connects at once and, when the configuration names a
    /// [stream](crate::NatsConfig::with_stream), creates it if it does not
    /// exist. An existing stream is left as it is (its replicas, retention and limits
    /// may be an operator's: a publisher with default settings must not scale a
    /// replicated stream down); [`ensure_stream`](Self::ensure_stream) updates one to a
    /// setup.
    ///
    /// # Errors
    /// [`NatsError::Connect`] when the server refuses or cannot be reached (an
    /// authorization violation is [`ErrorKind::Permanent`], an unreachable server
    /// [`ErrorKind::Unavailable`]), [`NatsError::Timeout`] after the connect timeout;
    /// [`NatsError::Stream`] when the server refuses to create the stream (subjects
    /// overlapping another stream's: permanent) or JetStream does not answer.
    /// [`NatsError::InvalidUrl`] or [`NatsError::InvalidConfig`] when `config` is invalid
    /// ([`NatsConfig::validate`]), before any connection is tried.
    pub async fn connect(config: NatsConfig) -> Result<Self, NatsError> {
        let publisher = Self::open(config, false).await?;
        if let Some(setup) = publisher.config.stream() {
            setup
                .get_or_create(&publisher.jetstream, publisher.config.connect_timeout())
                .await?;
        }
        Ok(publisher)
    }

    /// A publisher that connects in the background and keeps trying until it succeeds:
    /// use it when the relay must start while the server is down. Until the first
    /// connection, batches report `Unavailable` and `check_ready` fails. The same call
    /// as `RabbitPublisher::connect_lazy`. A configured
    /// [stream](crate::NatsConfig::with_stream) is created by the first readiness
    /// check that reaches the server (the relay makes one before its first claim), with
    /// an existing stream's settings left as they are.
    ///
    /// # Errors
    /// [`NatsError::InvalidUrl`] or [`NatsError::InvalidConfig`] when `config` is invalid
    /// ([`NatsConfig::validate`]), before anything else. (With
    /// `retry_on_initial_connect` the client only builds its server pool here, which
    /// fails for an empty list or a mix of WebSocket and plain URLs: a valid
    /// configuration admits neither.)
    pub async fn connect_lazy(config: NatsConfig) -> Result<Self, NatsError> {
        Self::open(config, true).await
    }

    async fn open(config: NatsConfig, lazy: bool) -> Result<Self, NatsError> {
        config.validate()?;
        let disconnects = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&disconnects);
        let url = config.url_redacted();
        let mut options = config.connect_options().event_callback(move |event| {
            let counter = Arc::clone(&counter);
            let url = url.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        counter.fetch_add(1, Ordering::AcqRel);
                        warn!(url = %url, "NATS connection lost, reconnecting");
                    }
                    async_nats::Event::Connected => info!(url = %url, "connected to NATS"),
                    other => debug!(url = %url, event = %other, "NATS client event"),
                }
            }
        });
        if lazy {
            options = options.retry_on_initial_connect();
        }
        let client = connect_with(&config, options).await?;
        // Our window bounds what is in flight; the context's own limit only has to be
        // larger so that it never blocks (its permits are released as acks resolve).
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(config.confirm_timeout())
            .max_ack_inflight(config.max_in_flight() + 16)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Self {
            in_flight: Arc::new(Semaphore::new(config.max_in_flight())),
            config,
            client,
            jetstream,
            disconnects,
            refusers: Refusers::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &NatsConfig {
        &self.config
    }

    /// The underlying client (shared connection), e.g. for a consumer in the same
    /// process.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context the publisher uses.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.jetstream
    }

    /// Creates the stream `setup` describes, or updates it to match, over the
    /// publisher's connection.
    ///
    /// # Errors
    /// As [`StreamSetup::apply_with`].
    pub async fn ensure_stream(&self, setup: &StreamSetup) -> Result<StreamInfo, NatsError> {
        setup
            .apply_with(&self.jetstream, self.config.connect_timeout())
            .await
    }

    /// Flushes what the client still buffers and closes the connection (draining it).
    /// Publishing after this reports `Unavailable`.
    pub async fn close(&self) {
        let flushed = timeout(self.config.connect_timeout(), self.client.flush()).await;
        if !matches!(flushed, Ok(Ok(()))) {
            debug!("flushing the NATS connection before closing failed");
        }
        if let Ok(Err(e)) = timeout(self.config.connect_timeout(), self.client.drain()).await {
            debug!(error = %e, "draining the NATS connection failed");
        }
    }

    /// The largest payload plus headers, in bytes, the publisher sends now.
    pub fn max_message_bytes(&self) -> usize {
        let server = self.client.max_payload();
        self.config.max_payload_bytes().min(server)
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    /// Checks one message and turns it into what a JetStream publish needs: see
    /// [`prepare`].
    fn prepare(&self, msg: &OutboxMessage, max: usize) -> Result<Prepared, PublishError> {
        prepare(&self.config, msg, max)
    }

    /// Publishes the prepared messages with a bounded window, then awaits every PubAck.
    /// Fills `results` for every index in `prepared`.
    async fn publish_prepared(
        &self,
        prepared: Vec<(usize, Prepared)>,
        results: &mut [Option<Result<(), PublishError>>],
    ) {
        if !self.connected() {
            let reason = format!(
                "not connected to NATS at {} (the client is reconnecting)",
                self.config.url_redacted()
            );
            for (i, _) in &prepared {
                results[*i] = Some(Err(PublishError::unavailable(reason.clone(), None)));
            }
            return;
        }
        let epoch = self.disconnects.load(Ordering::Acquire);
        let deadline = Instant::now() + self.config.confirm_timeout();
        let mut subjects: HashMap<usize, String> = HashMap::new();
        let mut failures: Vec<(usize, Failure)> = Vec::new();
        let mut pending = FuturesUnordered::new();
        let mut duplicates = 0usize;
        let mut acked = 0usize;
        let mut record = |i: usize,
                          result: Result<PublishAck, Failure>,
                          results: &mut [Option<Result<(), PublishError>>],
                          failures: &mut Vec<(usize, Failure)>| {
            match result {
                Ok(ack) => {
                    acked += 1;
                    duplicates += usize::from(ack.duplicate);
                    results[i] = Some(Ok(()));
                }
                Err(failure) => failures.push((i, failure)),
            }
        };

        for (
            i,
            Prepared {
                subject,
                headers,
                payload,
            },
        ) in prepared
        {
            let message = PublishMessage::build().payload(payload).headers(headers);
            // A free slot of the window, driving our own pending acks while we wait so
            // their permits come back.
            let permit: Option<OwnedSemaphorePermit> = loop {
                if let Ok(permit) = Arc::clone(&self.in_flight).try_acquire_owned() {
                    break Some(permit);
                }
                tokio::select! {
                    biased;
                    Some((j, result)) = pending.next(), if !pending.is_empty() => {
                        record(j, result, results, &mut failures);
                    }
                    permit = Arc::clone(&self.in_flight).acquire_owned() => break permit.ok(),
                    () = sleep_until(deadline) => break None,
                }
            };
            let Some(permit) = permit else {
                failures.push((i, Failure::Timeout));
                continue;
            };
            match timeout_at(
                deadline,
                self.jetstream.send_publish(subject.clone(), message),
            )
            .await
            {
                Ok(Ok(ack)) => {
                    subjects.insert(i, subject);
                    pending.push(async move {
                        let result = match timeout_at(deadline, ack.into_future()).await {
                            Ok(Ok(ack)) => Ok(ack),
                            Ok(Err(e)) => Err(Failure::Publish(e)),
                            Err(_) => Err(Failure::Timeout),
                        };
                        drop(permit);
                        (i, result)
                    });
                }
                Ok(Err(e)) => {
                    subjects.insert(i, subject);
                    failures.push((i, Failure::Publish(e)));
                }
                Err(_) => failures.push((i, Failure::Timeout)),
            }
        }
        while let Some((j, result)) = pending.next().await {
            record(j, result, results, &mut failures);
        }

        if failures.is_empty() {
            if duplicates > 0 {
                debug!(
                    acked,
                    duplicates, "JetStream batch acknowledged (duplicates dropped by the stream)"
                );
            } else {
                debug!(acked, "JetStream batch acknowledged");
            }
            return;
        }
        let connection_lost =
            !self.connected() || self.disconnects.load(Ordering::Acquire) != epoch;
        let mut no_stream: HashMap<String, Vec<usize>> = HashMap::new();
        let mut refused: HashSet<String> = HashSet::new();
        let failed = failures.len();
        for (i, failure) in failures {
            match failure.into_error(&self.config, connection_lost) {
                Mapped::Done(error) => {
                    if matches!(error, PublishError::Rejected { .. })
                        && let Some(subject) = subjects.get(&i)
                    {
                        refused.insert(subject.clone());
                    }
                    results[i] = Some(Err(error));
                }
                Mapped::NoResponders => no_stream
                    .entry(subjects.remove(&i).unwrap_or_default())
                    .or_default()
                    .push(i),
            }
        }
        // Every lookup ends by the batch's deadline plus one connect timeout (the
        // publisher's publish timeout).
        let lookups_end = deadline + self.config.connect_timeout();
        for (subject, indices) in no_stream {
            let error = self.no_responders(&subject, lookups_end).await;
            for i in indices {
                results[i] = Some(Err(error.clone_as_error()));
            }
        }
        self.learn_refusers(refused, lookups_end).await;
        warn!(
            acked,
            failed,
            connection_lost,
            connected = self.connected(),
            "JetStream batch incomplete"
        );
    }

    /// Learns which streams refused publishes on `subjects` (see `destinations`): at
    /// most [`LOOKUPS_PER_BATCH`] lookups, each ending by `end`. A lookup that fails
    /// leaves the subject its own destination until its next refusal.
    async fn learn_refusers(&self, subjects: HashSet<String>, end: Instant) {
        let mut lookups = 0;
        for subject in subjects {
            if lookups == LOOKUPS_PER_BATCH {
                break;
            }
            if !self.refusers.needs_lookup(&subject) {
                continue;
            }
            lookups += 1;
            let lookup = async {
                let name = self.jetstream.stream_by_subject(subject.clone()).await?;
                let stream = self.jetstream.get_stream(&name).await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                    name,
                    stream.cached_info().config.subjects.clone(),
                ))
            };
            match timeout_at(
                end.min(Instant::now() + self.config.connect_timeout()),
                lookup,
            )
            .await
            {
                Ok(Ok((name, filters))) => {
                    debug!(%subject, stream = %name, ?filters, "a stream refused a publish: its subjects share one destination circuit");
                    self.refusers.learned(&name, filters);
                }
                Ok(Err(e)) => {
                    debug!(%subject, error = %e, "which stream refused a publish is unknown: the subject stays its own destination");
                }
                Err(_) => {
                    debug!(%subject, "which stream refused a publish is unknown (lookup timed out): the subject stays its own destination");
                }
            }
        }
    }

    /// Decides what a "no responders" answer to a publish on `subject` means by asking
    /// JetStream which stream captures the subject.
    async fn no_responders(&self, subject: &str, end: Instant) -> Cloneable {
        let lookup = timeout_at(
            end.min(Instant::now() + self.config.connect_timeout()),
            self.jetstream.stream_by_subject(subject),
        )
        .await;
        match lookup {
            Ok(Err(e)) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                Cloneable::Unroutable {
                    subject: subject.to_owned(),
                }
            }
            Ok(Ok(stream)) => Cloneable::Rejected(format!(
                "no responders for subject {subject:?} although stream {stream:?} captures it now (the stream was being created, restored or moved)"
            )),
            Ok(Err(e)) => Cloneable::Unavailable(format!(
                "no responders for subject {subject:?} and the JetStream API did not answer the stream lookup: {e}"
            )),
            Err(_) => Cloneable::Unavailable(format!(
                "no responders for subject {subject:?} and the JetStream API did not answer the stream lookup within {:?}",
                self.config.connect_timeout()
            )),
        }
    }
}

#[async_trait]
impl EventPublisher for NatsPublisher {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let mut results: Vec<Option<Result<(), PublishError>>> =
            messages.iter().map(|_| None).collect();
        let max = self.max_message_bytes();
        let mut prepared = Vec::with_capacity(messages.len());
        for (i, msg) in messages.iter().enumerate() {
            match self.prepare(msg, max) {
                Ok(p) => prepared.push((i, p)),
                Err(e) => {
                    warn!(id = %msg.id, event_type = %msg.event_type, error = %e, "message cannot be published");
                    results[i] = Some(Err(e));
                }
            }
        }
        if !prepared.is_empty() {
            self.publish_prepared(prepared, &mut results).await;
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

    /// The ack timeout plus the connect timeout: a batch's PubAcks are awaited under one
    /// deadline of the ack timeout, and a "no responders" answer may add one stream
    /// lookup bounded by the connect timeout.
    fn publish_timeout(&self) -> Option<Duration> {
        Some(self.config.confirm_timeout() + self.config.connect_timeout())
    }

    /// The stream that refused a publish on the subject of `routing_key`, as
    /// `stream NAME`, so that one full stream is one circuit however many subjects it
    /// captures; else the routing key. A JetStream refusal does not name its stream:
    /// after one, the publisher looks the stream and its subject filters up (at most
    /// four lookups per batch, each bounded by the connect timeout, remembered for up
    /// to 256 streams and looked up again when the stream refuses a minute later).
    fn destination<'a>(&'a self, routing_key: &'a str) -> Cow<'a, str> {
        crate::destinations::destination(&self.refusers, routing_key, |k| {
            self.config.subject_for(k)
        })
    }

    /// Succeeds only when the client is connected and the JetStream API answers an
    /// account info request (`$JS.API.INFO`) within the connect timeout without an
    /// error; otherwise `Unavailable`.
    async fn check_ready(&self) -> Result<(), PublishError> {
        if !self.connected() {
            return Err(PublishError::unavailable(
                format!(
                    "not connected to NATS at {} (the client is reconnecting)",
                    self.config.url_redacted()
                ),
                None,
            ));
        }
        jetstream_ready(&self.client, self.config.connect_timeout())
            .await
            .map_err(|reason| PublishError::unavailable(reason, None))?;
        // The configured stream, created again if it was deleted (as the RabbitMQ
        // publisher declares its exchange on every check); an existing one is left
        // as it is. A refusal is an outage of the whole publisher: nothing it
        // publishes could be stored without the stream.
        if let Some(setup) = self.config.stream() {
            setup
                .get_or_create(&self.jetstream, self.config.connect_timeout())
                .await
                .map_err(|e| PublishError::unavailable(e.to_string(), None))?;
        }
        Ok(())
    }
}

/// Checks one message and turns it into what a JetStream publish needs (subject,
/// headers, payload), inside a debug-level `outbox.publish_message` span with the
/// message's id, event type, tenant, aggregate, version and attempts (never the
/// payload). `max` is the largest payload plus headers, in bytes, to accept.
///
/// A free function of the configuration so that it can be exercised without a server.
fn prepare(config: &NatsConfig, msg: &OutboxMessage, max: usize) -> Result<Prepared, PublishError> {
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
    let subject = config.subject_for(msg.effective_routing_key());
    if let Some(problem) = subject_problem(&subject) {
        return Err(PublishError::Invalid(format!(
            "not a valid NATS publish subject (prefix {:?} + routing key or event type): {problem}",
            config.subject_prefix()
        )));
    }
    // What a consumer would refuse to decode is refused here, at the source.
    check_limits(msg).map_err(|e| PublishError::Invalid(e.to_string()))?;
    let mut headers = HeaderMap::new();
    let mut names: Vec<String> = Vec::with_capacity(12 + msg.headers.len());
    let mut push = |headers: &mut HeaderMap, name: &str, value: &str| {
        if names.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            // encode_headers lists the CloudEvents attributes first: a pass-through
            // header must not overwrite the id, type, ... of the event.
            return Ok(());
        }
        // async-nats accepts an empty name, which would go out as the line ": value".
        let header_name = name
            .parse::<HeaderName>()
            .ok()
            .filter(|_| !name.is_empty())
            .ok_or_else(|| {
                PublishError::Invalid(format!(
                    "header name {name:?} is not a NATS header name (printable ASCII without ':', not empty)"
                ))
            })?;
        let header_value = value.parse::<HeaderValue>().map_err(|_| {
            PublishError::Invalid(format!(
                "the value of header {name:?} contains a line break"
            ))
        })?;
        headers.insert(header_name, header_value);
        names.push(name.to_owned());
        Ok::<(), PublishError>(())
    };
    let id = msg.id.to_string();
    push(&mut headers, MSG_ID_HEADER, &id)?;
    push(&mut headers, CONTENT_TYPE_HEADER, CONTENT_TYPE_JSON)?;
    for (name, value) in encode_headers(msg, Binding::Nats, config.source()) {
        if name
            .as_bytes()
            .get(..5)
            .is_some_and(|prefix| prefix.eq_ignore_ascii_case(b"nats-"))
        {
            return Err(PublishError::Invalid(format!(
                "header {name:?} is reserved for JetStream (Nats-* headers control deduplication and expectations)"
            )));
        }
        push(&mut headers, &name, &value)?;
    }
    let payload = Bytes::copy_from_slice(msg.payload.get().as_bytes());
    let size = payload.len() + header_wire_len(&headers);
    if size > max {
        return Err(PublishError::PayloadTooLarge { size, max });
    }
    Ok(Prepared {
        subject,
        headers,
        payload,
    })
}

/// The serialized size of a NATS header block (`NATS/1.0\r\n`, `name: value\r\n` per
/// value, `\r\n`), as the server counts it against `max_payload`.
fn header_wire_len(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n".len() + 2;
    for (name, values) in headers.iter() {
        for value in values {
            len += AsRef::<str>::as_ref(name).len() + 2 + value.as_str().len() + 2;
        }
    }
    len
}

/// What a JetStream publish needs for one message.
struct Prepared {
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
}

/// Why a message of a batch got no PubAck.
enum Failure {
    Publish(jetstream::context::PublishError),
    Timeout,
}

/// A failure mapped to an error, or one that needs a stream lookup first.
enum Mapped {
    Done(PublishError),
    NoResponders,
}

impl Failure {
    fn into_error(self, config: &NatsConfig, connection_lost: bool) -> Mapped {
        let lost = || {
            PublishError::unavailable(
                format!(
                    "connection to NATS at {} lost before the PubAck arrived",
                    config.url_redacted()
                ),
                None,
            )
        };
        let error = match self {
            Self::Timeout if connection_lost => lost(),
            Self::Timeout => PublishError::Timeout(config.confirm_timeout()),
            Self::Publish(e) => match e.kind() {
                PublishErrorKind::StreamNotFound => return Mapped::NoResponders,
                PublishErrorKind::TimedOut if connection_lost => lost(),
                PublishErrorKind::TimedOut => PublishError::Timeout(config.confirm_timeout()),
                PublishErrorKind::BrokenPipe => lost(),
                PublishErrorKind::MaxPayloadExceeded => PublishError::Other {
                    kind: ErrorKind::Permanent,
                    message: format!("the server's max_payload is exceeded: {e}"),
                    source: Some(Box::new(e)),
                },
                _ => match jetstream_error(&e).map(|js| (js.code(), js.error_code())) {
                    Some((_, ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)) => PublishError::Other {
                        kind: ErrorKind::Permanent,
                        message: format!("the message exceeds the stream's max_msg_size: {e}"),
                        source: Some(Box::new(e)),
                    },
                    // The stream cannot store it now (full with `discard: new`, out of
                    // storage): code 503 like the outages below, but the stream's own
                    // state, so only its subjects wait.
                    Some((
                        _,
                        ErrorCode::STREAM_STORE_FAILED
                        | ErrorCode::STORAGE_RESOURCES_EXCEEDED
                        | ErrorCode::INSUFFICIENT_RESOURCES,
                    )) => PublishError::Rejected {
                        reason: format!("the stream cannot store the message now: {e}"),
                    },
                    Some((503, _))
                    | Some((
                        _,
                        ErrorCode::JETSTREAM_NOT_ENABLED
                        | ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT
                        | ErrorCode::CLUSTER_NOT_AVAILABLE,
                    )) => PublishError::unavailable(
                        format!("JetStream is not available: {e}"),
                        Some(Box::new(e)),
                    ),
                    Some(_) => PublishError::Rejected {
                        reason: format!("JetStream refused the message: {e}"),
                    },
                    None if connection_lost => lost(),
                    // The client could not hand the publish to its connection task: the
                    // client's state, never the message's.
                    None => PublishError::unavailable(
                        format!("the NATS client could not send the publish: {e}"),
                        Some(Box::new(e)),
                    ),
                },
            },
        };
        Mapped::Done(error)
    }
}

/// The outcome of a stream lookup, shared by every message of one subject.
enum Cloneable {
    Unroutable { subject: String },
    Rejected(String),
    Unavailable(String),
}

impl Cloneable {
    fn clone_as_error(&self) -> PublishError {
        match self {
            Self::Unroutable { subject } => PublishError::Unroutable {
                exchange: String::new(),
                routing_key: subject.clone(),
                reply_code: 503,
                reply_text: "no responders: no JetStream stream captures this subject (create one with outboxkit_nats::StreamSetup, or fix the subject prefix)".to_owned(),
            },
            Self::Rejected(reason) => PublishError::Rejected {
                reason: reason.clone(),
            },
            Self::Unavailable(reason) => PublishError::unavailable(reason.clone(), None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_length_matches_the_wire_format() {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", "abc");
        headers.insert("ce-type", "OrderPlaced");
        // "NATS/1.0\r\n" + "Nats-Msg-Id: abc\r\n" + "ce-type: OrderPlaced\r\n" + "\r\n"
        assert_eq!(header_wire_len(&headers), 10 + 18 + 22 + 2);
    }

    #[test]
    fn timeouts_become_outages_when_the_connection_was_lost() {
        let config = crate::NatsConfig::new(crate::config::DEFAULT_URL);
        match Failure::Timeout.into_error(&config, false) {
            Mapped::Done(PublishError::Timeout(d)) => assert_eq!(d, config.confirm_timeout()),
            _ => panic!("expected Timeout"),
        }
        match Failure::Timeout.into_error(&config, true) {
            Mapped::Done(e) => assert_eq!(e.kind(), ErrorKind::Unavailable),
            Mapped::NoResponders => panic!("expected Unavailable"),
        }
        let no_stream = jetstream::context::PublishError::new(PublishErrorKind::StreamNotFound);
        assert!(matches!(
            Failure::Publish(no_stream).into_error(&config, false),
            Mapped::NoResponders
        ));
    }
}

/// Property tests: no panic is reachable from a row's content on the way to a JetStream
/// publish; what cannot be published gets a typed, permanent error.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::config::DEFAULT_URL;
    use outboxkit_core::MessageStatus;
    use outboxkit_core::proptest_support::{config, payload, text};
    use outboxkit_core::wire::IncomingMessage;
    use proptest::prelude::*;
    use uuid::Uuid;

    /// Header names: arbitrary text; names that are valid NATS names; `Nats-` in any
    /// case; names of 1-4 bytes (ASCII or one multi-byte char) and names whose 5th
    /// byte falls inside a multi-byte char (a `name[..5]` slice panicked on both);
    /// names with ':', CR/LF, spaces; empty and very long names; our attributes.
    fn header_name() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => text(30),
            3 => "[!-9;-~]{0,30}",
            2 => ("[nN][aA][tT][sS]-", "[!-9;-~]{0,12}").prop_map(|(p, s)| p + &s),
            2 => prop::collection::vec(any::<char>(), 1..=2)
                .prop_map(String::from_iter)
                .prop_filter("1 to 4 bytes", |s| (1..=4).contains(&s.len())),
            2 => ("[nN]?[aA]?[tT]?[sS]?", any::<char>(), text(6))
                .prop_map(|(p, c, s)| format!("{p}{c}{s}")),
            1 => "[a-z]{0,4}[:\r\n \t][a-z]{0,4}",
            1 => (0usize..600).prop_map(|n| "h".repeat(n)),
            1 => prop::sample::select(vec![
                "ce-id", "ce-type", "CE-TYPE", "ce-source", "ce-time", "ce-aggregateversion",
                "ce-correlationid", "correlationid", "causationid", "traceparent", "tracestate",
                "Content-Type", "content-type", "Nats-Msg-Id", "nats-expected-stream", "",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// Header values: mostly printable or any text without line breaks, sometimes
    /// arbitrary text (CR/LF included), long text.
    fn header_value() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => "[ -~]{0,40}",
            2 => "[^\r\n]{0,20}",
            1 => text(40),
            1 => (0usize..1000).prop_map(|n| "v".repeat(n)),
        ]
    }

    /// Text of the attributes that become header values (aggregate, tenant, ...).
    fn field_text() -> impl Strategy<Value = String> {
        prop_oneof![
            6 => "[ -~]{0,20}",
            4 => "[^\r\n]{0,20}",
            2 => text(20),
            1 => (250usize..260).prop_map(|n| "n".repeat(n)),
        ]
    }

    /// The headers of a row: most names valid NATS names, some of every kind above.
    fn headers() -> impl Strategy<Value = outboxkit_core::Headers> {
        let name = prop_oneof![6 => "x-[!-9;-~]{0,20}", 1 => header_name()];
        prop::collection::btree_map(name, header_value(), 0..6)
    }

    /// Routing keys and event types: mostly valid subject tokens, and wildcards, `$`,
    /// empty tokens, whitespace, multi-byte chars, arbitrary text, very long keys.
    fn subject_part() -> impl Strategy<Value = String> {
        prop_oneof![
            9 => "[A-Za-z0-9_-]{1,12}(\\.[A-Za-z0-9_-]{1,12}){0,3}",
            2 => "[A-Za-z0-9_.*>$ -]{0,20}",
            2 => "[a-z]{1,4}[é日𝄞\u{85}\u{a0}][a-z.]{0,4}",
            2 => text(20),
            1 => (0usize..5000).prop_map(|n| "k".repeat(n)),
        ]
    }

    fn message() -> impl Strategy<Value = OutboxMessage> {
        (
            (
                any::<u128>(),
                field_text(),
                field_text(),
                any::<i64>(),
                subject_part(),
            ),
            (
                headers(),
                prop::option::of(field_text()),
                prop::option::of(subject_part()),
                prop::option::of(field_text()),
            ),
            0usize..600,
        )
            .prop_map(
                |(
                    (id, aggregate_type, aggregate_id, aggregate_version, event_type),
                    (headers, tenant_id, routing_key, partition_key),
                    size,
                )| {
                    let now = chrono::Utc::now();
                    OutboxMessage {
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
                        occurred_at: now,
                        created_at: now,
                        visible_at: now,
                        attempts: 1,
                        status: MessageStatus::Processing,
                        last_error: None,
                        claim_token: None,
                        lease_until: None,
                        sent_at: None,
                    }
                },
            )
    }

    fn nats_config() -> impl Strategy<Value = NatsConfig> {
        (
            prop::sample::select(vec!["outbox.events", "", "orders"]),
            prop::option::of(Just("/orders-service".to_owned())),
        )
            .prop_map(|(prefix, source)| {
                crate::NatsConfig::new(DEFAULT_URL)
                    .with_subject_prefix(prefix)
                    .with_source(source)
            })
    }

    /// Whether every header `prepare` would write can be a NATS header: non-empty names
    /// of printable ASCII without ':' and not `Nats-*`, values without CR or LF.
    fn expressible(msg: &OutboxMessage, config: &NatsConfig) -> bool {
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.chars().all(|c| c.is_ascii_graphic() && c != ':')
                && !n.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("nats-"))
        };
        let value_ok = |v: &str| !v.contains(['\r', '\n']);
        msg.headers.iter().all(|(n, v)| name_ok(n) && value_ok(v))
            && [
                Some(&msg.event_type),
                Some(&msg.aggregate_type),
                Some(&msg.aggregate_id),
                msg.tenant_id.as_ref(),
                msg.partition_key.as_ref(),
            ]
            .into_iter()
            .flatten()
            .all(|v| value_ok(v))
            && config.source().is_none_or(value_ok)
    }

    /// What the consumer decodes from the prepared headers.
    fn consumed(prepared: &Prepared) -> Result<IncomingMessage, outboxkit_core::wire::DecodeError> {
        let headers = crate::consumer::headers_to_strings(Some(&prepared.headers));
        let message_id = headers.get(MSG_ID_HEADER).cloned();
        IncomingMessage::decode(
            Binding::Nats,
            message_id.as_deref(),
            headers,
            prepared.payload.to_vec(),
            false,
            Some(1),
        )
        .map_err(|undecodable| undecodable.error)
    }

    proptest! {
        #![proptest_config(config())]

        /// Guards against `prepare` panicking on a row's content (the `name[..5]` slice
        /// on a multi-byte header name did): arbitrary header names and values,
        /// routing keys and event types, payloads around `max`. The verdict is `Ok`,
        /// `Invalid` or `PayloadTooLarge`; an invalid subject or a field over the limits
        /// consumers decode is always `Invalid`, a message whose every part is
        /// expressible and within those limits never is; `Ok` fits `max`, has the
        /// configured subject and decodes on the consumer side to the same id and type.
        #[test]
        fn prepare_never_panics(
            msg in message(),
            config in nats_config(),
            max in 1usize..1500,
        ) {
            let subject = config.subject_for(msg.effective_routing_key());
            match prepare(&config, &msg, max) {
                Ok(prepared) => {
                    prop_assert!(subject_problem(&subject).is_none());
                    prop_assert_eq!(&prepared.subject, &subject);
                    let size = prepared.payload.len() + header_wire_len(&prepared.headers);
                    prop_assert!(size <= max);
                    prop_assert_eq!(prepared.payload.as_ref(), msg.payload.get().as_bytes());
                    let decoded = consumed(&prepared).map_err(|e| {
                        TestCaseError::fail(format!("prepared but undecodable: {e}"))
                    })?;
                    prop_assert_eq!(decoded.id, msg.id);
                    prop_assert_eq!(&decoded.event_type, &msg.event_type);
                    prop_assert_eq!(decoded.aggregate_version, Some(msg.aggregate_version));
                }
                Err(PublishError::Invalid(reason)) => {
                    prop_assert!(!reason.is_empty());
                    prop_assert!(
                        subject_problem(&subject).is_some()
                            || !expressible(&msg, &config)
                            || check_limits(&msg).is_err(),
                        "an expressible message was rejected: {}", reason
                    );
                }
                Err(PublishError::PayloadTooLarge { size, max: limit }) => {
                    prop_assert_eq!(limit, max);
                    prop_assert!(size > max && size >= msg.payload.get().len());
                }
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
            if subject_problem(&subject).is_some() || check_limits(&msg).is_err() {
                prop_assert!(matches!(prepare(&config, &msg, max), Err(PublishError::Invalid(_))));
            }
        }

        /// Guards the size check at its boundary: with `max` chosen so that the payload
        /// is a few bytes under, at or over what fits beside the headers, a payload
        /// that fits is `Ok` and one that does not is `PayloadTooLarge` with the exact
        /// size, never a panic or an off-by-one.
        #[test]
        fn payload_limit_is_exact(
            msg in message(),
            config in nats_config(),
            room in 1usize..3000,
            delta in -3isize..=3,
        ) {
            let Ok(probe) = prepare(&config, &msg, usize::MAX) else {
                // Invalid whatever its size: covered by `prepare_never_panics`.
                return Ok(());
            };
            let headers = header_wire_len(&probe.headers);
            let size = room.saturating_add_signed(delta).max(1);
            let msg = OutboxMessage { payload: payload(size), ..msg };
            let max = headers + room;
            match prepare(&config, &msg, max) {
                Ok(_) => prop_assert!(headers + size <= max),
                Err(PublishError::PayloadTooLarge { size: got, max: limit }) => {
                    prop_assert_eq!(got, headers + size);
                    prop_assert_eq!(limit, max);
                    prop_assert!(got > max);
                }
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }

    /// The inputs that made the old `name[..5]` check panic: a multi-byte char across
    /// byte 5, and names shorter than 5 bytes.
    #[test]
    fn multi_byte_header_names_are_invalid_not_a_panic() {
        let config = crate::NatsConfig::new(DEFAULT_URL);
        for name in ["Natsé-x", "Nat日本", "é", "日", "ab", "𝄞"] {
            let msg = OutboxMessage::claimed_from(
                outboxkit_core::NewMessage::builder("order", "1", "OrderPlaced")
                    .payload(&1)
                    .header(name, "v")
                    .build()
                    .expect("valid message"),
                chrono::Utc::now(),
            );
            let result = prepare(&config, &msg, 1 << 20);
            if name.is_ascii() {
                assert!(result.is_ok(), "{name:?}");
            } else {
                assert!(
                    matches!(result, Err(PublishError::Invalid(_))),
                    "{name:?}: {:?}",
                    result.err()
                );
            }
        }
    }
}
