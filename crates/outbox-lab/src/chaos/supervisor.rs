//! The relay and consumer processes: started, killed with `SIGKILL` on the schedule,
//! started again after a pause, and started again too when one exits by itself. Such an
//! exit is recorded ([`Exit`]) and fails the run unless the harness caused it.
//!
//! **What the harness causes** ([`explained_by`]): the exits it asks for by a signal
//! (`SIGKILL` on the schedule, never recorded as an exit; `SIGTERM` at the end, after
//! which a process must exit with code 0 within 20 s), and one documented reaction of
//! the relay to a database fault the harness injected: a relay exits with code 1 (a
//! runtime failure; never a panic, code 101, nor a signal) when a completion cannot be
//! recorded in the database within its lease, or when it cannot connect at start within
//! its pool's acquire timeout (10 s). So a relay's exit with code 1 is explained when
//! it comes while the database is stopped or its connections are being terminated (a
//! `PostgreSQL restarted` or `pg_terminate_backend` fault in the timeline, on MariaDB
//! `MariaDB restarted` or `KILL CONNECTION`), or at most
//! one lease (`--lease`) plus that acquire timeout after such a fault ended. Nothing
//! else explains an exit: not a broker fault (a relay rides those out behind its circuit
//! breaker, with the database as its source of truth), not the consumers' database
//! outage (it locks out the consumers' role alone), not a kill of another process, not
//! poison rows. A consumer never exits by itself: it rides out every fault by
//! reconnecting and deferring, so any exit of a consumer during the run is a bug.

use std::fs::File;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use rand::rngs::StdRng;
use rand::{RngExt as _, SeedableRng as _};
use tokio_util::sync::CancellationToken;

use outboxkit_testkit::faults::skewed_clock_env;

use super::schedule::{FaultKind, Planned, RESTART_PAUSE};
use super::timeline::{Record, Timeline};
use super::topology::TransportKind;

/// What a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Relay,
    Consumer,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::Relay => "relay",
            Self::Consumer => "consumer",
        }
    }
}

/// One supervised process slot (relay 0, consumer 1, ...), across its incarnations.
struct Slot {
    role: Role,
    index: usize,
    command: Command,
    log: PathBuf,
    child: Option<Child>,
    /// When to start it again (after a kill or an exit).
    restart_at: Option<Instant>,
    /// The timeline record of the kill being recovered from.
    kill_record: Option<usize>,
    /// The wall-clock offset of its next start (`RelayClockSkew`), in libfaketime's
    /// syntax ("-1", "+1").
    skew: Option<&'static str>,
    /// Whether it was last started with a skewed clock.
    skewed: bool,
}

impl Slot {
    fn label(&self) -> String {
        format!("{} {}", self.role.name(), self.index)
    }

    fn start(&mut self) -> std::io::Result<u32> {
        let log = File::options().create(true).append(true).open(&self.log)?;
        match self.skew.take().map(skewed_clock_env) {
            Some(Ok(env)) => {
                for (key, value) in env {
                    self.command.env(key, value);
                }
                self.skewed = true;
            }
            // libfaketime was there when the relay was killed: started unskewed.
            Some(Err(_)) | None if self.skewed => {
                for (key, _) in skewed_clock_env("0").unwrap_or_default() {
                    self.command.env_remove(key);
                }
                self.skewed = false;
            }
            Some(Err(_)) | None => {}
        }
        let child = self
            .command
            // Its own process group: a Ctrl-C at the terminal reaches the harness only,
            // which then stops the processes itself.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let pid = child.id();
        self.child = Some(child);
        Ok(pid)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A process that ended without a `SIGKILL` of the harness: by itself during the run,
/// or other than with code 0 after the final `SIGTERM`.
#[derive(Debug, Clone)]
pub(crate) struct Exit {
    pub(crate) role: Role,
    /// "relay 0".
    pub(crate) label: String,
    /// How it ended: "exited with code 1", "killed by signal 6", "did not stop within
    /// 20s, killed".
    pub(crate) how: String,
    /// Its exit code, if it exited.
    pub(crate) code: Option<i32>,
    pub(crate) at: DateTime<Utc>,
    /// After the final `SIGTERM`.
    pub(crate) at_shutdown: bool,
    /// The last line of its log, for the report.
    pub(crate) last_line: String,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{}: {}",
            self.label,
            if self.at_shutdown { " at shutdown" } else { "" },
            self.how
        )?;
        if !self.last_line.is_empty() {
            write!(f, " (its log ends: {})", self.last_line)?;
        }
        Ok(())
    }
}

/// The relay's pool acquire timeout (`outbox relay`'s default): how long a relay
/// starting while the database is down keeps trying to connect before it exits.
const RELAY_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The fault of `records` that explains `exit`, as "PostgreSQL restarted at 43.2 s"
/// (offsets from `origin`), or `None` when the harness did not cause it (see the
/// [module docs](self)). `lease` is the relays' `--lease`.
pub(crate) fn explained_by(
    exit: &Exit,
    records: &[Record],
    lease: Duration,
    origin: DateTime<Utc>,
) -> Option<String> {
    if exit.role != Role::Relay || exit.at_shutdown || exit.code != Some(1) {
        return None;
    }
    let grace = chrono::Duration::from_std(lease + RELAY_CONNECT_TIMEOUT).ok()?;
    records
        .iter()
        .filter(|r| r.injected && matches!(r.kind, FaultKind::DbRestart | FaultKind::DbTerminate))
        .find(|r| r.start <= exit.at && exit.at <= r.end.unwrap_or(r.start) + grace)
        .map(|r| {
            format!(
                "{} at {:.1} s",
                // A database fault's label is the same over either broker.
                r.kind.label(TransportKind::Rabbit),
                (r.start - origin).as_seconds_f64()
            )
        })
}

/// The last non-empty line of the log at `path` (at most 300 characters of it).
fn last_line(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let tail = &text[text.len().saturating_sub(4096)..];
    String::from_utf8_lossy(tail)
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(|l| l.chars().take(300).collect())
        .unwrap_or_default()
}

/// Counts for the verdict.
#[derive(Debug, Default, Clone)]
pub(crate) struct ProcessReport {
    pub(crate) relay_restarts: u32,
    pub(crate) consumer_restarts: u32,
    /// Every exit without a `SIGKILL` of the harness (see [`Exit`]); the verdict decides
    /// which ones the harness caused ([`explained_by`]).
    pub(crate) exits: Vec<Exit>,
    /// Kills planned for a process that was not running, moved to another one.
    pub(crate) retargeted: u32,
}

/// The supervised processes.
pub(crate) struct Supervisor {
    slots: Vec<Slot>,
    report: ProcessReport,
    rng: StdRng,
    /// Relay clock skews injected so far (even: behind, odd: ahead).
    skews: usize,
}

impl Supervisor {
    /// `relays` relay commands and `consumers` consumer commands (not started yet),
    /// logging to files in `logs`; `seed` draws the restart pauses.
    pub(crate) fn new(
        relays: Vec<Command>,
        consumers: Vec<Command>,
        logs: &Path,
        seed: u64,
    ) -> Self {
        let slots = relays
            .into_iter()
            .enumerate()
            .map(|(i, c)| (Role::Relay, i, c))
            .chain(
                consumers
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| (Role::Consumer, i, c)),
            )
            .map(|(role, index, command)| Slot {
                role,
                index,
                log: logs.join(format!("{}-{index}.log", role.name())),
                command,
                child: None,
                restart_at: None,
                kill_record: None,
                skew: None,
                skewed: false,
            })
            .collect();
        Self {
            slots,
            report: ProcessReport::default(),
            rng: StdRng::seed_from_u64(seed ^ 0x05ee_d0fc_4a05),
            skews: 0,
        }
    }

    /// Starts every process of `role`.
    pub(crate) fn start_all(&mut self, role: Role, timeline: &Timeline) -> anyhow::Result<()> {
        for slot in self.slots.iter_mut().filter(|s| s.role == role) {
            let pid = slot.start()?;
            timeline.say(format!("{} started (pid {pid})", slot.label()));
        }
        Ok(())
    }

    /// Runs the kill schedule (`kills`, offsets from `phase_start`) and restarts what
    /// stops, until `stop`; then returns itself, processes still running.
    pub(crate) async fn run(
        mut self,
        kills: Vec<Planned>,
        phase_start: Instant,
        timeline: Timeline,
        stop: CancellationToken,
    ) -> Self {
        let mut kills = kills.into_iter().peekable();
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            while let Some(kill) = kills.next_if(|k| phase_start + k.at <= now) {
                self.kill(kill, &timeline);
            }
            self.reap(&timeline);
            self.restart_due(&timeline);
        }
        self
    }

    /// Kills the planned process, or another running one of its role if it is not
    /// running.
    fn kill(&mut self, plan: Planned, timeline: &Timeline) {
        let role = match plan.kind {
            FaultKind::RelayKill | FaultKind::RelayClockSkew => Role::Relay,
            _ => Role::Consumer,
        };
        if plan.kind == FaultKind::RelayClockSkew
            && let Err(e) = skewed_clock_env("0")
        {
            timeline.not_injected(plan.kind, e.reason);
            return;
        }
        let running: Vec<usize> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.role == role && s.child.is_some())
            .map(|(i, _)| i)
            .collect();
        let planned = self
            .slots
            .iter()
            .position(|s| s.role == role && s.index == plan.target);
        let Some(at) = planned
            .filter(|i| running.contains(i))
            .or_else(|| running.first().copied())
        else {
            timeline.not_injected(plan.kind, format!("no {} was running", role.name()));
            return;
        };
        if Some(at) != planned {
            self.report.retargeted += 1;
        }
        let pause =
            Duration::from_millis(self.rng.random_range(
                RESTART_PAUSE.0.as_millis() as u64..=RESTART_PAUSE.1.as_millis() as u64,
            ));
        let slot = &mut self.slots[at];
        let Some(mut child) = slot.child.take() else {
            return;
        };
        let pid = child.id();
        // If it exited just now, this is not a kill: leave it to `reap`.
        if let Ok(Some(status)) = child.try_wait() {
            slot.child = Some(child);
            timeline.not_injected(
                plan.kind,
                format!("{} had just exited ({status})", slot.label()),
            );
            return;
        }
        let _ = child.kill();
        let _ = child.wait();
        let skew = (plan.kind == FaultKind::RelayClockSkew).then(|| {
            self.skews += 1;
            if self.skews % 2 == 1 { "-1" } else { "+1" }
        });
        slot.skew = skew;
        let record = timeline.injected(
            plan.kind,
            match skew {
                Some(offset) => format!(
                    "{} pid {pid}, started again with its clock {offset} s off",
                    slot.label()
                ),
                None => format!("{} pid {pid}", slot.label()),
            },
        );
        timeline.say(format!(
            "kill -9 {} (pid {pid}); restart in {:.1}s",
            slot.label(),
            pause.as_secs_f64()
        ));
        slot.restart_at = Some(Instant::now() + pause);
        slot.kill_record = Some(record);
    }

    /// Notices processes that exited by themselves and schedules their restart.
    fn reap(&mut self, timeline: &Timeline) {
        for slot in &mut self.slots {
            let Some(child) = &mut slot.child else {
                continue;
            };
            let Ok(Some(status)) = child.try_wait() else {
                continue;
            };
            slot.child = None;
            let exit = Exit {
                role: slot.role,
                label: slot.label(),
                how: describe(status),
                code: status.code(),
                at: Utc::now(),
                at_shutdown: false,
                last_line: last_line(&slot.log),
            };
            timeline.say(format!(
                "{}: {} (not a kill of the harness); restart in 1s",
                exit.label, exit.how
            ));
            self.report.exits.push(exit);
            slot.restart_at = Some(Instant::now() + Duration::from_secs(1));
        }
    }

    fn restart_due(&mut self, timeline: &Timeline) {
        let now = Instant::now();
        for slot in &mut self.slots {
            if slot.restart_at.is_none_or(|at| at > now) {
                continue;
            }
            slot.restart_at = None;
            match slot.start() {
                Ok(pid) => {
                    match slot.role {
                        Role::Relay => self.report.relay_restarts += 1,
                        Role::Consumer => self.report.consumer_restarts += 1,
                    }
                    if let Some(record) = slot.kill_record.take() {
                        timeline.ended(record);
                    }
                    timeline.say(format!("{} started again (pid {pid})", slot.label()));
                }
                Err(e) => {
                    timeline.say(format!(
                        "{} could not start: {e}; retry in 1s",
                        slot.label()
                    ));
                    slot.restart_at = Some(now + Duration::from_secs(1));
                }
            }
        }
    }

    /// Stops every process with SIGTERM, waiting up to `grace` before SIGKILL; returns
    /// the report.
    pub(crate) async fn stop_all(mut self, grace: Duration) -> ProcessReport {
        for slot in &self.slots {
            if let Some(child) = &slot.child {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
            }
        }
        let deadline = Instant::now() + grace;
        loop {
            let mut running = false;
            for slot in &mut self.slots {
                if let Some(child) = &mut slot.child {
                    match child.try_wait() {
                        Ok(Some(status)) => {
                            if !status.success() {
                                self.report.exits.push(Exit {
                                    role: slot.role,
                                    label: slot.label(),
                                    how: describe(status),
                                    code: status.code(),
                                    at: Utc::now(),
                                    at_shutdown: true,
                                    last_line: last_line(&slot.log),
                                });
                            }
                            slot.child = None;
                        }
                        _ => running = true,
                    }
                }
            }
            if !running || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for slot in &mut self.slots {
            if let Some(mut child) = slot.child.take() {
                let _ = child.kill();
                let _ = child.wait();
                self.report.exits.push(Exit {
                    role: slot.role,
                    label: slot.label(),
                    how: format!("did not stop within {grace:?}, killed"),
                    code: None,
                    at: Utc::now(),
                    at_shutdown: true,
                    last_line: last_line(&slot.log),
                });
            }
        }
        std::mem::take(&mut self.report)
    }
}

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}
