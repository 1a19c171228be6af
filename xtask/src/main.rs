//! Project automation, run as `cargo xtask <command>`.
//!
//! * `cargo xtask services` brings PostgreSQL, MariaDB, RabbitMQ and NATS up (Docker
//!   Compose when a Docker engine is reachable, the locally installed servers
//!   otherwise), installs libfaketime when missing (the clock-skew tests), and prints
//!   their status.
//! * `cargo xtask itest [--cluster] [-- ARGS]` checks the facade's feature combinations
//!   (as `cargo xtask features`; seconds with a warm cache) and what publishing needs (as
//!   `cargo xtask release-check --no-verify`, with the docs on the current toolchain
//!   rather than nightly), brings the services up (with `--cluster`
//!   the broker clusters too, as `cargo xtask services --cluster`, stopped again at the
//!   end if it started them, and their tests run in a pass of their own), runs the
//!   quick start in a project outside the workspace on the packages just made (as
//!   `cargo xtask outside`: about 10 s warm there, the packages being release-check's), installs
//!   Chromium and chromedriver for the dashboard's browser tests and libfaketime for
//!   the clock-skew tests when missing (apt-get, `packages.rs`), then runs every test
//!   of the
//!   workspace (`cargo test --workspace --all-targets ARGS`; with `MSSQL_URL` set, a
//!   second pass runs the SQL Server tests, `#[ignore = "needs MSSQL_URL"]`, with
//!   `--ignored`), a 500-order demo run over RabbitMQ and one over NATS whose
//!   reconciliations must be exact, the doc tests, and last a short chaos run over
//!   each broker and one of the WAL relay (`--source wal`) over RabbitMQ.
//! * `cargo xtask scale [-- ARGS]` runs the tests at production scale (`at_scale_*`,
//!   ignored otherwise: 300,000 held rows, a 1,000,000-row transaction, ...), one at a
//!   time; not part of `itest`.
//! * `cargo xtask demo [-- ARGS]` runs the orders example against the services.
//! * `cargo xtask bench [-- ARGS]` runs the benchmark (`crates/outbox-lab`).
//! * `cargo xtask chaos [-- ARGS]` builds `outbox` and the chaos harness (release)
//!   and runs it: relay and consumer processes killed, servers frozen and restarted,
//!   and a verdict that counts every message.
//! * `cargo xtask lint` checks formatting and runs clippy with warnings denied.
//! * `cargo xtask features` checks that the `outboxkit` facade crate builds with each
//!   feature combination a user can pick (none, each alone, each database × broker
//!   pair, with and without `inbox`, all), and the `outbox` binary with each database
//!   × broker pair.
//! * `cargo xtask outside` packs the published crates (`cargo package`), makes a new
//!   cargo project outside the workspace that depends on the unpacked packages, builds
//!   it and runs the quick start on PostgreSQL and on MariaDB, over RabbitMQ and over
//!   NATS, each until its event is projected (see `outside.rs`); part of `itest`.
//! * `cargo xtask release-check [--strict] [--no-verify]` checks what publishing the crates needs
//!   without publishing: manifests (licenses, MSRV, docs.rs metadata, `publish =
//!   false` where due), the MSRV, `cargo doc` with warnings denied, `cargo package` of
//!   every published crate, `cargo deny`, and a CHANGELOG (see `release.rs`).
//!
//! Child processes get `DATABASE_URL`, `MYSQL_URL`, `AMQP_URL` and `NATS_URL` pointing at
//! the local services unless those variables are already set.

mod cluster;
mod docs_once;
mod features;
mod outside;
mod packages;
mod release;
mod scale;
mod services;
mod sqlserver;
#[cfg(test)]
mod tidy;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

/// Connection settings handed to child processes when not already set.
const ENV_DEFAULTS: [(&str, &str); 4] = [
    ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
    ("MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
    ("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
    ("NATS_URL", "nats://127.0.0.1:4222"),
];

/// Project automation for the outbox workspace.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", version, about)]
struct Cli {
    /// Seconds to wait for the services to become ready.
    #[arg(
        long,
        global = true,
        env = "XTASK_SERVICE_TIMEOUT",
        default_value_t = 90,
        value_name = "SECS"
    )]
    service_timeout: u64,

    #[command(subcommand)]
    command: Cmd,
}

/// The xtask subcommands.
#[derive(Debug, Subcommand)]
enum Cmd {
    /// Ensure PostgreSQL, MariaDB, RabbitMQ and NATS are up and print their status.
    ///
    /// With `--cluster`, also a 3-node RabbitMQ cluster (AMQP 5681-5683) and a 3-node
    /// NATS JetStream cluster (4231-4233) of the project's own, data under
    /// `target/cluster/`; `--cluster --stop` stops them.
    Services {
        /// Also start the 3-node RabbitMQ and NATS clusters.
        #[arg(long)]
        cluster: bool,
        /// With `--cluster`: stop the clusters' nodes instead (data kept).
        #[arg(long, requires = "cluster")]
        stop: bool,
    },
    /// Check the `outboxkit` facade's feature combinations, ensure the services, then run all workspace tests and the doc tests.
    ///
    /// ARGS go to `cargo test --workspace --all-targets` unchanged; to reach
    /// the test harness use a second `--`, e.g.
    /// `cargo xtask itest -- -- --nocapture`.
    Itest {
        /// Also start the broker clusters (as `services --cluster`; stopped again at
        /// the end if this run started them) and run their tests (`on_cluster_*`,
        /// ignored otherwise) after the main pass: about 8 minutes more.
        #[arg(long)]
        cluster: bool,
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Ensure the services, then run the tests at production scale (`at_scale_*`,
    /// `#[ignore = "at production scale: cargo xtask scale"]`), one at a time: each
    /// takes minutes and the whole machine, so `itest` (CI) leaves them out.
    ///
    /// ARGS go to `cargo test --workspace --all-targets` up to a `--`, the rest to the
    /// test harness, e.g. `cargo xtask scale -- -p outboxkit-postgres -- --nocapture`.
    Scale {
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Ensure the services, then run the orders example (release build).
    Demo {
        /// Extra arguments for the example binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Ensure the services, then run the benchmark (release build, with `outbox`
    /// beside it for `--relay-process` and `--backlog`).
    Bench {
        /// Extra arguments for the bench binary.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Ensure the services, build `outbox` and the chaos harness (release), then run
    /// it: real relay and consumer processes killed, the broker and the database
    /// frozen and restarted, and a verdict that counts every message.
    ///
    /// ARGS go to the harness, e.g. `cargo xtask chaos -- --transport nats
    /// --duration 15m` (see `cargo xtask chaos -- --help`).
    Chaos {
        /// Extra arguments for the chaos harness.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Check formatting and run clippy with warnings denied.
    Lint,
    /// `cargo check` the `outboxkit` facade crate with every feature combination a user
    /// can pick: none, each feature alone, each database × broker pair with and without
    /// `inbox`, and all features; and `outboxkit-cli` with each database × broker pair.
    Features,
    /// Build the quick start in a new cargo project outside the workspace, on the
    /// packaged crates (`cargo package`, unpacked), and run it on PostgreSQL and on
    /// MariaDB, over RabbitMQ and over NATS, until each run's event is projected.
    Outside {
        /// Use the packages as the last `release-check` (or `outside`) left them
        /// unpacked under `TARGET/package`, instead of making them again.
        #[arg(long)]
        unpacked: bool,
        /// Then `cargo install --path crates/outbox-cli` outside the workspace (no
        /// lock, no patch: the newest dependencies the manifests allow; `--debug`), and
        /// the installed `outbox` migrates and relays a message to NATS. A cold build
        /// of its own (minutes): not part of `itest`.
        #[arg(long)]
        install: bool,
    },
    /// Build the facade's docs (`cargo doc -p outboxkit --all-features --no-deps`) and
    /// check that they list each item under one path (release-check does too).
    DocsOnce {
        /// Check the docs `TARGET/doc` holds (e.g. release-check's, every member crate
        /// documented) instead of building the facade's.
        #[arg(long)]
        no_build: bool,
    },
    /// Check what publishing the crates needs, without publishing: manifests, MSRV,
    /// docs (warnings denied), `cargo package` of every published crate, `cargo deny`.
    ReleaseCheck {
        /// Also fail on what could not be checked here (advisories offline, ...) and on
        /// what blocks publishing (crate names taken, placeholder repository URL).
        #[arg(long)]
        strict: bool,
        /// Make and unpack the packages without building each from its `.crate` (a
        /// cold build of every dependency); their included files are still checked.
        #[arg(long)]
        no_verify: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let timeout = Duration::from_secs(cli.service_timeout);
    match cli.command {
        Cmd::Services {
            cluster: true,
            stop: true,
        } => cluster::down(),
        Cmd::Services { cluster, stop: _ } => {
            services::ensure(timeout)?;
            packages::FAKETIME.ensure()?;
            if cluster {
                cluster::up(timeout)?;
            }
            Ok(())
        }
        Cmd::Itest { cluster, args } => {
            // First: a build break fails the run before any service is needed.
            features::check()?;
            // What publishing needs (docs as docs.rs builds them, the packages, licenses,
            // MSRV): a failure fails the run; the publishing blockers (crate names taken,
            // the placeholder repository URL) are reported, not failed on (`--strict`).
            // Packages unpacked and their included files checked, not built again from
            // the `.crate`s, and the docs built on the current toolchain, reusing the
            // feature check's builds (cold builds of every dependency: `release-check`
            // does both).
            release::check(false, release::Depth::Quick)?;
            services::ensure(timeout)?;
            // A user's project outside the workspace on the packages release-check just
            // made and unpacked: the quick start on each database over each broker.
            outside::run(false, false)?;
            // The broker clusters' tests (`tests/cluster.rs`) run in a pass of their own.
            let _clusters = if cluster {
                Some(cluster::ForRun::up(timeout)?)
            } else {
                None
            };
            // The dashboard's browser tests drive Debian's Chromium; the clock-skew
            // tests preload libfaketime.
            packages::BROWSER.ensure()?;
            packages::FAKETIME.ensure()?;
            sqlserver::announce_skip(None);
            let mut tests = cargo();
            tests
                .args(["test", "--workspace", "--all-targets"])
                // The process tests' hooks (never in a released binary), and every
                // database and the inbox in the facade, so that its `AnyStore` test and
                // its examples (the README's quick start among them) are built and run.
                .args([
                    "--features",
                    "outboxkit-cli/testing,outboxkit/mysql,outboxkit/sqlserver,outboxkit/inbox",
                ])
                .args(&args);
            env_default(&mut tests, "RUST_BACKTRACE", "1");
            run_child(&mut tests)?;
            let sqlserver_skipped = sqlserver::run_or_count(&args)?;
            if cluster {
                let mut tests = cluster::tests(&args);
                env_default(&mut tests, "RUST_BACKTRACE", "1");
                run_child(&mut tests)?;
            } else {
                eprintln!(
                    "xtask: the broker clusters' tests (#[ignore = \"{}\"]) do not run: \
                     `cargo xtask itest --cluster` runs them",
                    cluster::IGNORE_REASON
                );
            }

            // The main job must keep working: short demo runs over each broker (debug
            // build, already compiled by the tests) whose reconciliation fails the run
            // on any mismatch.
            for transport in ["rabbit", "nats"] {
                let mut demo = cargo();
                demo.args(["run", "--quiet", "-p", "orders-example", "--"])
                    .args(["--orders", "500", "--transport", transport]);
                run_child(&mut demo)?;
            }

            let mut doc = cargo();
            doc.args(["test", "--workspace", "--doc"]);
            env_default(&mut doc, "RUST_BACKTRACE", "1");
            run_child(&mut doc)?;

            // Last, so that no test touching the shared servers runs meanwhile: a short
            // chaos run over each broker and one of the WAL relay (every fault kind, at
            // least 10 relay kills),
            // whose verdict must pass. On the debug binaries the test run built
            // (`outbox-lab/tests/bins.rs` makes cargo build the lab's): the verdict counts
            // messages, not speed: 200 orders/s is below a debug relay's rate, and the
            // drain after the faults (debug consumers, about 75 s over RabbitMQ here) has
            // the harness's default 150 s; a release build of their own took 12-18
            // minutes of the run here.
            for bin in CHAOS_BINS {
                let path = lab_path(bin, Profile::Dev);
                if !path.exists() {
                    bail!(
                        "{} is missing: the test run builds it (`cargo xtask itest` with a test filter that skips it?)",
                        path.display()
                    );
                }
            }
            for (transport, duration, extra) in CI_CHAOS_RUNS {
                let started = Instant::now();
                run_child(
                    lab_command("chaos", Profile::Dev)
                        .args([
                            "--transport",
                            transport,
                            "--duration",
                            duration,
                            "--drain-timeout",
                            "150s",
                        ])
                        .args(extra),
                )?;
                eprintln!(
                    "xtask: chaos run over {transport} took {:.0} s",
                    started.elapsed().as_secs_f64()
                );
            }
            // Repeated at the end, where a reader of the run looks.
            sqlserver::announce_skip(sqlserver_skipped);
            Ok(())
        }
        Cmd::Outside { unpacked, install } => {
            services::ensure(timeout)?;
            outside::run(!unpacked, install)
        }
        Cmd::Scale { args } => {
            services::ensure(timeout)?;
            eprintln!(
                "xtask: the tests marked #[ignore = \"{}\"], one at a time",
                scale::IGNORE_REASON
            );
            let mut tests = scale::tests(&args);
            env_default(&mut tests, "RUST_BACKTRACE", "1");
            run_child(&mut tests)
        }
        Cmd::Demo { args } => {
            services::ensure(timeout)?;
            let mut demo = cargo();
            demo.args(["run", "--release", "-p", "orders-example", "--"])
                .args(&args);
            run_child(&mut demo)
        }
        Cmd::Bench { args } => {
            services::ensure(timeout)?;
            // `--relay-process` and `--backlog` run the release `outbox` beside the bench.
            build_lab(&["outbox", "bench"])?;
            let bench =
                |args: &[OsString]| run_child(lab_command("bench", Profile::Release).args(args));
            if args.iter().any(|a| a == "--cluster") {
                // The same measurement on the single servers first, then on the
                // clusters: one run shows what the replication costs.
                cluster::up(timeout)?;
                let single: Vec<OsString> =
                    args.iter().filter(|a| *a != "--cluster").cloned().collect();
                eprintln!("xtask: bench on the single servers, then on the clusters");
                bench(&single)?;
            }
            bench(&args)
        }
        Cmd::Chaos { args } => {
            services::ensure(timeout)?;
            if args.iter().any(|a| a == "--cluster") {
                cluster::up(timeout)?;
            }
            build_lab(&CHAOS_BINS)?;
            let mut chaos = lab_command("chaos", Profile::Release);
            chaos.args(&args);
            exec_child(&mut chaos)
        }
        Cmd::Features => features::check(),
        Cmd::DocsOnce { no_build } => {
            if !no_build {
                run_child(cargo().args(["doc", "-p", "outboxkit", "--all-features", "--no-deps"]))?;
            }
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map_or_else(|| workspace_root().join("target"), PathBuf::from);
            let problems = docs_once::check(&target.join("doc"))?;
            if problems.is_empty() {
                eprintln!("xtask: docs-once: each item is listed once");
                Ok(())
            } else {
                bail!("the facade's docs:\n  {}", problems.join("\n  "))
            }
        }
        Cmd::ReleaseCheck { strict, no_verify } => release::check(
            strict,
            if no_verify {
                release::Depth::NoVerify
            } else {
                release::Depth::Full
            },
        ),
        Cmd::Lint => {
            // Run both so one invocation reports every problem.
            let fmt = run_child(cargo().args(["fmt", "--all", "--", "--check"]));
            let clippy = run_child(cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]));
            match (fmt, clippy) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
                (Err(fmt), Err(clippy)) => bail!("{fmt:#}; {clippy:#}"),
            }
        }
    }
}

/// The short chaos runs of `cargo xtask itest`: transport, fault phase and extra
/// arguments (each run with its drain and verdict stays under 3 minutes). The RabbitMQ
/// runs' consumers take one transaction per delivery, the NATS run's one per batch; the
/// third run has the relays read the write-ahead log (`--source wal`: one reads the
/// slot, the other stands by), over RabbitMQ for its queue-full and alarm faults.
const CI_CHAOS_RUNS: [(&str, &str, &[&str]); 3] = [
    ("rabbit", "100s", &[]),
    ("nats", "90s", &["--batched"]),
    ("rabbit", "100s", &["--source", "wal"]),
];

/// What a chaos run starts: the `outbox` relay, the harness and its consumer.
const CHAOS_BINS: [&str; 3] = ["outbox", "chaos", "chaos-consumer"];

/// Which build of the lab's binaries to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Profile {
    /// [`build_lab`]'s: the bench and `cargo xtask chaos`.
    Release,
    /// The test run's: itest's short chaos runs.
    Dev,
}

impl Profile {
    /// The directory of its binaries under the target directory.
    fn dir(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Dev => "debug",
        }
    }
}

/// Builds `bins` of `outboxkit-cli` and `outboxkit-lab` (release) with both packages
/// selected, for the bench and the chaos harness alike: cargo resolves features over
/// the packages selected, so building them apart rebuilt about 40 crates each time the
/// selection changed.
fn build_lab(bins: &[&str]) -> Result<()> {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "outboxkit-cli",
        "-p",
        "outboxkit-lab",
    ]);
    for bin in bins {
        build.args(["--bin", bin]);
    }
    run_child(&mut build)
}

/// Binary `bin` of `profile` (the chaos harness finds `outbox` and `chaos-consumer`
/// next to itself), run from the workspace root with the service URLs defaulted.
fn lab_command(bin: &str, profile: Profile) -> Command {
    in_workspace(lab_path(bin, profile))
}

/// Where the build of `profile` puts `bin`.
fn lab_path(bin: &str, profile: Profile) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from);
    target.join(profile.dir()).join(bin)
}

/// Replaces this process with `cmd` (Unix), so that a Ctrl-C reaches the harness alone
/// and the shell waits until it has undone its faults; elsewhere runs it as a child.
fn exec_child(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: running `{}`", display(cmd));
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt as _;
        let err = cmd.exec();
        bail!("could not run `{}`: {err}", display(cmd));
    }
    #[cfg(not(unix))]
    run_child(cmd)
}

/// All files below `dir`, skipping build output (`target`) and hidden directories,
/// sorted (the tidy checks, release-check's package contents).
pub(crate) fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(path);
                }
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The workspace root (the parent of this crate's directory).
pub(crate) fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().unwrap_or(manifest_dir).to_path_buf()
}

/// A `cargo` command (honouring `$CARGO`) run from the workspace root with
/// the service URLs defaulted.
fn cargo() -> Command {
    in_workspace(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `program`, run from the workspace root with the service URLs defaulted
/// ([`ENV_DEFAULTS`]).
fn in_workspace(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(workspace_root());
    for (key, value) in ENV_DEFAULTS {
        env_default(&mut cmd, key, value);
    }
    cmd
}

/// Sets `key` for the child unless the variable is already set for us.
fn env_default(cmd: &mut Command, key: &str, value: &str) {
    if std::env::var_os(key).is_none() {
        cmd.env(key, value);
    }
}

/// The command line of `cmd`, for messages.
pub(crate) fn display(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` with inherited stdio; fails unless it exits successfully.
fn run_child(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    eprintln!("xtask: running `{shown}`");
    let status = cmd
        .status()
        .with_context(|| format!("could not run `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args_of(argv: &[&str]) -> Vec<OsString> {
        match Cli::try_parse_from(argv).expect("parses").command {
            Cmd::Itest { args, .. }
            | Cmd::Demo { args }
            | Cmd::Scale { args }
            | Cmd::Bench { args }
            | Cmd::Chaos { args } => args,
            other => panic!("unexpected command {other:?}"),
        }
    }

    #[test]
    fn extra_args_are_forwarded_verbatim() {
        assert_eq!(
            args_of(&["xtask", "itest", "--", "-p", "outboxkit-core"]),
            ["-p", "outboxkit-core"]
        );
        assert_eq!(
            args_of(&["xtask", "itest", "--", "--", "--nocapture"]),
            ["--", "--nocapture"]
        );
        assert_eq!(
            args_of(&["xtask", "demo", "--", "--orders", "10"]),
            ["--orders", "10"]
        );
        assert_eq!(args_of(&["xtask", "bench"]), Vec::<OsString>::new());
        assert_eq!(
            args_of(&["xtask", "chaos", "--", "--transport", "nats"]),
            ["--transport", "nats"]
        );
    }

    #[test]
    fn itest_takes_cluster_before_the_forwarded_args() {
        let cli = Cli::try_parse_from(["xtask", "itest", "--cluster", "--", "--", "--nocapture"])
            .expect("parses");
        let Cmd::Itest { cluster, args } = cli.command else {
            panic!("itest");
        };
        assert!(cluster);
        assert_eq!(args, ["--", "--nocapture"]);
        let harness = |args: &[&str]| {
            let args: Vec<OsString> = args.iter().map(OsString::from).collect();
            cluster::tests(&args)
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            harness(&["-p", "outboxkit-core", "--", "--nocapture"]),
            [
                "test",
                "-p",
                "outboxkit-cli",
                "-p",
                "outboxkit-testkit",
                "--test",
                "cluster",
                "--",
                "--nocapture",
                "--ignored",
                "on_cluster_"
            ]
        );
    }

    #[test]
    fn service_timeout_is_a_global_option() {
        let cli =
            Cli::try_parse_from(["xtask", "itest", "--service-timeout", "5"]).expect("parses");
        assert_eq!(cli.service_timeout, 5);
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
