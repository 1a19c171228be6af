//! The `outbox` binary: see `outbox --help` and docs/operations.md.

fn main() -> std::process::ExitCode {
    outbox_cli::main_with_args(std::env::args_os())
}
