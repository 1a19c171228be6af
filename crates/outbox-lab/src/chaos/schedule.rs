//! The fault schedule, drawn from the seed: which faults, when, for how long, against
//! which process. The same seed and settings give the same schedule.
//!
//! Five lanes run at once, each one fault at a time:
//! - **processes**: `kill -9` of a relay (at least 10 per run, spaced so that the
//!   killed relay is back before the next kill) and of a consumer, each restarted after
//!   a pause of 1 to 3 s;
//! - **broker**: freeze, restart, one destination full (the side events' queue or
//!   stream refuses them for half a fault window while the orders' destination must
//!   keep flowing), and for RabbitMQ a memory alarm and a full queue (every message
//!   refused), in rounds (every kind once per round, shuffled), never two at once
//!   (`rabbitmqctl` hangs while the node is frozen); on the clusters (`--cluster`)
//!   instead: the node holding the queue's or stream's leader killed and started again,
//!   a node frozen, a node cut off the network;
//! - **database**: PostgreSQL (or MariaDB) restarted, the relays' and consumers'
//!   connections terminated, and the consumers locked out of it for longer than their NATS
//!   `ack_wait`, in rounds;
//! - **poison**: batches of poison rows, one of each kind per batch;
//! - **foreign**: batches of another producer's messages published straight to the
//!   broker, one of each kind per batch.
//!
//! The swallowing handler is no lane: the producers mark a fixed share of the orders
//! (see `producers::SWALLOW_EVERY`).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom as _;
use rand::{RngExt as _, SeedableRng as _};

use super::db::Database;
use super::topology::TransportKind;

/// A kind of fault, as the verdict table lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum FaultKind {
    RelayKill,
    /// A relay killed and started again with its wall clock 1 s off the database's
    /// (libfaketime), until its next kill.
    RelayClockSkew,
    ConsumerKill,
    BrokerFreeze,
    BrokerRestart,
    NodeKill,
    NodeFreeze,
    NodePartition,
    MemoryAlarm,
    QueueFull,
    DestinationFull,
    DbRestart,
    DbTerminate,
    ConsumerLockout,
    Poison,
    Foreign,
    Swallow,
}

impl FaultKind {
    /// Every kind that applies to `transport` on a single server or (`cluster`) on the
    /// clusters, in table order.
    pub(crate) fn all(transport: TransportKind, cluster: bool) -> Vec<Self> {
        let mut kinds = vec![Self::RelayKill, Self::RelayClockSkew, Self::ConsumerKill];
        if cluster {
            kinds.extend(Self::CLUSTER_BROKER);
        } else {
            kinds.extend([Self::BrokerFreeze, Self::BrokerRestart]);
            if transport == TransportKind::Rabbit {
                kinds.extend([Self::MemoryAlarm, Self::QueueFull]);
            }
            kinds.push(Self::DestinationFull);
        }
        kinds.extend([
            Self::DbRestart,
            Self::DbTerminate,
            Self::ConsumerLockout,
            Self::Poison,
            Self::Foreign,
            Self::Swallow,
        ]);
        kinds
    }

    /// The broker lane's kinds on the clusters.
    const CLUSTER_BROKER: [Self; 3] = [Self::NodeKill, Self::NodeFreeze, Self::NodePartition];

    /// The table's name of the kind.
    pub(crate) fn label(self, transport: TransportKind) -> &'static str {
        match (self, transport) {
            (Self::NodeKill, TransportKind::Rabbit) => "RabbitMQ leader's node kill -9",
            (Self::NodeKill, TransportKind::Nats) => "NATS leader's node kill -9",
            (Self::NodeFreeze, TransportKind::Rabbit) => "RabbitMQ node frozen",
            (Self::NodeFreeze, TransportKind::Nats) => "NATS node frozen",
            (Self::NodePartition, _) => "node cut off (partition)",
            (Self::RelayKill, _) => "relay kill -9",
            (Self::RelayClockSkew, _) => "relay clock 1 s off (faketime)",
            (Self::ConsumerKill, _) => "consumer kill -9",
            (Self::BrokerFreeze, TransportKind::Rabbit) => "RabbitMQ frozen (SIGSTOP)",
            (Self::BrokerFreeze, TransportKind::Nats) => "NATS frozen (SIGSTOP)",
            (Self::BrokerRestart, TransportKind::Rabbit) => "RabbitMQ restarted",
            (Self::BrokerRestart, TransportKind::Nats) => "NATS restarted",
            (Self::MemoryAlarm, _) => "RabbitMQ memory alarm",
            (Self::QueueFull, _) => "queue full (reject-publish)",
            (Self::DestinationFull, TransportKind::Rabbit) => "one destination's queue full",
            (Self::DestinationFull, TransportKind::Nats) => "one destination's stream full",
            (Self::DbRestart, _) => match super::db::database() {
                Database::Postgres => "PostgreSQL restarted",
                Database::Mysql => "MariaDB restarted",
            },
            (Self::DbTerminate, _) => match super::db::database() {
                Database::Postgres => "pg_terminate_backend",
                Database::Mysql => "KILL CONNECTION",
            },
            (Self::ConsumerLockout, _) => "consumers' database outage",
            (Self::Poison, _) => "poison rows",
            (Self::Foreign, _) => "foreign messages",
            (Self::Swallow, _) => "handler swallows an error",
        }
    }
}

/// One planned fault.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    pub(crate) kind: FaultKind,
    /// When, from the start of the fault phase.
    pub(crate) at: Duration,
    /// How long the fault is held (the down time of a restart; zero for an instant
    /// fault).
    pub(crate) hold: Duration,
    /// For a kill: which process (relay or consumer index); for a node fault, which
    /// node (0 to 2) where the fault does not pick its own; otherwise 0.
    pub(crate) target: usize,
}

/// The whole schedule, lane by lane.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    pub(crate) kills: Vec<Planned>,
    pub(crate) broker: Vec<Planned>,
    pub(crate) database: Vec<Planned>,
    pub(crate) poison: Vec<Planned>,
    pub(crate) foreign: Vec<Planned>,
    /// Kinds that did not fit in the run at all, with why.
    pub(crate) unscheduled: Vec<(FaultKind, String)>,
}

/// What the schedule depends on besides the seed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) transport: TransportKind,
    /// On the 3-node clusters: node faults in the broker lane.
    pub(crate) cluster: bool,
    pub(crate) duration: Duration,
    pub(crate) relays: usize,
    pub(crate) consumers: usize,
    pub(crate) fault_window: Duration,
    /// The shortest consumers' database outage (it lasts up to 5 s more).
    pub(crate) consumer_outage: Duration,
}

/// Quiet time at the start, before the first fault (the pipeline warms up).
fn warmup(duration: Duration) -> Duration {
    (duration / 12).clamp(Duration::from_secs(3), Duration::from_secs(20))
}

/// The pause before a killed process is started again.
pub(crate) const RESTART_PAUSE: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(3));
/// Least time between two relay kills: longer than the longest restart pause, so the
/// relay killed before is running again.
const MIN_KILL_SPACING: Duration = Duration::from_secs(4);

impl Schedule {
    /// Draws the schedule of a run.
    pub(crate) fn plan(seed: u64, s: Settings) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let start = warmup(s.duration);
        // The last faults end a little before the phase does.
        let end = s.duration.saturating_sub(Duration::from_secs(3));
        let mut schedule = Self {
            kills: Vec::new(),
            broker: Vec::new(),
            database: Vec::new(),
            poison: Vec::new(),
            foreign: Vec::new(),
            unscheduled: Vec::new(),
        };

        // Relay kills: at least 10, one per 20 s of a longer run.
        let relay_kills = (s.duration.as_secs() / 20).max(10) as usize;
        let mut kills = spaced(
            &mut rng,
            start,
            end,
            relay_kills,
            MIN_KILL_SPACING,
            FaultKind::RelayKill,
            s.relays,
        );
        let consumer_kills = (s.duration.as_secs() / 60).max(3) as usize;
        kills.extend(spaced(
            &mut rng,
            start,
            end,
            consumer_kills,
            Duration::from_secs(10),
            FaultKind::ConsumerKill,
            s.consumers,
        ));
        kills.sort_by_key(|p| p.at);
        schedule.kills = kills;

        let broker_kinds: Vec<FaultKind> = match s.transport {
            _ if s.cluster => FaultKind::CLUSTER_BROKER.to_vec(),
            TransportKind::Rabbit => vec![
                FaultKind::BrokerFreeze,
                FaultKind::BrokerRestart,
                FaultKind::MemoryAlarm,
                FaultKind::QueueFull,
                FaultKind::DestinationFull,
            ],
            TransportKind::Nats => vec![
                FaultKind::BrokerFreeze,
                FaultKind::BrokerRestart,
                FaultKind::DestinationFull,
            ],
        };
        let window = s.fault_window;
        let (broker, left_out) =
            rounds(
                &mut rng,
                start,
                end,
                &broker_kinds,
                40,
                |kind, rng| match kind {
                    FaultKind::BrokerRestart | FaultKind::NodeKill => {
                        rng.random_range(3_000..=6_000)
                    }
                    // Long enough for a stall of the other destination to show, short
                    // enough to fit a CI run beside the broker-wide faults.
                    FaultKind::DestinationFull => {
                        u64::try_from((window / 2).as_millis()).unwrap_or(u64::MAX)
                    }
                    _ => u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
                },
            );
        // The node of a node fault (a single server's runs draw nothing more, so their
        // seeds keep their schedules).
        schedule.broker = if s.cluster {
            broker
                .into_iter()
                .map(|p| Planned {
                    target: rng.random_range(0..3),
                    ..p
                })
                .collect()
        } else {
            broker
        };
        schedule.unscheduled.extend(left_out);

        // The database lane starts a little later, so its first fault rarely lands on
        // the broker lane's first one.
        let db_start = start + Duration::from_millis(rng.random_range(2_000..=8_000));
        let outage = u64::try_from(s.consumer_outage.as_millis()).unwrap_or(u64::MAX);
        let (database, left_out) = rounds(
            &mut rng,
            db_start,
            end,
            &[
                FaultKind::DbRestart,
                FaultKind::DbTerminate,
                FaultKind::ConsumerLockout,
            ],
            90,
            |kind, rng| match kind {
                FaultKind::DbRestart => rng.random_range(2_000..=5_000),
                FaultKind::ConsumerLockout => rng.random_range(outage..=outage + 5_000),
                _ => 0,
            },
        );
        schedule.database = database;
        schedule.unscheduled.extend(left_out);

        // Poison rows: 3 batches, one more per 5 minutes past 10.
        let batches = 3 + (s.duration.as_secs().saturating_sub(600) / 300) as usize;
        schedule.poison = spaced(
            &mut rng,
            start,
            end,
            batches,
            Duration::from_secs(1),
            FaultKind::Poison,
            1,
        );
        // Foreign messages: as many batches as poison rows.
        schedule.foreign = spaced(
            &mut rng,
            start,
            end,
            batches,
            Duration::from_secs(1),
            FaultKind::Foreign,
            1,
        );
        // Relay clock skews, drawn last so that each seed keeps the rest of its
        // schedule: at least 2, one more per 2 minutes past 4; a relay killed and started
        // again with its wall clock 1 s behind the database's (the first, third, ...) or
        // ahead of it, until its next kill (see `supervisor`).
        let skews = (s.duration.as_secs() / 120).max(2) as usize;
        schedule.kills.extend(spaced(
            &mut rng,
            start,
            end,
            skews,
            MIN_KILL_SPACING,
            FaultKind::RelayClockSkew,
            s.relays,
        ));
        schedule.kills.sort_by_key(|p| p.at);
        schedule
    }

    /// Relay kills planned.
    pub(crate) fn relay_kills(&self) -> usize {
        self.kills
            .iter()
            .filter(|p| p.kind == FaultKind::RelayKill)
            .count()
    }

    /// How many faults of `kind` are planned.
    pub(crate) fn planned(&self, kind: FaultKind) -> usize {
        self.kills
            .iter()
            .chain(&self.broker)
            .chain(&self.database)
            .chain(&self.poison)
            .chain(&self.foreign)
            .filter(|p| p.kind == kind)
            .count()
    }
}

/// `n` instants in `[start, end)`, each in its own slot of equal length with a random
/// offset, consecutive ones at least `spacing` apart; each with a random target below
/// `targets`.
fn spaced(
    rng: &mut StdRng,
    start: Duration,
    end: Duration,
    n: usize,
    spacing: Duration,
    kind: FaultKind,
    targets: usize,
) -> Vec<Planned> {
    let span = end.saturating_sub(start);
    let n = n.min((span.as_millis() / spacing.as_millis().max(1)) as usize);
    if n == 0 {
        return Vec::new();
    }
    let slot = span / u32::try_from(n).unwrap_or(u32::MAX);
    let jitter = slot.saturating_sub(spacing).as_millis() as u64;
    (0..n)
        .map(|i| Planned {
            kind,
            at: start
                + slot * u32::try_from(i).unwrap_or(u32::MAX)
                + Duration::from_millis(rng.random_range(0..=jitter)),
            hold: Duration::ZERO,
            target: rng.random_range(0..targets.max(1)),
        })
        .collect()
}

/// Rounds of `kinds` (each once per round, shuffled) from `start` until `end`, one at a
/// time with random gaps of at most `max_gap_secs`. The gaps shrink to fit a short run;
/// a kind that does not fit even in the first round is returned as left out.
fn rounds(
    rng: &mut StdRng,
    start: Duration,
    end: Duration,
    kinds: &[FaultKind],
    max_gap_secs: u64,
    mut hold_ms: impl FnMut(FaultKind, &mut StdRng) -> u64,
) -> (Vec<Planned>, Vec<(FaultKind, String)>) {
    let mut planned = Vec::new();
    let mut left_out = Vec::new();
    let span = end.saturating_sub(start).as_millis() as u64;
    // Room for the gaps of one round, at most `max_gap_secs` each.
    let holds_guess: u64 = kinds.iter().map(|k| hold_ms(*k, rng)).sum();
    let per_gap =
        (span.saturating_sub(holds_guess) / (kinds.len() as u64 + 1)).min(max_gap_secs * 1_000);
    let gap_max = per_gap.max(1_000);
    let gap_min = (gap_max / 3).clamp(500, 30_000);
    let mut t = start.as_millis() as u64;
    let end = end.as_millis() as u64;
    let mut first_round = true;
    loop {
        let mut round = kinds.to_vec();
        round.shuffle(rng);
        for kind in round {
            let hold = hold_ms(kind, rng);
            let gap = rng.random_range(gap_min..=gap_max);
            if t + gap + hold > end {
                if first_round {
                    left_out.push((
                        kind,
                        "not scheduled: the run is too short for it".to_owned(),
                    ));
                    continue;
                }
                return (planned, left_out);
            }
            t += gap;
            planned.push(Planned {
                kind,
                at: Duration::from_millis(t),
                hold: Duration::from_millis(hold),
                target: 0,
            });
            t += hold;
        }
        if !left_out.is_empty() {
            return (planned, left_out);
        }
        first_round = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(transport: TransportKind, secs: u64) -> Settings {
        Settings {
            transport,
            cluster: false,
            duration: Duration::from_secs(secs),
            relays: 2,
            consumers: 2,
            fault_window: Duration::from_secs(20),
            consumer_outage: Duration::from_secs(15),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = Schedule::plan(7, settings(TransportKind::Rabbit, 900));
        let b = Schedule::plan(7, settings(TransportKind::Rabbit, 900));
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        let c = Schedule::plan(8, settings(TransportKind::Rabbit, 900));
        assert_ne!(format!("{a:?}"), format!("{c:?}"));
    }

    #[test]
    fn a_short_run_still_schedules_every_kind_and_ten_relay_kills() {
        // The CI runs, and NATS one message at a time (a 35 s outage: `ack_wait` 30 s).
        for (transport, secs, outage) in [
            (TransportKind::Rabbit, 100, 15),
            (TransportKind::Nats, 90, 15),
            (TransportKind::Nats, 90, 35),
        ] {
            for seed in 0..50 {
                let s = Schedule::plan(
                    seed,
                    Settings {
                        consumer_outage: Duration::from_secs(outage),
                        ..settings(transport, secs)
                    },
                );
                assert!(s.unscheduled.is_empty(), "{seed}: {:?}", s.unscheduled);
                assert!(s.relay_kills() >= 10, "{seed}");
                for kind in FaultKind::all(transport, false) {
                    // The swallowing handler is not scheduled: a share of the orders.
                    if kind != FaultKind::Swallow {
                        assert!(s.planned(kind) >= 1, "{seed}: {kind:?}");
                    }
                }
                let lockout = s
                    .database
                    .iter()
                    .find(|p| p.kind == FaultKind::ConsumerLockout)
                    .expect("a lockout");
                assert!(lockout.hold >= Duration::from_secs(outage), "{seed}");
            }
        }
    }

    #[test]
    fn a_cluster_run_schedules_node_faults_instead_of_server_faults() {
        for transport in [TransportKind::Rabbit, TransportKind::Nats] {
            for seed in 0..20 {
                let s = Schedule::plan(
                    seed,
                    Settings {
                        cluster: true,
                        ..settings(transport, 600)
                    },
                );
                assert!(s.unscheduled.is_empty(), "{seed}: {:?}", s.unscheduled);
                for kind in FaultKind::all(transport, true) {
                    if kind != FaultKind::Swallow {
                        assert!(s.planned(kind) >= 1, "{seed}: {kind:?}");
                    }
                }
                for kind in [FaultKind::BrokerFreeze, FaultKind::BrokerRestart] {
                    assert_eq!(s.planned(kind), 0, "{seed}: {kind:?}");
                }
                assert!(s.broker.iter().all(|p| p.target < 3), "{seed}");
            }
        }
    }

    #[test]
    fn relay_kills_are_spaced_and_lanes_do_not_overlap() {
        for seed in 0..50 {
            let s = Schedule::plan(seed, settings(TransportKind::Rabbit, 900));
            let kills: Vec<_> = s
                .kills
                .iter()
                .filter(|p| p.kind == FaultKind::RelayKill)
                .collect();
            for w in kills.windows(2) {
                assert!(w[1].at - w[0].at >= MIN_KILL_SPACING, "{seed}");
            }
            for lane in [&s.broker, &s.database] {
                for w in lane.windows(2) {
                    assert!(w[0].at + w[0].hold <= w[1].at, "{seed}");
                }
                assert!(
                    lane.iter()
                        .all(|p| p.at + p.hold <= Duration::from_secs(900))
                );
            }
        }
    }
}
