//! The broker side of the benchmark: where the ceilings and the relay publish, and how
//! to warm it up, empty it and remove it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use futures::StreamExt as _;
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ExchangeKind};
use outboxkit_nats::StreamSetup;
use outboxkit_nats::async_nats::jetstream;
use uuid::Uuid;

use super::ceilings::{Feed, copies, nats_publish, rabbit_publish, reference_feeds};
use super::{Args, TransportKind};
use crate::common;

/// The broker side of the benchmark: where the ceiling and the relay publish, and how
/// to empty and remove it.
pub(super) enum Broker {
    /// A durable topic exchange with one durable queue bound to everything.
    Rabbit {
        exchange: String,
        queue: String,
        admin: Connection,
        channel: lapin::Channel,
    },
    /// A file-storage stream (2-minute duplicate window) capturing `bench.<tag>.>`.
    Nats {
        js: jetstream::Context,
        stream: String,
        prefix: String,
    },
}

/// An admin connection to RabbitMQ and a channel on it, with the durable topic
/// `exchange` declared (the relay and the bench's publishers publish to it).
pub(super) async fn rabbit_admin_with_exchange(
    exchange: &str,
) -> anyhow::Result<(Connection, lapin::Channel)> {
    let admin = common::amqp_connect()
        .await
        .context("connect to RabbitMQ (is it running? `cargo xtask services`)")?;
    let channel = admin.create_channel().await?;
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok((admin, channel))
}

/// Declares the durable queue `queue` and binds it to `exchange` with `key`: a classic
/// queue, or on the clusters ([`common::on_cluster`]) a quorum queue.
pub(super) async fn declare_bound_queue(
    channel: &lapin::Channel,
    queue: &str,
    exchange: &str,
    key: &str,
) -> anyhow::Result<()> {
    let mut arguments = FieldTable::default();
    if common::on_cluster() {
        arguments.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
    }
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    declare_and_bind(channel, queue, options, arguments, exchange, key).await?;
    Ok(())
}

/// Declares `queue` with `options` and `arguments` and binds it to `exchange` with
/// `key`; returns its name (the server's choice when `queue` is empty).
async fn declare_and_bind(
    channel: &lapin::Channel,
    queue: &str,
    options: QueueDeclareOptions,
    arguments: FieldTable,
    exchange: &str,
    key: &str,
) -> anyhow::Result<String> {
    let declared = channel
        .queue_declare(queue.into(), options, arguments)
        .await?;
    let queue = declared.name().as_str().to_owned();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(queue)
}

/// A stream's replicas: 3 on the clusters ([`common::on_cluster`]), else 1.
pub(super) fn replicas() -> usize {
    if common::on_cluster() { 3 } else { 1 }
}

impl Broker {
    pub(super) async fn setup(transport: TransportKind, tag: &str) -> anyhow::Result<Self> {
        match transport {
            TransportKind::Rabbit => {
                let exchange = format!("bench.{tag}");
                let queue = format!("bench.{tag}.sink");
                let (admin, channel) = rabbit_admin_with_exchange(&exchange).await?;
                declare_bound_queue(&channel, &queue, &exchange, "#").await?;
                Ok(Self::Rabbit {
                    exchange,
                    queue,
                    admin,
                    channel,
                })
            }
            TransportKind::Nats => {
                let client = common::nats_connect().await.context(
                    "connect to NATS (is it running with JetStream? `cargo xtask services`)",
                )?;
                let js = jetstream::new(client);
                let stream = format!("BENCH_{tag}");
                let prefix = format!("bench.{tag}");
                StreamSetup::new(&stream)
                    .with_subject(format!("{prefix}.>"))
                    .with_replicas(replicas())
                    .apply_with(&js, Duration::from_secs(10))
                    .await?;
                Ok(Self::Nats { js, stream, prefix })
            }
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "RabbitMQ",
            Self::Nats { .. } => "NATS",
        }
    }

    /// The process name of the broker, for CPU accounting.
    pub(super) fn comm(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "beam.smp",
            Self::Nats { .. } => "nats-server",
        }
    }

    pub(super) fn ceiling_label(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "broker ceiling (raw lapin, pipelined confirms)",
            Self::Nats { .. } => "broker ceiling (raw JetStream, pipelined PubAcks)",
        }
    }

    pub(super) fn bare_label(&self) -> &'static str {
        match self {
            Self::Rabbit { .. } => "(reference) raw lapin, bodies without headers",
            Self::Nats { .. } => "(reference) raw JetStream, bodies without headers",
        }
    }

    /// An untimed publish of the phase's size, then a purge: every timed broker phase
    /// starts on a broker that has just done the same work, as a running relay's broker
    /// has, and on an empty sink. It narrows the effect of the phases' order within a
    /// round but does not remove it (hence the balanced order of the rounds).
    pub(super) async fn warm_up(&self, args: &Args, body: &[u8]) -> anyhow::Result<()> {
        self.ceiling(args, body, false).await?;
        self.purge().await
    }

    /// The raw broker rate; fails (instead of hanging) when the broker stops
    /// confirming for 5 minutes.
    pub(super) async fn ceiling(
        &self,
        args: &Args,
        body: &[u8],
        bare: bool,
    ) -> anyhow::Result<Duration> {
        self.publish(args, copies(args, body), bare)
            .await
            .context("the broker ceiling got no confirmations for 5 minutes (broker blocked? check its alarms)")?
    }

    /// The reference relay over the outbox table of `db` (see
    /// [`reference_feeds`]): `args.concurrency` loops of claim, pipelined publish, mark
    /// sent, until no pending row is left; fails (instead of hanging) when the broker
    /// stops confirming for 5 minutes.
    pub(super) async fn reference_relay(
        &self,
        args: &Args,
        db: &outboxkit_postgres::PgOutbox,
    ) -> anyhow::Result<Duration> {
        let feeds = reference_feeds(args.concurrency, db.pool(), db.schema());
        self.publish(args, feeds, false)
            .await
            .context("the reference relay got no confirmations for 5 minutes")?
    }

    /// The raw client publishing `feeds` (see [`rabbit_publish`], [`nats_publish`]),
    /// given up after 5 minutes.
    async fn publish(
        &self,
        args: &Args,
        feeds: Vec<Box<dyn Feed>>,
        bare: bool,
    ) -> Result<anyhow::Result<Duration>, tokio::time::error::Elapsed> {
        let run = async {
            match self {
                Self::Rabbit { exchange, .. } => rabbit_publish(args, exchange, feeds, bare).await,
                Self::Nats { js, prefix, .. } => {
                    nats_publish(args, js, &format!("{prefix}.BenchEvent"), feeds, bare).await
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(300), run).await
    }

    /// Empties the queue or stream between phases; fails instead of hanging after a
    /// minute.
    pub(super) async fn purge(&self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(60), self.purge_now())
            .await
            .context("purging the bench sink took over a minute")?
    }

    pub(super) async fn purge_now(&self) -> anyhow::Result<()> {
        match self {
            Self::Rabbit { queue, channel, .. } => {
                channel
                    .queue_purge(queue.as_str().into(), Default::default())
                    .await?;
            }
            Self::Nats { js, stream, .. } => {
                js.get_stream(stream).await?.purge().await?;
            }
        }
        Ok(())
    }

    pub(super) async fn cleanup(self) -> anyhow::Result<()> {
        match self {
            Self::Rabbit {
                exchange,
                queue,
                admin,
                channel,
            } => {
                channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await?;
                channel
                    .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
                    .await?;
                admin.close(200, "bench done".into()).await.ok();
            }
            Self::Nats { js, stream, .. } => {
                js.delete_stream(&stream).await?;
            }
        }
        Ok(())
    }
}

/// When each message reached a subscriber of the bench's broker, by outbox id (this
/// host's wall clock): the relay's publish as a consumer sees it, independent of when
/// the relay recorded the confirm. On NATS a core subscription to the stream's subjects
/// (the server routes a published message to it as it stores it in the stream); on
/// RabbitMQ an exclusive, auto-deleted queue bound to the exchange with `#`, consumed
/// without acks.
pub(super) struct Receipts {
    seen: Arc<Mutex<HashMap<Uuid, SystemTime>>>,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Receipts {
    /// Subscribes; returns once the subscription is in place, so that every message
    /// published after this is seen.
    pub(super) async fn start(broker: &Broker) -> anyhow::Result<Self> {
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let record = {
            let seen = Arc::clone(&seen);
            move |id: Option<&str>| {
                let at = SystemTime::now();
                if let Some(id) = id.and_then(|s| s.parse::<Uuid>().ok()) {
                    seen.lock().expect("receipts").insert(id, at);
                }
            }
        };
        let task = match broker {
            Broker::Nats { js, prefix, .. } => {
                let client = js.client();
                let mut sub = client.subscribe(format!("{prefix}.>")).await?;
                client.flush().await?;
                let stop = stop.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => break,
                            msg = sub.next() => {
                                let Some(msg) = msg else { break };
                                let id = msg.headers.as_ref().and_then(|h| {
                                    h.get(outboxkit_nats::publisher::MSG_ID_HEADER).map(|v| v.as_str())
                                });
                                record(id);
                            }
                        }
                    }
                    let _ = sub.unsubscribe().await;
                })
            }
            Broker::Rabbit {
                exchange, admin, ..
            } => {
                let channel = admin.create_channel().await?;
                let options = QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..Default::default()
                };
                let queue =
                    declare_and_bind(&channel, "", options, FieldTable::default(), exchange, "#")
                        .await?;
                let mut consumer = channel
                    .basic_consume(
                        queue.as_str().into(),
                        "bench-receipts".into(),
                        lapin::options::BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                let stop = stop.clone();
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => break,
                            delivery = consumer.next() => {
                                let Some(Ok(delivery)) = delivery else { break };
                                record(delivery.properties.message_id().as_ref().map(|s| s.as_str()));
                            }
                        }
                    }
                    // Closing the channel deletes the exclusive queue.
                    let _ = channel.close(200, "bench done".into()).await;
                })
            }
        };
        Ok(Self { seen, stop, task })
    }

    /// Waits (at most 10 s) until every one of `ids` was seen, then stops and returns
    /// what was seen.
    pub(super) async fn finish(self, ids: &[Uuid]) -> HashMap<Uuid, SystemTime> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let all = {
                let seen = self.seen.lock().expect("receipts");
                ids.iter().all(|id| seen.contains_key(id))
            };
            if all || tokio::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop.cancel();
        let _ = self.task.await;
        std::mem::take(&mut *self.seen.lock().expect("receipts"))
    }
}
