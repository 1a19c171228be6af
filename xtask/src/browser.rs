//! The browser of the dashboard's tests (`crates/outbox-cli/tests/dashboard_browser.rs`):
//! Debian's `chromium` and `chromium-driver`, installed with apt-get when missing. The
//! tests fail (never skip) without them, so a machine that cannot install them fails
//! `cargo xtask itest` here, saying why, instead of halfway through the tests.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::display;

/// Where the tests look for the browser and its driver (unless `CHROMIUM` /
/// `CHROMEDRIVER` say otherwise).
const PROGRAMS: [(&str, &str); 2] = [
    ("CHROMIUM", "/usr/bin/chromium"),
    ("CHROMEDRIVER", "/usr/bin/chromedriver"),
];

fn missing() -> Vec<String> {
    PROGRAMS
        .iter()
        .map(|(env, default)| std::env::var(env).unwrap_or_else(|_| (*default).to_owned()))
        .filter(|path| !Path::new(path).exists())
        .collect()
}

fn apt_get(args: &[&str]) -> Result<()> {
    let mut cmd = Command::new("apt-get");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    let shown = display(&cmd);
    eprintln!("xtask: running `{shown}`");
    let status = cmd
        .status()
        .with_context(|| format!("could not run `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Installs `chromium` and `chromium-driver` with apt-get unless both are there.
///
/// # Errors
/// When they are missing and cannot be installed (no apt-get, not root, no package
/// source): the dashboard's browser tests cannot run.
pub(crate) fn ensure() -> Result<()> {
    let absent = missing();
    if absent.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: {} missing; installing Debian's chromium and chromium-driver for the dashboard's browser tests",
        absent.join(", ")
    );
    let installed = apt_get(&["update", "-qq"])
        .and_then(|()| apt_get(&["install", "-y", "-qq", "chromium", "chromium-driver"]));
    let still = missing();
    if let Err(e) = installed {
        bail!(
            "the dashboard's browser tests need chromium and chromium-driver ({} missing) and they could not be installed: {e:#}",
            still.join(", ")
        );
    }
    if !still.is_empty() {
        bail!(
            "chromium and chromium-driver were installed but {} is still missing",
            still.join(", ")
        );
    }
    Ok(())
}
