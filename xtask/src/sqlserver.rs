//! SQL Server is opt-in (a large amd64-only image). Its live tests are
//! `#[ignore = "needs MSSQL_URL"]`, so that a run without it reports them as ignored
//! rather than passed; `cargo xtask itest` runs them in a second pass (`--ignored`) when
//! `MSSQL_URL` is set, and otherwise says how many did not run.

use std::ffi::OsString;

use anyhow::{Context, Result};

use crate::{cargo, display, env_default, run_child};

/// The reason every SQL Server live test is ignored with (the tidy tests keep it the
/// only reason besides [`OTHER_IGNORED`] and the broker clusters'
/// [`crate::cluster::IGNORE_REASON`]).
pub(crate) const IGNORE_REASON: &str = "needs MSSQL_URL";

/// The ignored tests that are not SQL Server ones, left out of the `--ignored` pass: the
/// backends' `dump_sql`, which prints the rendered SQL for review, and the dashboard's
/// page timings, which load a million rows (both run by hand).
pub(crate) const OTHER_IGNORED: [&str; 2] = [
    "dump_sql",
    "every_page_at_a_million_pending_and_ten_thousand_dead",
];

/// Whether `MSSQL_URL` names a server (set and not empty).
pub(crate) fn url_set() -> bool {
    std::env::var_os("MSSQL_URL").is_some_and(|v| !v.is_empty())
}

/// Says, without `MSSQL_URL`, that the SQL Server suite does not run: before the tests
/// (`skipped` unknown yet) and after them, with the number of tests that did not run.
pub(crate) fn announce_skip(skipped: Option<usize>) {
    if url_set() {
        return;
    }
    let what = match skipped {
        Some(n) => format!("{n} tests marked #[ignore = \"{IGNORE_REASON}\"] did not run"),
        None => format!(
            "the tests marked #[ignore = \"{IGNORE_REASON}\"] (outboxkit-sqlserver's \
             conformance, inbox, admin and connection tests, outboxkit-cli's \
             every_command_on_sqlserver) do not run"
        ),
    };
    eprintln!(
        "xtask: SQL Server suite SKIPPED: MSSQL_URL is not set, so {what}; the test summaries \
         count them as ignored, not passed (`docker compose up -d mssql`, then export \
         MSSQL_URL as in compose.yaml)"
    );
}

/// `cargo test --workspace --all-targets ARGS -- HARNESS --ignored --skip ...`: the
/// SQL Server live tests alone, with the user's arguments (cargo's and the harness's).
fn ignored_tests(args: &[OsString], harness: &[&str]) -> std::process::Command {
    let mut cmd = cargo();
    cmd.args(["test", "--workspace", "--all-targets"])
        .args(args);
    // The user's ARGS may already hold the `--` that starts the harness's arguments.
    if !args.iter().any(|a| a == "--") {
        cmd.arg("--");
    }
    cmd.args(harness).arg("--ignored");
    for name in OTHER_IGNORED {
        cmd.args(["--skip", name]);
    }
    // The broker clusters' tests have a pass of their own (`--cluster`).
    cmd.args(["--skip", crate::cluster::TEST_PREFIX]);
    // The scale tests too (`cargo xtask scale`).
    cmd.args(["--skip", crate::scale::TEST_PREFIX]);
    cmd
}

/// With `MSSQL_URL` set, runs the SQL Server live tests (built already by the main
/// pass, same packages and features); without it, counts them and says so.
pub(crate) fn run_or_count(args: &[OsString]) -> Result<Option<usize>> {
    if url_set() {
        eprintln!(
            "xtask: MSSQL_URL is set: running the tests marked #[ignore = \"{IGNORE_REASON}\"]"
        );
        let mut tests = ignored_tests(args, &[]);
        env_default(&mut tests, "RUST_BACKTRACE", "1");
        run_child(&mut tests)?;
        return Ok(None);
    }
    let mut list = ignored_tests(args, &["--list"]);
    let shown = display(&list);
    let out = list
        .output()
        .with_context(|| format!("could not run `{shown}`"))?;
    if !out.status.success() {
        anyhow::bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let skipped = count_listed(&String::from_utf8_lossy(&out.stdout));
    announce_skip(Some(skipped));
    Ok(Some(skipped))
}

/// The tests in a test harness's `--list` output (`name: test` lines).
fn count_listed(stdout: &str) -> usize {
    stdout
        .lines()
        .filter(|line| line.ends_with(": test"))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args_of(cmd: &std::process::Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn the_ignored_pass_keeps_the_users_arguments() {
        let plain = args_of(&ignored_tests(&[], &[]));
        assert_eq!(
            plain,
            [
                "test",
                "--workspace",
                "--all-targets",
                "--",
                "--ignored",
                "--skip",
                "dump_sql",
                "--skip",
                "every_page_at_a_million_pending_and_ten_thousand_dead",
                "--skip",
                "on_cluster_",
                "--skip",
                "at_scale_"
            ]
        );
        let user: Vec<OsString> = ["-p", "outboxkit-sqlserver", "--", "--nocapture"]
            .map(OsString::from)
            .into();
        let with_user = args_of(&ignored_tests(&user, &["--list"]));
        assert_eq!(
            with_user,
            [
                "test",
                "--workspace",
                "--all-targets",
                "-p",
                "outboxkit-sqlserver",
                "--",
                "--nocapture",
                "--list",
                "--ignored",
                "--skip",
                "dump_sql",
                "--skip",
                "every_page_at_a_million_pending_and_ten_thousand_dead",
                "--skip",
                "on_cluster_",
                "--skip",
                "at_scale_"
            ]
        );
    }

    #[test]
    fn listed_tests_are_counted() {
        let out = "a::b: test\nc: test\n\nsome_bench: benchmark\n";
        assert_eq!(count_listed(out), 2);
    }
}
