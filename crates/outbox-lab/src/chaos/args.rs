//! The harness's command line.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use super::db::Database;
use super::topology::{ConsumerMode, TransportKind};

/// The durable inbox or the idempotent consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum InboxArg {
    /// `IdempotentConsumer` over `PgInbox` or `MySqlInbox`.
    Idempotent,
    /// `DurableReceiver` + `InboxProcessor`.
    Durable,
}

/// Chaos run: real `outbox relay` and consumer processes killed, the broker frozen,
/// alarmed and restarted, the database (PostgreSQL, or MariaDB with `--database mysql`)
/// restarted and its connections terminated, poison
/// rows written; then a drain and a verdict that counts every message (exit code 0
/// only when nothing was lost, nothing applied twice, and the only dead letters are
/// the injected poison rows).
#[derive(Debug, Parser)]
#[command(name = "chaos")]
pub struct Args {
    /// The broker.
    #[arg(long, value_enum, default_value_t = TransportKind::Rabbit)]
    pub(crate) transport: TransportKind,
    /// The database: PostgreSQL (`DATABASE_URL`) or MariaDB / MySQL (`MYSQL_URL`, a
    /// user that may create databases and users, kill connections and stop the server:
    /// the local `root`).
    #[arg(long, value_enum, default_value_t = Database::Postgres)]
    pub(crate) database: Database,
    /// Length of the fault phase (producers write, faults are injected), e.g. 90s, 15m.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub(crate) duration: Duration,
    /// Seed of the fault schedule (random when not given; always printed).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// `outbox relay` processes.
    #[arg(long, default_value_t = 2)]
    pub(crate) relays: usize,
    /// Consumer processes.
    #[arg(long, default_value_t = 2)]
    pub(crate) consumers: usize,
    /// Producer tasks, each writing one order and its event per transaction.
    #[arg(long, default_value_t = 4)]
    pub(crate) producers: usize,
    /// Orders per second, all producers together.
    #[arg(long, default_value_t = 200)]
    pub(crate) rate: u32,
    /// The consumers' inbox.
    #[arg(long, value_enum, default_value_t = InboxArg::Idempotent)]
    pub(crate) inbox: InboxArg,
    /// Consumers apply effects directly and ack after the write, without an inbox: the
    /// run must then report double effects and fail (it shows the harness can fail).
    #[arg(long)]
    pub(crate) consumers_without_inbox: bool,
    /// Consumers take deliveries in batches, one database transaction per batch
    /// (`run_batched`: `IdempotentConsumer::process_batch`, or `DurableReceiver` storing
    /// a batch with one statement), instead of one transaction per delivery. Not with
    /// `--consumers-without-inbox`.
    #[arg(long)]
    pub(crate) batched: bool,
    /// How long the broker stays frozen, under a memory alarm, or with a full queue.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub(crate) fault_window: Duration,
    /// Deadline of the drain after the fault phase.
    #[arg(long, default_value = "150s", value_parser = humantime::parse_duration)]
    pub(crate) drain_timeout: Duration,
    /// The relays' `--lease`; at least twice 5 s plus `--confirm-timeout`.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub(crate) lease: Duration,
    /// The relays' `--confirm-timeout`.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub(crate) confirm_timeout: Duration,
    /// Schema of the run (dropped and recreated; default `chaos_<transport>`).
    #[arg(long)]
    pub(crate) schema: Option<String>,
    /// The `outbox` binary [default: `outbox` next to this executable].
    #[arg(long, env = "CHAOS_OUTBOX_BIN")]
    pub(crate) outbox_bin: Option<PathBuf>,
    /// The consumer binary [default: `chaos-consumer` next to this executable].
    #[arg(long, env = "CHAOS_CONSUMER_BIN")]
    pub(crate) consumer_bin: Option<PathBuf>,
    /// Keep the schema, the broker objects and the process logs after the run (they are
    /// always kept when the run fails).
    #[arg(long)]
    pub(crate) keep: bool,
    /// Run on the 3-node clusters of `cargo xtask services --cluster`: relays and
    /// consumers get every node's URL, the streams have 3 replicas (the consumers'
    /// queue is a quorum queue either way), and the broker lane kills the node holding
    /// the queue's or stream's leader, freezes a node and cuts a node off the network
    /// instead of freezing, restarting and alarming the single server.
    #[arg(long)]
    pub(crate) cluster: bool,
    /// Where the relays read committed messages: `poll` (claims on the outbox table, the
    /// default) or `wal` (PostgreSQL only: `outbox wal setup` before the run, the relays
    /// run `outbox relay --source wal`, one reads the slot while the other stands by;
    /// the slot and publication are dropped at the end, however the run ends).
    #[arg(long, default_value = "poll", value_parser = ["poll", "wal"])]
    pub(crate) source: String,
}

impl Args {
    /// How the consumer processes apply effects.
    pub(crate) fn consumer_mode(&self) -> ConsumerMode {
        match (self.consumers_without_inbox, self.inbox) {
            (true, _) => ConsumerMode::Direct,
            (false, InboxArg::Idempotent) => ConsumerMode::Idempotent,
            (false, InboxArg::Durable) => ConsumerMode::Durable,
        }
    }

    pub(crate) fn schema(&self) -> String {
        self.schema
            .clone()
            .unwrap_or_else(|| format!("chaos_{}", self.transport.name()))
    }

    /// Whether the relays read the write-ahead log (`--source wal`).
    pub(crate) fn wal(&self) -> bool {
        self.source == "wal"
    }

    /// Rejects settings the relays would refuse or the run cannot honour.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        let publish = Duration::from_secs(5) + self.confirm_timeout;
        anyhow::ensure!(
            self.lease >= publish * 2,
            "--lease {} must be at least twice 5 s + --confirm-timeout ({})",
            humantime::format_duration(self.lease),
            humantime::format_duration(publish * 2)
        );
        anyhow::ensure!(
            !(self.batched && self.consumers_without_inbox),
            "--batched needs an inbox: not with --consumers-without-inbox"
        );
        anyhow::ensure!(
            !(self.wal() && self.database != Database::Postgres),
            "--source wal reads PostgreSQL's write-ahead log: not with --database mysql"
        );
        anyhow::ensure!(self.relays >= 1, "--relays must be at least 1");
        anyhow::ensure!(self.consumers >= 1, "--consumers must be at least 1");
        anyhow::ensure!(self.producers >= 1, "--producers must be at least 1");
        anyhow::ensure!(self.rate >= 1, "--rate must be at least 1");
        anyhow::ensure!(
            self.duration >= Duration::from_secs(30),
            "--duration must be at least 30s"
        );
        Ok(())
    }
}
