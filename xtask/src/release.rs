//! `cargo xtask release-check`: what publishing the crates to crates.io needs, checked
//! without publishing anything.
//!
//! * Manifests: every publishable crate (`publish` not `false`: each of `crates/*` but
//!   `outboxkit-testkit` and `outboxkit-lab`) carries `MIT OR Apache-2.0` with both license files, the
//!   workspace's `rust-version`, a description, a repository and docs.rs metadata
//!   (`all-features`, `--cfg docsrs`, `doc_cfg`); the examples and xtask are
//!   `publish = false`; no published crate needs an unpublished one; a `CHANGELOG.md`
//!   with a section for the version. The publish order is derived from the manifests.
//! * MSRV: built with the `rust-version` toolchain when rustup has it; otherwise every
//!   crate a user compiles with ours must declare a `rust-version` no newer than ours
//!   (`cargo metadata`), and clippy's `incompatible_msrv` finds any standard library
//!   item newer than it.
//! * Docs: `cargo doc --no-deps --all-features -D warnings` of the published crates, as
//!   docs.rs builds them (nightly and `--cfg docsrs` when rustup has a nightly).
//! * Packages: `cargo package` of all the published crates together (cargo resolves
//!   them against each other through a local registry overlay, so nothing of ours must
//!   be on crates.io yet) with verification (each package builds alone, from its
//!   `.crate`; `cargo xtask itest` skips that build, see [`check`]), then each
//!   package's contents: the license files, every `include_str!`/`include_bytes!` file,
//!   a size that rules out stray files, and a lockfile whose copies of our crates are
//!   ours.
//! * `cargo deny check licenses bans sources` (deny.toml), and `advisories` against a
//!   local copy of the RustSec database when there is one (it is fetched from GitHub).
//!
//! Every step runs and reports; the run fails if one failed. What could not be checked
//! here and what blocks publishing (a decision, not a fix) is listed at the end;
//! `--strict` fails on those too.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{cargo, display, files_under, run_child as run, workspace_root};

/// The license of every crate, and the files in each published package that carry it.
const LICENSE: &str = "MIT OR Apache-2.0";
const LICENSE_FILES: [&str; 2] = ["LICENSE-MIT", "LICENSE-APACHE"];

/// The crate attribute that makes docs.rs show each feature-gated item's feature.
const DOC_CFG: &str = "#![cfg_attr(docsrs, feature(doc_cfg))]";

/// Largest `.crate` accepted. Ours are about 100 KiB; a package near this holds a file
/// packed by mistake (crates.io itself refuses above 10 MiB).
const MAX_CRATE_BYTES: u64 = 1024 * 1024;

/// Names of ours that other owners already hold on crates.io (their versions were in
/// the index when cargo resolved our packages in November 2026: `inbox` 0.0.1,
/// `outboxkit-core` 0.1.0 to 0.6.0, `outboxkit-postgres` 0.1.0 to 0.3.0; the other six names
/// were not; `outboxkit-mysql`, added later, was not looked up). Publishing needs other names; until then
/// a package that depends on them resolves the foreign crate whenever its versions
/// match, which the lockfile check tolerates for these names alone.
const NAMES_TAKEN_ON_CRATES_IO: [&str; 3] = ["inbox", "outboxkit-core", "outboxkit-postgres"];

/// A workspace member, from `cargo metadata`.
#[derive(Debug)]
struct Member {
    name: String,
    version: String,
    /// The directory of its `Cargo.toml`.
    dir: PathBuf,
    publish: bool,
    package: Value,
}

impl Member {
    fn str_field(&self, key: &str) -> Option<&str> {
        self.package.get(key).and_then(Value::as_str)
    }

    /// Its dependencies as `(name, kind, requirement)`; kind `normal`, `build` or `dev`.
    fn deps(&self) -> Vec<(&str, &str, &str)> {
        self.package["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                (
                    d["name"].as_str().unwrap_or_default(),
                    d["kind"].as_str().unwrap_or("normal"),
                    d["req"].as_str().unwrap_or("*"),
                )
            })
            .collect()
    }

    /// The library target's root file, if it has one.
    fn lib_root(&self) -> Option<PathBuf> {
        self.package["targets"].as_array()?.iter().find_map(|t| {
            let is_lib = t["kind"]
                .as_array()?
                .iter()
                .any(|k| k.as_str() == Some("lib"));
            is_lib.then(|| PathBuf::from(t["src_path"].as_str().unwrap_or_default()))
        })
    }
}

/// What `cargo metadata` says about the workspace.
struct Workspace {
    members: Vec<Member>,
    /// Every package of the resolved graph by id: `(name, version, rust_version)`.
    packages: BTreeMap<String, (String, String, Option<String>)>,
    /// The resolved graph: package id → `(dependency id, kinds)`.
    resolve: BTreeMap<String, Vec<(String, Vec<String>)>>,
    target_dir: PathBuf,
    /// `[workspace.package] rust-version`.
    msrv: String,
}

impl Workspace {
    fn load() -> Result<Self> {
        let mut cmd = cargo();
        cmd.args(["metadata", "--format-version", "1", "--all-features"]);
        let out = cmd
            .output()
            .with_context(|| format!("could not run `{}`", display(&cmd)))?;
        if !out.status.success() {
            bail!(
                "`{}` failed: {}",
                display(&cmd),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let meta: Value = serde_json::from_slice(&out.stdout).context("cargo metadata")?;
        let member_ids: BTreeSet<&str> = meta["workspace_members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let mut members = Vec::new();
        let mut packages = BTreeMap::new();
        for p in meta["packages"].as_array().into_iter().flatten() {
            let id = p["id"].as_str().unwrap_or_default();
            let name = p["name"].as_str().unwrap_or_default().to_owned();
            let version = p["version"].as_str().unwrap_or_default().to_owned();
            let rust_version = p["rust_version"].as_str().map(str::to_owned);
            packages.insert(id.to_owned(), (name.clone(), version.clone(), rust_version));
            if member_ids.contains(id) {
                let manifest = PathBuf::from(p["manifest_path"].as_str().unwrap_or_default());
                members.push(Member {
                    name,
                    version,
                    dir: manifest.parent().unwrap_or(Path::new(".")).to_path_buf(),
                    // `publish = false` is `[]`; no restriction is `null`.
                    publish: p["publish"].as_array().is_none_or(|r| !r.is_empty()),
                    package: p.clone(),
                });
            }
        }
        members.sort_by(|a, b| a.name.cmp(&b.name));
        let mut resolve = BTreeMap::new();
        for node in meta["resolve"]["nodes"].as_array().into_iter().flatten() {
            let deps = node["deps"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| {
                    let kinds = d["dep_kinds"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|k| k["kind"].as_str().unwrap_or("normal").to_owned())
                        .collect();
                    (d["pkg"].as_str().unwrap_or_default().to_owned(), kinds)
                })
                .collect();
            resolve.insert(node["id"].as_str().unwrap_or_default().to_owned(), deps);
        }
        let root_manifest = fs::read_to_string(workspace_root().join("Cargo.toml"))
            .context("reading the root Cargo.toml")?;
        let msrv = workspace_rust_version(&root_manifest)
            .context("the root Cargo.toml declares no [workspace.package] rust-version")?;
        Ok(Self {
            members,
            packages,
            resolve,
            target_dir: PathBuf::from(meta["target_directory"].as_str().unwrap_or("target")),
            msrv,
        })
    }

    fn published(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().filter(|m| m.publish)
    }

    /// `-p NAME` for every published crate, in publish order.
    fn package_args(&self, order: &[String]) -> Vec<String> {
        order
            .iter()
            .flat_map(|name| ["-p".to_owned(), name.clone()])
            .collect()
    }
}

/// `rust-version` of `[workspace.package]` in the root manifest.
fn workspace_rust_version(manifest: &str) -> Option<String> {
    let mut table = "";
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            table = line;
        } else if table == "[workspace.package]"
            && let Some((key, value)) = line.split_once('=')
            && key.trim() == "rust-version"
        {
            return Some(value.trim().trim_matches('"').to_owned());
        }
    }
    None
}

/// A Rust version as numbers, `"1.85"` = `"1.85.0"`.
fn version_key(v: &str) -> Vec<u32> {
    let mut key: Vec<u32> = v.split('.').map(|p| p.parse().unwrap_or(0)).collect();
    key.resize(3, 0);
    key
}

/// What a run found: failures fail it; the rest is reported.
#[derive(Default)]
struct Report {
    failures: Vec<String>,
    /// Checks that could not run here, and why.
    not_checked: Vec<String>,
    /// What stops publishing and needs a decision rather than a fix.
    blockers: Vec<String>,
    /// Step name, outcome and seconds, for the summary.
    steps: Vec<(&'static str, &'static str, f64)>,
}

impl Report {
    /// Runs one step, recording its outcome (an `Err` is a failure of its own).
    fn step(&mut self, name: &'static str, f: impl FnOnce(&mut Self) -> Result<()>) {
        eprintln!("xtask: release-check: {name}");
        let started = Instant::now();
        let failures_before = self.failures.len();
        let not_checked_before = self.not_checked.len();
        if let Err(e) = f(self) {
            self.failures.push(format!("{name}: {e:#}"));
        }
        let outcome = if self.failures.len() > failures_before {
            "FAILED"
        } else if self.not_checked.len() > not_checked_before {
            "partly checked"
        } else {
            "ok"
        };
        self.steps
            .push((name, outcome, started.elapsed().as_secs_f64()));
    }

    fn fail(&mut self, what: impl Into<String>) {
        self.failures.push(what.into());
    }
}

/// How much of the release check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Depth {
    /// Everything: each package built from its `.crate`, docs on nightly as docs.rs
    /// builds them.
    Full,
    /// Full, but the packages are only made and unpacked, not built again from their
    /// `.crate`s (`--no-verify`).
    NoVerify,
    /// As `cargo xtask itest` runs it: no verification build, and the docs (warnings
    /// denied, without `--cfg docsrs`) and clippy's `incompatible_msrv` on the current
    /// toolchain, so that they reuse the dependency builds of the feature check before
    /// them instead of a cold nightly build of every dependency (about 5 minutes on 2
    /// cores). What is left out is reported as not checked.
    Quick,
}

/// Runs every check; fails if one failed (or, `strict`, if anything could not be
/// checked or blocks publishing).
///
/// `depth`: [`Depth::Full`] builds each package from its `.crate` (a cold build of
/// every dependency again, about 10 minutes on 2 cores); without it the packages are
/// made and unpacked, and every `include_str!`/`include_bytes!` of theirs must find its
/// file in the package, which is what a build from the `.crate` mostly catches that
/// the workspace's own build does not. [`Depth::Quick`] also builds the docs on the
/// current toolchain (see there).
pub(crate) fn check(strict: bool, depth: Depth) -> Result<()> {
    let started = Instant::now();
    let ws = Workspace::load()?;
    let mut report = Report::default();
    let mut order = Vec::new();
    report.step("manifests and publish order", |r| {
        manifests(&ws, r);
        order = publish_order(&ws)?;
        eprintln!("xtask: release-check: publish order: {}", order.join(", "));
        Ok(())
    });
    if order.is_empty() {
        // No order (a cycle): package in name order so the other steps still report.
        order = ws.published().map(|m| m.name.clone()).collect();
    }
    let toolchains = installed_toolchains();
    report.step("MSRV", |r| msrv(&ws, &order, &toolchains, r));
    report.step("docs", |r| docs(&ws, &order, &toolchains, depth, r));
    report.step("packages", |r| {
        packages(&ws, &order, depth == Depth::Full, r)
    });
    report.step("cargo deny", deny);
    report.blockers.push(format!(
        "crate names already on crates.io under other owners: {} (rename before publishing)",
        NAMES_TAKEN_ON_CRATES_IO.join(", ")
    ));

    eprintln!("xtask: release-check summary:");
    for (name, outcome, secs) in &report.steps {
        eprintln!("xtask:   {name:<28} {outcome:<15} {secs:>5.0} s");
    }
    for note in &report.not_checked {
        eprintln!("xtask:   NOT CHECKED: {note}");
    }
    for blocker in &report.blockers {
        eprintln!("xtask:   BLOCKS PUBLISHING: {blocker}");
    }
    eprintln!(
        "xtask: release-check took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    if !report.failures.is_empty() {
        bail!("release-check failed:\n  {}", report.failures.join("\n  "));
    }
    if strict && !(report.not_checked.is_empty() && report.blockers.is_empty()) {
        bail!("release-check --strict: something was not checked or blocks publishing (above)");
    }
    Ok(())
}

/// The manifest rules of the module docs, and the root's license files and changelog.
fn manifests(ws: &Workspace, r: &mut Report) {
    let root = workspace_root();
    for file in LICENSE_FILES {
        if !root.join(file).is_file() {
            r.fail(format!("{file} is missing at the workspace root"));
        }
    }
    let published: BTreeSet<&str> = ws.published().map(|m| m.name.as_str()).collect();
    for m in &ws.members {
        let rel = m.dir.strip_prefix(&root).unwrap_or(&m.dir);
        if m.str_field("rust_version") != Some(ws.msrv.as_str()) {
            r.fail(format!(
                "{}: rust-version {:?}, not the workspace's {} (`rust-version.workspace = true`)",
                m.name,
                m.str_field("rust_version"),
                ws.msrv
            ));
        }
        if m.str_field("license") != Some(LICENSE) {
            r.fail(format!("{}: license is not {LICENSE}", m.name));
        }
        if !m.publish {
            continue;
        }
        if !rel.starts_with("crates") {
            r.fail(format!(
                "{} ({}) would be published: set `publish = false`",
                m.name,
                rel.display()
            ));
        }
        if m.str_field("description").is_none_or(str::is_empty) {
            r.fail(format!("{}: no description", m.name));
        }
        match m.str_field("repository") {
            None => r.fail(format!("{}: no repository", m.name)),
            Some(url) if url.contains(".invalid") => {
                let blocker = format!("the repository URL is a placeholder ({url})");
                if !r.blockers.contains(&blocker) {
                    r.blockers.push(blocker);
                }
            }
            Some(_) => {}
        }
        for file in LICENSE_FILES {
            if !m.dir.join(file).is_file() {
                r.fail(format!(
                    "{}: no {file} (a link to the root's, which cargo package follows)",
                    m.name
                ));
            }
        }
        let docs_rs = &m.package["metadata"]["docs"]["rs"];
        let cfg_docsrs = docs_rs["rustdoc-args"]
            .as_array()
            .is_some_and(|a| a.windows(2).any(|w| w[0] == "--cfg" && w[1] == "docsrs"));
        if docs_rs["all-features"] != Value::Bool(true) || !cfg_docsrs {
            r.fail(format!(
                "{}: [package.metadata.docs.rs] needs `all-features = true` and \
                 `rustdoc-args = [\"--cfg\", \"docsrs\"]`",
                m.name
            ));
        }
        if let Some(lib) = m.lib_root()
            && !fs::read_to_string(&lib)
                .unwrap_or_default()
                .contains(DOC_CFG)
        {
            r.fail(format!("{}: {} lacks `{DOC_CFG}`", m.name, lib.display()));
        }
        for (dep, kind, _) in m.deps() {
            let member = ws.members.iter().any(|o| o.name == dep);
            if kind != "dev" && member && !published.contains(dep) {
                r.fail(format!(
                    "{} depends on {dep}, which is not published",
                    m.name
                ));
            }
        }
    }
    changelog(ws, r);
}

/// `CHANGELOG.md` at the root with a section for the workspace's version (or an
/// Unreleased one before it is released).
fn changelog(ws: &Workspace, r: &mut Report) {
    let Ok(text) = fs::read_to_string(workspace_root().join("CHANGELOG.md")) else {
        r.fail("CHANGELOG.md is missing at the workspace root");
        return;
    };
    let versions: BTreeSet<&str> = ws.published().map(|m| m.version.as_str()).collect();
    for version in versions {
        let heading = format!("## [{version}]");
        if !text.contains(&heading) && !text.contains("## [Unreleased]") {
            r.fail(format!(
                "CHANGELOG.md has no `{heading}` (or `## [Unreleased]`) section"
            ));
        }
    }
}

/// The published crates in an order crates.io accepts: each after every published crate
/// it depends on, dev-dependencies with a version included (crates.io requires those
/// to exist too; a path-only dev-dependency is dropped from the published manifest).
fn publish_order(ws: &Workspace) -> Result<Vec<String>> {
    let published: BTreeSet<&str> = ws.published().map(|m| m.name.as_str()).collect();
    let mut needs: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for m in ws.published() {
        let deps = m
            .deps()
            .into_iter()
            .filter(|(dep, kind, req)| {
                published.contains(dep) && *dep != m.name && (*kind != "dev" || *req != "*")
            })
            .map(|(dep, _, _)| dep)
            .collect();
        needs.insert(&m.name, deps);
    }
    let mut order: Vec<String> = Vec::new();
    while !needs.is_empty() {
        let ready: Vec<&str> = needs
            .iter()
            .filter(|(_, deps)| deps.iter().all(|d| order.iter().any(|o| o.as_str() == *d)))
            .map(|(name, _)| *name)
            .collect();
        if ready.is_empty() {
            bail!(
                "the published crates depend on each other in a cycle (dev-dependencies \
                 included): {:?}",
                needs.keys().collect::<Vec<_>>()
            );
        }
        for name in ready {
            needs.remove(name);
            order.push(name.to_owned());
        }
    }
    Ok(order)
}

/// Installed rustup toolchains (`nightly-x86_64-...`, `1.94.0-...`), none without rustup.
fn installed_toolchains() -> Vec<String> {
    Command::new("rustup")
        .args(["toolchain", "list"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().next())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The installed toolchain named `channel` (`nightly`, `1.94`), if any.
fn toolchain<'a>(toolchains: &'a [String], channel: &str) -> Option<&'a str> {
    toolchains
        .iter()
        .find(|t| {
            t.strip_prefix(channel).is_some_and(|rest| {
                // `1.94-x86_64-...` or `1.94.1-x86_64-...`, not `1.940-...`.
                rest.starts_with('-')
                    || rest
                        .strip_prefix('.')
                        .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            })
        })
        .map(String::as_str)
}

/// `cargo` of the given rustup toolchain, or the current one.
fn cargo_on(toolchain: Option<&str>) -> Command {
    match toolchain {
        Some(t) => {
            let mut cmd = Command::new("rustup");
            cmd.args(["run", t, "cargo"]).current_dir(workspace_root());
            cmd
        }
        None => cargo(),
    }
}

/// The MSRV: a build with that toolchain, or the dependencies' declared `rust-version`s
/// and clippy's `incompatible_msrv` (run in [`docs`], on the same toolchain as rustdoc
/// so that both share one build of the dependencies).
fn msrv(ws: &Workspace, order: &[String], toolchains: &[String], r: &mut Report) -> Result<()> {
    if let Some(t) = toolchain(toolchains, &ws.msrv) {
        return run(cargo_on(Some(t))
            .args(["check", "--all-features"])
            .args(ws.package_args(order)));
    }
    r.not_checked.push(format!(
        "no build with Rust {} (toolchain not installed: `rustup toolchain install {}`); \
         checked by metadata and clippy's incompatible_msrv instead, which do not see \
         language features newer than it",
        ws.msrv, ws.msrv
    ));
    // Every package a user compiles with ours: the normal and build dependencies of the
    // published crates, transitively.
    let mut stack: Vec<&str> = ws
        .published()
        .filter_map(|m| m.package["id"].as_str())
        .collect();
    let mut seen: BTreeSet<&str> = stack.iter().copied().collect();
    while let Some(id) = stack.pop() {
        for (dep, kinds) in ws.resolve.get(id).into_iter().flatten() {
            if kinds.iter().any(|k| k != "dev") && seen.insert(dep) {
                stack.push(dep);
            }
        }
    }
    let limit = version_key(&ws.msrv);
    let (mut declared, mut undeclared, mut newest) = (0, 0, (Vec::new(), String::new()));
    let dependencies: Vec<&str> = seen
        .iter()
        .copied()
        .filter(|id| {
            !ws.members
                .iter()
                .any(|m| m.package["id"].as_str() == Some(*id))
        })
        .collect();
    for id in &dependencies {
        let Some((name, version, rust_version)) = ws.packages.get(*id) else {
            continue;
        };
        let Some(rv) = rust_version else {
            undeclared += 1;
            continue;
        };
        declared += 1;
        let key = version_key(rv);
        if key > limit {
            r.fail(format!(
                "{name} {version} needs Rust {rv}, newer than our rust-version {}",
                ws.msrv
            ));
        }
        if key > newest.0 {
            newest = (key, format!("{name} {version}: {rv}"));
        }
    }
    eprintln!(
        "xtask: release-check: MSRV {}: {} dependencies compiled by users of ours; \
         {declared} declare a rust-version (the newest: {}), {undeclared} declare none",
        ws.msrv,
        dependencies.len(),
        newest.1
    );
    Ok(())
}

/// The docs as docs.rs builds them, then clippy's `incompatible_msrv` on the same
/// toolchain (without the MSRV toolchain, the one check of the standard library items
/// we use).
fn docs(
    ws: &Workspace,
    order: &[String],
    toolchains: &[String],
    depth: Depth,
    r: &mut Report,
) -> Result<()> {
    let nightly = match depth {
        Depth::Quick => None,
        Depth::Full | Depth::NoVerify => toolchain(toolchains, "nightly"),
    };
    let rustdocflags = if nightly.is_some() {
        "-D warnings --cfg docsrs"
    } else if depth == Depth::Quick {
        r.not_checked.push(
            "docs built on the current toolchain without `--cfg docsrs` (quick check): \
             `cargo xtask release-check` builds them as docs.rs does"
                .to_owned(),
        );
        "-D warnings"
    } else {
        r.not_checked.push(
            "docs built on stable without `--cfg docsrs` (no nightly toolchain): the \
             `doc(cfg)` badges docs.rs shows were not built"
                .to_owned(),
        );
        "-D warnings"
    };
    let mut doc = cargo_on(nightly);
    doc.args(["doc", "--no-deps", "--all-features"])
        .args(ws.package_args(order))
        .env("RUSTDOCFLAGS", rustdocflags);
    eprintln!("xtask: RUSTDOCFLAGS={rustdocflags:?}");
    let doc = run(&mut doc);
    let clippy = if toolchain(toolchains, &ws.msrv).is_some() {
        Ok(()) // Built with the MSRV toolchain itself.
    } else {
        run(cargo_on(nightly)
            .args(["clippy", "--all-features"])
            .args(ws.package_args(order))
            .args(["--", "-A", "clippy::all", "-D", "clippy::incompatible_msrv"]))
    };
    doc.and(clippy)
}

/// `cargo package` of the published crates together (`verify`: each built from its
/// `.crate`), then each package's contents.
fn packages(ws: &Workspace, order: &[String], verify: bool, r: &mut Report) -> Result<()> {
    // `--allow-dirty`: a check, not a release; the packages are not kept.
    let mut package = cargo();
    package.args(["package", "--allow-dirty"]);
    if !verify {
        package.arg("--no-verify");
    }
    run(package.args(ws.package_args(order)))?;
    let ours: BTreeMap<&str, &str> = ws
        .published()
        .map(|m| (m.name.as_str(), m.version.as_str()))
        .collect();
    let dir = ws.target_dir.join("package");
    for m in ws.published() {
        let base = format!("{}-{}", m.name, m.version);
        let size = fs::metadata(dir.join(format!("{base}.crate")))
            .with_context(|| format!("{base}.crate was not made"))?
            .len();
        if size > MAX_CRATE_BYTES {
            r.fail(format!(
                "{base}.crate is {size} bytes (at most {MAX_CRATE_BYTES}): a stray file?"
            ));
        }
        let unpacked = dir.join(&base);
        if !verify {
            // Verification unpacks the `.crate`; without it, unpack it here.
            if unpacked.exists() {
                fs::remove_dir_all(&unpacked)
                    .with_context(|| format!("could not remove {}", unpacked.display()))?;
            }
            run(Command::new("tar")
                .arg("-xzf")
                .arg(dir.join(format!("{base}.crate")))
                .arg("-C")
                .arg(&dir))?;
        }
        for missing in missing_includes(&unpacked) {
            r.fail(format!("{base}.crate: {missing}"));
        }
        for file in LICENSE_FILES {
            if !unpacked.join(file).is_file() {
                r.fail(format!("{base}.crate does not contain {file}"));
            }
        }
        let lock = fs::read_to_string(unpacked.join("Cargo.lock")).unwrap_or_default();
        for (name, version) in lock_entries(&lock) {
            let Some(our_version) = ours.get(name.as_str()) else {
                continue;
            };
            if version == *our_version {
                continue;
            }
            let found = format!(
                "{base}'s lockfile resolves {name} {version} from crates.io, not ours \
                 ({our_version})"
            );
            if NAMES_TAKEN_ON_CRATES_IO.contains(&name.as_str()) {
                eprintln!("xtask: release-check: {found} (a name taken on crates.io)");
            } else {
                r.fail(found);
            }
        }
        eprintln!("xtask: release-check: {base}.crate: {size} bytes");
    }
    Ok(())
}

/// The `include_str!`/`include_bytes!` of the Rust sources under `root` whose file is
/// not there (a literal path, relative to the including file), as `file: path`.
fn missing_includes(root: &Path) -> Vec<String> {
    let mut missing = Vec::new();
    for path in files_under(root) {
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        let text = fs::read_to_string(&path).unwrap_or_default();
        for included in included_paths(&text) {
            let at = path.parent().unwrap_or(root).join(&included);
            if !at.is_file() {
                let shown = path.strip_prefix(root).unwrap_or(&path).display();
                missing.push(format!("{shown} includes {included}, not in the package"));
            }
        }
    }
    missing.sort();
    missing
}

/// The literal paths of `include_str!("…")` and `include_bytes!("…")` in `text`.
fn included_paths(text: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for macro_name in ["include_str!(", "include_bytes!("] {
        for (at, _) in text.match_indices(macro_name) {
            let rest = text[at + macro_name.len()..].trim_start();
            if let Some(literal) = rest.strip_prefix('"')
                && let Some(end) = literal.find('"')
            {
                paths.push(literal[..end].to_owned());
            }
        }
    }
    paths
}

/// `(name, version)` of every package in a `Cargo.lock`.
fn lock_entries(lock: &str) -> Vec<(String, String)> {
    let mut entries = Vec::new();
    let mut name = None;
    for line in lock.lines().map(str::trim) {
        if line == "[[package]]" {
            name = None;
        } else if let Some(v) = line.strip_prefix("name = ") {
            name = Some(v.trim_matches('"').to_owned());
        } else if let Some(v) = line.strip_prefix("version = ")
            && let Some(n) = name.take()
        {
            entries.push((n, v.trim_matches('"').to_owned()));
        }
    }
    entries
}

/// `cargo deny check licenses bans sources`, and `advisories` against a local copy of
/// the RustSec database. cargo-deny is installed once (`cargo install cargo-deny
/// --locked`, a few minutes), not by this check.
fn deny(r: &mut Report) -> Result<()> {
    let installed = cargo()
        .args(["deny", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        r.not_checked.push(
            "cargo deny (licenses, bans, sources, advisories): cargo-deny is not installed \
             (`cargo install cargo-deny --locked`, once)"
                .to_owned(),
        );
        return Ok(());
    }
    let checks = run(cargo().args([
        "deny",
        "check",
        "--hide-inclusion-graph",
        "licenses",
        "bans",
        "sources",
    ]));
    if advisory_db_present() {
        // `--offline`: the copy as it is; GitHub may be out of reach.
        let advisories = run(cargo().args([
            "deny",
            "--offline",
            "check",
            "--hide-inclusion-graph",
            "advisories",
        ]));
        r.not_checked.push(
            "advisories were checked against the local copy of the RustSec database, \
             which may be old (`cargo deny fetch` where GitHub is reachable)"
                .to_owned(),
        );
        return checks.and(advisories);
    }
    r.not_checked.push(
        "advisories: no local copy of the RustSec database (it is fetched from GitHub: \
         `cargo deny fetch`, then `cargo deny check advisories`)"
            .to_owned(),
    );
    checks
}

/// Whether cargo-deny's default database directory holds a fetched database.
fn advisory_db_present() -> bool {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let Some(dbs) = cargo_home.map(|h| h.join("advisory-dbs")) else {
        return false;
    };
    fs::read_dir(dbs).into_iter().flatten().flatten().any(|e| {
        e.file_name().to_string_lossy().starts_with("advisory-db")
            && e.path().join("crates").is_dir()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn included_paths_are_found() {
        let text = r#"
            const CSS: &str = include_str!("assets/dashboard.css");
            static ICON: &[u8] = include_bytes!( "../icon.png" );
            let not_literal = include_str!(concat!(env!("OUT_DIR"), "/x"));
        "#;
        assert_eq!(
            included_paths(text),
            ["assets/dashboard.css", "../icon.png"]
        );
    }

    #[test]
    fn a_missing_include_is_reported() {
        let root = std::env::temp_dir().join(format!("release-check-{}", std::process::id()));
        fs::create_dir_all(root.join("src/assets")).expect("dirs");
        fs::write(root.join("src/assets/a.css"), "").expect("a.css");
        fs::write(
            root.join("src/lib.rs"),
            "const A: &str = include_str!(\"assets/a.css\");\nconst B: &str = include_str!(\"assets/b.js\");\n",
        )
        .expect("lib.rs");
        let missing = missing_includes(&root);
        fs::remove_dir_all(&root).expect("cleanup");
        assert_eq!(
            missing,
            ["src/lib.rs includes assets/b.js, not in the package"]
        );
    }

    #[test]
    fn the_workspace_rust_version_is_read_from_its_table() {
        let manifest = "[package]\nrust-version = \"1.60\"\n\n[workspace.package]\n\
                        version = \"0.1.0\"\nrust-version = \"1.94\"\n";
        assert_eq!(workspace_rust_version(manifest).as_deref(), Some("1.94"));
        assert_eq!(workspace_rust_version("[workspace]\n"), None);
    }

    #[test]
    fn rust_versions_compare_as_numbers() {
        assert_eq!(version_key("1.94"), version_key("1.94.0"));
        assert!(version_key("1.100") > version_key("1.94.1"));
        assert!(version_key("1.85") < version_key("1.94"));
    }

    #[test]
    fn toolchains_are_found_by_channel() {
        let installed = [
            "stable-x86_64-unknown-linux-gnu".to_owned(),
            "nightly-x86_64-unknown-linux-gnu".to_owned(),
            "1.95.0-x86_64-unknown-linux-gnu".to_owned(),
        ];
        assert_eq!(
            toolchain(&installed, "nightly"),
            Some("nightly-x86_64-unknown-linux-gnu")
        );
        assert_eq!(
            toolchain(&installed, "1.95"),
            Some("1.95.0-x86_64-unknown-linux-gnu")
        );
        assert_eq!(toolchain(&installed, "1.9"), None);
        assert_eq!(toolchain(&installed, "1.94"), None);
        let patch = ["1.94.1-x86_64-unknown-linux-gnu".to_owned()];
        assert_eq!(
            toolchain(&patch, "1.94"),
            Some("1.94.1-x86_64-unknown-linux-gnu")
        );
    }

    #[test]
    fn lock_entries_pair_names_with_versions() {
        let lock = "version = 4\n\n[[package]]\nname = \"outbox\"\nversion = \"0.1.0\"\n\
                    dependencies = [\n \"outboxkit-core\",\n]\n\n[[package]]\n\
                    name = \"outboxkit-core\"\nversion = \"0.2.2\"\nsource = \"registry+x\"\n";
        assert_eq!(
            lock_entries(lock),
            [
                ("outbox".to_owned(), "0.1.0".to_owned()),
                ("outboxkit-core".to_owned(), "0.2.2".to_owned())
            ]
        );
    }

    #[test]
    fn the_publish_order_puts_dependencies_first() {
        let ws = Workspace::load().expect("cargo metadata");
        let order = publish_order(&ws).expect("no cycle");
        let position = |name: &str| {
            order
                .iter()
                .position(|n| n == name)
                .unwrap_or_else(|| panic!("{name} is published: {order:?}"))
        };
        for m in ws.published() {
            for (dep, kind, req) in m.deps() {
                if order.iter().any(|o| o == dep) && (kind != "dev" || req != "*") {
                    assert!(position(dep) < position(&m.name), "{dep} before {}", m.name);
                }
            }
        }
        assert!(
            !order
                .iter()
                .any(|n| n == "outboxkit-testkit" || n == "outboxkit-lab" || n == "xtask")
        );
        assert_eq!(order.first().map(String::as_str), Some("outboxkit-core"));
        // Every backend is published before the facade and the binary that use it.
        for backend in [
            "outboxkit-postgres",
            "outboxkit-sqlserver",
            "outboxkit-mysql",
        ] {
            assert!(
                position(backend) < position("outbox"),
                "{backend}: {order:?}"
            );
            assert!(
                position(backend) < position("outboxkit-cli"),
                "{backend}: {order:?}"
            );
        }
    }
}
