//! `cargo xtask chaos`: the whole pipeline under faults, with a verdict that counts
//! every message.
//!
//! 1. **Set up** a fresh schema (outbox and inbox tables, `orders`, `effects`,
//!    `deliveries`, `audit`, `foreign_messages`, `side_events`, `delayed_events`) on
//!    PostgreSQL or, with
//!    `--database mysql`, MariaDB (`db`), the consumers' login role (on MariaDB also the
//!    relays' user), and the broker side (RabbitMQ: exchange, the consumers' quorum queue, an
//!    audit queue bound to `#`, the side events' queue; NATS: a file-storage stream for
//!    the orders' events with a durable consumer, and one for the side events), under
//!    the machine-wide fault lock of `outboxkit_testkit::faults`.
//! 2. **Run** `--relays` `outbox relay` processes (the release build's binary),
//!    `--consumers` `chaos-consumer` processes, and `--producers` tasks writing orders
//!    and their events at `--rate` (a share of them marked for the consumers' swallowing
//!    handler), for `--duration`, while the `schedule` drawn from `--seed` kills
//!    processes and injects server faults and the consumers' database outage
//!    (`injector`), poison rows (`producers`) and another producer's messages published
//!    straight to the broker (`foreign`), while the delayed lane (`delayed`) writes
//!    12,000 messages due long after the run and one due in seconds every 2 s.
//! 3. **Drain**: producers stop, every fault is undone, killed processes are back;
//!    wait (up to `--drain-timeout`) until the outbox has nothing pending (but the
//!    delayed lane's messages due after the run), every order
//!    and every foreign message is applied or a consumer dead letter, and the broker
//!    holds nothing unacknowledged (or until, with nothing left anywhere to deliver,
//!    the rest has stayed unsettled for 10 s: the verdict counts it).
//! 4. **Judge** (`verdict`): the orders against the effects and the consumer dead
//!    letters, the foreign messages against what each kind must become, the outbox's
//!    dead letters against the poison rows, the broker's own copies (`audit`) against
//!    all of them, and every process exit against the faults that explain it
//!    (`supervisor`); then remove what the run created (kept on failure) and check the
//!    servers are as found (`servers`).

pub mod args;
mod audit;
pub mod consumer;
pub mod db;
mod delayed;
mod foreign;
mod harness;
mod injector;
mod producers;
mod schedule;
pub(crate) mod servers;
mod setup;
mod supervisor;
mod timeline;
mod topology;
mod verdict;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::Utc;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use outboxkit_nats::async_nats;
use outboxkit_testkit::faults::RabbitMaxMessageSize;
use tokio_util::sync::CancellationToken;

use crate::common;
use args::Args;
use db::{Db, Outbox};
pub use harness::main;
use schedule::{FaultKind, Schedule, Settings};
use supervisor::{Role, Supervisor};
use timeline::Timeline;
use topology::{ConsumerMode, HARNESS_APP, Names, TransportKind};

/// The shortest consumers' database outage of a run (it lasts up to 5 s more): over NATS
/// 5 s longer than the consumers' `ack_wait`; over RabbitMQ, whose limit on a held
/// delivery (`consumer_timeout`, 30 minutes) no run reaches, 15 s.
fn consumer_outage(transport: TransportKind, batched: bool) -> Duration {
    match transport {
        TransportKind::Nats => topology::nats_ack_wait(batched) + Duration::from_secs(5),
        TransportKind::Rabbit => Duration::from_secs(15),
    }
}

/// The binaries the harness starts.
/// The run's replication slot and publication (`--source wal`): created by `outbox wal
/// setup`, dropped by `outbox wal drop --force` on drop, so that a failed or interrupted
/// run leaves no slot retaining WAL behind.
struct WalSlot {
    outbox: PathBuf,
    url: String,
    schema: String,
}

impl WalSlot {
    fn setup(bins: &Binaries, args: &Args, names: &Names) -> anyhow::Result<Self> {
        let slot = Self {
            outbox: bins.outbox.clone(),
            url: topology::relay_url(args.database, names),
            schema: names.schema.clone(),
        };
        let status = slot.command(&["setup"]).status()?;
        anyhow::ensure!(
            status.success(),
            "`outbox wal setup` failed ({status}): --source wal needs wal_level = logical (`cargo xtask services`)"
        );
        Ok(slot)
    }

    fn command(&self, verb: &[&str]) -> Command {
        let mut c = Command::new(&self.outbox);
        c.env_remove("OUTBOX_CONFIG")
            .env("RUST_LOG", "warn")
            .args(["--database-url", &self.url, "--schema", &self.schema, "wal"])
            .args(verb)
            .stdout(std::process::Stdio::null());
        c
    }
}

impl Drop for WalSlot {
    fn drop(&mut self) {
        match self.command(&["drop", "--force"]).status() {
            Ok(status) if status.success() => {}
            other => eprintln!(
                "chaos: `outbox wal drop --force` for schema {} failed ({other:?}): drop its slot by hand, it retains WAL",
                self.schema
            ),
        }
    }
}

struct Binaries {
    outbox: PathBuf,
    consumer: PathBuf,
}

impl Binaries {
    /// `--outbox-bin` and `--consumer-bin`, or `outbox` and `chaos-consumer` next to
    /// this executable (the release build's `target/release`).
    fn find(args: &Args) -> anyhow::Result<Self> {
        let dir = std::env::current_exe()
            .context("where is this executable?")?
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default();
        let pick = |given: &Option<PathBuf>, name: &str| -> anyhow::Result<PathBuf> {
            let path = given.clone().unwrap_or_else(|| dir.join(name));
            anyhow::ensure!(
                path.is_file(),
                "{} not found: build it with `cargo build --release -p outboxkit-cli -p outboxkit-lab` \
                 (or run `cargo xtask chaos`, which does), or pass its path",
                path.display()
            );
            Ok(path)
        };
        Ok(Self {
            outbox: pick(&args.outbox_bin, "outbox")?,
            consumer: pick(&args.consumer_bin, "chaos-consumer")?,
        })
    }
}

fn duration_arg(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

fn relay_command(bins: &Binaries, args: &Args, names: &Names, crash_loop_limit: usize) -> Command {
    let mut c = Command::new(&bins.outbox);
    c.env_remove("OUTBOX_CONFIG")
        .env("RUST_LOG", "warn,outboxkit_cli=info")
        .args(["--database-url", &topology::relay_url(args.database, names)])
        .args(["--schema", &names.schema, "relay"])
        .args(["--listen", "127.0.0.1:0", "--poll-interval", "100ms"])
        .args(["--batch-size", "100", "--drain-timeout", "2s"])
        .args(["--lease", &duration_arg(args.lease)])
        .args(["--confirm-timeout", &duration_arg(args.confirm_timeout)])
        .args(["--crash-loop-limit", &crash_loop_limit.to_string()]);
    if args.wal() {
        c.args(["--source", "wal"]);
    }
    match args.transport {
        TransportKind::Rabbit => c
            .args(["--transport", "rabbit", "--broker-url", &common::amqp_url()])
            .args(["--exchange", &names.exchange]),
        TransportKind::Nats => c
            .args(["--transport", "nats", "--broker-url", &common::nats_url()])
            .args(["--subject-prefix", &names.subject_prefix]),
    };
    c
}

fn consumer_command(bins: &Binaries, args: &Args, names: &Names, instance: usize) -> Command {
    let mut c = Command::new(&bins.consumer);
    c.env("RUST_LOG", "warn")
        .envs(common::broker_env())
        .args([
            "--transport",
            args.transport.name(),
            "--schema",
            &names.schema,
            "--database",
            args.database.name(),
        ])
        .args([
            "--inbox",
            match args.consumer_mode() {
                ConsumerMode::Idempotent => "idempotent",
                ConsumerMode::Durable => "durable",
                ConsumerMode::Direct => "direct",
            },
        ])
        .args(["--instance", &instance.to_string()]);
    if args.batched {
        c.arg("--batched");
    }
    c
}

/// The crash-loop limit of the chaos relays: the default, 5. The guard isolates before it
/// kills: a row a killed relay held is claimed alone afterwards, and only claims alone
/// count, so a healthy row reaches the limit only if five relays are killed (or lose
/// their lease to a database fault) while each holds that row alone; the run's dozens
/// of kills land on whole batches. (Before the isolation the chaos relays needed a
/// limit above the number of kills and database faults of the run.)
fn crash_loop_limit(_schedule: &Schedule) -> usize {
    outboxkit_core::DEFAULT_CRASH_LOOP_LIMIT as usize
}

fn print_schedule(schedule: &Schedule, transport: TransportKind, limit: usize) {
    let at = |p: &schedule::Planned| {
        if p.hold.is_zero() {
            format!("{:.0}s", p.at.as_secs_f64())
        } else {
            format!("{:.0}s+{:.0}s", p.at.as_secs_f64(), p.hold.as_secs_f64())
        }
    };
    println!(
        "chaos: schedule: {} relay kills, {} consumer kills; relays get --crash-loop-limit {limit}",
        schedule.relay_kills(),
        schedule.planned(FaultKind::ConsumerKill)
    );
    for (lane, plan) in [
        ("broker", &schedule.broker),
        ("database", &schedule.database),
        ("poison", &schedule.poison),
        ("foreign", &schedule.foreign),
    ] {
        let items: Vec<String> = plan
            .iter()
            .map(|p| format!("{} {}", p.kind.label(transport), at(p)))
            .collect();
        println!("chaos:   {lane}: {}", items.join(", "));
    }
}

/// Whether the broker still holds messages for the consumers (ready or unacked).
async fn broker_busy(
    transport: TransportKind,
    cluster: bool,
    names: &Names,
) -> anyhow::Result<u64> {
    match transport {
        TransportKind::Rabbit => {
            // `rabbitmqctl` sees unacknowledged deliveries too; AMQP only ready ones.
            let queue = names.queue.clone();
            let args = [
                "-q",
                "list_queues",
                "name",
                "messages",
                "--no-table-headers",
            ];
            let listed = tokio::task::block_in_place(|| {
                if cluster {
                    // Any node that answers; a listing can time out after a partition.
                    (1..=outboxkit_testkit::cluster::NODES).find_map(|node| {
                        let mut with_timeout = vec!["-t", "10"];
                        with_timeout.extend(args);
                        outboxkit_testkit::cluster::rabbitmqctl(node, &with_timeout).ok()
                    })
                } else {
                    Command::new("rabbitmqctl")
                        .args(args)
                        .output()
                        .ok()
                        .filter(|out| out.status.success())
                        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
                }
            });
            if let Some(text) = listed {
                for l in text.lines() {
                    let mut parts = l.split_whitespace();
                    if parts.next() == Some(queue.as_str()) {
                        return Ok(parts.next().and_then(|n| n.parse().ok()).unwrap_or(0));
                    }
                }
            }
            let conn = common::amqp_connect().await?;
            let ch = conn.create_channel().await?;
            let q = ch
                .queue_declare(
                    names.queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            let _ = conn.close(200, "checked".into()).await;
            Ok(u64::from(q.message_count()))
        }
        TransportKind::Nats => {
            let client = common::nats_connect().await?;
            let js = async_nats::jetstream::new(client);
            let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
                .get_consumer_from_stream(&names.durable, &names.stream)
                .await?;
            let info = consumer.info().await?;
            Ok(info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(0))
        }
    }
}

/// What is still to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outstanding {
    /// Outbox rows pending, but the delayed lane's far ones (due after the run).
    pending: i64,
    /// Orders with neither an effect nor a consumer dead letter.
    orders: i64,
    /// Foreign messages the broker confirmed with a usable id, neither applied nor a
    /// consumer dead letter.
    foreign: i64,
    /// Durable-inbox messages not processed.
    inbox: i64,
    /// Messages the broker holds for the consumers (ready or unacknowledged).
    busy: u64,
}

impl Outstanding {
    /// Nothing left anywhere that could still deliver or apply a message.
    fn idle(&self) -> bool {
        self.pending == 0 && self.inbox == 0 && self.busy == 0
    }

    fn done(&self) -> bool {
        self.idle() && self.orders == 0 && self.foreign == 0
    }
}

impl std::fmt::Display for Outstanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} outbox rows pending, {} orders and {} foreign messages neither applied nor \
             dead letters, {} durable-inbox messages unprocessed, {} messages held by the broker",
            self.pending, self.orders, self.foreign, self.inbox, self.busy
        )
    }
}

async fn outstanding(
    admin: &Db,
    names: &Names,
    transport: TransportKind,
    cluster: bool,
) -> anyhow::Result<Outstanding> {
    let settled = |id: &str| {
        format!(
            "(EXISTS (SELECT 1 FROM {e} e WHERE e.event_id = {id})
              OR EXISTS (SELECT 1 FROM {f} d WHERE d.message_id = {id} AND d.dead_at IS NOT NULL)
              OR EXISTS (SELECT 1 FROM {i} m WHERE m.id = {id} AND m.status = 3))",
            e = names.table("effects"),
            f = names.table("inbox_failures"),
            i = names.table("inbox_messages"),
        )
    };
    let (pending, orders, foreign, inbox): (i64, i64, i64, i64) = admin
        .fetch_one(
            format!(
                "SELECT (SELECT count(*) FROM {o} WHERE status IN (0, 9)
                          AND NOT EXISTS (SELECT 1 FROM {d} d WHERE d.id = {o}.id AND d.far)),
                    (SELECT count(*) FROM {orders} r WHERE NOT {order_settled}),
                    (SELECT count(*) FROM {foreign} x WHERE x.confirmed AND NOT {foreign_settled}),
                    (SELECT count(*) FROM {i} WHERE status IN (0, 9))",
                o = names.table("outbox_messages"),
                d = names.table("delayed_events"),
                orders = names.table("orders"),
                order_settled = settled("r.event_id"),
                foreign = names.table("foreign_messages"),
                foreign_settled = settled("x.id"),
                i = names.table("inbox_messages"),
            ),
            Vec::new(),
        )
        .await?;
    let busy = broker_busy(transport, cluster, names).await?;
    Ok(Outstanding {
        pending,
        orders,
        foreign,
        inbox,
        busy,
    })
}

/// How the drain ended.
#[derive(Debug, Clone)]
pub(crate) struct Drained {
    pub(crate) took: Duration,
    /// What stayed unsettled with nothing left to deliver it, if anything (the verdict
    /// counts it).
    pub(crate) unsettled: Option<String>,
}

/// How long the drain waits, with nothing left anywhere to deliver a message, before
/// it takes what is still unsettled as final.
const QUIET: Duration = Duration::from_secs(10);

/// Waits until nothing is outstanding (twice in a row, a second apart), or until
/// nothing could deliver what is still unsettled for [`QUIET`], up to `deadline`.
async fn drain(
    admin: &Db,
    names: &Names,
    transport: TransportKind,
    cluster: bool,
    timeline: &Timeline,
    deadline: Duration,
) -> Result<Drained, String> {
    let started = Instant::now();
    let mut quiet = 0;
    let mut idle_since: Option<Instant> = None;
    let mut last = String::from("not checked yet");
    let mut said = Instant::now();
    loop {
        match outstanding(admin, names, transport, cluster).await {
            Ok(o) if o.done() => {
                quiet += 1;
                if quiet >= 2 {
                    return Ok(Drained {
                        took: started.elapsed(),
                        unsettled: None,
                    });
                }
            }
            Ok(o) => {
                quiet = 0;
                last = o.to_string();
                let since = if o.idle() {
                    *idle_since.get_or_insert_with(Instant::now)
                } else {
                    idle_since = None;
                    Instant::now()
                };
                if since.elapsed() >= QUIET {
                    timeline.say(format!(
                        "draining: nothing left to deliver for {}s: {last}",
                        QUIET.as_secs()
                    ));
                    return Ok(Drained {
                        took: started.elapsed(),
                        unsettled: Some(last),
                    });
                }
                if said.elapsed() > Duration::from_secs(10) {
                    timeline.say(format!("draining: {last}"));
                    said = Instant::now();
                }
            }
            Err(e) => {
                quiet = 0;
                idle_since = None;
                last = format!("cannot check: {e:#}");
            }
        }
        if started.elapsed() > deadline {
            return Err(format!(
                "after {}: {last}",
                humantime::format_duration(Duration::from_secs(deadline.as_secs()))
            ));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Runs the whole harness; returns whether the run passed. The servers' settings as
/// found (`before`) are checked again at the end.
pub(crate) async fn run(args: Args, seed: u64, before: servers::Snapshot) -> anyhow::Result<bool> {
    let bins = Binaries::find(&args)?;
    let names = Names::new(&args.schema());
    let mode = args.consumer_mode();
    let admin = Db::connect(args.database, HARNESS_APP, 4)
        .await
        .with_context(|| {
            format!(
                "connect to {} (is it running? `cargo xtask services`)",
                args.database.server()
            )
        })?;
    let outbox = Outbox::connect(
        args.database,
        &names.schema,
        u32::try_from(args.producers).unwrap_or(8) + 2,
    )
    .await?;
    setup::database(&admin, &outbox, &names).await?;
    // Dropped (slot and publication) when the run ends, however it ends; before the
    // schema when the run passes.
    let mut wal = if args.wal() {
        Some(WalSlot::setup(&bins, &args, &names)?)
    } else {
        None
    };
    setup::broker(args.transport, &names, args.batched, args.cluster).await?;
    let timeline = Timeline::new();

    // RabbitMQ's `max_message_size` lowered for the whole run (before the relays open
    // their channels), so the oversized poison row is refused by the broker itself.
    let size_limit = match args.transport {
        // The clusters' nodes are left at their defaults.
        TransportKind::Rabbit if args.cluster => None,
        TransportKind::Rabbit => match tokio::task::block_in_place(|| {
            RabbitMaxMessageSize::try_set(producers::BROKER_LIMIT)
        }) {
            Ok(guard) => Some(guard),
            Err(e) => {
                timeline.not_injected(
                    FaultKind::Poison,
                    format!("payload over the broker's limit: {}", e.reason),
                );
                None
            }
        },
        TransportKind::Nats => None,
    };
    let poison_kinds = producers::poison_kinds(args.transport, args.database, size_limit.is_some());

    let schedule = Schedule::plan(
        seed,
        Settings {
            transport: args.transport,
            cluster: args.cluster,
            duration: args.duration,
            relays: args.relays,
            consumers: args.consumers,
            fault_window: args.fault_window,
            consumer_outage: consumer_outage(args.transport, args.batched),
        },
    );
    let limit = crash_loop_limit(&schedule);
    print_schedule(&schedule, args.transport, limit);

    let logs = std::env::temp_dir().join(format!("outbox-chaos-{}", names.schema));
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
    println!("chaos: process logs in {}", logs.display());
    let mut supervisor = Supervisor::new(
        (0..args.relays)
            .map(|_| relay_command(&bins, &args, &names, limit))
            .collect(),
        (0..args.consumers)
            .map(|i| consumer_command(&bins, &args, &names, i))
            .collect(),
        &logs,
        seed,
    );
    supervisor.start_all(Role::Consumer, &timeline)?;
    supervisor.start_all(Role::Relay, &timeline)?;

    // Producers.
    let stop_producers = CancellationToken::new();
    let stats = Arc::new(producers::ProducerStats::default());
    let per_producer = f64::from(args.rate) / args.producers as f64;
    let producer_tasks: Vec<_> = (0..args.producers)
        .map(|_| {
            tokio::spawn(producers::produce(
                outbox.clone(),
                names.clone(),
                per_producer,
                Arc::clone(&stats),
                stop_producers.clone(),
            ))
        })
        .collect();

    // The delayed lane, stopped with the producers.
    let delayed_stats = Arc::new(delayed::DelayedStats::default());
    let far_delay = delayed::far_delay(args.duration + args.drain_timeout);
    let delayed_lane = tokio::spawn(delayed::lane(
        outbox.clone(),
        names.clone(),
        far_delay,
        Arc::clone(&delayed_stats),
        timeline.clone(),
        stop_producers.clone(),
    ));

    let phase_start = Instant::now();
    let phase_start_utc = Utc::now();
    // The foreign lane runs as a task of its own (see `foreign::lane`), stopped when
    // the run ends, however it ends.
    let stop_foreign = CancellationToken::new();
    let _stop_foreign = stop_foreign.clone().drop_guard();
    let foreign_lane = tokio::spawn(foreign::lane(
        args.transport,
        names.clone(),
        schedule.foreign.clone(),
        phase_start,
        timeline.clone(),
        stop_foreign,
    ));
    timeline.say(format!(
        "fault phase: {} with {} producers at {} orders/s, {} relays, {} consumers ({})",
        humantime::format_duration(args.duration),
        args.producers,
        args.rate,
        args.relays,
        args.consumers,
        mode.name()
    ));
    // The supervisor runs as a task of its own, so that the lanes' blocking fault
    // commands (`rabbitmqctl` can take seconds) neither delay a kill nor keep a killed
    // process down longer than its pause; it is stopped when the run ends, however it
    // ends (and then kills what it started).
    let stop_supervisor = CancellationToken::new();
    let _stop_supervisor = stop_supervisor.clone().drop_guard();
    let never = CancellationToken::new();
    let supervised = tokio::spawn(supervisor.run(
        schedule.kills.clone(),
        phase_start,
        timeline.clone(),
        stop_supervisor.clone(),
    ));
    let rest = async {
        let lane = |_: ()| injector::Lane {
            transport: args.transport,
            names: &names,
            admin: &admin,
            timeline: &timeline,
            phase_start,
            stop: &never,
        };
        let (broker_lane, database_lane) = (lane(()), lane(()));
        let (_, _, poison_rows, foreign_sent, ()) = tokio::join!(
            broker_lane.run(&schedule.broker),
            database_lane.run(&schedule.database),
            producers::poison_lane(
                &outbox,
                &names,
                &poison_kinds,
                &schedule.poison,
                phase_start,
                &timeline,
                &never,
            ),
            async {
                foreign_lane.await.unwrap_or_else(|e| {
                    timeline.say(format!("the foreign lane failed: {e}"));
                    Vec::new()
                })
            },
            tokio::time::sleep_until(tokio::time::Instant::from_std(phase_start + args.duration)),
        );
        stop_producers.cancel();
        for task in producer_tasks {
            let _ = task.await;
        }
        let _ = delayed_lane.await;
        let phase_end = Utc::now();
        // Every fault is undone: the database answers.
        let recorded = foreign::record(&admin, &names, &foreign_sent)
            .await
            .map_err(|e| format!("{e:#}"));
        timeline.say(format!(
            "fault phase over ({} orders committed): draining, at most {}",
            stats.committed.load(Ordering::Relaxed),
            humantime::format_duration(args.drain_timeout)
        ));
        let drained = drain(
            &admin,
            &names,
            args.transport,
            args.cluster,
            &timeline,
            args.drain_timeout,
        )
        .await;
        stop_supervisor.cancel();
        (poison_rows, foreign_sent, recorded, drained, phase_end)
    };
    let (supervisor, (poison_rows, foreign_sent, recorded, drained, phase_end)) =
        tokio::join!(supervised, rest);
    let supervisor = supervisor.context("the supervisor panicked")?;
    timeline.say("stopping the relays and consumers (SIGTERM)");
    let processes = supervisor.stop_all(Duration::from_secs(20)).await;
    let broker = audit::broker_copies(args.transport, &names)
        .await
        .map_err(|e| format!("{e:#}"));
    tokio::task::block_in_place(move || drop(size_limit));

    let inputs = verdict::Inputs {
        transport: args.transport,
        cluster: args.cluster,
        mode,
        batched: args.batched,
        seed,
        duration: args.duration,
        drain: drained,
        schedule,
        records: timeline.records(),
        processes,
        producer_failures: stats.failed.load(Ordering::Relaxed),
        delayed: delayed_stats,
        poison: poison_rows,
        foreign: foreign_sent,
        foreign_recorded: recorded,
        broker,
        phase: (phase_start_utc, phase_end),
        relays: args.relays,
        consumers: args.consumers,
        crash_loop_limit: limit,
        poison_kinds: poison_kinds.len(),
        lease: args.lease,
        outage_ack_wait: match args.transport {
            TransportKind::Nats => Some(topology::nats_ack_wait(args.batched)),
            TransportKind::Rabbit => None,
        },
    };
    let mut failures = verdict::judge(&admin, &names, &inputs).await?;

    if failures.is_empty() && !args.keep {
        drop(wal.take());
        setup::remove_database(&admin, &names).await?;
        setup::remove_broker(args.transport, &names).await?;
        let _ = std::fs::remove_dir_all(&logs);
    } else {
        println!(
            "\n  kept for inspection: schema {}, the broker's {}, logs in {} (the next run drops them)",
            names.schema,
            match args.transport {
                TransportKind::Rabbit => format!(
                    "exchange {} and queues {}, {} and {}",
                    names.exchange, names.queue, names.audit_queue, names.overflow_queue
                ),
                TransportKind::Nats => format!("stream {}", names.stream),
            },
            logs.display()
        );
    }
    admin.close().await;
    outbox.pool().close().await;

    let (lines, as_found) = tokio::task::block_in_place(|| servers::after(&before, args.cluster));
    println!();
    for l in lines {
        println!("  servers: {l}");
    }
    if !as_found {
        failures.push("the servers are not as the run found them".to_owned());
    }
    println!();
    if failures.is_empty() {
        println!("VERDICT: PASS (seed {seed})");
    } else {
        println!("VERDICT: FAIL (seed {seed})");
        for f in &failures {
            println!("  - {f}");
        }
    }
    Ok(failures.is_empty())
}
