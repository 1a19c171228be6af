//! `cargo xtask release-check`: what publishing the crates to crates.io needs, checked
//! without publishing anything.
//!
//! * Manifests: every publishable crate (`publish` not `false`: each of `crates/*` but
//!   `outboxkit-testkit` and `outboxkit-lab`) carries `MIT OR Apache-2.0` with both license files, the
//!   workspace's `rust-version`, a description, a repository and docs.rs metadata
//!   (`all-features`, `--cfg docsrs`, `doc_cfg`); the examples and xtask are
//!   `publish = false`; no published crate needs an unpublished one; a `CHANGELOG.md`
//!   with a section for the version. The publish order is derived from the manifests.
//! * Names on crates.io: each published crate's name is looked up in crates.io's sparse
//!   index (`https://index.crates.io/`, with `curl`; also spelled with `_` for `-`, which
//!   crates.io takes for the same name): not there, it is free; there, it must be ours
//!   (the manifest of its newest version names the workspace's `repository`), or the run
//!   fails saying the name is taken. Without crates.io (offline, no `curl`) the names
//!   are reported as not checked.
//! * MSRV: built with the `rust-version` toolchain when rustup has it; otherwise every
//!   crate a user compiles with ours must declare a `rust-version` no newer than ours
//!   (`cargo metadata`), and clippy's `incompatible_msrv` finds any standard library
//!   item newer than it.
//! * Docs: `cargo doc --no-deps --all-features -D warnings` of the published crates, as
//!   docs.rs builds them (nightly and `--cfg docsrs` when rustup has a nightly); the
//!   facade's list of items names each item once and misses none of the member crates'
//!   (`docs_once`).
//! * Packages: `cargo package` of all the published crates together (cargo resolves
//!   them against each other through a local registry overlay, so nothing of ours must
//!   be on crates.io yet) with verification (each package builds alone, from its
//!   `.crate`; `cargo xtask itest` skips that build, see [`check`]), then each
//!   package's contents: the license files, every `include_str!`/`include_bytes!` file,
//!   a size that rules out stray files, and a lockfile whose copies of our crates are
//!   ours.
//! * Publish dry run: `cargo publish --workspace --dry-run --no-verify` (cargo 1.90+),
//!   which uploads nothing but packages the crates in cargo's own publish order against
//!   crates.io's index, a path the `cargo package` step does not take; the order must be
//!   ours, and the step is not checked when crates.io cannot be reached. The builds from
//!   the `.crate`s are the `cargo package` step's (`--no-verify` here: not twice).
//! * `cargo deny check licenses bans sources` (deny.toml), and `advisories` against a
//!   local copy of the RustSec database when there is one (it is fetched from GitHub).
//!
//! Every step runs and reports; the run fails if one failed. What could not be checked
//! here and what blocks publishing (a decision, not a fix) is listed at the end;
//! `--strict` fails on those too.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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

/// crates.io's sparse index: one file per crate name, one JSON line per version.
const SPARSE_INDEX: &str = "https://index.crates.io";

/// crates.io's downloads, for the manifest (its `repository`) of a crate the index has:
/// the index does not say where a crate comes from (and crates.io's API, which does,
/// is not always reachable where the index is).
const CRATES_IO_DOWNLOADS: &str = "https://static.crates.io/crates";

/// How long one request to crates.io may take, in seconds.
const HTTP_TIMEOUT_SECS: &str = "20";

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
    let mut crates_io = None;
    report.step("names on crates.io", |r| {
        crates_io = Some(names_on_crates_io(&ws, r));
        Ok(())
    });
    let toolchains = installed_toolchains();
    report.step("MSRV", |r| msrv(&ws, &order, &toolchains, r));
    report.step("docs", |r| docs(&ws, &order, &toolchains, depth, r));
    report.step("packages", |r| {
        packages(&ws, &order, depth == Depth::Full, r)
    });
    report.step("publish dry run", |r| {
        publish_dry_run(&order, crates_io == Some(true), r)
    });
    report.step("cargo deny", deny);

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
    let doc = run(&mut doc).and_then(|()| {
        // Each item once in the facade's docs, and every member crate's item in them.
        for problem in crate::docs_once::check(&ws.target_dir.join("doc"))? {
            r.fail(format!("docs of the facade: {problem}"));
        }
        Ok(())
    });
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
    let dir = package_and_unpack(ws, order, verify)?;
    let ours: BTreeMap<&str, &str> = ws
        .published()
        .map(|m| (m.name.as_str(), m.version.as_str()))
        .collect();
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
            r.fail(format!(
                "{base}'s lockfile resolves {name} {version} from crates.io, not ours \
                 ({our_version})"
            ));
        }
        eprintln!("xtask: release-check: {base}.crate: {size} bytes");
    }
    Ok(())
}

/// `cargo package` of the published crates together (`verify`: each built from its
/// `.crate`, which unpacks it), each `.crate` unpacked beside it; returns the directory
/// (`TARGET/package`) holding `NAME-VERSION.crate` and `NAME-VERSION/`.
fn package_and_unpack(ws: &Workspace, order: &[String], verify: bool) -> Result<PathBuf> {
    // `--allow-dirty`: a check, not a release; the packages are not kept.
    let mut package = cargo();
    package.args(["package", "--allow-dirty"]);
    if !verify {
        package.arg("--no-verify");
    }
    run(package.args(ws.package_args(order)))?;
    let dir = ws.target_dir.join("package");
    for m in ws.published() {
        let base = format!("{}-{}", m.name, m.version);
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
    }
    Ok(dir)
}

/// The published crates as `cargo package` made them, unpacked.
pub(crate) struct Unpacked {
    /// The unpacked directory of each published crate, by name.
    pub(crate) dirs: BTreeMap<String, PathBuf>,
    /// The workspace's target directory (`cargo metadata`).
    pub(crate) target_dir: PathBuf,
}

/// The published crates' packages unpacked under `TARGET/package`: made and unpacked
/// here (`make`, without the verification build), or as an earlier
/// `release-check` left them (which `cargo xtask itest` has just run).
///
/// # Errors
/// `cargo metadata` or `cargo package` failing, a dependency cycle, or (not `make`)
/// a package that is not unpacked there.
pub(crate) fn unpacked(make: bool) -> Result<Unpacked> {
    let ws = Workspace::load()?;
    let dir = if make {
        package_and_unpack(&ws, &publish_order(&ws)?, false)?
    } else {
        ws.target_dir.join("package")
    };
    let mut dirs = BTreeMap::new();
    for m in ws.published() {
        let unpacked = dir.join(format!("{}-{}", m.name, m.version));
        if !unpacked.join("Cargo.toml").is_file() {
            bail!(
                "{} is not there: `cargo xtask release-check --no-verify` makes it",
                unpacked.display()
            );
        }
        dirs.insert(m.name.clone(), unpacked);
    }
    Ok(Unpacked {
        dirs,
        target_dir: ws.target_dir.clone(),
    })
}

/// The file of crate `name` in a sparse index (lowercase): `1/a`, `2/ab`, `3/a/abc`,
/// then the first two letters and the next two, `ou/tb/outboxkit-core`.
fn index_path(name: &str) -> String {
    let name = name.to_ascii_lowercase();
    match name.len() {
        1 => format!("1/{name}"),
        2 => format!("2/{name}"),
        3 => format!("3/{}/{name}", &name[..1]),
        _ => format!("{}/{}/{name}", &name[..2], &name[2..4]),
    }
}

/// The versions in a sparse index file (one JSON object a line), yanked ones marked.
fn index_versions(file: &str) -> Vec<String> {
    file.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|v| {
            let version = v["vers"].as_str()?.to_owned();
            Some(if v["yanked"] == Value::Bool(true) {
                format!("{version} (yanked)")
            } else {
                version
            })
        })
        .collect()
}

/// What a GET from crates.io gave.
enum Fetched {
    /// An HTTP answer: status and body.
    Answer(u16, String),
    /// No answer (no `curl`, no network, a timeout), and why.
    Unreachable(String),
}

/// GET `url` with `curl` (no HTTP client in xtask's dependencies).
fn http_get(url: &str) -> Fetched {
    let out = Command::new("curl")
        .args([
            "--silent",
            "--show-error",
            "--location",
            "--max-time",
            HTTP_TIMEOUT_SECS,
            // crates.io's API refuses requests without a user agent.
            "--user-agent",
            "outboxkit-xtask-release-check",
            "--write-out",
            "\n%{http_code}",
            url,
        ])
        .stdin(Stdio::null())
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => return Fetched::Unreachable(format!("could not run curl: {e}")),
    };
    if !out.status.success() {
        return Fetched::Unreachable(format!(
            "curl {url}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    match code.trim().parse::<u16>() {
        Ok(code) if code != 0 => Fetched::Answer(code, body.to_owned()),
        _ => Fetched::Unreachable(format!("curl {url}: no HTTP status")),
    }
}

/// A repository URL compared loosely: no trailing `/` or `.git`, lowercase.
fn same_repository(a: &str, b: &str) -> bool {
    let norm = |u: &str| {
        u.trim()
            .trim_end_matches('/')
            .trim_end_matches(".git")
            .to_ascii_lowercase()
    };
    norm(a) == norm(b)
}

/// `repository` of a manifest's `[package]` table.
fn manifest_repository(manifest: &str) -> Option<String> {
    let mut table = "";
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            table = line;
        } else if table == "[package]"
            && let Some((key, value)) = line.split_once('=')
            && key.trim() == "repository"
        {
            return Some(value.trim().trim_matches('"').to_owned());
        }
    }
    None
}

/// The `repository` in the manifest of crates.io's `name` `version` (its `.crate`
/// downloaded and read), or why it could not be read.
fn published_repository(name: &str, version: &str) -> Result<Option<String>, String> {
    let file = std::env::temp_dir().join(format!(
        "release-check-{}-{name}-{version}.crate",
        std::process::id()
    ));
    let url = format!("{CRATES_IO_DOWNLOADS}/{name}/{name}-{version}.crate");
    let downloaded = Command::new("curl")
        .args([
            "--silent",
            "--show-error",
            "--fail",
            "--location",
            "--max-time",
            HTTP_TIMEOUT_SECS,
            "--output",
        ])
        .arg(&file)
        .arg(&url)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run curl: {e}"))?;
    if !downloaded.status.success() {
        let _ = fs::remove_file(&file);
        return Err(format!(
            "curl {url}: {}",
            String::from_utf8_lossy(&downloaded.stderr).trim()
        ));
    }
    let manifest = Command::new("tar")
        .arg("-xzOf")
        .arg(&file)
        .arg(format!("{name}-{version}/Cargo.toml"))
        .output();
    let _ = fs::remove_file(&file);
    let manifest = manifest.map_err(|e| format!("could not run tar: {e}"))?;
    if !manifest.status.success() {
        return Err(format!("{url} holds no {name}-{version}/Cargo.toml"));
    }
    Ok(manifest_repository(&String::from_utf8_lossy(
        &manifest.stdout,
    )))
}

/// Versions for a message: all of a few, or how many and the first and last.
fn versions_shown(versions: &[String]) -> String {
    match versions {
        [] => "no versions".to_owned(),
        [first, .., last] if versions.len() > 4 => {
            format!("{} versions, {first} to {last}", versions.len())
        }
        _ => format!("versions {}", versions.join(", ")),
    }
}

/// Each published crate's name in crates.io's sparse index, as it is spelled and with
/// `_` for `-` (one name to crates.io): free (not there), ours (the manifest of its
/// newest version gives this workspace's repository) or taken (a failure). Returns
/// whether crates.io answered; when it did not, the names are reported as not checked.
fn names_on_crates_io(ws: &Workspace, r: &mut Report) -> bool {
    for m in ws.published() {
        let mut spellings = vec![m.name.clone()];
        if m.name.contains('-') {
            spellings.push(m.name.replace('-', "_"));
        }
        let mut found = None;
        for spelling in spellings {
            let url = format!("{SPARSE_INDEX}/{}", index_path(&spelling));
            match http_get(&url) {
                Fetched::Unreachable(why) => {
                    r.not_checked.push(format!(
                        "names on crates.io: could not check, crates.io's index was not \
                         reached ({why})"
                    ));
                    return false;
                }
                Fetched::Answer(404, _) => {}
                Fetched::Answer(200, body) => {
                    found = Some(Some((spelling, index_versions(&body))));
                    break;
                }
                Fetched::Answer(code, _) => {
                    r.not_checked.push(format!(
                        "name {} on crates.io: could not check, {url} answered HTTP {code}",
                        m.name
                    ));
                    found = Some(None);
                    break;
                }
            }
        }
        let (spelling, versions) = match found {
            None => {
                eprintln!("xtask: release-check: {}: free on crates.io", m.name);
                continue;
            }
            Some(None) => continue, // Reported as not checked.
            Some(Some(found)) => found,
        };
        let shown = versions_shown(&versions);
        let as_spelled = if spelling == m.name {
            String::new()
        } else {
            format!(" as {spelling}")
        };
        let ours = m.str_field("repository").unwrap_or_default();
        let newest = versions
            .last()
            .and_then(|v| v.split(' ').next())
            .unwrap_or_default();
        match published_repository(&spelling, newest) {
            Ok(Some(repo)) if !ours.is_empty() && same_repository(&repo, ours) => {
                eprintln!(
                    "xtask: release-check: {}: published from this repository ({shown})",
                    m.name
                );
                if versions
                    .iter()
                    .any(|v| v.split(' ').next() == Some(m.version.as_str()))
                {
                    r.blockers.push(format!(
                        "{} {} is already on crates.io: the version needs a bump",
                        m.name, m.version
                    ));
                }
            }
            Ok(repo) => r.fail(format!(
                "the name {} is taken on crates.io{as_spelled} ({shown}; repository {}), \
                 not published from this repository ({ours}): rename the package",
                m.name,
                repo.as_deref().unwrap_or("none given")
            )),
            Err(why) => r.fail(format!(
                "the name {} is taken on crates.io{as_spelled} ({shown}); whether it is \
                 ours could not be read ({why})",
                m.name
            )),
        }
    }
    true
}

/// `cargo publish --workspace --dry-run --no-verify`: cargo packages every published
/// crate and walks the uploads in its dependency order, against crates.io's index,
/// uploading nothing. Each crate's build from its `.crate` is the `packages` step's.
fn publish_dry_run(order: &[String], crates_io: bool, r: &mut Report) -> Result<()> {
    if !crates_io {
        r.not_checked.push(
            "cargo publish --dry-run: crates.io could not be reached (it reads the index)"
                .to_owned(),
        );
        return Ok(());
    }
    let mut cmd = cargo();
    cmd.args([
        "publish",
        "--workspace",
        "--dry-run",
        "--no-verify",
        "--allow-dirty",
    ]);
    let shown = display(&cmd);
    eprintln!("xtask: running `{shown}`");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not run `{shown}`"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if stderr.contains("unexpected argument '--workspace'") {
            r.not_checked.push(
                "cargo publish --dry-run: this cargo has no multi-package publishing \
                 (`--workspace`, cargo 1.90+)"
                    .to_owned(),
            );
            return Ok(());
        }
        bail!("`{shown}` failed ({}):\n{stderr}", out.status);
    }
    let uploaded: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("Uploading "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    eprintln!(
        "xtask: release-check: cargo's publish order: {}",
        uploaded.join(", ")
    );
    let cargos: BTreeSet<&str> = uploaded.iter().copied().collect();
    let ours: BTreeSet<&str> = order.iter().map(String::as_str).collect();
    if cargos != ours {
        r.fail(format!(
            "`{shown}` would publish {cargos:?}, not the published crates {ours:?}"
        ));
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

/// `(name, version)` of every package in a `Cargo.lock` (also `cargo xtask outside`'s).
pub(crate) fn lock_entries(lock: &str) -> Vec<(String, String)> {
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
    fn index_paths_follow_the_sparse_index_layout() {
        assert_eq!(index_path("a"), "1/a");
        assert_eq!(index_path("ab"), "2/ab");
        assert_eq!(index_path("abc"), "3/a/abc");
        assert_eq!(index_path("outboxkit-core"), "ou/tb/outboxkit-core");
        assert_eq!(index_path("Serde"), "se/rd/serde");
    }

    #[test]
    fn index_versions_are_read_line_by_line() {
        let file = "{\"name\":\"x\",\"vers\":\"0.1.0\",\"yanked\":false}\n\
                    {\"name\":\"x\",\"vers\":\"0.2.0\",\"yanked\":true}\n";
        assert_eq!(index_versions(file), ["0.1.0", "0.2.0 (yanked)"]);
        assert!(same_repository(
            "https://github.com/o/r.git",
            "https://github.com/O/r/"
        ));
        assert!(!same_repository(
            "https://github.com/o/r",
            "https://example.invalid/r"
        ));
    }

    #[test]
    fn the_repository_is_read_from_the_package_table() {
        let manifest = "[package]\nname = \"x\"\nrepository = \"https://github.com/o/r\"\n\n\
                        [dependencies]\nrepository = \"no\"\n";
        assert_eq!(
            manifest_repository(manifest).as_deref(),
            Some("https://github.com/o/r")
        );
        assert_eq!(manifest_repository("[lib]\nrepository = \"no\"\n"), None);
        let many: Vec<String> = ["0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"]
            .map(str::to_owned)
            .to_vec();
        assert_eq!(versions_shown(&many), "5 versions, 0.1.0 to 0.5.0");
        assert_eq!(versions_shown(&many[..2]), "versions 0.1.0, 0.2.0");
    }

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
        let lock = "version = 4\n\n[[package]]\nname = \"outboxkit\"\nversion = \"0.1.0\"\n\
                    dependencies = [\n \"outboxkit-core\",\n]\n\n[[package]]\n\
                    name = \"outboxkit-core\"\nversion = \"0.2.2\"\nsource = \"registry+x\"\n";
        assert_eq!(
            lock_entries(lock),
            [
                ("outboxkit".to_owned(), "0.1.0".to_owned()),
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
                position(backend) < position("outboxkit"),
                "{backend}: {order:?}"
            );
            assert!(
                position(backend) < position("outboxkit-cli"),
                "{backend}: {order:?}"
            );
        }
    }
}
