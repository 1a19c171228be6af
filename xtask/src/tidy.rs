//! House-style checks over the repository, run as ordinary tests.

use std::fs;
use std::path::PathBuf;

use crate::{files_under, workspace_root};

/// Whether the manifest opts into the workspace lints
/// (`[lints]` + `workspace = true`, or `lints.workspace = true`).
fn uses_workspace_lints(manifest: &str) -> bool {
    // The current `[table]` header; empty before the first one.
    let mut table = String::new();
    for line in manifest.lines() {
        let line: String = line
            .split('#')
            .next()
            .unwrap_or_default()
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        if line.starts_with('[') {
            table = line;
        } else if (table == "[lints]" && line == "workspace=true")
            || (table.is_empty() && line == "lints.workspace=true")
        {
            return true;
        }
    }
    false
}

#[test]
fn every_manifest_uses_workspace_lints() {
    let root = workspace_root();
    let mut manifests: Vec<PathBuf> = ["crates", "examples"]
        .iter()
        .flat_map(|dir| files_under(&root.join(dir)))
        .filter(|path| path.file_name().is_some_and(|name| name == "Cargo.toml"))
        .collect();
    manifests.push(root.join("xtask/Cargo.toml"));

    let offenders: Vec<String> = manifests
        .iter()
        .filter(|path| {
            let text = fs::read_to_string(path).unwrap_or_default();
            !uses_workspace_lints(&text)
        })
        .map(|path| {
            path.strip_prefix(&root)
                .unwrap_or(path)
                .display()
                .to_string()
        })
        .collect();
    assert!(
        offenders.is_empty(),
        "these manifests need `[lints]\\nworkspace = true`: {offenders:?}"
    );
}

#[test]
fn no_crate_level_lint_lists_in_crates() {
    let root = workspace_root();
    let mut offenders = Vec::new();
    for path in files_under(&root.join("crates")) {
        // Non-text files cannot hold attributes.
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        for (number, line) in text.lines().enumerate() {
            let compact: String = line.chars().filter(|c| !c.is_whitespace()).collect();
            if compact.contains("#![warn(") || compact.contains("#![deny(") {
                let shown = path.strip_prefix(&root).unwrap_or(&path).display();
                offenders.push(format!("{shown}:{}", number + 1));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "lint levels belong in [workspace.lints], not in `#![warn(..)]`/`#![deny(..)]`: {offenders:?}"
    );
}

/// A test is ignored only because it needs SQL Server (`cargo xtask itest` runs those
/// with `--ignored` when `MSSQL_URL` is set), because it needs the broker clusters
/// (named `on_cluster_*`, run by `cargo xtask itest --cluster`) or because it is one of
/// [`sqlserver::OTHER_IGNORED`](crate::sqlserver::OTHER_IGNORED), which that pass skips.
#[test]
fn tests_are_ignored_only_for_sql_server() {
    use crate::sqlserver::{IGNORE_REASON, OTHER_IGNORED};

    let root = workspace_root();
    let wanted = format!("#[ignore=\"{IGNORE_REASON}\"]").replace(' ', "");
    let cluster = format!("#[ignore=\"{}\"]", crate::cluster::IGNORE_REASON).replace(' ', "");
    let scale = format!("#[ignore=\"{}\"]", crate::scale::IGNORE_REASON).replace(' ', "");
    let mut offenders = Vec::new();
    let mut found = 0;
    for path in ["crates", "examples"]
        .iter()
        .flat_map(|dir| files_under(&root.join(dir)))
        .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
    {
        let text = fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        'lines: for (number, line) in lines.iter().enumerate() {
            let compact: String = line.chars().filter(|c| !c.is_whitespace()).collect();
            if compact.starts_with("//") || !compact.contains("#[ignore") {
                continue;
            }
            found += 1;
            if compact.contains(&wanted) {
                continue;
            }
            // The broker clusters' tests (run by `cargo xtask itest --cluster`) and the
            // scale tests (`cargo xtask scale`): ignored, named so that the SQL Server
            // pass can skip them.
            for (reason, prefix) in [
                (&cluster, crate::cluster::TEST_PREFIX),
                (&scale, crate::scale::TEST_PREFIX),
            ] {
                let named = compact.contains(reason.as_str())
                    && lines[number..lines.len().min(number + 4)]
                        .iter()
                        .find_map(|l| l.split("fn ").nth(1))
                        .is_some_and(|name| name.starts_with(prefix));
                if named {
                    continue 'lines;
                }
            }
            // The function it is on, within the next few lines.
            let function = lines[number..lines.len().min(number + 4)]
                .iter()
                .find_map(|l| l.split("fn ").nth(1))
                .and_then(|rest| rest.split('(').next())
                .unwrap_or_default();
            if !OTHER_IGNORED.contains(&function) {
                let shown = path.strip_prefix(&root).unwrap_or(&path).display();
                offenders.push(format!("{shown}:{}", number + 1));
            }
        }
    }
    assert!(found > 0, "the SQL Server tests are marked #[ignore]");
    assert!(
        offenders.is_empty(),
        "ignore a test only with #[ignore = \"{IGNORE_REASON}\"] (or list it in \
         sqlserver::OTHER_IGNORED, which `cargo xtask itest` skips): {offenders:?}"
    );
}

#[test]
fn ci_runs_the_documented_test_command() {
    let ci = fs::read_to_string(workspace_root().join(".ci/run")).expect(".ci/run exists");
    assert!(
        ci.contains("cargo xtask itest"),
        ".ci/run must run `cargo xtask itest`"
    );
}

/// The README's quick start is the compiled example, line for line (from its first
/// `use`), so that what a newcomer copies is what CI builds and runs.
#[test]
fn readme_quick_start_is_the_example() {
    let readme = fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let example =
        fs::read_to_string(workspace_root().join("crates/outbox/examples/quick_start.rs"))
            .expect("the quick start example");
    let program = &example[example.find("use std::sync::Arc;").expect("its first use")..];
    assert!(
        readme.contains(&format!("```rust,ignore\n{program}```\n")),
        "README.md's quick start differs from crates/outbox/examples/quick_start.rs \
         (copy the example from its first `use` into the README's code block)"
    );
}

#[test]
fn readme_documents_the_xtask_commands() {
    let Ok(readme) = fs::read_to_string(workspace_root().join("README.md")) else {
        return; // No README yet.
    };
    for command in ["cargo xtask itest", "cargo xtask demo", "cargo xtask chaos"] {
        assert!(
            readme.contains(command),
            "README.md must mention `{command}`"
        );
    }
}

#[test]
fn lints_detection() {
    assert!(uses_workspace_lints(
        "[package]\nname = \"x\"\n\n[lints]\nworkspace = true\n"
    ));
    assert!(uses_workspace_lints("[lints]\nworkspace=true # shared\n"));
    assert!(uses_workspace_lints("lints.workspace = true\n"));
    assert!(!uses_workspace_lints("[package]\nworkspace = true\n"));
    assert!(!uses_workspace_lints("[package]\nlints.workspace = true\n"));
    assert!(!uses_workspace_lints("[lints]\n# workspace = true\n"));
    assert!(!uses_workspace_lints(
        "[lints.rust]\nunsafe_code = \"forbid\"\n"
    ));
}
