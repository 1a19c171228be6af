//! Tests at production scale: backlogs, windows and maps taken 10-100x past their
//! size on the happy path (300,000 held rows, a 1,000,000-row transaction, 100,000
//! routing keys, a 2,000,000-message soak). Each takes minutes and the whole machine,
//! so they are `#[ignore = "at production scale: cargo xtask scale"]`, named
//! `at_scale_*`, and run one at a time by `cargo xtask scale`, not by `cargo xtask
//! itest` (CI).

use std::ffi::OsString;
use std::process::Command;

/// The reason every scale test is ignored with (the tidy tests allow it only on
/// functions named [`TEST_PREFIX`]`*`).
pub(crate) const IGNORE_REASON: &str = "at production scale: cargo xtask scale";

/// The start of every scale test's name, so that the SQL Server pass (`--ignored`)
/// can skip them and `cargo xtask scale` pick them.
pub(crate) const TEST_PREFIX: &str = "at_scale_";

/// `cargo test --workspace --all-targets ARGS -- HARNESS --ignored at_scale_
/// --test-threads 1`: the scale tests alone, one at a time, with the user's arguments
/// (cargo's before their `--`, the harness's after it).
pub(crate) fn tests(args: &[OsString]) -> Command {
    let mut cmd = crate::cargo();
    cmd.args(["test", "--workspace", "--all-targets"]);
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    cmd.args(&args[..split]).arg("--");
    cmd.args(args.iter().skip(split + 1))
        .args(["--ignored", TEST_PREFIX, "--test-threads", "1"]);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn scale_tests_run_alone_with_the_users_arguments() {
        let os = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            args(&tests(&os(&[
                "-p",
                "outboxkit-postgres",
                "--",
                "--nocapture"
            ]))),
            [
                "test",
                "--workspace",
                "--all-targets",
                "-p",
                "outboxkit-postgres",
                "--",
                "--nocapture",
                "--ignored",
                "at_scale_",
                "--test-threads",
                "1"
            ]
        );
        assert_eq!(
            args(&tests(&[])),
            [
                "test",
                "--workspace",
                "--all-targets",
                "--",
                "--ignored",
                "at_scale_",
                "--test-threads",
                "1"
            ]
        );
    }
}
