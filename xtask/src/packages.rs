//! Debian packages the tests need beside the services, installed with apt-get when
//! missing:
//!
//! - the dashboard's browser tests (`crates/outbox-cli/tests/dashboard_browser.rs`):
//!   `chromium` and `chromium-driver`. They fail (never skip) without them, so a
//!   machine that cannot install them fails `cargo xtask itest` here, saying why,
//!   instead of halfway through the tests;
//! - the relay clock-skew tests (`crates/outbox-cli/tests/relay_wal.rs`, (w) and (x))
//!   and the chaos harness's clock-skew fault: `faketime` (libfaketime's preload
//!   library). Those tests skip visibly without it.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::display;

/// Debian packages and the files that show they are installed.
pub(crate) struct Packages {
    /// What needs them, for messages.
    purpose: &'static str,
    /// The packages.
    names: &'static [&'static str],
    /// Files that must exist: `(environment variable that overrides the path, paths)`,
    /// any one of the paths.
    files: &'static [(Option<&'static str>, &'static [&'static str])],
}

/// Chromium and its WebDriver, for the dashboard's browser tests.
pub(crate) const BROWSER: Packages = Packages {
    purpose: "the dashboard's browser tests",
    names: &["chromium", "chromium-driver"],
    files: &[
        (Some("CHROMIUM"), &["/usr/bin/chromium"]),
        (Some("CHROMEDRIVER"), &["/usr/bin/chromedriver"]),
    ],
};

/// libfaketime, for the relay clock-skew tests and the chaos harness's clock fault.
/// Its program stands for the package: the tests find the preload library
/// (`outboxkit_testkit::faults::libfaketime`) where the package puts it beside.
pub(crate) const FAKETIME: Packages = Packages {
    purpose: "the relay clock-skew tests and the chaos harness's clock fault",
    names: &["faketime"],
    files: &[(None, &["/usr/bin/faketime"])],
};

impl Packages {
    /// The files that are missing (for an entry with several paths, its first).
    fn missing(&self) -> Vec<String> {
        self.files
            .iter()
            .filter_map(|(env, paths)| {
                let paths: Vec<String> = match env.and_then(|e| std::env::var(e).ok()) {
                    Some(p) => vec![p],
                    None => paths.iter().map(|p| (*p).to_owned()).collect(),
                };
                (!paths.iter().any(|p| Path::new(p).exists())).then(|| paths[0].clone())
            })
            .collect()
    }

    /// Installs the packages with apt-get unless their files are there.
    ///
    /// # Errors
    /// When files are missing and cannot be installed (no apt-get, not root, no
    /// package source), or are still missing after the install.
    pub(crate) fn ensure(&self) -> Result<()> {
        let absent = self.missing();
        if absent.is_empty() {
            return Ok(());
        }
        let names = self.names.join(" ");
        eprintln!(
            "xtask: {} missing; installing Debian's {names} for {}",
            absent.join(", "),
            self.purpose
        );
        let mut install = vec!["install", "-y", "-qq"];
        install.extend_from_slice(self.names);
        let installed = apt_get(&["update", "-qq"]).and_then(|()| apt_get(&install));
        let still = self.missing();
        if let Err(e) = installed {
            bail!(
                "{} need {names} ({} missing) and it could not be installed: {e:#}",
                self.purpose,
                still.join(", ")
            );
        }
        if !still.is_empty() {
            bail!(
                "{names} installed but {} is still missing",
                still.join(", ")
            );
        }
        Ok(())
    }
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
