//! The lab's binaries start and describe their options. Besides checking that, this
//! test makes `cargo test --workspace --all-targets` build them (cargo builds a
//! package's binaries for its integration tests), with the test run's features: the
//! chaos runs that end `cargo xtask itest` use those debug builds, with no build of
//! their own.

use std::process::Command;

fn help(bin: &str, path: &str, expected: &str) {
    let out = Command::new(path)
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("{bin} runs: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{bin} --help: {out:?}");
    assert!(
        text.contains(expected),
        "{bin} --help lacks {expected:?}:\n{text}"
    );
}

#[test]
fn chaos_describes_its_options() {
    help("chaos", env!("CARGO_BIN_EXE_chaos"), "--transport");
}

#[test]
fn chaos_consumer_describes_its_options() {
    help(
        "chaos-consumer",
        env!("CARGO_BIN_EXE_chaos-consumer"),
        "Usage",
    );
}

#[test]
fn bench_describes_its_options() {
    help("bench", env!("CARGO_BIN_EXE_bench"), "--relay-process");
}
