//! `cargo xtask outside`: the quick start built and run by a new cargo project outside
//! the workspace, on the packaged crates, as a user of ours would after `cargo add
//! outboxkit`, on PostgreSQL and on MariaDB, over RabbitMQ and over NATS.
//!
//! The project (`TARGET/outside/`, made again on every run) is its own workspace (an
//! empty `[workspace]`), with three binaries:
//!
//! * `outside-quick-start-postgres`: the quick start as `cargo package` packed it
//!   (`outboxkit-VERSION/examples/quick_start.rs`), with the names it hard-codes
//!   replaced by names of the run's own ([`SUBSTITUTIONS`]: the NATS stream, the
//!   consumer, and the default exchange / subject prefix of `from_url`), so that it
//!   cannot meet another test's queue, stream or subjects on the shared brokers; a
//!   replacement that no longer matches the example fails the run, saying so.
//! * `outside-quick-start-mysql`: the same program on MySQL / MariaDB
//!   (`xtask/outside/quick_start_mysql.rs`, written line for line beside it), with the
//!   same replacements.
//! * `outside-probe` (`xtask/outside/probe.rs`): creates the run's schema, waits for the
//!   projected row, and drops what the run made (the schema or database, the queue and
//!   exchange or the stream and its durable).
//!
//! The dependency is `outboxkit = { path = "TARGET/package/outboxkit-VERSION", features =
//! […] }`, the unpacked `.crate`. A packaged manifest names its dependencies by version,
//! not by path (`cargo package` drops the paths), so the facade's own `outboxkit-core`,
//! `outboxkit-postgres`, … would be looked up on crates.io, where they are not yet:
//! a `[patch.crates-io]` section maps those (our crates, and only those) to their
//! unpacked packages. A path dependency of the project on them would not do: cargo
//! treats a path source and the registry source the facade asks for as different
//! packages. No other crate is patched: the workspace has no `[patch]`, and the one
//! sqlx a user gets from crates.io is the one built here.
//!
//! The build reuses the workspace's: the same target directory, the workspace's
//! `Cargo.lock` copied in (cargo keeps the versions it pins and drops what the project
//! does not use; the run checks that every package of the project's lock is pinned at
//! the workspace's version), the workspace's `tokio`, `serde_json` and `async-trait` requirements and
//! its `[profile.dev]`, so that the dependencies compiled for the workspace are
//! compiled for this project too (`--locked` refuses the copy: cargo would add the
//! project and drop the rest). Where the features a dependency is built with differ from
//! every workspace build's, it is compiled again on the first run; what was compiled
//! again here was ring and what depends on it, whose build script tracks
//! `CARGO_MANIFEST_DIR` (set for a `cargo` started by `cargo xtask`, not for one typed
//! in a shell).
//!
//! `--install` then runs `cargo install --path crates/outbox-cli` outside the workspace
//! and relays a message with the installed binary ([`install`]).
//!
//! Each of the four runs has its own names (`outside_PID_quick_start_DB_BROKER`): the schema
//! (`OUTBOX_SCHEMA`; PostgreSQL's `search_path` and MySQL's URL database, so that the
//! quick start's unqualified `projected` table lands there too), the exchange
//! (`OUTBOX_EXCHANGE`) or subject prefix (`OUTBOX_SUBJECT_PREFIX`), the NATS stream
//! and the consumer. The quick start runs until cancelled: the run waits (polling, with
//! a deadline) until the projected row is there, kills the process and drops the
//! names, also when it failed.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::release::{self, Unpacked};
use crate::{ENV_DEFAULTS, display, run_child, workspace_root};

/// The program shared by the quick starts (`src/lib.rs`).
const LIB_RS: &str = include_str!("../outside/lib.rs");
/// The quick start on MySQL / MariaDB.
const QUICK_START_MYSQL: &str = include_str!("../outside/quick_start_mysql.rs");
/// The test's side: prepare, wait, clean.
const PROBE: &str = include_str!("../outside/probe.rs");

/// The facade's features the project enables, beside the default ones (`postgres`,
/// `rabbit`, `opentelemetry`).
const FEATURES: [&str; 3] = ["mysql", "nats", "inbox"];

/// Our crates the facade needs with [`FEATURES`]: patched to their packages.
const PATCHED: [&str; 6] = [
    "outboxkit-core",
    "outboxkit-postgres",
    "outboxkit-mysql",
    "outboxkit-rabbit",
    "outboxkit-nats",
    "outboxkit-inbox",
];

/// The project's other dependencies, with the workspace's requirement and features.
const WORKSPACE_DEPENDENCIES: [&str; 3] = ["tokio", "serde_json", "async-trait"];

/// `(text in the quick start, replacement, occurrences)`: the names the quick start
/// hard-codes, read from the run's environment instead (`OUTSIDE_STREAM`,
/// `OUTSIDE_CONSUMER`; the publisher's configuration from the transport's `from_env`,
/// which reads `OUTBOX_EXCHANGE` / `OUTBOX_SUBJECT_PREFIX`).
const SUBSTITUTIONS: [(&str, &str, usize); 4] = [
    (
        "AnyConsumerConfig::from_url(&broker, \"projection\")?",
        "AnyConsumerConfig::new(outside::publisher_config()?, std::env::var(\"OUTSIDE_CONSUMER\")?)",
        1,
    ),
    (
        "AnyPublisherConfig::from_url(&broker)?",
        "outside::publisher_config()?",
        1,
    ),
    (
        "with_stream(\"OUTBOX\")",
        "with_stream(std::env::var(\"OUTSIDE_STREAM\")?)",
        1,
    ),
    (
        "on(\"OrderPlaced\", \"projection\", Project)",
        "on(\"OrderPlaced\", std::env::var(\"OUTSIDE_CONSUMER\")?, Project)",
        1,
    ),
];

/// How long a run may take from the quick start's start to its projected row.
const WAIT_SECS: u64 = 120;

/// The databases: `(name, binary)`.
const DATABASES: [(&str, &str); 2] = [
    ("postgres", "outside-quick-start-postgres"),
    ("mysql", "outside-quick-start-mysql"),
];

/// The brokers.
const BROKERS: [&str; 2] = ["rabbit", "nats"];

/// Makes the project on the packages (`make`: packed and unpacked here; otherwise as
/// the `release-check` just run left them), builds it and runs the quick start on each
/// database over each broker; `with_install`, then [`install`]. The services must be
/// up.
///
/// # Errors
/// A package missing, a replacement that no longer matches the quick start, the
/// build failing, a run without its projected row within [`WAIT_SECS`], or a cleanup
/// that failed.
pub(crate) fn run(make: bool, with_install: bool) -> Result<()> {
    let started = Instant::now();
    let packages = release::unpacked(make)?;
    let project = packages.target_dir.join("outside");
    write_project(&project, &packages)?;

    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build
        .current_dir(&project)
        .env("CARGO_TARGET_DIR", &packages.target_dir)
        .args(["build", "--bins"]);
    let build_started = Instant::now();
    run_child(&mut build)?;
    eprintln!(
        "xtask: outside: built in {:.0} s",
        build_started.elapsed().as_secs_f64()
    );
    lock_matches_workspace(&project)?;

    let bin = packages.target_dir.join("debug");
    let mut failures = Vec::new();
    for (database, program) in DATABASES {
        for broker in BROKERS {
            let run_started = Instant::now();
            let names = Names::new("quick_start", database, broker);
            match names.run(&bin, program) {
                Ok(()) => eprintln!(
                    "xtask: outside: {program} over {broker}: projected in {:.1} s",
                    run_started.elapsed().as_secs_f64()
                ),
                Err(e) => failures.push(format!("{program} over {broker}: {e:#}")),
            }
        }
    }
    if with_install && let Err(e) = install(&packages.target_dir) {
        failures.push(format!("cargo install --path crates/outbox-cli: {e:#}"));
    }
    eprintln!(
        "xtask: outside took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if !failures.is_empty() {
        bail!("outside:\n  {}", failures.join("\n  "));
    }
    Ok(())
}

/// Writes the project: manifest, lockfile, `src/lib.rs` and the three binaries.
fn write_project(project: &Path, packages: &Unpacked) -> Result<()> {
    if project.exists() {
        fs::remove_dir_all(project)
            .with_context(|| format!("could not remove {}", project.display()))?;
    }
    let bins = project.join("src/bin");
    fs::create_dir_all(&bins).with_context(|| format!("could not create {}", bins.display()))?;
    let facade = packages
        .dirs
        .get("outboxkit")
        .context("no outboxkit package")?;
    let example = facade.join("examples/quick_start.rs");
    let quick_start = fs::read_to_string(&example)
        .with_context(|| format!("could not read {}", example.display()))?;
    let files = [
        (project.join("Cargo.toml"), manifest(packages)?),
        (project.join("src/lib.rs"), LIB_RS.to_owned()),
        (
            bins.join("quick_start_postgres.rs"),
            substitute(&quick_start, "the packaged examples/quick_start.rs")?,
        ),
        (
            bins.join("quick_start_mysql.rs"),
            substitute(QUICK_START_MYSQL, "xtask/outside/quick_start_mysql.rs")?,
        ),
        (bins.join("probe.rs"), PROBE.to_owned()),
    ];
    for (path, text) in files {
        fs::write(&path, text).with_context(|| format!("could not write {}", path.display()))?;
    }
    let lock = workspace_root().join("Cargo.lock");
    fs::copy(&lock, project.join("Cargo.lock"))
        .with_context(|| format!("could not copy {}", lock.display()))?;
    Ok(())
}

/// The project's `Cargo.toml`.
fn manifest(packages: &Unpacked) -> Result<String> {
    let root = fs::read_to_string(workspace_root().join("Cargo.toml"))
        .context("reading the root Cargo.toml")?;
    let path = |name: &str| -> Result<String> {
        let dir = packages
            .dirs
            .get(name)
            .with_context(|| format!("no {name} package"))?;
        Ok(dir.display().to_string())
    };
    let mut text = String::from(
        "# Made by `cargo xtask outside` (xtask/src/outside.rs): a user's project on the\n\
         # packaged crates, outside the workspace.\n\
         [package]\n\
         name = \"outside\"\n\
         version = \"0.0.0\"\n\
         edition = \"2024\"\n\
         publish = false\n\n\
         # A workspace of its own, wherever it lies.\n\
         [workspace]\n\n\
         [[bin]]\n\
         name = \"outside-quick-start-postgres\"\n\
         path = \"src/bin/quick_start_postgres.rs\"\n\n\
         [[bin]]\n\
         name = \"outside-quick-start-mysql\"\n\
         path = \"src/bin/quick_start_mysql.rs\"\n\n\
         [[bin]]\n\
         name = \"outside-probe\"\n\
         path = \"src/bin/probe.rs\"\n\n\
         [dependencies]\n",
    );
    let features: Vec<String> = FEATURES.iter().map(|f| format!("{f:?}")).collect();
    text.push_str(&format!(
        "outboxkit = {{ path = {:?}, features = [{}] }}\n",
        path("outboxkit")?,
        features.join(", ")
    ));
    for name in WORKSPACE_DEPENDENCIES {
        let line = workspace_dependency(&root, name)
            .with_context(|| format!("no {name} in [workspace.dependencies]"))?;
        text.push_str(&line);
        text.push('\n');
    }
    text.push_str(
        "\n# The facade's dependencies on our other crates name versions that are not on\n\
         # crates.io yet: their packages instead. Nothing else is patched.\n\
         [patch.crates-io]\n",
    );
    for name in PATCHED {
        text.push_str(&format!("{name} = {{ path = {:?} }}\n", path(name)?));
    }
    text.push_str(
        "\n# The workspace's, so that its compiled dependencies are reused.\n\
         [profile.dev]\n",
    );
    let profile = profile_dev(&root).context("no [profile.dev] in the root Cargo.toml")?;
    text.push_str(&profile);
    Ok(text)
}

/// The `name = …` line of `[workspace.dependencies]` in the root manifest.
fn workspace_dependency(manifest: &str, name: &str) -> Option<String> {
    let mut table = "";
    for line in manifest.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            table = trimmed;
        } else if table == "[workspace.dependencies]"
            && trimmed
                .split_once('=')
                .is_some_and(|(key, _)| key.trim() == name)
        {
            return Some(trimmed.to_owned());
        }
    }
    None
}

/// The settings of the root manifest's `[profile.dev]`, one a line (comments left out).
fn profile_dev(manifest: &str) -> Option<String> {
    let mut table = "";
    let mut settings = String::new();
    for line in manifest.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            table = trimmed;
        } else if table == "[profile.dev]" && !trimmed.is_empty() && !trimmed.starts_with('#') {
            settings.push_str(trimmed);
            settings.push('\n');
        }
    }
    (!settings.is_empty()).then_some(settings)
}

/// `program` with [`SUBSTITUTIONS`] applied, each found exactly as often as expected.
fn substitute(program: &str, what: &str) -> Result<String> {
    let mut text = program.to_owned();
    for (from, to, count) in SUBSTITUTIONS {
        let found = text.matches(from).count();
        if found != count {
            bail!(
                "{what}: `{from}` found {found} times, not {count}: the quick start changed; \
                 update SUBSTITUTIONS in xtask/src/outside.rs (and xtask/outside/quick_start_mysql.rs)"
            );
        }
        text = text.replace(from, to);
    }
    // `broker` (the URL) and `AnyPublisherConfig` are no longer used once replaced.
    Ok(format!(
        "// Made by `cargo xtask outside` from {what}, its names replaced by the run's own.\n\
         #![allow(unused_imports, unused_variables)]\n{text}"
    ))
}

/// Fails unless every package in the project's `Cargo.lock` (but the project) is one
/// the workspace's lock pins, at that version: the project built what the workspace
/// builds, not newer releases from crates.io.
fn lock_matches_workspace(project: &Path) -> Result<()> {
    let read = |path: &Path| {
        fs::read_to_string(path).with_context(|| format!("could not read {}", path.display()))
    };
    let workspace: BTreeSet<(String, String)> =
        release::lock_entries(&read(&workspace_root().join("Cargo.lock"))?)
            .into_iter()
            .collect();
    let lock = release::lock_entries(&read(&project.join("Cargo.lock"))?);
    let new: Vec<String> = lock
        .iter()
        .filter(|(name, _)| name != "outside")
        .filter(|entry| !workspace.contains(entry))
        .map(|(name, version)| format!("{name} {version}"))
        .collect();
    if !new.is_empty() {
        bail!(
            "the project outside the workspace resolved packages the workspace's Cargo.lock \
             does not pin: {}",
            new.join(", ")
        );
    }
    eprintln!(
        "xtask: outside: {} packages, each at the workspace's locked version",
        lock.len() - 1
    );
    Ok(())
}

/// The service URL `key` of [`ENV_DEFAULTS`], or the caller's.
fn service_url(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| {
        ENV_DEFAULTS
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| (*v).to_owned())
            .unwrap_or_default()
    })
}

/// `url` (`scheme://authority/db?query`) with the database `db`.
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (url, String::new()),
    };
    let (scheme, rest) = base.split_once("://").unwrap_or(("", base));
    let authority = rest.split('/').next().unwrap_or(rest);
    format!("{scheme}://{authority}/{db}{query}")
}

/// `url` with `key=value` added to its query.
fn with_query(url: &str, key: &str, value: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{key}={value}")
}

/// The names and settings of one run.
struct Names {
    /// The schema, exchange, subject prefix and consumer: `outside_PID_LABEL_DB_BROKER`.
    tag: String,
    /// The NATS stream: the tag in capitals.
    stream: String,
    /// The environment of the quick start and the probe.
    env: BTreeMap<&'static str, String>,
}

impl Names {
    /// The names of a run `label` (`quick_start`, `install`) on `database` (`postgres`
    /// or `mysql`) over `broker` (`rabbit` or `nats`).
    fn new(label: &str, database: &str, broker: &str) -> Self {
        let tag = format!("outside_{}_{label}_{database}_{broker}", std::process::id());
        let stream = tag.to_ascii_uppercase();
        let (admin, url) = if database == "postgres" {
            let admin = service_url("DATABASE_URL");
            // The quick start's unqualified table lands in the run's schema.
            let url = with_query(&admin, "options", &format!("-c%20search_path%3D{tag}"));
            (admin, url)
        } else {
            let admin = service_url("MYSQL_URL");
            let url = with_database(&admin, &tag);
            (admin, url)
        };
        let broker_url = service_url(if broker == "rabbit" {
            "AMQP_URL"
        } else {
            "NATS_URL"
        });
        let env = BTreeMap::from([
            ("DATABASE_URL", url),
            ("OUTSIDE_ADMIN_URL", admin),
            ("OUTBOX_SCHEMA", tag.clone()),
            ("OUTBOX_BROKER_URL", broker_url),
            ("OUTBOX_EXCHANGE", tag.clone()),
            ("OUTBOX_SUBJECT_PREFIX", tag.clone()),
            ("OUTSIDE_STREAM", stream.clone()),
            ("OUTSIDE_CONSUMER", tag.clone()),
        ]);
        Self { tag, stream, env }
    }

    fn command(&self, path: PathBuf) -> Command {
        let mut cmd = Command::new(path);
        cmd.envs(&self.env)
            .env_remove("OUTBOX_STREAM")
            .env_remove("OUTBOX_DESTINATION_RULES");
        cmd
    }

    /// Prepares, runs `program` until its projected row is there, and cleans up
    /// (also after a failure).
    fn run(&self, bin: &Path, program: &str) -> Result<()> {
        let probe = || self.command(bin.join("outside-probe"));
        run_child(probe().arg("prepare"))?;
        let program = self.command(bin.join(program));
        let ran = until(program, probe().args(["wait", &WAIT_SECS.to_string()]));
        let cleaned = run_child(probe().args(["clean", &self.stream, &self.tag]));
        ran.and(cleaned)
    }
}

/// Runs `program` (which runs until killed) and `wait` beside it until `wait` exits:
/// fails if `wait` fails or `program` exits first.
fn until(mut program: Command, wait: &mut Command) -> Result<()> {
    eprintln!("xtask: running `{}`", display(&program));
    let shown = display(&program);
    let mut program = Kill(
        program
            .spawn()
            .with_context(|| format!("could not run `{shown}`"))?,
    );
    eprintln!("xtask: running `{}`", display(wait));
    let mut wait = Kill(
        wait.spawn()
            .with_context(|| format!("could not run `{}`", display(wait)))?,
    );
    loop {
        if let Some(status) = program.0.try_wait()? {
            bail!("`{shown}` exited ({status}) before the wait was over");
        }
        if let Some(status) = wait.0.try_wait()? {
            if status.success() {
                return Ok(());
            }
            bail!("`{shown}`: the wait failed ({status})");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `cargo install --path crates/outbox-cli` as a user of a checkout would run it:
/// outside the workspace (so neither its `Cargo.lock` nor a `[patch]` of its applies:
/// cargo resolves the newest versions the manifests allow), `--debug` to keep it short
/// (the code and the dependencies built are the release's, not their optimisation),
/// into `TARGET/outside-install/` with a target directory of its own there (the
/// workspace's `debug/outbox` is not overwritten). Then the installed `outbox` migrates
/// a schema of its own on PostgreSQL and relays a message enqueued by the packaged
/// crates (`outside-probe enqueue`) to NATS JetStream (a stream of its own, declared by
/// `--stream`), until the message is `Sent`; everything is dropped afterwards.
fn install(target_dir: &Path) -> Result<()> {
    let root = target_dir.join("outside-install");
    fs::create_dir_all(&root).with_context(|| format!("could not create {}", root.display()))?;
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo
        .current_dir(&root)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .args(["install", "--debug", "--force", "--path"])
        .arg(workspace_root().join("crates/outbox-cli"))
        .arg("--root")
        .arg(&root);
    let started = Instant::now();
    run_child(&mut cargo)?;
    eprintln!(
        "xtask: outside: `cargo install --path crates/outbox-cli` took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let outbox = root.join("bin/outbox");
    let names = Names::new("install", "postgres", "nats");
    let probe = || names.command(target_dir.join("debug/outside-probe"));
    // An address of its own for /metrics and /healthz (127.0.0.1:9464 by default).
    let listen = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("no free port")?;
    let relay = || {
        let mut relay = names.command(outbox.clone());
        // The binary takes the broker from OUTBOX_TRANSPORT (default: rabbit), not
        // from the URL, and refuses a RabbitMQ setting with NATS.
        relay
            .env("OUTBOX_TRANSPORT", "nats")
            .env_remove("OUTBOX_EXCHANGE")
            .env("OUTBOX_STREAM", &names.stream)
            .env("OUTBOX_LISTEN", listen.to_string());
        relay
    };
    run_child(probe().arg("prepare"))?;
    let ran = (|| {
        run_child(relay().arg("migrate"))?;
        run_child(probe().arg("enqueue"))?;
        let mut relaying = relay();
        relaying.arg("relay");
        until(relaying, probe().args(["sent", &WAIT_SECS.to_string()]))
    })();
    let cleaned = run_child(probe().args(["clean", &names.stream, &names.tag]));
    ran.and(cleaned)?;
    eprintln!("xtask: outside: the installed `outbox` relayed to NATS");
    Ok(())
}

/// A child process killed (and reaped) when dropped: the quick start runs until
/// cancelled.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quick_starts_take_every_substitution() {
        let example =
            fs::read_to_string(workspace_root().join("crates/outbox/examples/quick_start.rs"))
                .expect("the quick start");
        for program in [example.as_str(), QUICK_START_MYSQL] {
            let text = substitute(program, "test").expect("substitutes");
            assert!(!text.contains("\"projection\"") && !text.contains("\"OUTBOX\""));
        }
    }

    #[test]
    fn urls_get_the_run_database() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/test", "x"),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("mysql://root@h:3306?ssl-mode=disabled", "x"),
            "mysql://root@h:3306/x?ssl-mode=disabled"
        );
        assert_eq!(
            with_query("postgres://h/db", "a", "b"),
            "postgres://h/db?a=b"
        );
        assert_eq!(
            with_query("postgres://h/db?c=d", "a", "b"),
            "postgres://h/db?c=d&a=b"
        );
    }

    #[test]
    fn workspace_settings_are_found() {
        let root = fs::read_to_string(workspace_root().join("Cargo.toml")).expect("manifest");
        for name in WORKSPACE_DEPENDENCIES {
            assert!(workspace_dependency(&root, name).is_some(), "{name}");
        }
        assert!(profile_dev(&root).is_some_and(|p| p.contains("debug")));
    }
}
