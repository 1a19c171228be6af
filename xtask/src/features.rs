//! `cargo xtask features`: every feature combination of the `outboxkit` facade crate
//! that a user can pick must build, and so must the `outbox` binary (`outboxkit-cli`) with
//! each database × broker pair; and the facade without its `opentelemetry` feature must
//! not depend on OpenTelemetry.

use std::time::Instant;

use anyhow::{Result, bail};

use crate::{cargo, display};

/// The databases among the facade's features.
const DATABASES: [&str; 3] = ["postgres", "sqlserver", "mysql"];
/// The brokers among the facade's features.
const BROKERS: [&str; 2] = ["rabbit", "nats"];
/// Every feature of `crates/outbox/Cargo.toml` but `default` (a test keeps them equal).
const FEATURES: [&str; 7] = [
    "postgres",
    "sqlserver",
    "mysql",
    "rabbit",
    "nats",
    "inbox",
    "opentelemetry",
];

/// The combinations checked, as `--features` values (`""`: none): none, each feature
/// alone, each database × broker pair, each pair with `inbox`, and all of them.
pub(crate) fn combinations() -> Vec<String> {
    let mut combos = vec![String::new()];
    combos.extend(FEATURES.iter().map(|f| (*f).to_owned()));
    for database in DATABASES {
        for broker in BROKERS {
            combos.push(format!("{database},{broker}"));
            combos.push(format!("{database},{broker},inbox"));
        }
    }
    combos.push(FEATURES.join(","));
    combos
}

/// Every `(package, features)` checked: the facade's [`combinations`], then the
/// `outbox` binary with one database and one broker (it needs at least one of each).
pub(crate) fn jobs() -> Vec<(&'static str, String)> {
    let mut jobs: Vec<_> = combinations()
        .into_iter()
        .map(|c| ("outboxkit", c))
        .collect();
    for database in DATABASES {
        for broker in BROKERS {
            jobs.push(("outboxkit-cli", format!("{database},{broker}")));
        }
    }
    jobs
}

/// Runs `cargo check -p PACKAGE --no-default-features --all-targets --features COMBO`
/// for every [`jobs`] entry (the unit tests' `cfg`s included), reporting every failing
/// one rather than stopping at the first.
pub(crate) fn check() -> Result<()> {
    let started = Instant::now();
    let combos = jobs();
    let mut failed = Vec::new();
    for (package, combo) in &combos {
        let mut cmd = cargo();
        cmd.args([
            "check",
            "--quiet",
            "-p",
            package,
            "--no-default-features",
            "--all-targets",
        ]);
        if !combo.is_empty() {
            cmd.args(["--features", combo]);
        }
        let shown = display(&cmd);
        eprintln!("xtask: running `{shown}`");
        match cmd.status() {
            Ok(status) if status.success() => {}
            Ok(status) => failed.push(format!("{package} [{combo}] ({status})")),
            Err(e) => bail!("could not run `{shown}`: {e}"),
        }
    }
    eprintln!(
        "xtask: {} feature combinations of `outboxkit` and `outboxkit-cli` checked in {:.0} s",
        combos.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        bail!("does not build with features: {}", failed.join(", "));
    }
    opentelemetry_stays_out()
}

/// Every facade feature but `opentelemetry` must leave the `opentelemetry` crate out of
/// the dependency graph (`cargo tree -i` finds no such package), so that turning the
/// feature off really saves what it says.
fn opentelemetry_stays_out() -> Result<()> {
    let features: Vec<&str> = FEATURES
        .into_iter()
        .filter(|f| *f != "opentelemetry")
        .collect();
    let mut cmd = cargo();
    cmd.args([
        "tree",
        "-p",
        "outboxkit",
        "--no-default-features",
        "-e",
        "normal",
    ])
    .args(["--features", &features.join(",")])
    .args(["-i", "opentelemetry"]);
    let shown = display(&cmd);
    eprintln!("xtask: running `{shown}` (must find no such package)");
    let out = cmd
        .output()
        .map_err(|e| anyhow::anyhow!("could not run `{shown}`: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !stderr.contains("did not match any packages") {
        bail!(
            "the facade without its `opentelemetry` feature still depends on opentelemetry:\n{}{stderr}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::fs;

    use super::*;
    use crate::workspace_root;

    #[test]
    fn combinations_cover_none_singles_pairs_and_all() {
        let combos = combinations();
        assert_eq!(combos.len(), 1 + 7 + 6 + 6 + 1);
        assert!(combos.contains(&String::new()));
        assert!(combos.contains(&"sqlserver,nats,inbox".to_owned()));
        assert!(combos.contains(&"mysql,rabbit,inbox".to_owned()));
        assert_eq!(
            combos.last().map(String::as_str),
            Some("postgres,sqlserver,mysql,rabbit,nats,inbox,opentelemetry")
        );
        let unique: BTreeSet<_> = combos.iter().collect();
        assert_eq!(unique.len(), combos.len(), "{combos:?}");
    }

    /// The features declared in the facade's manifest, `default` excepted.
    fn manifest_features() -> BTreeSet<String> {
        let manifest = fs::read_to_string(workspace_root().join("crates/outbox/Cargo.toml"))
            .expect("crates/outbox/Cargo.toml exists");
        let mut in_features = false;
        let mut found = BTreeSet::new();
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                in_features = line == "[features]";
            } else if in_features
                && let Some((name, _)) = line.split_once('=')
                && !line.starts_with('#')
            {
                found.insert(name.trim().to_owned());
            }
        }
        found.remove("default");
        found
    }

    #[test]
    fn every_facade_feature_is_checked() {
        let listed: BTreeSet<String> = FEATURES.iter().map(|f| (*f).to_owned()).collect();
        assert_eq!(manifest_features(), listed);
        for f in DATABASES.iter().chain(&BROKERS) {
            assert!(FEATURES.contains(f), "{f}");
        }
    }
}
